"""bench/_common.py's kernel profile: on CUDA it keeps the device-side events, whatever their names --
FlashAttention-3's kernels are C++ templates (``flash::FlashAttnFwdSm90<...>``) and were once dropped
with the host ops (``aten::mm``) by a "no ``::`` in the name" filter, which hid attention from the
FLUX profile."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


def _event(kind: str, name: str, device_us: float = 0.0, cpu_us: float = 0.0) -> SimpleNamespace:
    return SimpleNamespace(device_type=SimpleNamespace(name=kind), name=name, device_time_total=device_us,
                           self_cpu_time_total=cpu_us)


def test_cuda_keeps_device_events_with_namespaced_names(common):
    fa3 = "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<128>>>(Params)"
    events = [_event("CUDA", fa3, 300.0), _event("CPU", "aten::mm", 900.0, 10.0),
              _event("CUDA", "nvjet_sm90_tst_192x192_bias_TNN", 200.0), _event("CUDA", fa3, 100.0)]
    times = common._kernel_times(events, True)
    assert times == {fa3: [400.0, 2.0], "nvjet_sm90_tst_192x192_bias_TNN": [200.0, 1.0]}


def test_cpu_uses_the_ops_own_time(common):
    times = common._kernel_times([_event("CPU", "aten::mm", cpu_us=7.0), _event("CPU", "aten::mm", cpu_us=3.0)], False)
    assert times == {"aten::mm": [10.0, 2.0]}


def test_one_step_is_two_steps_minus_one(common):
    """What a one-step request also runs (text encoders, the VAE) cancels; a kernel that only the
    two-step request ran more of is the step's."""
    one = {"gemm_step": [100.0, 10.0], "vae_conv": [500.0, 3.0], "t5_gemm": [50.0, 24.0]}
    two = {"gemm_step": [210.0, 20.0], "vae_conv": [499.0, 3.0], "t5_gemm": [50.0, 24.0], "scheduler_add": [1.0, 1.0]}
    assert common.step_kernels(one, two) == {"gemm_step": [110.0, 10.0], "scheduler_add": [1.0, 1.0]}


@pytest.mark.parametrize("name, group", [
    ("void cutlass::device_kernel<flash::enable_sm90<flash::FlashAttnFwdSm90<...>>>", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16", "attention"),
    ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_cudnn", "matmul"),
    ("void cudnn::engines_precompiled::nchwToNhwcKernel<__nv_bfloat16>", "other"),
    ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN", "matmul"),
    ("triton_poi_fused_cat_gelu_view_3", "other"),
])
def test_groups(common, name, group):
    assert common.kernel_group(name) == group
