"""SD3's ``options.qk_norm_rope`` (omniloop-kit's joint q/k norm kernel in the attention processor: SD3.5's
diffusers ``RMSNorm`` q/k norms and the joint concatenation; SD3 has no rotary embedding; the kernel
itself: tests/kit/test_qk_norm_rope.py).

* Always: ``fused`` is refused off CUDA (without Triton's interpreter) and unknown values are refused,
  before any weight is read; the default is recorded; where the kernel does not take a call (CPU) the
  processor keeps diffusers' ops bit for bit.
* Under Triton's CPU interpreter (``TRITON_INTERPRET=1``, a child pytest process): an SD3.5-medium
  transformer (joint ``attn`` and the image-only ``attn2`` of its dual-attention layers) whose attention
  runs the kernel against diffusers' (float32, within 1e-5 of the largest output: the norm's sum order),
  separate and fused projections, the kernel called for q and k of every attention; a deployment with
  ``qk_norm_rope: fused`` against one without (final latents, 1e-4).
* CUDA: a fused bf16 deployment, eager and compiled, within bf16 rounding of the reference one.
"""

from __future__ import annotations

import copy

import pytest
import torch

from omniloop.errors import DeployError
from omniloop.runtime import Runtime
from omniloop.testing import completed_latents
from omniloop.testing.pytest_plugin import HAS_TRITON, interpreted
from omniloop.testing.pytest_plugin import IN_TRITON_INTERPRETER as IN_INTERPRETER
from omniloop_kit import qk_norm_rope as knr
from omniloop_sd3.tiny import transformer_kwargs

from .conftest import sd3_manager
from .test_attention import _inputs


def _forward(model, x, t, e, p):
    return model(hidden_states=x, timestep=t, encoder_hidden_states=e, pooled_projections=p, return_dict=False)[0]


def test_refused_off_cuda_and_for_unknown_values_before_load(tiny_ckpt, monkeypatch: pytest.MonkeyPatch) -> None:
    from omniloop_sd3 import checkpoint as ck

    def no_load(*a, **k):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(ck, "load_model", no_load)
    monkeypatch.setattr(knr, "INTERPRETED", False)
    for value, message in (("fused", r"^options\.qk_norm_rope: 'fused' cannot run: "),
                           ("triton", r"^options\.qk_norm_rope: must be one of reference, fused, not 'triton'$")):
        with pytest.raises(DeployError, match=message):
            Runtime.from_model(tiny_ckpt(), device="cpu", dtype="float32", manager=sd3_manager(),
                               options={"qk_norm_rope": value})


def test_reference_is_the_default_and_recorded(sd3_runtime) -> None:
    assert sd3_runtime().model.config["qk_norm_rope"] == "reference"


def test_where_the_kernel_does_not_take_the_call_diffusers_ops_run_bit_exact(monkeypatch) -> None:
    from diffusers import SD3Transformer2DModel

    from omniloop_sd3.attention import install

    monkeypatch.setattr(knr, "INTERPRETED", False)
    torch.manual_seed(0)
    ref = SD3Transformer2DModel(**transformer_kwargs("sd35-medium")).eval()
    ours = copy.deepcopy(ref)
    install(ours, None, fused_norm=True)
    x = _inputs()
    with torch.no_grad():
        assert torch.equal(_forward(ours, *x), _forward(ref, *x))


@interpreted
@pytest.mark.parametrize("fused_qkv", [False, True])
def test_an_sd35_transformer_on_the_kernel_matches_diffusers_interpreted(fused_qkv) -> None:
    from diffusers import SD3Transformer2DModel

    from omniloop_sd3.attention import attention_modules, install

    torch.manual_seed(0)
    ref = SD3Transformer2DModel(**transformer_kwargs("sd35-medium")).eval()
    ours = copy.deepcopy(ref)
    install(ours, None, fused_qkv=fused_qkv, fused_norm=True)
    calls: list[int] = []
    real = knr.joint_norm_rope

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    knr.joint_norm_rope = counted
    try:
        x = _inputs()
        with torch.no_grad():
            got, want = _forward(ours, *x), _forward(ref, *x)
    finally:
        knr.joint_norm_rope = real
    assert len(calls) == 2 * len(attention_modules(ours))  # q and k of every attention, attn2 included
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@interpreted
def test_a_deployment_with_the_option_matches_one_without_interpreted(tiny_ckpt, t2i_request) -> None:
    path = tiny_ckpt("sd35-medium")
    plain = Runtime.from_model(path, device="cpu", dtype="float32", manager=sd3_manager())
    rt = Runtime.from_model(path, device="cpu", dtype="float32", manager=sd3_manager(),
                            options={"qk_norm_rope": "fused"})
    assert rt.model.config["qk_norm_rope"] == "fused"
    req = t2i_request(steps=2)
    got, want = completed_latents(rt.generate(req)), completed_latents(plain.generate(req))
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


@pytest.mark.gpu
def test_a_fused_deployment_is_within_bf16_rounding_on_cuda(tiny_ckpt, t2i_request) -> None:
    """bf16 on CUDA: the kernel runs for q and k of every attention (compiled and eager) and the final
    latents stay within bf16 rounding of the reference ops'."""
    if knr.unavailable_reason("cuda") or IN_INTERPRETER:
        pytest.skip(knr.unavailable_reason("cuda") or "interpreter run")
    from omniloop_sd3.attention import attention_modules

    path = tiny_ckpt("sd35-medium")
    plain = Runtime.from_model(path, device="cuda", dtype="bfloat16", manager=sd3_manager())
    req = t2i_request(steps=3)
    want = completed_latents(plain.generate(req)).float()
    for compile_ in (False, True):
        rt = Runtime.from_model(path, device="cuda", dtype="bfloat16", manager=sd3_manager(), compile=compile_,
                                options={"qk_norm_rope": "fused"})
        assert all(m.processor.fused_norm_rope for m in attention_modules(rt.model.components["transformer"]))
        got = completed_latents(rt.generate(req)).float()
        assert (got - want).norm() / want.norm() < 2e-2, compile_


@pytest.mark.skipif(not HAS_TRITON or IN_INTERPRETER, reason="triton is not installed / this is the interpreter run")
def test_interpreted_tests_in_a_child_process(run_interpreted_child) -> None:
    """The ``*_interpreted`` tests above, in a fresh pytest process started with TRITON_INTERPRET=1."""
    run_interpreted_child(__file__)
