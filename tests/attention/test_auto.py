"""``attention_backend: auto`` (the deploy default): the fastest exact-class backend that declares
itself for this machine and deploy, else the core ``sdpa`` — chosen at load, by declared rank, never
by timing and never a distribution-altering backend. flash-attn-4 declares itself for the Wan family
on Hopper in bf16/fp16; on a machine without it (CI) every deploy runs ``sdpa`` as before."""

import attrs
import pytest
import torch

from omniloop.builtin import sdpa
from omniloop.deploy import DeployConfig
from omniloop.errors import DeployError
from omniloop.family import AttentionBackendSpec
from omniloop.plugins import Registry
from omniloop.runtime import AUTO_ATTENTION, resolve_auto_attention
from omniloop.testing import toy_runtime
from omniloop_attention import plugin
from omniloop_attention.backends import BACKENDS
from omniloop_attention.flash4 import flash_attn4_accepts

BY_NAME = {b.name: b for b in BACKENDS}
SDPA = AttentionBackendSpec(name="sdpa", fn=sdpa)


def _registry(*specs):
    return Registry(attention_backends={s.name: s for s in (SDPA, *specs)})


def _spec(name, rank, **kw):
    return AttentionBackendSpec(name=name, fn=sdpa, auto_rank=rank, **kw)


GPU_BF16 = DeployConfig(device="cuda", dtype="bfloat16")


def test_auto_is_the_default():
    assert DeployConfig().attention_backend == AUTO_ATTENTION == "auto"


def test_highest_rank_available_exact_backend_wins():
    reg = _registry(_spec("slow", 1), _spec("fast", 5), _spec("b-tie", 3), _spec("a-tie", 3),
                    _spec("unranked", 0))
    spec, _ = resolve_auto_attention(reg, GPU_BF16, "wan")
    assert spec.name == "fast"
    reg = _registry(_spec("b-tie", 3), _spec("a-tie", 3))
    assert resolve_auto_attention(reg, GPU_BF16, "wan")[0].name == "a-tie"


def test_never_a_distribution_altering_or_configurable_backend():
    class Opts:
        pass

    reg = _registry(_spec("fp8", 9, distribution_altering=True), _spec("sparse", 9, options_schema=Opts))
    spec, _ = resolve_auto_attention(reg, GPU_BF16, "wan")
    assert spec.name == "sdpa"


def test_unavailable_or_refusing_backends_fall_to_sdpa_with_the_reason():
    reg = _registry(_spec("gone", 9, available=lambda: "not installed"),
                    _spec("picky", 8, auto_accepts=lambda d, f: "only bf16" if d.dtype != "bfloat16" else None))
    spec, why = resolve_auto_attention(reg, DeployConfig(device="cuda", dtype="float32"), "wan")
    assert spec.name == "sdpa"
    assert "gone: not installed" in why and "picky: only bf16" in why
    assert resolve_auto_attention(reg, GPU_BF16, "wan")[0].name == "picky"


def test_flash_attn4_declares_itself_for_hopper_bf16_fp16_cuda_only():
    spec = BY_NAME["flash-attn-4"]
    assert spec.auto_rank > 0 and not spec.distribution_altering and spec.options_schema is None
    assert flash_attn4_accepts(GPU_BF16, "wan") is None
    assert flash_attn4_accepts(DeployConfig(device="cuda:1", dtype="float16"), "wan") is None
    assert "float32" in flash_attn4_accepts(DeployConfig(device="cuda", dtype="float32"), "wan")
    assert "not a CUDA device" in flash_attn4_accepts(DeployConfig(device="cpu", dtype="bfloat16"), "wan")
    assert flash_attn4_accepts(GPU_BF16, "sd3") is None  # measured faster on SD3.5-medium's step (2026-12-04)
    assert "family 'flux' was not measured faster" in flash_attn4_accepts(GPU_BF16, "flux")
    # where it is available (Hopper + the package), auto picks it for a bf16 CUDA deploy
    present = attrs.evolve(spec, available=lambda: None)
    reg = _registry(*(b for b in BACKENDS if b.name != "flash-attn-4"), present)
    assert resolve_auto_attention(reg, GPU_BF16, "wan")[0].name == "flash-attn-4"
    assert resolve_auto_attention(reg, GPU_BF16, "sd3")[0].name == "flash-attn-4"
    assert resolve_auto_attention(reg, GPU_BF16, "flux")[0].name == "sdpa"
    assert resolve_auto_attention(reg, DeployConfig(device="cuda", dtype="float32"), "wan")[0].name == "sdpa"
    # of the other registered backends only flash-attn-3 declares a rank (below flash-attn-4's)
    assert [b.name for b in BACKENDS if b.auto_rank > 0] == ["flash-attn-4", "flash-attn-3"]


