"""FLUX.1's ``options.qk_norm_rope`` (omniloop-kit's joint q/k norm + rotary kernel in the attention
processor; the kernel itself: tests/kit/test_qk_norm_rope.py).

* Always: ``fused`` is refused off CUDA (without Triton's interpreter) and unknown values are refused,
  before any weight is read; the default is recorded; where the kernel does not take a call (CPU) the
  processor keeps diffusers' ops bit for bit.
* Under Triton's CPU interpreter (``TRITON_INTERPRET=1``, a child pytest process): a FLUX.1 transformer
  whose attention runs the kernel against diffusers' (float32, within 1e-5 of the largest output: the
  norm's sum order inside every block), separate and fused projections, the kernel called for q and k
  of every block; a deployment with ``qk_norm_rope: fused`` against one without (final latents, 1e-4).
"""

from __future__ import annotations

import copy

import pytest
import torch

from omniloop.runtime import Runtime
from omniloop.testing import completed_latents
from omniloop.testing.pytest_plugin import HAS_TRITON, interpreted
from omniloop.testing.pytest_plugin import IN_TRITON_INTERPRETER as IN_INTERPRETER
from omniloop_kit import qk_norm_rope as knr

from .conftest import flux_manager
from .test_attention import TINY, _inputs


def test_refused_off_cuda_and_for_unknown_values_before_load(refused_before_load, monkeypatch) -> None:
    monkeypatch.setattr(knr, "INTERPRETED", False)
    refused_before_load("qk_norm_rope", [
        ("fused", r"^options\.qk_norm_rope: 'fused' cannot run: "),
        ("triton", r"^options\.qk_norm_rope: must be one of reference, fused, not 'triton'$")])


def test_reference_is_the_default_and_recorded(flux_runtime) -> None:
    assert flux_runtime("dev").model.config["qk_norm_rope"] == "reference"


def test_where_the_kernel_does_not_take_the_call_diffusers_ops_run_bit_exact(monkeypatch) -> None:
    from diffusers import FluxTransformer2DModel

    from omniloop_flux.attention import install

    monkeypatch.setattr(knr, "INTERPRETED", False)
    torch.manual_seed(0)
    ref = FluxTransformer2DModel(**TINY).eval()
    ours = copy.deepcopy(ref)
    install(ours, None, fused_norm_rope=True)
    x = _inputs()
    with torch.no_grad():
        assert torch.equal(ours(**x, return_dict=False)[0], ref(**x, return_dict=False)[0])


@interpreted
@pytest.mark.parametrize("fused_qkv", [False, True])
def test_a_flux_transformer_on_the_kernel_matches_diffusers_interpreted(fused_qkv) -> None:
    from diffusers import FluxTransformer2DModel

    from omniloop_flux.attention import install

    torch.manual_seed(0)
    ref = FluxTransformer2DModel(**TINY).eval()
    ours = copy.deepcopy(ref)
    if fused_qkv:
        ours.fuse_qkv_projections()
    install(ours, None, fused_norm_rope=True)
    calls: list[int] = []
    real = knr.joint_norm_rope

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    knr.joint_norm_rope = counted
    try:
        x = _inputs()
        with torch.no_grad():
            got, want = ours(**x, return_dict=False)[0], ref(**x, return_dict=False)[0]
    finally:
        knr.joint_norm_rope = real
    assert len(calls) == 2 * (TINY["num_layers"] + TINY["num_single_layers"])  # q and k of every block
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@interpreted
def test_a_deployment_with_the_option_matches_one_without_interpreted(flux_ckpt, make_t2i) -> None:
    path = flux_ckpt("dev")
    plain = Runtime.from_model(path, device="cpu", dtype="float32", manager=flux_manager())
    rt = Runtime.from_model(path, device="cpu", dtype="float32", manager=flux_manager(),
                            options={"qk_norm_rope": "fused"})
    assert rt.model.config["qk_norm_rope"] == "fused"
    req = make_t2i(steps=2)
    got, want = completed_latents(rt.generate(req)), completed_latents(plain.generate(req))
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


@pytest.mark.gpu
def test_a_fused_deployment_is_within_bf16_rounding_on_cuda(flux_ckpt, make_t2i) -> None:
    """bf16 on CUDA: the kernel runs for q and k of every block (compiled and eager) and the final latents
    stay within bf16 rounding of the reference ops'."""
    if knr.unavailable_reason("cuda") or IN_INTERPRETER:
        pytest.skip(knr.unavailable_reason("cuda") or "interpreter run")
    path = flux_ckpt("dev")
    plain = Runtime.from_model(path, device="cuda", dtype="bfloat16", manager=flux_manager())
    req = make_t2i(steps=3)
    want = completed_latents(plain.generate(req)).float()
    for compile_ in (False, True):
        rt = Runtime.from_model(path, device="cuda", dtype="bfloat16", manager=flux_manager(), compile=compile_,
                                options={"qk_norm_rope": "fused"})
        tf = rt.model.components["transformer"]
        assert all(b.attn.processor.fused_norm_rope for b in tf.transformer_blocks)
        got = completed_latents(rt.generate(req)).float()
        assert (got - want).norm() / want.norm() < 2e-2, compile_


@pytest.mark.skipif(not HAS_TRITON or IN_INTERPRETER, reason="triton is not installed / this is the interpreter run")
def test_interpreted_tests_in_a_child_process(run_interpreted_child) -> None:
    """The ``*_interpreted`` tests above, in a fresh pytest process started with TRITON_INTERPRET=1."""
    run_interpreted_child(__file__)
