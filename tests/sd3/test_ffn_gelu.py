"""Deploy ``options.ffn_gelu`` on SD3 / SD3.5 (omniloop-kit's fused feed-forward projection).

* ``fused`` swaps every joint block's feed-forward input projection (``ff`` and, where the block has
  one, ``ff_context``) for :class:`omniloop_kit.ffn.FusedGeluProjection` -- same ``Linear``, same
  state-dict keys. Off CUDA the swapped module computes what diffusers' does (bit for bit), so the swap
  and the family's wiring are checked here on the CPU.
* It is refused off CUDA (cuBLASLt's epilogue is the tanh GELU; the CPU op is another GELU) and for
  unknown values, before any weight is read; adapters refuse it (a LoRA on the projection would be
  bypassed), as they refuse ``qkv: fused``.
* On CUDA, a fused request stays within bf16 rounding of the reference one (skipped on CPU).
"""

from __future__ import annotations

import copy

import pytest
import torch

from omniloop.errors import DeployError
from omniloop.runtime import Runtime
from omniloop.testing import completed_latents
from omniloop_kit import ffn
from omniloop_sd3.tiny import transformer_kwargs

from .conftest import sd3_manager
from .test_attention import _inputs


@pytest.mark.parametrize("variant", ["sd3", "sd35-medium"])
def test_the_feed_forwards_are_swapped_and_compute_the_same_on_cpu(variant) -> None:
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    ref = SD3Transformer2DModel(**transformer_kwargs(variant)).eval()
    ours = copy.deepcopy(ref)
    keys = set(ours.state_dict())
    ffs = [b.ff for b in ours.transformer_blocks] + [b.ff_context for b in ours.transformer_blocks
                                                      if b.ff_context is not None]
    assert ffn.install(ours) == len(ffs)  # the last block's context stream has no feed-forward
    assert all(isinstance(f.net[0], ffn.FusedGeluProjection) for f in ffs)
    assert set(ours.state_dict()) == keys  # same parameters under the same names
    x, t, e, p = _inputs()
    with torch.no_grad():
        got = ours(hidden_states=x, timestep=t, encoder_hidden_states=e, pooled_projections=p, return_dict=False)[0]
        want = ref(hidden_states=x, timestep=t, encoder_hidden_states=e, pooled_projections=p, return_dict=False)[0]
    assert torch.equal(got, want)
    assert ffn.restore(ours) == len(ffs) and not ffn.installed(ours)


def test_refused_off_cuda_and_for_unknown_values_before_load(tiny_ckpt, monkeypatch: pytest.MonkeyPatch) -> None:
    from omniloop_sd3 import checkpoint as ck

    def no_load(*a, **k):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(ck, "load_model", no_load)
    for value, message in (("fused", r"^options\.ffn_gelu: 'fused' needs a CUDA device \(cuBLASLt's GELU epilogue\), not cpu"),
                           ("fast", r"^options\.ffn_gelu: must be one of reference, fused, not 'fast'$")):
        with pytest.raises(DeployError, match=message):
            Runtime.from_model(tiny_ckpt(), device="cpu", dtype="float32", manager=sd3_manager(),
                               options={"ffn_gelu": value})


def test_reference_is_the_default_and_recorded(sd3_runtime) -> None:
    assert sd3_runtime().model.config["ffn_gelu"] == "reference"
    assert not ffn.installed(sd3_runtime().model.components["transformer"])


@pytest.mark.parametrize("options, refused", [({"ffn_gelu": "reference", "qkv": "separate"}, None),
                                               ({"ffn_gelu": "fused"}, "ffn_gelu"), ({"qkv": "fused"}, "qkv")])
def test_adapters_refuse_each_fused_projection(options, refused) -> None:
    from omniloop_sd3.lora import check

    if refused is None:
        check(None, options)  # nothing fused: adapters load
        return
    with pytest.raises(DeployError, match=rf"^adapters: options\.{refused} 'fused'"):
        check(None, options)


def test_prepare_swaps_before_compiling(tiny_ckpt, t2i_request, sd3_runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """The family's wiring, on the CPU: with the device check passed (as on CUDA) the loaded transformer's
    feed-forwards get the fused projection, the deployment records it, and a compiled request equals the
    reference deployment's (on the CPU the swapped module computes diffusers' two ops)."""
    import omniloop_sd3.family as family

    monkeypatch.setattr(family, "ffn_option", lambda options, device: options.get("ffn_gelu", "reference"))
    torch._dynamo.reset()
    rt = Runtime.from_model(tiny_ckpt(), device="cpu", dtype="float32", manager=sd3_manager(), compile=True,
                            options={"ffn_gelu": "fused", "compile_backend": "eager"})
    tf = rt.model.components["transformer"]
    assert ffn.installed(tf) and rt.model.config["ffn_gelu"] == "fused"
    assert all(isinstance(b.ff.net[0], ffn.FusedGeluProjection) for b in tf.transformer_blocks)
    out = rt.generate(t2i_request(steps=2))
    assert out.metrics["denoise"]["compiled_blocks"] is True
    want = completed_latents(sd3_runtime().generate(t2i_request(steps=2)))
    torch.testing.assert_close(completed_latents(out), want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused projection needs a CUDA device")
def test_a_fused_request_is_within_bf16_rounding_on_cuda(tiny_ckpt, t2i_request) -> None:
    plain = Runtime.from_model(tiny_ckpt(), device="cuda", dtype="bfloat16", manager=sd3_manager())
    rt = Runtime.from_model(tiny_ckpt(), device="cuda", dtype="bfloat16", manager=sd3_manager(),
                            options={"ffn_gelu": "fused"})
    assert ffn.installed(rt.model.components["transformer"])
    req = t2i_request(steps=3)
    got, want = completed_latents(rt.generate(req)).float(), completed_latents(plain.generate(req)).float()
    # the GELU applied to the float32 accumulator instead of the bf16-rounded projection: a few bf16 ulps
    assert (got - want).norm() / want.norm() < 2e-2
