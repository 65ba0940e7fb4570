"""The ``vae_cpu_kernels`` deploy option: ``reference`` (default, diffusers' ops) vs ``fast``.

``fast`` is not bit-equal; its stated tolerance (omniloop_wan.vae_kernels) is 1e-5 on the decoded
video in [-1, 1] and at most one uint8 level per pixel.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omniloop.errors import DeployError
from omniloop_wan.vae_kernels import install_fast_kernels, remove_fast_kernels, uses_fast_kernels

TOL = 1e-5


def _decode(vae: Any, z: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return vae.decode(z, return_dict=False)[0]


def _demo_vae() -> Any:
    demo = pytest.importorskip("omniloop_wan_demo.checkpoint_path")
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan.from_pretrained(demo.checkpoint_dir() / "vae").eval()


def test_default_is_reference_and_fast_is_opt_in(wan_runtime, t2v_request):
    ref = wan_runtime("t2v")
    assert ref.model.config["vae_cpu_kernels"] == "reference"
    assert not uses_fast_kernels(ref.model.components["vae"])
    fast = wan_runtime("t2v", options={"vae_cpu_kernels": "fast"})
    assert fast.model.config["vae_cpu_kernels"] == "fast"
    assert uses_fast_kernels(fast.model.components["vae"])
    a = ref.generate(t2v_request())
    b = fast.generate(t2v_request())
    assert a.ok and b.ok
    # same denoise (the option touches only the VAE), frames within one uint8 level
    assert torch.equal(a.artifacts["latents"].tensor, b.artifacts["latents"].tensor)
    diff = (a.artifacts["video"].frames.int() - b.artifacts["video"].frames.int()).abs()
    assert int(diff.max()) <= 1


def test_bad_value_is_refused_before_loading(wan_runtime):
    with pytest.raises(DeployError, match=r"options\.vae_cpu_kernels: must be one of reference, fast"):
        wan_runtime("t2v", options={"vae_cpu_kernels": "turbo"})


def test_demo_vae_within_tolerance_and_removal_restores_reference_exactly():
    vae = _demo_vae()
    z = torch.randn(1, 16, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    ref = _decode(vae, z)
    assert install_fast_kernels(vae) > 0
    assert install_fast_kernels(vae) == 0  # idempotent
    fast = _decode(vae, z)
    err = float((fast - ref).abs().max())
    assert 0 < err <= TOL  # not bit-equal (hence opt-in), within the stated tolerance
    to_u8 = lambda v: ((v * 0.5 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).int()  # noqa: E731
    assert int((to_u8(fast) - to_u8(ref)).abs().max()) <= 1
    assert remove_fast_kernels(vae) > 0 and not uses_fast_kernels(vae)
    assert torch.equal(_decode(vae, z), ref)


def test_other_dtypes_and_autograd_run_the_reference_code():
    vae = _demo_vae()
    z = torch.randn(1, 16, 2, 8, 8, generator=torch.Generator().manual_seed(1))
    bf16 = vae.to(torch.bfloat16)
    ref_bf16 = _decode(bf16, z.to(torch.bfloat16))
    install_fast_kernels(bf16)
    assert torch.equal(_decode(bf16, z.to(torch.bfloat16)), ref_bf16)
    remove_fast_kernels(bf16)
    vae = bf16.to(torch.float32)
    conv = next(m for m in vae.modules() if isinstance(m, torch.nn.Conv3d) and m.kernel_size == (3, 3, 3))
    x = torch.randn(1, conv.in_channels, 3, 6, 6, generator=torch.Generator().manual_seed(2))
    ref = conv(x)  # grad enabled, weights require grad: the native kernel
    install_fast_kernels(vae)
    out = conv(x)
    assert torch.equal(out, ref) and out.requires_grad
