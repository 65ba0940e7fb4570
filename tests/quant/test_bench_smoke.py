"""The FP8-linear rows of bench/wan_gpu.py and bench/attention_fp8_quality.py run on the CPU (``--smoke``), and
bench/fp8_error.py on flux-demo's transformer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from omniloop.testing.scripts import run_script

pytest.importorskip("diffusers")
BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.skipif(not (BENCH / "wan_gpu.py").exists(), reason="bench/ not in this checkout")
def test_wan_gpu_fp8lin_smoke(tmp_path):
    """14b smoke (48-wide, 3 blocks): all 30 block linears quantised, close to diffusers, and the
    shared modules restored afterwards (the next configuration is diffusers' again: bit-equal);
    ``-fp8fastx`` (``fp8-fast-except-down``) reports fast accumulation except the FFN down GEMMs."""
    only = "diffusers,omniloop-sdpa-compile-fp8lin,omniloop-sdpa-fp8fastx,omniloop-sdpa-fp8lin-nq,omniloop-sdpa"
    rec = run_script(BENCH / "wan_gpu.py", ["--smoke", "--models", "14b", "--only", only], tmp_path,
                     "wan_gpu-*-smoke.json")
    rows = {r["config"]: r for r in rec["results"]}
    fp8 = rows["omniloop-sdpa-compile-fp8lin"]
    assert "error" not in fp8, fp8
    assert fp8["fp8lin"] and fp8["fp8_linears"] == {"quantized": 30, "skipped": 0, "blocks": 3, "fast_accum": False,
                                                    "down_fast_accum": False}
    fastx = rows["omniloop-sdpa-fp8fastx"]
    assert "error" not in fastx, fastx
    assert fastx["fp8lin"] and fastx["fp8fastx"] and not fastx["fp8fast"]
    assert fastx["linear_precision"] == "fp8-fast-except-down"
    assert fastx["fp8_linears"] == {"quantized": 30, "skipped": 0, "blocks": 3, "fast_accum": True,
                                    "down_fast_accum": False}
    assert not fp8["vs_diffusers_eager"]["bit_equal"] and fp8["vs_diffusers_eager"]["rel_rms"] < 0.06
    nq = rows["omniloop-sdpa-fp8lin-nq"]  # omniloop_wan.blocks in place (the CPU runs its unfused path)
    assert "error" not in nq, nq
    assert nq["nq"] and nq["vs_diffusers_eager"]["rel_rms"] < 0.06
    assert rows["omniloop-sdpa"]["vs_diffusers_eager"]["bit_equal"]  # restored (blocks and linears)


@pytest.mark.skipif(not (BENCH / "wan_gpu.py").exists(), reason="bench/ not in this checkout")
def test_wan_gpu_side_words_name_the_linear_precision():
    """``-fp8lin`` / ``-fp8fast`` / ``-fp8fastx``: deploy ``linear_precision`` ``fp8`` / ``fp8-fast`` /
    ``fp8-fast-except-down``, in any position among the other words; ``-fp8fast`` with ``-fp8fastx`` refused."""
    import sys

    spec = importlib.util.spec_from_file_location("wan_gpu_linears_under_test", BENCH / "wan_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH))
    want = {"omniloop-fa3fp8-compile-fused": ("dtype", False, False, False),
            "omniloop-fa3fp8-compile-fused-fp8lin": ("fp8", True, False, False),
            "omniloop-fa3fp8-compile-fused-fp8fast": ("fp8-fast", True, True, False),
            "omniloop-fa3fp8-compile-fused-fp8fastx": ("fp8-fast-except-down", True, False, True),
            "omniloop-fp8-compile-fused-fp8fastx-qkv-mk": ("fp8-fast-except-down", True, False, True),
            "diffusers": ("dtype", False, False, False)}
    for name, (precision, lin, fast, fastx) in want.items():
        c = mod.parse_config(name)
        assert (c["linear_precision"], c["fp8lin"], c["fp8fast"], c["fp8fastx"]) == (precision, lin, fast, fastx), name
    fused = mod.parse_config("omniloop-fa3fp8-compile-fused-fp8fastx")
    assert fused["backend"] == "fa3-fp8" and fused["compile"] and fused["rope"] and fused["ffn"]
    assert {n for n in mod.all_configs() if n.endswith("-fp8fastx")}  # listed among the known names
    with pytest.raises(SystemExit, match="contradict"):
        mod.parse_config("omniloop-fa3fp8-compile-fused-fp8fast-fp8fastx")
    with pytest.raises(SystemExit, match="unknown configuration"):
        mod.parse_config("omniloop-fa3fp8-compile-fused-fp8fastxx")
    assert mod.parse_config("omniloop-fa3fp8-compile-fused-fp8fastx-nq")["nq"]
    with pytest.raises(SystemExit, match="feeds FP8 linears"):
        mod.parse_config("omniloop-fa3fp8-compile-fused-nq")


@pytest.mark.skipif(not (BENCH / "attention_fp8_quality.py").exists(), reason="bench/ not in this checkout")
def test_fp8_quality_clip_config_fp8fastx(monkeypatch):
    """``--clip-configs fa3fp8+fp8fastx``: ``fa3-fp8`` attention (fused q/k) with ``linear_precision:
    fp8-fast-except-down``, appended after the existing keys (their numbers unchanged); the runtime is faked."""
    pytest.importorskip("omniloop_wan_demo")
    from types import SimpleNamespace

    import numpy as np

    import omniloop_wan_demo.evaluate as evaluate

    spec = importlib.util.spec_from_file_location("attention_fp8_quality_bench", BENCH / "attention_fp8_quality.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.CLIP_CONFIGS["fa3fp8+fp8fastx"] == 15
    assert mod.CLIP_CONFIGS["fa3fp8+fp8fastx-nq"] == 16
    assert mod.CLIP_CONFIGS["fa3fp8+fp8fastx-nq-xq-oq"] == 17
    assert mod.CLIP_CONFIGS["fa3fp8+fp8fast-nq-xq-oq-sk2"] == max(mod.CLIP_CONFIGS.values()) == len(mod.CLIP_CONFIGS) - 1
    assert mod.CLIP_CONFIGS["fa3fp8+fp8fast"] == 7 and mod.CLIP_CONFIGS["fa3fp8-exact2"] == 14
    built = []

    from omniloop_quant import fp8
    from omniloop_wan import attention

    def runtime(device, backend, rope, capture=None, linear_precision="dtype", options=None):
        built.append((backend, linear_precision, options or {}, attention.FUSE_FP8_CROSS_QUANT, attention.FUSE_OUT_QUANT,
                      fp8.SPLIT_DOWN_K))
        return SimpleNamespace(linears=None)

    def score(vids, prompts, seeds):
        ok = {"color": True, "direction": True, "shape": True}
        return dict(ok, all=1.0), [SimpleNamespace(ok=ok) for _ in vids]

    monkeypatch.setattr(mod, "demo_runtime", runtime)
    monkeypatch.setattr(mod, "wan_demo_clip", lambda *a, **k: np.zeros((17, 8, 8, 3), np.uint8))
    monkeypatch.setattr(evaluate, "score", score)
    res: dict = {}
    mod.part_clips(res, "cpu", True, ["bf16", "fa3fp8+fp8fast", "fa3fp8+fp8fastx", "fa3fp8+fp8fastx-nq",
                                      "fa3fp8+fp8fastx-nq-xq-oq", "fa3fp8+fp8fast-nq-xq-oq-sk2"], [0])
    rows = res["clips"]["configs"]
    nq = {"norm_quant": "fused"}
    assert built == [("sdpa-cudnn", "dtype", {}, False, False, 1), ("fa3-fp8", "fp8-fast", {}, False, False, 1),
                     ("fa3-fp8", "fp8-fast-except-down", {}, False, False, 1),
                     ("fa3-fp8", "fp8-fast-except-down", nq, False, False, 1),
                     ("fa3-fp8", "fp8-fast-except-down", nq, True, True, 1),  # the switches for that one only
                     ("fa3-fp8", "fp8-fast", nq, True, True, 2)]
    assert attention.FUSE_FP8_CROSS_QUANT and attention.FUSE_OUT_QUANT and fp8.SPLIT_DOWN_K == 1  # the runtime's back
    row = rows["fa3-fp8 (fused q/k) + fp8-fast-except-down linears"]
    assert "error" not in row, row.get("traceback_tail")
    assert (row["attention_backend"], row["qk_norm_rope"], row["fp8_quant_in_rope_kernel"], row["linear_precision"]) == (
        "fa3-fp8", "fused", True, "fp8-fast-except-down")


@pytest.mark.skipif(not (BENCH / "attention_fp8_quality.py").exists(), reason="bench/ not in this checkout")
def test_fp8_quality_linears_smoke(tmp_path):
    pytest.importorskip("omniloop_wan_demo")
    rec = run_script(BENCH / "attention_fp8_quality.py", ["--smoke", "--parts", "linears"], tmp_path,
                     "attention_fp8-*-smoke.json")
    acts = rec["linears"]["activations"]
    assert "linears_error" not in rec
    assert len(acts["by_layer_fp8_mean"]) == 100 and acts["all_fp8"]["n"] == 400  # 100 linears x 2 steps x 2 branches
    assert 0.005 < acts["all_fp8"]["mean"] < 0.06
    assert acts["by_kind"]["ffn.net.2"]["dtype"]["max"] < 1e-5  # float32 on the CPU: the model's own is the reference


@pytest.mark.skipif(not (BENCH / "attention_fp8_quality.py").exists(), reason="bench/ not in this checkout")
@pytest.mark.parametrize("precision", ["fp8", "fp8-fast", "fp8-fast-except-down"])
def test_fp8_quality_clip_runtime_registers_the_quant_plugin(precision):
    """The clips part builds its runtime from plugins named by hand (the GPU machine has the repo on
    PYTHONPATH, no entry points): omniloop-quant must be among them, or fp8 / fp8-fast / fp8-fast-except-down
    is unknown."""
    pytest.importorskip("omniloop_wan_demo")
    import importlib.util

    spec = importlib.util.spec_from_file_location("attention_fp8_quality_bench", BENCH / "attention_fp8_quality.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rt = mod.demo_runtime("cpu", "sdpa", "reference", linear_precision=precision)
    assert rt.linears["quantized"] == 100 and rt.describe()["linear_precision"] == precision


@pytest.mark.skipif(not (BENCH / "attention_fp8_quality.py").exists(), reason="bench/ not in this checkout")
def test_fp8_quality_emulate_smoke(tmp_path):
    """The CPU study of FP8 attention's quality (cudnn-fp8's numerical model in place of the kernel):
    each configuration scored against plain SDPA on the same clips."""
    pytest.importorskip("omniloop_wan_demo")
    rec = run_script(BENCH / "attention_fp8_quality.py",
                     ["--smoke", "--parts", "emulate", "--emulate-configs", "fp8-model,fp8-model-qkv-only"], tmp_path,
                     "attention_fp8-*-smoke.json")
    assert "emulate_error" not in rec, rec.get("emulate_traceback")
    emu = rec["emulate"]
    assert emu["sdpa"]["n"] == 4 and "verdicts_vs_sdpa" not in emu["sdpa"]
    for name in ("fp8-model", "fp8-model-qkv-only"):
        assert set(emu[name]["verdicts_vs_sdpa"]) == {"color", "direction", "shape"}
        assert 10 < emu[name]["psnr_db_mean"] < 80  # FP8 rounding moves pixels, not the picture


@pytest.mark.skipif(not (BENCH / "attention_fp8_quality.py").exists(), reason="bench/ not in this checkout")
def test_fp8_quality_emulated_roundings_order_as_their_precision():
    """The emulate part's backends on one attention call: rounding q/k/v to bf16 (8 mantissa bits)
    costs less than SageAttention's INT8 q/k (7 bits per 64-token block), which costs less than
    e4m3 (3 bits); leaving every input unrounded (``exact``) with P and O exact is plain attention."""
    import importlib.util

    import torch
    import torch.nn.functional as F

    spec = importlib.util.spec_from_file_location("attention_fp8_quality_bench", BENCH / "attention_fp8_quality.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fns = {}
    mod.EmulatedFP8Plugin().omniloop_register_attention_backends(lambda s: fns.__setitem__(s.name, s.fn))
    assert set(fns) == set(mod.EMULATED)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 150, 64) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v)

    def rel(name):
        o = fns[name](q, k, v)
        return float((o - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())

    assert rel("bf16-qkv") < rel("int8-qk") < rel("fp8-model-qkv-only") < rel("fp8-model")
    assert rel("fp8-model-v-only") < rel("fp8-model-qkv-only")
    # cross-attention (Lq != Lk) runs plain SDPA in the self-attention-only model
    kc, vc = torch.randn(1, 2, 20, 64), torch.randn(1, 2, 20, 64)
    assert torch.allclose(fns["fp8-model-self"](q, kc, vc), F.scaled_dot_product_attention(q, kc, vc))


def test_paired_verdicts_is_mcnemars_exact_test():
    import sys

    sys.path.insert(0, str(BENCH))
    from _common import paired_verdicts

    assert paired_verdicts(0, 0) == {"lost": 0, "gained": 0, "net": 0, "p_two_sided": 1.0}
    assert paired_verdicts(4, 3)["p_two_sided"] == 1.0  # as even as 7 changes can be
    assert paired_verdicts(8, 0)["p_two_sided"] == round(2 / 2**8, 4)  # all 8 one way
    assert paired_verdicts(10, 3) == {"lost": 10, "gained": 3, "net": -7, "p_two_sided": round(2 * 378 / 8192, 4)}
    assert paired_verdicts(3, 10)["p_two_sided"] == paired_verdicts(10, 3)["p_two_sided"]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (its CPU interpreter)")
def test_quant_kernels_bench_smoke(tmp_path):
    """bench/quant_kernels.py on the CPU under Triton's interpreter (a subprocess: the interpreter is
    chosen before triton is imported): every side timed, the kernel variants compared with the reference."""
    import json
    import os
    import subprocess
    import sys

    repo = BENCH.parent
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, str(BENCH / "quant_kernels.py"), "--smoke", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, cwd=repo, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    (path,) = tmp_path.glob("quant_kernels-smoke-*.json")
    rec = json.loads(path.read_text())
    assert rec["command"].startswith("python bench/quant_kernels.py --smoke")
    assert [(r["shape"], r.get("site")) for r in rec["results"]] == [
        ("smoke", None), ("smoke-norm", "norm1"), ("smoke-norm", "norm2"), ("smoke-norm", "norm3")]
    for norm in rec["results"][1:]:  # the residual + LayerNorm + modulation + e4m3 kernel at Wan's sites
        kern = {r["side"]: r for r in norm["sides"]}["kernel w4 (default)"]
        assert "error" not in kern and kern["vs_reference"]["equal_e4m3_share"] > 0.8
    sides = {r["side"]: r for r in rec["results"][0]["sides"]}
    assert set(sides) == {"torch-eager", "kernel w4 (default)", "kernel pow2 w4 (first form)", "kernel c256 w4"}
    for side in sides.values():
        assert "error" not in side and side["ms"] > 0
    # (the interpreter casts to e4m3 by truncation: most values agree, the scales exactly)
    assert sides["kernel c256 w4"]["vs_reference"]["scale_max_rel_diff"] == 0.0
    assert sides["kernel c256 w4"]["vs_reference"]["equal_e4m3_share"] > 0.8


@pytest.mark.skipif(not (BENCH / "attention_fp8_quality.py").exists(), reason="bench/ not in this checkout")
def test_fp8_quality_clip_budget_keeps_what_was_made(monkeypatch):
    """``--clip-budget-s`` (a device call's time box): no clip starts after the budget; the configuration
    cut short keeps and scores the clips it made, and the ones after it are marked ``not_run`` -- so a
    slow machine still returns a record instead of nothing (the GPU parts are faked here)."""
    pytest.importorskip("omniloop_wan_demo")
    import importlib.util
    import time
    from types import SimpleNamespace

    import numpy as np

    import omniloop_wan_demo.evaluate as evaluate

    spec = importlib.util.spec_from_file_location("attention_fp8_quality_bench", BENCH / "attention_fp8_quality.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    made = mod.clips_until(lambda p, s: (p, s), [("a", 0), ("b", 1)], None)
    assert made == [("a", 0), ("b", 1)] and mod.clips_until(lambda p, s: p, [("a", 0)], time.perf_counter() - 1) == []

    clock = [0.0]  # the bench module's clock: each clip (not the warm-up) takes one "second"

    def clip(rt, prompt, seed, steps, guidance=5.0):
        if steps != 2:  # not the warm-up
            clock[0] += 1.0
        return np.zeros((17, 8, 8, 3), np.uint8)

    def score(vids, prompts, seeds):
        ok = {"color": True, "direction": True, "shape": True}
        return dict(ok, all=1.0), [SimpleNamespace(ok=ok) for _ in vids]

    monkeypatch.setattr(mod, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(mod, "demo_runtime", lambda *a, **k: SimpleNamespace(linears=None))
    monkeypatch.setattr(mod, "wan_demo_clip", clip)
    monkeypatch.setattr(evaluate, "score", score)
    res: dict = {}
    mod.part_clips(res, "cpu", True, ["bf16", "fa3fp8"], [0, 1], guidance=2.0, budget_s=1.5)
    ref, fp8 = res["clips"]["configs"].values()
    assert "error" not in ref, ref.get("traceback_tail")
    assert ref["n"] == 2 and ref["cut_short"] == "2 of 4 clips (--clip-budget-s 1.5)"
    assert fp8 == {**{k: fp8[k] for k in ("attention_backend", "qk_norm_rope", "fp8_quant_in_rope_kernel",
                                            "fp8_quant_cross_in_norm_kernel", "out_rows_kernel", "split_down_k",
                                            "linear_precision")}, "not_run": "--clip-budget-s 1.5 spent"}
    # a budget that ends inside the second configuration: it is compared on the pairs both made
    res, clock[0] = {}, 0.0
    mod.part_clips(res, "cpu", True, ["bf16", "fa3fp8"], [0, 1], guidance=2.0, budget_s=5.5)
    ref, fp8 = res["clips"]["configs"].values()
    assert "error" not in fp8, fp8.get("traceback_tail")
    assert ref["n"] == 4 and "cut_short" not in ref and fp8["n"] == 2 and fp8["compared_clips"] == 2
    assert fp8["verdict_changes_vs_bf16"]["shape"]["lost"] == 0 and fp8["vs_bf16"]["identical_clips"] == 2


@pytest.mark.skipif(not (BENCH / "fp8_error.py").exists(), reason="bench/ not in this checkout")
def test_fp8_error_on_the_cpu(tmp_path):
    """bench/fp8_error.py on flux-demo's transformer (CPU): FP8 linears err more than bf16 against float32,
    each FP8 layer stays near its numerical model, and keeping any one layer group in bf16 lowers the
    whole forward's error; rounding only the weights or only the activations to e4m3 errs between bf16 and both."""
    from omniloop_quant.fp8 import unavailable_reason

    if unavailable_reason("cpu") is not None:
        pytest.skip(f"FP8 on this CPU: {unavailable_reason('cpu')}")
    pytest.importorskip("omniloop_flux_demo")
    rec = run_script(BENCH / "fp8_error.py", ["--device", "cpu", "--timesteps", "1.0", "--groups", "--split", "--blocks"], tmp_path,
                     "fp8_error-cpu.json")
    s = rec["summary"]
    assert s["forwards"]["bf16"] < s["forwards"]["fp8_torch_ops"] < 0.05
    assert s["linears"]["fp8_vs_model"] < 0.01 and s["linears"]["bf16"] < s["linears"]["fp8"]
    assert len(rec["groups_kept_in_bf16"]) == 5
    assert all(g["forward"] < s["forwards"]["fp8_torch_ops"] for g in rec["groups_kept_in_bf16"].values())
    alone = rec["operands_alone"]
    assert set(alone) == {"weights_only", "activations_only"}
    assert all(s["forwards"]["bf16"] < e < s["forwards"]["fp8_torch_ops"] for e in alone.values())
    assert len(rec["blocks_kept_in_bf16"]) == 8  # flux-demo: 2 double + 6 single blocks
    assert all(e < s["forwards"]["fp8_torch_ops"] for e in rec["blocks_kept_in_bf16"].values())


def _adherence(tmp_path, name: str, precision: str, dtype_steps: int | None) -> list:
    """flux-demo's default 54 images at 2 steps through the runtime in a child process (the experiment patches
    omniloop-quant's modules on import), with bench/fp8_dtype_first_steps.py first when ``dtype_steps`` is set:
    each image's detections."""
    import json
    import os
    import subprocess
    import sys

    prelude = "" if dtype_steps is None else f"import runpy; runpy.run_path({str(BENCH / 'fp8_dtype_first_steps.py')!r}); "
    out = tmp_path / f"{name}.json"
    code = prelude + "import sys; from omniloop_wan_demo.cli import adherence; adherence(sys.argv[1:])"
    env = {**os.environ, "FP8_DTYPE_STEPS": str(dtype_steps or 0), "FP8_STEPS_PER_IMAGE": "2"}
    args = ["--model", "flux-demo", "--prompts", "default", "--seeds", "0", "--steps", "2", "--device", "cpu",
            "--dtype", "bfloat16", "--linear-precision", precision, "--no-table", "--json", str(out)]
    subprocess.run([sys.executable, "-c", code, *args], check=True, env=env, capture_output=True, timeout=600)
    return [c["detected"] for c in json.loads(out.read_text())["reports"][0]["clips"]]


@pytest.mark.skipif(not (BENCH / "fp8_dtype_first_steps.py").exists(), reason="bench/ not in this checkout")
def test_fp8_dtype_first_steps_routes_by_step(tmp_path):
    """bench/fp8_dtype_first_steps.py (the session-24 experiment): with every step below FP8_DTYPE_STEPS the
    FP8 deployment computes what linear_precision: dtype does, detection for detection; with none, what fp8 does;
    with the first step only, neither."""
    from omniloop_quant.fp8 import unavailable_reason

    if unavailable_reason("cpu") is not None:
        pytest.skip(f"FP8 on this CPU: {unavailable_reason('cpu')}")
    pytest.importorskip("omniloop_flux_demo")
    dtype = _adherence(tmp_path, "dtype", "dtype", None)
    fp8 = _adherence(tmp_path, "fp8", "fp8", None)
    assert dtype != fp8
    assert _adherence(tmp_path, "k2", "fp8", 2) == dtype
    assert _adherence(tmp_path, "k0", "fp8", 0) == fp8
    first = _adherence(tmp_path, "k1", "fp8", 1)
    assert first != dtype and first != fp8


_EMULATE_CHECK = """
import runpy, sys, torch
runpy.run_path(sys.argv[1])
import omniloop_quant.fp8 as f
torch.manual_seed(0)
lin = torch.nn.Linear(64, 32)
x = torch.randn(5, 64)
layer = f.FP8Linear(lin)
w, sw = layer.qweight, layer.weight_scale
side = sys.argv[3]
on_w, on_a = side in ("both", "weights"), side in ("both", "activations")
xs = x.abs().amax(-1, keepdim=True) / (127.0 if sys.argv[2] == "int8" else 448.0)
if sys.argv[2] == "int8":
    assert w.dtype == torch.float32 and bool((w == w.round()).all()) == on_w and abs(float(w.abs().max()) - 127) < 1e-4
    xq = (x / xs).round().clamp(-127, 127) if on_a else x / xs
else:
    assert bool((w == w.to(torch.float8_e4m3fn).float()).all()) == on_w
    xq = (x / xs).to(torch.float8_e4m3fn).float() if on_a else x / xs
if not on_w:
    assert torch.allclose(w * sw.reshape(-1, 1), lin.weight, rtol=1e-6, atol=1e-7)
want = (xq * xs) @ (w * sw.reshape(-1, 1)).t() + lin.bias
got = layer(x)
assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), (got - want).abs().max()
if side == "none":
    assert torch.allclose(got, lin(x), rtol=1e-5, atol=1e-5)
assert f.FUSE_GELU_QUANT is False
print("ok", sys.argv[2], side, float((got - lin(x)).pow(2).mean().sqrt() / lin(x).pow(2).mean().sqrt()))
"""


@pytest.mark.skipif(not (BENCH / "emulated_linears.py").exists(), reason="bench/ not in this checkout")
@pytest.mark.parametrize("grid, side", [("e4m3", "both"), ("int8", "both"), ("e4m3", "weights"), ("e4m3", "activations"),
                                        ("int8", "activations"), ("e4m3", "none")])
def test_emulated_linears_compute_the_numerical_model_on_their_grid(grid, side):
    """bench/emulated_linears.py (session 25's experiment) in a child process: omniloop-quant's FP8Linear then
    quantises onto EMULATE's grid (e4m3 values, or integers within ±127) with the same per-channel / per-row
    scales and multiplies the dequantised operands in float32 — only the operands EMULATE_SIDE names (session
    27: which operand carries FP8's systematic shift; ``none``, the control, is the float32 linear itself); a bad
    EMULATE or EMULATE_SIDE is refused."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "EMULATE": grid, "EMULATE_SIDE": side}
    res = subprocess.run([sys.executable, "-c", _EMULATE_CHECK, str(BENCH / "emulated_linears.py"), grid, side], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and f"ok {grid} {side}" in res.stdout, res.stderr[-2000:]
    if side != "both":
        return
    for var, value in (("EMULATE", "int4"), ("EMULATE_SIDE", "bias")):
        bad = subprocess.run([sys.executable, "-c", _EMULATE_CHECK, str(BENCH / "emulated_linears.py"), grid, side],
                             env={**env, var: value}, capture_output=True, text=True, timeout=300)
        assert bad.returncode != 0 and f"{var}={value!r}" in bad.stderr + bad.stdout


@pytest.mark.skipif(not (BENCH / "int8_gemm_gpu.py").exists(), reason="bench/ not in this checkout")
def test_int8_gemm_bench_smoke(tmp_path):
    """bench/int8_gemm_gpu.py --smoke on the CPU: every run of one tiny shape, INT8's products exact against its
    numerical model, e4m3's grid error above INT8's on the same operands."""
    rec = run_script(BENCH / "int8_gemm_gpu.py", ["--smoke"], tmp_path, "int8_gemm_gpu-smoke-*.json")
    runs = rec["shapes"]["smoke"]["runs"]
    assert set(runs) == {"bf16", "fp8-rowwise", "int8-mm", "int8-mm+scale", "int8-mm+scale-compiled"}
    assert runs["int8-mm"]["rel_rms_vs_model"] == 0.0
    assert runs["bf16"]["rel_rms_vs_fp32"] < runs["int8-mm+scale"]["rel_rms_vs_fp32"] < runs["fp8-rowwise"]["rel_rms_vs_fp32"]


@pytest.mark.parametrize("script", sorted((Path(__file__).resolve().parents[2] / "plugins" / "compute" / "quant" / "scripts")
                                          .glob("*.sh")), ids=lambda p: p.name)
def test_the_device_scripts_parse_and_name_real_files(script):
    """The GPU scripts cannot run here; what can drift is checked: bash parses each, and the bench scripts and
    the other device scripts each names exist."""
    import re
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    named = re.findall(r"\b((?:bench|plugins/compute/quant/scripts)/[\w/]+\.(?:py|sh))\b", script.read_text())
    assert all((repo / f).is_file() for f in named), [f for f in named if not (repo / f).is_file()]


@pytest.mark.skipif(not (BENCH / "fp8_cast_devices.py").exists(), reason="bench/ not in this checkout")
def test_fp8_cast_devices_cpu_against_itself(tmp_path):
    """bench/fp8_cast_devices.py (the GPU's e4m3 cast and per-row quantisation against the CPU's) runs its two
    checks with ``--device cpu``: the CPU against itself, no mismatch; ``--device cuda`` without CUDA is one line."""
    import torch

    rec = run_script(BENCH / "fp8_cast_devices.py", ["--device", "cpu"], tmp_path, "fp8_cast_devices-cpu.json")
    assert rec["cast"]["values"] > 6_000_000 and rec["cast"]["mismatches"] == 0
    assert rec["quantize_rows"] == {"rows": 4096, "row_scale_mismatches": 0, "max_scale_ulps": 0, "codes": 4096 * 512,
                                    "code_mismatches": 0}
    if not torch.cuda.is_available():
        import subprocess
        import sys

        r = subprocess.run([sys.executable, str(BENCH / "fp8_cast_devices.py"), "--out", str(tmp_path)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr


_EXCLUDE_CHECK = """
import runpy, sys, torch
from torch import nn
runpy.run_path(sys.argv[1])
import omniloop_quant.blocks as b
import omniloop_quant.fp8 as f

class Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(32, 64)

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = Norm()
        self.to_q = nn.Linear(32, 32)

blocks = nn.ModuleList([Block(), Block()])
report = b.install(list(blocks), names=["b0", "b1"])  # as the deploy does: block by block
assert report["quantized"] == 2, report
assert type(blocks[0].norm1.linear) is nn.Linear and type(blocks[1].norm1.linear) is nn.Linear
assert isinstance(blocks[0].to_q, f.FP8Linear) and isinstance(blocks[1].to_q, f.FP8Linear)
print("ok")
"""


@pytest.mark.skipif(not (BENCH / "fp8_exclude.py").exists(), reason="bench/ not in this checkout")
def test_fp8_exclude_keeps_the_matching_linears():
    """bench/fp8_exclude.py (session 27's experiment) in a child process: the deploy's FP8 install then keeps every
    linear whose path under its block list matches FP8_EXCLUDE (here the modulation's ``norm1.linear``) as it was;
    a missing or malformed expression is refused."""
    import os
    import subprocess
    import sys

    script = str(BENCH / "fp8_exclude.py")
    env = {**os.environ, "FP8_EXCLUDE": r"(^|\.)norm\w*\.linear$"}
    res = subprocess.run([sys.executable, "-c", _EXCLUDE_CHECK, script], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout and "kept the layers at 1 path(s)" in res.stdout, res.stderr[-2000:]
    for value, message in (("", "FP8_EXCLUDE: a regular expression"), ("(", "FP8_EXCLUDE='('")):
        bad = subprocess.run([sys.executable, "-c", _EXCLUDE_CHECK, script], env={**env, "FP8_EXCLUDE": value},
                             capture_output=True, text=True, timeout=300)
        assert bad.returncode != 0 and message in bad.stderr + bad.stdout


_MEAN_CORRECTION_CHECK = """
import runpy, sys, torch
runpy.run_path(sys.argv[1])
import omniloop_quant.fp8 as f
torch.manual_seed(0)
lin = torch.nn.Linear(64, 32)
layer = f.FP8Linear(lin)
deq = layer.dequantized_weight()
assert torch.equal(layer.weight_error, lin.weight.detach() - deq)
def act_part(x):  # what is left: the activations' rounding, through the rounded weight
    xq, sx = f.quantize_rows(x.reshape(-1, 64))
    return ((xq.float() * sx) - x.reshape(-1, 64)) @ deq.t()
# a per-sample vector (2-D, few rows): corrected row by row, so only the activations' error is left
v = torch.randn(2, 64) + 1.0
with torch.no_grad():
    assert torch.allclose(layer(v), lin(v) + act_part(v), rtol=1e-5, atol=1e-5)
    # tokens (3-D): the weight error's mean over the tokens is removed; inputs with a mean (after a GELU, a shift)
    x = torch.randn(1, 256, 64) + 0.5
    plain = f.FP8Linear.__mro__[0]._forward_uncorrected(layer, x)
    exact = lin(x)
    corrected = layer(x)
    err_plain = (plain - exact).mean(dim=1).norm()
    err_corr = (corrected - exact - act_part(x).reshape(1, 256, 32)).mean(dim=1).norm()
assert err_corr < 1e-5 < err_plain, (float(err_corr), float(err_plain))
assert f.FUSE_GELU_QUANT is False
print("ok", float(err_plain))
"""


@pytest.mark.skipif(not (BENCH / "fp8_mean_correction.py").exists(), reason="bench/ not in this checkout")
def test_fp8_mean_correction_removes_the_weight_errors_token_mean():
    """bench/fp8_mean_correction.py (session 27's experiment) in a child process: an FP8Linear then adds its weight
    rounding error times the inputs' token mean — a per-sample vector is corrected exactly, a token sequence's
    output mean is what the exact weight gives (up to the activations' rounding)."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", _MEAN_CORRECTION_CHECK, str(BENCH / "fp8_mean_correction.py")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]
