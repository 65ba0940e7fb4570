"""flash-attn-3 / fa3-fp8: registered (exact-class / distribution-altering), refused with the reason
where they cannot run, their arguments checked before any kernel, the FP8 path's plumbing (layout,
per-tensor scales as the kernel's ``(B, H_k)`` descales, bf16 output) checked on the CPU through a
stand-in for the kernel; on a Hopper GPU with FlashAttention-3 built they match float32 attention
(bf16: within bf16 rounding; FP8: within e4m3 rounding), also inside ``torch.compile(fullgraph=True)``."""

import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F

from omniloop.errors import DeployError
from omniloop.testing import make_manager
from omniloop_attention import flash3, plugin
from omniloop_attention.backends import BACKENDS
from omniloop_attention.flash3 import fa3_fp8, fa3_fp8_available, flash_attn3, flash_attn3_available
from omniloop_attention.fp8 import fp8_dtype, quantize

SPECS = {b.name: b for b in BACKENDS}


def _hopper(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))


def test_registered():
    registered = {}
    plugin.omniloop_register_attention_backends(lambda spec: registered.setdefault(spec.name, spec))
    assert registered["flash-attn-3"].fn is flash_attn3 and registered["flash-attn-3"].distribution_altering is False
    assert registered["fa3-fp8"].fn is fa3_fp8 and registered["fa3-fp8"].distribution_altering is True
    assert fa3_fp8.accepts_quantized_qk is True  # Wan's fused rope kernel hands it e4m3 q/k


def test_refused_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert flash_attn3_available() == "CUDA is not available on this machine"
    assert fa3_fp8_available() == "CUDA is not available on this machine"


