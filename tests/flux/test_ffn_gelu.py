"""Deploy ``options.ffn_gelu`` on FLUX.1 (omniloop-kit's fused feed-forward projection).

* ``fused`` swaps the double blocks' feed-forward input projections (``ff`` and ``ff_context``) for
  :class:`omniloop_kit.ffn.FusedGeluProjection` -- same ``Linear``, same state-dict keys; the single
  blocks' bare ``proj_mlp`` + GELU are left alone. Off CUDA the swapped module computes what diffusers'
  does (bit for bit), so the swap is checked here on the CPU.
* It is refused off CUDA (cuBLASLt's epilogue is the tanh GELU; the CPU op is another GELU) and for
  unknown values, before any weight is read; adapters refuse it (a LoRA on the projection would be
  bypassed).
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

from .conftest import flux_manager
from .test_attention import TINY, _inputs


def test_the_double_blocks_feed_forwards_are_swapped_and_compute_the_same_on_cpu() -> None:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    ref = FluxTransformer2DModel(**TINY).eval()
    ours = copy.deepcopy(ref)
    keys = set(ours.state_dict())
    assert ffn.install(ours) == 2 * TINY["num_layers"]  # ff and ff_context of every double block
    assert all(isinstance(b.ff.net[0], ffn.FusedGeluProjection) and isinstance(b.ff_context.net[0], ffn.FusedGeluProjection)
               for b in ours.transformer_blocks)
    assert set(ours.state_dict()) == keys  # same parameters under the same names
    x = _inputs()
    with torch.no_grad():
        assert torch.equal(ours(**x, return_dict=False)[0], ref(**x, return_dict=False)[0])
    assert ffn.restore(ours) == 2 * TINY["num_layers"] and not ffn.installed(ours)


def test_refused_off_cuda_and_for_unknown_values_before_load(refused_before_load) -> None:
    refused_before_load("ffn_gelu", [
        ("fused", r"^options\.ffn_gelu: 'fused' needs a CUDA device \(cuBLASLt's GELU epilogue\), not cpu"),
        ("fast", r"^options\.ffn_gelu: must be one of reference, fused, not 'fast'$")])


def test_reference_is_the_default_and_recorded(flux_runtime) -> None:
    assert flux_runtime("dev").model.config["ffn_gelu"] == "reference"


def test_adapters_refuse_the_fused_projection() -> None:
    from omniloop_flux.lora import check

    check(None, {"ffn_gelu": "reference"})
    with pytest.raises(DeployError, match=r"^adapters: options\.ffn_gelu 'fused'"):
        check(None, {"ffn_gelu": "fused"})
    with pytest.raises(DeployError, match=r"^adapters: options\.qkv 'fused'"):
        check(None, {"qkv": "fused"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused projection needs a CUDA device")
def test_a_fused_request_is_within_bf16_rounding_on_cuda(flux_ckpt, make_t2i) -> None:
    plain = Runtime.from_model(flux_ckpt("dev"), device="cuda", dtype="bfloat16", manager=flux_manager())
    rt = Runtime.from_model(flux_ckpt("dev"), device="cuda", dtype="bfloat16", manager=flux_manager(),
                            options={"ffn_gelu": "fused"})
    assert ffn.installed(rt.model.components["transformer"])
    req = make_t2i(steps=3)
    got, want = completed_latents(rt.generate(req)).float(), completed_latents(plain.generate(req)).float()
    # the GELU applied to the float32 accumulator instead of the bf16-rounded projection: a few bf16 ulps
    assert (got - want).norm() / want.norm() < 2e-2


def test_prepare_swaps_before_compiling(flux_ckpt, monkeypatch: pytest.MonkeyPatch) -> None:
    """The family's wiring, on the CPU: with the device check passed (as on CUDA) the loaded transformer's
    double blocks get the fused projection and the deployment records it."""
    import omniloop_flux.family as family

    monkeypatch.setattr(family, "ffn_option", lambda options, device: options.get("ffn_gelu", "reference"))
    rt = Runtime.from_model(flux_ckpt("dev"), device="cpu", dtype="float32", manager=flux_manager(),
                            options={"ffn_gelu": "fused"})
    tf = rt.model.components["transformer"]
    assert ffn.installed(tf) and rt.model.config["ffn_gelu"] == "fused"
    assert all(isinstance(b.ff.net[0], ffn.FusedGeluProjection) for b in tf.transformer_blocks)