def test_flash_attn3_declares_itself_for_wan_flux_and_sd3_below_flash_attn4():
    """FlashAttention-3 (built by hand) is picked for Wan and SD3 on Hopper in bf16/fp16 where
    flash-attn-4 is not installed; with both, flash-attn-4 (higher rank). For FLUX.1 it is picked with
    or without flash-attn-4 (which does not declare itself for FLUX); never for another family."""
    fa3, fa4 = BY_NAME["flash-attn-3"], BY_NAME["flash-attn-4"]
    assert 0 < fa3.auto_rank < fa4.auto_rank and not fa3.distribution_altering and fa3.options_schema is None
    assert fa3.auto_accepts(GPU_BF16, "wan") is None
    assert fa3.auto_accepts(GPU_BF16, "sd3") is None
    assert "family 'qwen' was not measured faster" in fa3.auto_accepts(GPU_BF16, "qwen")
    assert "float32" in fa3.auto_accepts(DeployConfig(device="cuda", dtype="float32"), "wan")
    others = [b for b in BACKENDS if b.name not in ("flash-attn-3", "flash-attn-4")]
    fa3_here, fa4_here = attrs.evolve(fa3, available=lambda: None), attrs.evolve(fa4, available=lambda: None)
    assert resolve_auto_attention(_registry(*others, fa3_here, fa4), GPU_BF16, "wan")[0].name == "flash-attn-3"
    assert resolve_auto_attention(_registry(*others, fa3_here, fa4_here), GPU_BF16, "wan")[0].name == "flash-attn-4"
    assert resolve_auto_attention(_registry(*others, fa3_here, fa4), GPU_BF16, "sd3")[0].name == "flash-attn-3"
    assert resolve_auto_attention(_registry(*others, fa3_here, fa4_here), GPU_BF16, "sd3")[0].name == "flash-attn-4"
    assert resolve_auto_attention(_registry(*others, fa3_here, fa4_here), GPU_BF16, "qwen")[0].name == "sdpa"
    assert fa3.auto_accepts(GPU_BF16, "flux") is None
    for fa4_maybe in (fa4, fa4_here):
        assert resolve_auto_attention(_registry(*others, fa3_here, fa4_maybe), GPU_BF16, "flux")[0].name == "flash-attn-3"
    assert resolve_auto_attention(_registry(*others, fa3, fa4), GPU_BF16, "flux")[0].name == "sdpa"  # not installed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU machine's choice")
def test_a_default_deploy_runs_sdpa_on_a_cpu_machine(toy_checkpoint):
    rt = toy_runtime(toy_checkpoint, ("attention", plugin))
    assert rt.deploy.attention_backend == "auto"
    assert rt.attention.name == "sdpa"
    assert rt.describe()["attention_backend"] == "sdpa"


def test_options_need_a_named_backend(toy_checkpoint):
    with pytest.raises(DeployError, match="attention_options: given for attention_backend: auto"):
        toy_runtime(toy_checkpoint, ("attention", plugin), attention_options={"density": 0.3})