def test_refused_off_hopper(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    assert flash_attn3_available() == "FlashAttention-3's kernels are Hopper (sm90) only; this GPU is sm100"


def test_refused_when_not_installed(monkeypatch):
    _hopper(monkeypatch)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn_3" else real(name, *a))
    flash3._import_error.cache_clear()
    try:
        reason = flash_attn3_available()
    finally:
        flash3._import_error.cache_clear()
    assert "FlashAttention-3 (module 'flash_attn_3') is not installed" in reason
    assert "build_flash_attn_3.sh" in reason


def test_a_library_that_does_not_load_says_why(monkeypatch, reason_when_import_breaks):
    """Found but its ``_C`` does not load (built for another torch or CUDA): the reason carries the
    loader's error, at load, not at the first call."""
    reason = reason_when_import_breaks(monkeypatch, "flash_attn_3", "flash_attn_3._C", flash3._import_error,
                                       flash_attn3_available)
    assert reason.startswith("flash_attn_3 is installed but its library does not load: ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
@pytest.mark.parametrize("name", ["flash-attn-3", "fa3-fp8"])
def test_unavailable_is_an_error_at_load(toy_checkpoint, name):
    from omniloop.runtime import Runtime

    with pytest.raises(DeployError, match=f"attention_backend: '{name}' cannot run here: "):
        Runtime.from_model(toy_checkpoint, manager=make_manager(("attention", plugin)), attention_backend=name)


@pytest.mark.parametrize("fn", [flash_attn3, fa3_fp8], ids=["flash-attn-3", "fa3-fp8"])
@pytest.mark.parametrize("case, match", [
    ("mask", "takes no attention mask"),
    ("float32", "needs bf16 or fp16"),
    ("head_dim", "multiples of (8|16) up to 256"),
    ("dropout", "does not take dropout_p"),
])
def test_bad_calls_are_refused_before_the_kernel(fn, case, match, bad_call):
    q, k, v, kw = bad_call(case)
    with pytest.raises(ValueError, match=match):
        fn(q, k, v, **kw)


def test_the_op_has_a_fake_for_compile():
    """bf16 in: the input dtype out; e4m3 in: bf16 out (the kernel's), ``[B, Lq, H, Dv]``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 100, 3, 128, dtype=torch.bfloat16)
        k = torch.empty(2, 40, 3, 128, dtype=torch.bfloat16)
        out = torch.ops.omniloop_attention.flash_attn3_fwd(q, k, k, None, None, None, 0.1, False)
        d = torch.empty(2, 3)
        out8 = torch.ops.omniloop_attention.flash_attn3_fwd(q.to(fp8_dtype()), k.to(fp8_dtype()), k.to(fp8_dtype()),
                                                            d, d, d, 0.1, False)
    assert tuple(out.shape) == (2, 100, 3, 128) and out.dtype == torch.bfloat16
    assert tuple(out8.shape) == (2, 100, 3, 128) and out8.dtype == torch.bfloat16


class _StandIn:
    """The kernel's contract in plain torch: e4m3 ``[B, L, H, D]`` with ``(B, H_k)`` descales → bf16."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, dq, dk, dv, scale, causal):
        self.calls.append({"dtypes": (q.dtype, k.dtype, v.dtype), "shape": tuple(q.shape), "descale": tuple(dq.shape),
                           "unit_stride": all(x.stride(-1) == 1 for x in (q, k, v)), "scale": scale})
        qf, kf, vf = (x.float() * d[:, None, :, None] for x, d in ((q, dq), (k, dk), (v, dv)))
        out = F.scaled_dot_product_attention(qf.transpose(1, 2), kf.transpose(1, 2), vf.transpose(1, 2), scale=scale)
        return out.transpose(1, 2).to(torch.bfloat16)


@pytest.fixture
def stand_in(monkeypatch):
    fake = _StandIn()
    monkeypatch.setattr(torch.ops.omniloop_attention, "flash_attn3_fwd", fake)
    return fake


def _blhd_views(B, H, L, D, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, L, H, D, generator=g).to(torch.bfloat16).transpose(1, 2)


def test_fp8_path_hands_the_kernel_e4m3_and_per_tensor_descales(stand_in):
    """The backend's own work around the kernel: q, k, v rounded to e4m3 with one scale each, given as
    ``(B, H_k)`` descales, ``[B, L, H, D]`` with unit strides (free for Wan's views), output back to
    ``[B, H, L, D]`` in the query's dtype; equal to attention of the dequantised values."""
    q, k, v = (_blhd_views(2, 3, 40, 64, s) for s in range(3))
    out = fa3_fp8(q, k, v)
    call = stand_in.calls[-1]
    assert call["dtypes"] == (fp8_dtype(),) * 3 and call["shape"] == (2, 40, 3, 64)
    assert call["descale"] == (2, 3) and call["unit_stride"] and call["scale"] == pytest.approx(64 ** -0.5)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    deq = [x8.float() * d for x8, d in (quantize(q), quantize(k), quantize(v))]
    ref = F.scaled_dot_product_attention(*deq)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=1e-2)  # bf16 output rounding


def test_fp8_path_takes_q_and_k_already_quantised(stand_in):
    """``attend_quantized`` (Wan's fused rope kernel): the given e4m3 q/k and descales reach the kernel as they are."""
    q, k, v = (_blhd_views(1, 2, 24, 32, s) for s in range(3))
    (q8, dq), (k8, dk) = quantize(q), quantize(k)
    a = fa3_fp8.attend_quantized(q8, dq, k8, dk, v, torch.bfloat16)
    b = fa3_fp8(q, k, v)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert stand_in.calls[0]["descale"] == (1, 2)


# ------------------------------------------------------------------------------------------------
# GPU: Hopper with FlashAttention-3 built (plugins/compute/attention/scripts/build_flash_attn_3.sh)
# ------------------------------------------------------------------------------------------------

needs_fa3 = pytest.mark.skipif(not torch.cuda.is_available() or flash_attn3_available() is not None,
                               reason="needs a Hopper GPU with FlashAttention-3 (flash_attn_3) built")


@needs_fa3
@pytest.mark.parametrize("lq, lk, d", [(1000, 1000, 128), (777, 512, 128), (256, 300, 64), (320, 320, 32)])
def test_bf16_matches_float32_attention(lq, lk, d, cuda_views, rel_to_float32):
    q, k, v = cuda_views(2, 4, lq, d, 0), cuda_views(2, 4, lk, d, 1), cuda_views(2, 4, lk, d, 2)
    assert rel_to_float32(flash_attn3, q, k, v) < 1e-2  # bf16 output rounding: ~4e-3


@needs_fa3
@pytest.mark.parametrize("lq, lk, d", [(1000, 1000, 128), (320, 320, 32)])
def test_fp8_matches_float32_attention_within_e4m3(lq, lk, d, cuda_views, rel_to_float32):
    """e4m3 keeps 3 mantissa bits (relative step 1/16) on q, k, v and the probabilities: on random
    inputs the output's relative RMS error is a few percent (cuDNN's FP8 graph: the same order)."""
    q, k, v = cuda_views(2, 4, lq, d, 0), cuda_views(2, 4, lk, d, 1), cuda_views(2, 4, lk, d, 2)
    assert rel_to_float32(fa3_fp8, q, k, v) < 0.1


@needs_fa3
@pytest.mark.parametrize("fn", [flash_attn3, fa3_fp8], ids=["flash-attn-3", "fa3-fp8"])
def test_compiled_fullgraph_equals_eager(fn, compiled_equals_eager):
    assert compiled_equals_eager(fn, emulate_precision_casts=fn is fa3_fp8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_bench_needs_a_gpu(monkeypatch):
    import importlib.util as iu
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "attention_fa3.py"
    spec = iu.spec_from_file_location("attention_fa3_bench", path)
    bench = iu.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(sys, "argv", ["attention_fa3.py"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main()


def test_the_device_script_parses_and_its_tests_part_names_real_files():
    """``scripts/gpu_fa3.sh`` cannot run here (no Hopper GPU, no carried wheels); what can drift is
    checked: bash parses it and the test files its ``tests`` part hands pytest by default (``TESTS``) exist."""
    import re
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    script = repo / "plugins" / "compute" / "attention" / "scripts" / "gpu_fa3.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    named = re.findall(r"\b(tests/[\w/]+\.py)\b", text)  # the default of TESTS
    assert named and all((repo / f).is_file() for f in named), named


def test_the_device_script_names_only_sides_its_benches_know():
    """The default side lists of ``gpu_fa3.sh`` (``C13``, ``C14`` for bench/wan_gpu.py, ``CF`` for
    bench/flux_gpu.py) name sides the bench scripts accept: a typo there costs a device call."""
    import importlib.util as iu
    import re
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    text = (repo / "plugins" / "compute" / "attention" / "scripts" / "gpu_fa3.sh").read_text()
    sys.path.insert(0, str(repo / "bench"))
    try:
        mods = {}
        for name in ("wan_gpu", "flux_gpu"):
            spec = iu.spec_from_file_location(f"_bench_{name}", repo / "bench" / f"{name}.py")
            mods[name] = iu.module_from_spec(spec)
            spec.loader.exec_module(mods[name])
    finally:
        sys.path.remove(str(repo / "bench"))
    lists = {var: re.search(r"\$\{" + var + r":-([\w,-]+)\}", text).group(1).split(",") for var in ("C13", "C14", "CF")}
    for var in ("C13", "C14"):
        for side in lists[var]:
            mods["wan_gpu"].parse_config(side)  # SystemExit on an unknown side
    assert set(lists["CF"]) <= set(mods["flux_gpu"].SIDES), lists["CF"]


def test_the_device_script_passes_the_quality_bench_only_options_it_knows():
    """The ``quality`` part's command line (``--clip-budget-s`` and the rest) against bench/attention_fp8_quality.py's
    parser: an unknown option would end the device call's quality part at once."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    text = (repo / "plugins" / "compute" / "attention" / "scripts" / "gpu_fa3.sh").read_text().replace("\\\n", " ")
    (call,) = [ln for ln in text.splitlines() if "bench/attention_fp8_quality.py" in ln and not ln.lstrip().startswith("#")]
    used = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", call.split("2>&1")[0]))
    known = set(re.findall(r'add_argument\("(--[a-z0-9-]+)"', (repo / "bench" / "attention_fp8_quality.py").read_text()))
    assert "--clip-budget-s" in used and used <= known, used - known
