"""FP8 attention (``cudnn-fp8``): kernel checks, speed on Wan 1.3B's shape, and quality on the trained wan-demo.

Parts, one JSON (``$OUT`` or ``bench/results/attention_fp8-<date>.json``, with the command):

1. **kernel** (GPU): the backend against bf16 SDPA (cuDNN) and against the FP8 numerical model
   (:func:`omniloop_attention.fp8.reference_fp8_attention`) on small random shapes; on Wan 1.3B's
   self-attention shape (1 x 12 heads x 32,760 x 128, ``[B, L, H, D]`` memory) the time of bf16
   cuDNN SDPA, of the FP8 kernel alone, of the backend with its own quantisation passes, and of
   the QK-norm + rotary Triton kernel writing bf16 vs e4m3 (the fused quantisation's cost).
2. **activations** (GPU or CPU): q/k/v of every self-attention call of one real wan-demo clip
   (20 steps, CFG: 400 calls), captured at the backend boundary of a bf16 run; per call the
   relative RMS error of the attention output vs float32 math attention for: bf16 cuDNN, the FP8
   kernel (per-tensor amax scales), the FP8 model with per-tensor / per-head amax scales and with
   the fused kernel's static scale (``omniloop_wan.fused.fp8_descale``), and with P/O kept exact
   (how much of the error is q/k/v rounding).
3. **clips** (GPU): the wan-demo evaluator's 48 clips (24 prompts x seeds 0, 1; 20 steps, CFG 5)
   with bf16 ``sdpa-cudnn`` and with ``cudnn-fp8`` (fused quantisation, and the separate pass),
   each also with deploy ``linear_precision: fp8`` (omniloop-quant's e4m3 block linears; ``fp8+fp8fast``:
   ``fp8-fast``, the GEMMs' fast accumulation; ``fa3fp8+fp8fastx-nq``: the next one with deploy
   ``options.norm_quant: fused`` (omniloop_wan.blocks); ``fa3fp8+fp8fastx``: ``fa3-fp8`` attention with
   ``fp8-fast-except-down``, fast accumulation except the feed-forwards' down projections):
   color / direction / shape adherence, clips whose verdict changed, PSNR / SSIM of the frames vs
   the bf16 frames.
4. **linears** (GPU or CPU): FP8 linears (``omniloop_quant.FP8Linear``) on the inputs every block
   linear of one real wan-demo clip receives (bf16 run, 20 steps, CFG: 100 linears x 40 calls) —
   per layer the relative RMS error of the output vs the float32 linear, beside the bf16 linear's
   own; on the GPU also the time of bf16 vs FP8 GEMMs on Wan 1.3B / 14B linear shapes
   (32,760 tokens).

    python bench/attention_fp8_quality.py              # GPU: all four (~2-3 min on one H200)
    python bench/attention_fp8_quality.py --smoke      # CPU: parts 2 and 4 on a few calls / steps
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _repo_paths import add_repo_packages  # noqa: E402

add_repo_packages()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import (  # noqa: E402
    command_line,
    cuda_ms,
    frames_psnr,
    frames_ssim,
    library_versions,
    machine,
    rel_rms,
    verdict_changes,
    wan_demo_clip,
)

from omniloop.hookspecs import hookimpl  # noqa: E402


def bench(fn: Any, n: int = 10) -> float:
    """Seconds per call (three warm-up calls, then ``n`` between two CUDA events)."""
    return cuda_ms(fn, n, warmup=3) / 1e3


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float())


# --------------------------------------------------------------------------------------------
# 1. kernel
# --------------------------------------------------------------------------------------------


def part_plans(res: dict[str, Any]) -> None:
    """cuDNN's execution plans for the FP8 graph on Wan 1.3B's and 14B's self-attention shapes
    (q, k, v ``[B, L, H, D]`` memory viewed as ``[B, H, L, D]``, 32,760 tokens): every plan of heuristic
    modes A, B and FALLBACK timed (``attention_options.plan: fastest``'s tuning), then the backend
    call with ``plan: heuristic`` vs ``fastest`` (v quantisation and output dequantisation included)."""
    from omniloop_attention.fp8 import PLAN_TIMINGS, CudnnFP8Attention, quantize

    out: dict[str, Any] = {}
    res["plans"] = out
    dev = "cuda"
    for label, (b, h, s, d) in {"wan13b": (1, 12, 32760, 128), "wan14b": (1, 40, 32760, 128)}.items():
        flops = 4 * b * h * s * s * d
        row: dict[str, Any] = {"shape": [b, h, s, d], "tflop": round(flops / 1e12, 2)}
        out[label] = row
        try:
            g = torch.Generator(dev).manual_seed(2)
            q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16, generator=g).transpose(1, 2)
                       for _ in range(3))
            q8, dq = quantize(q)
            k8, dk = quantize(k)
            heur, fast = CudnnFP8Attention("heuristic"), CudnnFP8Attention("fastest")
            with torch.no_grad():
                ref = heur.attend_quantized(q8, dq, k8, dk, v, torch.bfloat16)
                before = set(PLAN_TIMINGS)
                o = fast.attend_quantized(q8, dq, k8, dk, v, torch.bfloat16)
                new = [key for key in PLAN_TIMINGS if key not in before]
                row["plan_timings"] = PLAN_TIMINGS[new[0]] if new else "not tuned (cached from an earlier call)"
                row["fastest_vs_heuristic_rel_rms"] = rel_rms(o, ref)
                args = (q8, dq, k8, dk, v, torch.bfloat16)
                for name, fn in (("heuristic", heur), ("fastest", fast)):
                    t = bench(functools.partial(fn.attend_quantized, *args), n=20)
                    row[name] = {"ms": round(t * 1e3, 3), "tflops": round(flops / t / 1e12, 1)}
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:800]
            row["traceback"] = traceback.format_exc()[-1500:]
        print("plans", label, json.dumps(row, default=str)[:3000], flush=True)


def part_kernel(res: dict[str, Any]) -> None:
    from omniloop_attention.backends import BACKENDS
    from omniloop_attention.fp8 import cudnn_fp8, quantize, reference_fp8_attention
    from omniloop_wan import fused

    by = {b.name: b for b in BACKENDS}
    out: dict[str, Any] = {"available": by["cudnn-fp8"].available()}
    res["kernel"] = out
    dev = "cuda"
    torch.manual_seed(0)
    checks = []
    for (b, h, lq, lk, d) in [(1, 4, 256, 256, 128), (2, 5, 320, 320, 32), (1, 5, 320, 64, 32), (1, 3, 1000, 512, 64)]:
        row: dict[str, Any] = {"shape_q": [b, h, lq, d], "shape_kv": [b, h, lk, d]}
        try:
            # [B, L, H, D] memory viewed as [B, H, L, D], as a DiT block produces it
            q, k, v = (torch.randn(b, n, h, d, device=dev, dtype=torch.bfloat16).transpose(1, 2) for n in (lq, lk, lk))
            ref = math_attention(q, k, v)
            o = cudnn_fp8(q, k, v)
            row["layout_out"] = list(o.shape)
            row["rel_rms_vs_fp32_math"] = rel_rms(o, ref)
            row["rel_rms_bf16_cudnn_vs_fp32_math"] = rel_rms(by["sdpa-cudnn"].fn(q, k, v), ref)
            row["rel_rms_vs_fp8_model"] = rel_rms(o, reference_fp8_attention(q.float(), k.float(), v.float()))
            row["fp8_model_rel_rms_vs_fp32_math"] = rel_rms(reference_fp8_attention(q.float(), k.float(), v.float()), ref)
            row["finite"] = bool(torch.isfinite(o).all())
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:600]
        print("kernel check", row, flush=True)
        checks.append(row)
    out["checks"] = checks

    # Wan 1.3B self-attention shape
    b, h, s, d = 1, 12, 32760, 128
    C = h * d
    flops = 4 * b * h * s * s * d
    g = torch.Generator(dev).manual_seed(1)
    x_q = torch.randn(b, s, C, device=dev, dtype=torch.bfloat16, generator=g)
    x_k = torch.randn(b, s, C, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16, generator=g)
    norm_q = torch.nn.RMSNorm(C, eps=1e-6, device=dev, dtype=torch.bfloat16)
    norm_k = torch.nn.RMSNorm(C, eps=1e-6, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        norm_q.weight.uniform_(0.5, 1.5)
        norm_k.weight.uniform_(0.5, 1.5)
    ang = torch.rand(s, d // 2, device=dev) * 6.28
    cos = torch.cos(ang).repeat_interleave(2, -1).reshape(1, s, 1, d)
    sin = torch.sin(ang).repeat_interleave(2, -1).reshape(1, s, 1, d)
    fused.prepare()
    big: dict[str, Any] = {"shape": [b, h, s, d], "tflop": flops / 1e12}
    out["wan13b_shape"] = big
    try:
        with torch.no_grad():
            q = fused.qk_norm_rope(x_q, norm_q, cos, sin, h)  # [B, L, H, D]
            k = fused.qk_norm_rope(x_k, norm_k, cos, sin, h)
            qt, kt, vt = (t.permute(0, 2, 1, 3) for t in (q, k, v))
            ref = by["sdpa-cudnn"].fn(qt, kt, vt)
            t = bench(lambda: by["sdpa-cudnn"].fn(qt, kt, vt))
            big["bf16_sdpa_cudnn"] = {"s": t, "tflops": flops / t / 1e12}
            o = cudnn_fp8(qt, kt, vt)
            t = bench(lambda: cudnn_fp8(qt, kt, vt))
            big["fp8_backend_with_quant_passes"] = {"s": t, "tflops": flops / t / 1e12, "rel_rms_vs_bf16": rel_rms(o, ref)}
            q8, dq = quantize(qt)
            k8, dk = quantize(kt)
            t = bench(lambda: cudnn_fp8.attend_quantized(q8, dq, k8, dk, vt, torch.bfloat16))
            big["fp8_backend_qk_prequantised"] = {"s": t, "tflops": flops / t / 1e12}
            v8, dv = quantize(vt)
            so = torch.full((1, 1, 1, 1), 384.0, device=dev) / (dv * 448.0)
            t = bench(lambda: torch.ops.omniloop_attention.cudnn_fp8_sdpa(q8, k8, v8, dq, dk, dv, so, 1 / math.sqrt(d)))
            big["fp8_kernel_only"] = {"s": t, "tflops": flops / t / 1e12}
            t = bench(lambda: (quantize(qt), quantize(kt)))
            big["separate_qk_quant_pass_eager"] = {"s": t}
            t = bench(lambda: (fused.qk_norm_rope(x_q, norm_q, cos, sin, h), fused.qk_norm_rope(x_k, norm_k, cos, sin, h)))
            big["rope_kernel_bf16_q_and_k"] = {"s": t}
            t = bench(lambda: (fused.qk_norm_rope_fp8(x_q, norm_q, cos, sin, h), fused.qk_norm_rope_fp8(x_k, norm_k, cos, sin, h)))
            big["rope_kernel_fp8_q_and_k"] = {"s": t}
            fq8, fdq = fused.qk_norm_rope_fp8(x_q, norm_q, cos, sin, h)
            fk8, fdk = fused.qk_norm_rope_fp8(x_k, norm_k, cos, sin, h)
            big["fused_fp8_q_rel_rms_vs_bf16_rope"] = rel_rms(fq8.float() * fdq, q)
            big["amax_fp8_q_rel_rms_vs_bf16_rope"] = rel_rms(q8.float() * dq, qt)
            of = cudnn_fp8.attend_quantized(fq8.permute(0, 2, 1, 3), fdq, fk8.permute(0, 2, 1, 3), fdk, vt, torch.bfloat16)
            big["fp8_fused_static_scale_rel_rms_vs_bf16"] = rel_rms(of, ref)
            big["q_static_descale_over_amax_descale"] = float(fdq.flatten()[0] / dq.flatten()[0])
    except Exception as exc:
        big["error"] = f"{type(exc).__name__}: {exc}"[:800]
        big["traceback_tail"] = traceback.format_exc()[-1500:]
    print("wan 1.3b shape", big, flush=True)


# --------------------------------------------------------------------------------------------
# wan-demo runtimes
# --------------------------------------------------------------------------------------------

CAPTURED: list[dict[str, Any]] = []


class CapturePlugin:
    """Registers ``capture-bf16``: ``sdpa-cudnn`` (or math on CPU) that keeps a copy of the
    inputs of every self-attention call."""

    OMNILOOP_HOOK_API = ">=1.0,<2"

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.on = False

    @hookimpl
    def omniloop_register_attention_backends(self, register: Any) -> None:
        from omniloop.family import AttentionBackendSpec

        def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
            if self.on and q.shape[-2] == k.shape[-2]:
                CAPTURED.append({"q": q.detach().cpu(), "k": k.detach().cpu(), "v": v.detach().cpu()})
            return self.inner(q, k, v, **kw)

        register(AttentionBackendSpec(name="capture-bf16", fn=fn, description="capture"))


_EXACT_P_O = {"quantize_p": False, "quantize_o": False}
#: ``--emulate-configs`` keys -> how the model runs: ``self_only`` (cross-attention exact), the
#: inputs left unrounded (``exact``: some of "qkv"), and :func:`reference_fp8_attention`'s keywords
EMULATED: dict[str, dict[str, Any]] = {
    "fp8-model": {}, "fp8-model-self": {"self_only": True},
    "fp8-model-exact-p": {"quantize_p": False}, "fp8-model-exact-o": {"quantize_o": False},
    "fp8-model-qkv-only": dict(_EXACT_P_O),
    "fp8-model-q-only": {**_EXACT_P_O, "exact": "kv"}, "fp8-model-k-only": {**_EXACT_P_O, "exact": "qv"},
    "fp8-model-v-only": {**_EXACT_P_O, "exact": "qk"},
    "fp8-model-smooth-k": {"smooth_k": True}, "fp8-model-smooth-kv": {"smooth_k": True, "smooth_v": True},
    "fp8-model-qkv-only-smooth-k": {**_EXACT_P_O, "smooth_k": True},
    # controls and alternatives: q/k/v rounded to bf16 only (the noise floor of a rounding that
    # every exact-class bf16 kernel makes); SageAttention's arithmetic (K smoothed, q and k in INT8
    # with one scale per 64-token block and head; P and V exact, or P, V in e4m3 with the output exact)
    "bf16-qkv": {**_EXACT_P_O, "exact": "qkv", "round": "bf16"},
    "int8-qk": {**_EXACT_P_O, "exact": "v", "round": "int8", "smooth_k": True},
    "int8-qk-fp8-pv": {"quantize_o": False, "round": "int8", "smooth_k": True},
    "int8-qk-fp8-pv-unsmoothed": {"quantize_o": False, "round": "int8"},
    # the first and the last of wan-demo's 10 blocks in exact attention, the rest in the model
    "fp8-model-edges": {"exact_blocks": (0, -1), "blocks": 10},
    # some of the 20 denoising steps in exact attention (the steps that lay the clip out, or the last ones)
    "fp8-model-exact4": {"exact_steps": tuple(range(4))}, "fp8-model-exact2": {"exact_steps": (0, 1)},
    "fp8-model-exactlast4": {"exact_steps": tuple(range(16, 20))},
}
# q and k rotated by one random-sign Hadamard matrix before rounding (FlashAttention-3's "incoherent
# processing": q k^T is unchanged, channels that carry outliers in both q and k are spread over all)
EMULATED["fp8-model-hadamard"] = {"rotate": True}
#: the emulate part's step (:class:`StepTracker`), for configurations with ``exact_steps``
EMULATE_STEP: list[Any] = [None]


@functools.lru_cache(maxsize=8)
def random_hadamard(d: int, seed: int = 0) -> torch.Tensor:
    """An orthogonal ``d x d`` float32 matrix: Sylvester's Hadamard (``d`` a power of 2) with random column signs, / sqrt(d)."""
    if d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-2 head dim, got {d}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(seed)).float() * 2 - 1
    return h * signs / math.sqrt(d)


def _round_inputs(q: torch.Tensor, k: torch.Tensor, how: str, smooth_k: bool) -> dict[str, Any]:
    """``q8`` / ``k8`` for :func:`reference_fp8_attention` rounded another way than e4m3 (``round``)."""
    from omniloop_attention.fp8 import smooth

    one = torch.ones(())
    if smooth_k:
        k = smooth(k)[0]
    if how == "bf16":
        return {"q8": (q.bfloat16().float(), one), "k8": (k.bfloat16().float(), one)}

    def int8(x: torch.Tensor, block: int = 64) -> torch.Tensor:
        B, H, L, D = x.shape
        pad = (-L) % block
        xb = F.pad(x, (0, 0, 0, pad)).reshape(B, H, -1, block, D)
        scale = xb.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(1e-12) / 127.0
        return ((xb / scale).round().clamp(-127, 127) * scale).reshape(B, H, -1, D)[:, :, :L]

    return {"q8": (int8(q), one), "k8": (int8(k), one)}


class EmulatedFP8Plugin:
    """Registers :data:`EMULATED`'s backends: ``cudnn-fp8``'s numerical model
    (:func:`omniloop_attention.fp8.reference_fp8_attention`: per-tensor e4m3 q/k/v, e4m3 probabilities
    and output) on any device — in every attention call or in self-attention only (``Lq == Lk``;
    cross-attention then runs the plain float SDPA), with some inputs, the probabilities or the output
    left unrounded (which of the kernel's roundings costs what), and with K / V smoothed. Not the
    kernel: its rounding of the probabilities differs (see the model's docstring); for CPU studies of
    where FP8 attention costs quality."""

    OMNILOOP_HOOK_API = ">=1.0,<2"

    @hookimpl
    def omniloop_register_attention_backends(self, register: Any) -> None:
        from omniloop.family import AttentionBackendSpec
        from omniloop_attention.fp8 import reference_fp8_attention

        def make(self_only: bool = False, exact: str = "", round: str = "e4m3", exact_blocks: tuple[int, ...] = (),
                 blocks: int = 0, exact_steps: tuple[int, ...] = (), rotate: bool = False, **model: Any) -> Any:
            # exact_blocks: these blocks' attention runs the plain float SDPA (a block is told by counting
            # self-attention calls, Lq == Lk, modulo ``blocks``: each forward visits every block in order)
            seen = [0]

            def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
                if exact_blocks and q.shape[-2] == k.shape[-2]:
                    seen[0] += 1
                if exact_blocks and (seen[0] - 1) % blocks in {b % blocks for b in exact_blocks}:
                    return F.scaled_dot_product_attention(q, k, v)
                if self_only and q.shape[-2] != k.shape[-2]:
                    return F.scaled_dot_product_attention(q, k, v)
                if exact_steps and EMULATE_STEP[0].index in exact_steps:
                    return F.scaled_dot_product_attention(q, k, v)
                one = torch.ones(())
                if rotate:
                    rot = random_hadamard(q.shape[-1]).to(q.device)
                    q, k = q.float() @ rot, k.float() @ rot
                given = {f"{n}8": (x.float(), one) for n, x in zip("qkv", (q, k, v), strict=True) if n in exact}
                if round != "e4m3":
                    given.update(_round_inputs(q.float(), k.float(), round, model.get("smooth_k", False)))
                    if round == "bf16":
                        given["v8"] = (v.float().bfloat16().float(), one)
                return reference_fp8_attention(q.float(), k.float(), v.float(), **given, **model).to(q.dtype)
            return fn

        for name, flags in EMULATED.items():
            register(AttentionBackendSpec(name=name, fn=make(**flags), distribution_altering=True,
                                          description="cudnn-fp8's numerical model (bench)"))


def part_emulate(res: dict[str, Any], device: str, smoke: bool, seeds: list[int] | None, save: Any,
                 configs: list[str] | None = None, guidance: float = 5.0) -> None:
    """wan-demo clips (the evaluator's 24 prompts x ``seeds``) with ``cudnn-fp8``'s numerical model in
    every attention call vs in self-attention only, against the plain SDPA clips of the same seeds:
    verdicts lost / gained and PSNR (runs on the CPU: the model needs no FP8 kernel)."""
    from omniloop_wan_demo.evaluate import DEFAULT_SEEDS, default_prompts, score

    prompts = default_prompts()[: 2 if smoke else None]
    seeds = list(seeds or DEFAULT_SEEDS)
    pairs = [(p, s) for s in seeds for p in prompts]
    out: dict[str, Any] = {"setup": f"wan-demo evaluator prompts x seeds {seeds}, 17x64x64, {3 if smoke else 20} steps, "
                                    f"CFG {guidance:g}, {'bf16' if device == 'cuda' else 'float32'} on {device}"}
    res.setdefault("emulate", {}).update(out)
    out = res["emulate"]
    base: list[np.ndarray] | None = None
    base_verdicts: list[dict[str, bool]] = []
    for backend in ["sdpa", *(configs or ["fp8-model", "fp8-model-self"])]:
        row: dict[str, Any] = {}
        out[backend] = row
        rt = demo_runtime(device, backend, "reference", capture=EmulatedFP8Plugin() if backend != "sdpa" else None)
        tracker = EMULATE_STEP[0] = StepTracker()
        tracker.install()
        t = time.perf_counter()
        vids = []
        for p, s in pairs:
            tracker.reset()
            vids.append(wan_demo_clip(rt, p, s, steps=3 if smoke else 20, guidance=guidance))
        row["seconds"] = round(time.perf_counter() - t, 1)
        acc, clips = score(vids, [p for p, _ in pairs], [s for _, s in pairs])
        verdicts = [{k: c.ok[k] for k in ("color", "direction", "shape")} for c in clips]
        row.update(accuracy=acc, n=len(clips))
        if base is None:
            base, base_verdicts = vids, verdicts
        else:
            row["verdicts_vs_sdpa"] = verdict_changes(verdicts, base_verdicts)
            ps = [frames_psnr(a, b) for a, b in zip(vids, base, strict=True)]
            row["psnr_db_mean"] = float(np.mean([p for p in ps if np.isfinite(p)] or [float("inf")]))
        print("emulate", backend, json.dumps(row, default=str), flush=True)
        save()


def demo_runtime(device: str, backend: str, rope: str, capture: Any = None,
                 linear_precision: str = "dtype", options: dict[str, Any] | None = None) -> Any:
    import omniloop_attention.plugin as attn_plugin
    import omniloop_quant.plugin as quant_plugin
    import omniloop_wan.plugin as wan_plugin
    from omniloop.runtime import Runtime
    from omniloop.testing import make_manager
    from omniloop_wan_demo.checkpoint_path import checkpoint_dir

    # the plugins by hand (the GPU machine has the repo on PYTHONPATH, no entry points): omniloop-quant
    # registers linear_precision fp8 / fp8-fast / fp8-fast-except-down
    plugins: list[tuple[str, Any]] = [("wan", wan_plugin), ("attention", attn_plugin), ("quant", quant_plugin)]
    if capture is not None:
        plugins.append(("capture", capture))
    return Runtime.from_model(checkpoint_dir(), device=device, dtype="bfloat16" if device == "cuda" else "float32",
                              manager=make_manager(*plugins, toy=False), attention_backend=backend,
                              options={"qk_norm_rope": rope, **(options or {})}, linear_precision=linear_precision)



def _transformers() -> list[Any]:
    from diffusers import WanTransformer3DModel

    gc.collect()
    # issubclass(type(o)) rather than isinstance: isinstance also reads o.__class__, which on torch's deprecated
    # torch.distributed.reduce_op object warns FutureWarning
    return [o for o in gc.get_objects() if issubclass(type(o), WanTransformer3DModel)]


def _transformer() -> Any:
    return _transformers()[-1]


# --------------------------------------------------------------------------------------------
# 2. activations
# --------------------------------------------------------------------------------------------


def part_activations(res: dict[str, Any], device: str, smoke: bool) -> None:
    from omniloop_attention.backends import BACKENDS
    from omniloop_attention.fp8 import cudnn_fp8, quantize, reference_fp8_attention
    from omniloop_wan.fused import fp8_descale

    by = {b.name: b for b in BACKENDS}
    inner = by["sdpa-cudnn" if device == "cuda" else "sdpa-math"].fn
    cap = CapturePlugin(inner)
    rt = demo_runtime(device, "capture-bf16", "reference", cap)
    cap.on = True
    CAPTURED.clear()
    from omniloop_wan_demo.evaluate import default_prompts

    prompt = default_prompts()[0]
    wan_demo_clip(rt, prompt, 0, steps=3 if smoke else 20)
    cap.on = False
    tf = _transformer()
    n_layers = len(tf.blocks)
    calls = CAPTURED if not smoke else CAPTURED[: 2 * n_layers]
    kinds = ["bf16_cudnn", "fp8_kernel", "model_tensor", "model_head", "model_static", "model_qkv_only"]
    per: dict[str, list[float]] = {k: [] for k in kinds}
    per_layer: dict[int, list[float]] = {}
    head_spread = []
    for i, c in enumerate(calls):
        layer = i % n_layers
        q, k, v = (c[n].to(device) for n in ("q", "k", "v"))
        ref = math_attention(q, k, v)
        blk = tf.blocks[layer].attn1
        if device == "cuda":
            per["bf16_cudnn"].append(rel_rms(inner(q, k, v), ref))
            try:
                e = rel_rms(cudnn_fp8(q, k, v), ref)
                per["fp8_kernel"].append(e)
                per_layer.setdefault(layer, []).append(e)
            except Exception as exc:
                res.setdefault("activation_errors", str(exc)[:600])
        qf, kf, vf = q.float(), k.float(), v.float()
        per["model_tensor"].append(rel_rms(reference_fp8_attention(qf, kf, vf), ref))
        per["model_head"].append(rel_rms(reference_fp8_attention(qf, kf, vf, granularity="head"), ref))
        C = q.shape[1] * q.shape[-1]
        sq = fp8_descale(blk.norm_q, C).to(device)
        sk = fp8_descale(blk.norm_k, C).to(device)
        q8 = ((qf / sq).clamp(-448, 448).to(torch.float8_e4m3fn), sq)
        k8 = ((kf / sk).clamp(-448, 448).to(torch.float8_e4m3fn), sk)
        per["model_static"].append(rel_rms(reference_fp8_attention(qf, kf, vf, q8=q8, k8=k8), ref))
        per["model_qkv_only"].append(rel_rms(reference_fp8_attention(qf, kf, vf, quantize_p=False, quantize_o=False), ref))
        amax_h = q.abs().amax(dim=(-2, -1)).float().flatten()
        head_spread.append(float(amax_h.max() / amax_h.min().clamp_min(1e-12)))
        if i == 0:
            res["activation_example"] = {"q_shape": list(q.shape), "q_rms": float(qf.pow(2).mean().sqrt()),
                                         "q_amax": float(qf.abs().max()), "static_over_amax_descale_q":
                                         float(sq.flatten()[0] / quantize(q)[1].flatten()[0])}

    def summ(xs: list[float]) -> dict[str, float] | None:
        return {"mean": statistics.fmean(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)} if xs else None

    res["activations"] = {
        "source": f"wan-demo, prompt {prompt!r}, seed 0, {'3' if smoke else '20'} steps CFG 5, {'bf16' if device == 'cuda' else 'float32'} on {device}; "
                  f"every self-attention call ({len(calls)} calls; q/k/v {list(calls[0]['q'].shape)})",
        "metric": "relative RMS error of the attention output vs float32 math attention on the same bf16 inputs",
        "rel_rms": {k: summ(v) for k, v in per.items()},
        "fp8_kernel_by_layer_mean": {str(k): statistics.fmean(v) for k, v in sorted(per_layer.items())},
        "per_head_amax_ratio_max_over_min": summ(head_spread),
    }
    print("activations", json.dumps(res["activations"], indent=1), flush=True)
    del rt
    gc.collect()


# --------------------------------------------------------------------------------------------
# 3. clips
# --------------------------------------------------------------------------------------------




#: ``--clip-configs`` keys -> the clips part's configurations (label, backend, rope, q/k quantised in
#: the rope kernel, linears); ``bf16-flash`` is the control: another
#: exact-class bf16 kernel (torch's FlashAttention-2), whose verdict changes vs ``bf16`` are the
#: noise floor any other configuration's are read against
CLIP_CONFIGS = {"bf16": 0, "fp8": 1, "fp8-sepq": 2, "bf16+fp8lin": 3, "fp8+fp8lin": 4, "fp8+fp8fast": 5, "bf16-flash": 6,
                "fa3fp8+fp8fast": 7, "bf16-fa3": 8, "fa3fp8": 9, "fa3fp8+fp8lin": 10, "fa3fp8-exact4": 11,
                "fa3fp8+fp8fast-exact4": 12, "fa3fp8-exactlast4": 13, "fa3fp8-exact2": 14, "fa3fp8+fp8fastx": 15,
                "fa3fp8+fp8fastx-nq": 16, "fa3fp8+fp8fastx-nq-xq-oq": 17, "fa3fp8+fp8fast-nq-xq-oq-sk2": 18}


class Switches(dict):
    """A clip configuration's module flags (name → value; the others at :data:`SWITCH_DEFAULTS`)."""


#: the module flags a clip configuration may set: name → (module, the value a configuration that names
#: none runs with -- the arithmetic configurations 0-16 were measured with; session 21 turned the first two
#: on in the runtime, so configurations 17 and 18 name them)
SWITCH_DEFAULTS = {"FUSE_FP8_CROSS_QUANT": ("omniloop_wan.attention", False),
                   "FUSE_OUT_QUANT": ("omniloop_wan.attention", False),
                   "SPLIT_DOWN_K": ("omniloop_quant.fp8", 1)}


def current_switches() -> dict[str, Any]:
    """The flags of :data:`SWITCH_DEFAULTS` as the modules hold them now."""
    import importlib

    return {name: getattr(importlib.import_module(module), name) for name, (module, _) in SWITCH_DEFAULTS.items()}


def set_switches(switches: dict[str, Any]) -> None:
    """Every flag of :data:`SWITCH_DEFAULTS` to ``switches``' value, else its default."""
    import importlib

    for name, (module, default) in SWITCH_DEFAULTS.items():
        setattr(importlib.import_module(module), name, switches.get(name, default))


class StepTracker:
    """The denoising step a wan-demo forward belongs to, told by the transformer's ``timestep`` (a
    forward pre-hook on its ``condition_embedder``, :meth:`install`: Wan's forward is omniloop's,
    :func:`omniloop_wan.transformer.wan_forward`; CFG's two forwards of a step share the timestep),
    counted from :meth:`reset` (call it before each clip). ``on_step(index)`` runs at each forward."""

    def __init__(self, on_step: Any = None) -> None:
        self.seen: list[float] = []
        self.index = 0
        self.on_step = on_step

    def reset(self) -> None:
        self.seen = []
        self.index = 0

    def install(self) -> None:
        for tf in _transformers():
            tf.condition_embedder.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        t = kwargs.get("timestep", args[0] if args else None)
        t = float(t.flatten()[0]) if isinstance(t, torch.Tensor) else float(t)
        if t not in self.seen:
            self.seen.append(t)
        self.index = self.seen.index(t)
        if self.on_step is not None:
            self.on_step(self.index)


class StepScheduledFP8:
    """``fa3-fp8`` with some of a clip's denoising steps in ``flash-attn-3`` (exact-class): which steps
    an FP8 attention's error costs verdicts in. In an exact step the Wan processor's fused e4m3 q/k
    path is switched off (``FUSE_FP8_QUANT``), so the backend gets bf16 q/k/v; ``tracker`` (a
    :class:`StepTracker`) says the step."""

    accepts_quantized_qk = True

    def __init__(self, exact_steps: set[int]) -> None:
        self.exact_steps = exact_steps
        self.exact = False
        self.tracker = StepTracker(self._on_step)

    def _on_step(self, index: int) -> None:
        from omniloop_wan import attention as wan_attention

        self.exact = index in self.exact_steps
        wan_attention.FUSE_FP8_QUANT = not self.exact

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        from omniloop_attention.flash3 import fa3_fp8, flash_attn3

        return (flash_attn3 if self.exact else fa3_fp8)(q, k, v, **kw)

    def attend_quantized(self, *args: Any) -> torch.Tensor:
        from omniloop_attention.flash3 import fa3_fp8

        return fa3_fp8.attend_quantized(*args)


class ScheduledPlugin:
    """Registers ``fa3-fp8-scheduled``: a :class:`StepScheduledFP8`."""

    OMNILOOP_HOOK_API = ">=1.0,<2"

    def __init__(self, fn: StepScheduledFP8) -> None:
        self.fn = fn

    @hookimpl
    def omniloop_register_attention_backends(self, register: Any) -> None:
        from omniloop.family import AttentionBackendSpec

        register(AttentionBackendSpec(name="fa3-fp8-scheduled", fn=self.fn, distribution_altering=True,
                                      description="fa3-fp8 with some steps in flash-attn-3 (bench)"))


def clips_until(make: Any, pairs: list[tuple[str, int]], deadline: float | None) -> list[Any]:
    """``make(prompt, seed)`` for each pair in order, stopping at the first pair that would start after
    ``deadline`` (a ``time.perf_counter()`` value; None: no limit): the clips made, a prefix of ``pairs``."""
    out: list[Any] = []
    for p, s in pairs:
        if deadline is not None and time.perf_counter() > deadline:
            break
        out.append(make(p, s))
    return out


def part_clips(res: dict[str, Any], device: str, smoke: bool, keys: list[str] | None = None,
               seeds: list[int] | None = None, save: Any = None, guidance: float = 5.0,
               budget_s: float | None = None) -> None:
    """``save()``, when given, writes the record after each configuration (a time-boxed run keeps
    what finished); ``guidance``: the clips' CFG scale (5 the protocol's, 2 wan-demo's shipped default);
    ``budget_s``: no clip starts after this many seconds of the part -- a configuration cut short keeps
    the clips it made (``cut_short``), compared with the reference's clips of the same prompts and seeds,
    and the configurations after it are marked ``not_run``."""
    deadline = None if budget_s is None else time.perf_counter() + budget_s
    from omniloop_wan import attention as wan_attention
    from omniloop_wan_demo.evaluate import DEFAULT_SEEDS, default_prompts, score

    prompts = default_prompts()[: 2 if smoke else None]
    seeds = list(seeds or DEFAULT_SEEDS)
    pairs = [(p, s) for s in seeds for p in prompts]
    configs = [("bf16 sdpa-cudnn", "sdpa-cudnn", "fused", True, "dtype"),
               ("cudnn-fp8, q/k quantised in the fused rope kernel", "cudnn-fp8", "fused", True, "dtype"),
               ("cudnn-fp8, separate quantisation pass", "cudnn-fp8", "fused", False, "dtype"),
               ("bf16 sdpa-cudnn + fp8 linears", "sdpa-cudnn", "fused", True, "fp8"),
               ("cudnn-fp8 (fused q/k) + fp8 linears", "cudnn-fp8", "fused", True, "fp8"),
               ("cudnn-fp8 (fused q/k) + fp8-fast linears", "cudnn-fp8", "fused", True, "fp8-fast"),
               ("bf16 sdpa-flash (exact-class control)", "sdpa-flash", "fused", True, "dtype"),
               ("fa3-fp8 (fused q/k) + fp8-fast linears", "fa3-fp8", "fused", True, "fp8-fast"),
               ("bf16 flash-attn-3 (exact-class)", "flash-attn-3", "fused", True, "dtype"),
               ("fa3-fp8, q/k quantised in the fused rope kernel", "fa3-fp8", "fused", True, "dtype"),
               ("fa3-fp8 (fused q/k) + fp8 linears", "fa3-fp8", "fused", True, "fp8"),
               ("fa3-fp8, the first 4 of 20 steps in flash-attn-3", "fa3-fp8-scheduled", "fused", True, "dtype", range(4)),
               ("fa3-fp8 + fp8-fast linears, the first 4 of 20 steps in flash-attn-3", "fa3-fp8-scheduled", "fused", True,
                "fp8-fast", range(4)),
               ("fa3-fp8, the last 4 of 20 steps in flash-attn-3", "fa3-fp8-scheduled", "fused", True, "dtype", range(16, 20)),
               ("fa3-fp8, the first 2 of 20 steps in flash-attn-3", "fa3-fp8-scheduled", "fused", True, "dtype", range(2)),
               ("fa3-fp8 (fused q/k) + fp8-fast-except-down linears", "fa3-fp8", "fused", True, "fp8-fast-except-down"),
               ("fa3-fp8 (fused q/k) + fp8-fast-except-down linears, norm + e4m3 rows in one kernel", "fa3-fp8", "fused",
                True, "fp8-fast-except-down", {"norm_quant": "fused"}),
               ("the same, cross-attention q/k in the norm kernel and the attention outputs by the row kernel", "fa3-fp8",
                "fused", True, "fp8-fast-except-down", {"norm_quant": "fused"},
                Switches({"FUSE_FP8_CROSS_QUANT": True, "FUSE_OUT_QUANT": True})),
               ("the same with fp8-fast linears, the FFN down GEMM over two halves of its reduction", "fa3-fp8", "fused",
                True, "fp8-fast", {"norm_quant": "fused"},
                Switches({"FUSE_FP8_CROSS_QUANT": True, "FUSE_OUT_QUANT": True, "SPLIT_DOWN_K": 2}))]
    configs = [configs[CLIP_CONFIGS[k]] for k in (keys or CLIP_CONFIGS)]  # bf16 (the reference) must be first
    videos: dict[str, list[np.ndarray]] = {}
    table: dict[str, Any] = {}
    runtime_switches = current_switches()  # put back after each configuration
    for label, backend, rope, fuse_q, linears, *extra in configs:
        exact = [e for e in extra if isinstance(e, range)]  # steps run exact (fa3-fp8-scheduled)
        options = next((e for e in extra if isinstance(e, dict) and not isinstance(e, Switches)), {})  # deploy options
        switches = next((e for e in extra if isinstance(e, Switches)), Switches())  # module flags
        set_switches(switches)
        row: dict[str, Any] = {"attention_backend": backend, "qk_norm_rope": rope, "fp8_quant_in_rope_kernel": fuse_q,
                               # session 20's switches: cross-attention's q/k in the norm kernel too; with
                               # norm_quant, the attention outputs' rows by omniloop-quant's row kernel
                               "fp8_quant_cross_in_norm_kernel": fuse_q and wan_attention.FUSE_FP8_CROSS_QUANT,
                               "out_rows_kernel": wan_attention.FUSE_OUT_QUANT,
                               "split_down_k": switches.get("SPLIT_DOWN_K", 1),
                               "linear_precision": linears, **({"options": options} if options else {})}
        if deadline is not None and time.perf_counter() > deadline:
            row["not_run"] = f"--clip-budget-s {budget_s:g} spent"
            table[label] = row
            print("clips", label, json.dumps(row), flush=True)
            set_switches(runtime_switches)
            continue
        sched = StepScheduledFP8(set(exact[0])) if exact else None
        if sched is not None:
            row["exact_steps"] = sorted(sched.exact_steps)
        try:
            wan_attention.FUSE_FP8_QUANT = fuse_q
            rt = demo_runtime(device, backend, rope, linear_precision=linears, options=options,
                              capture=ScheduledPlugin(sched) if sched is not None else None)
            if sched is not None:
                sched.tracker.install()
            if rt.linears is not None:
                row["fp8_linears"] = {k: rt.linears[k] for k in ("quantized", "blocks")} | {"skipped": len(rt.linears["skipped"])}
            wan_demo_clip(rt, prompts[0], 0, steps=2)  # warm-up
            t = time.perf_counter()

            def make(p: str, s: int, rt: Any = rt, sched: Any = sched) -> np.ndarray:
                if sched is not None:
                    sched.tracker.reset()
                return wan_demo_clip(rt, p, s, steps=3 if smoke else 20, guidance=guidance)

            vids = clips_until(make, pairs, deadline)
            row["seconds"] = round(time.perf_counter() - t, 2)
            if len(vids) < len(pairs):
                row["cut_short"] = f"{len(vids)} of {len(pairs)} clips (--clip-budget-s {budget_s:g})"
            if not vids:
                raise RuntimeError("no clip made inside --clip-budget-s")
            done = pairs[: len(vids)]
            acc, clips = score(vids, [p for p, _ in done], [s for _, s in done])
            row["accuracy"] = acc
            row["n"] = len(clips)
            row["verdicts"] = [{k: c.ok[k] for k in ("color", "direction", "shape")} for c in clips]
            videos[label] = vids
            base = videos.get("bf16 sdpa-cudnn")
            if base is not None and label != "bf16 sdpa-cudnn":
                n = min(len(vids), len(base))  # either cut short: the clips of the pairs both made
                if n < len(pairs):
                    row["compared_clips"] = n
                ps = [frames_psnr(a, b) for a, b in zip(vids[:n], base[:n], strict=True)]
                ss = [frames_ssim(a, b) for a, b in zip(vids[:n], base[:n], strict=True)]
                finite = [p for p in ps if math.isfinite(p)]
                row["vs_bf16"] = {
                    "psnr_db_mean": statistics.fmean(finite) if finite else float("inf"),
                    "psnr_db_min": min(finite) if finite else float("inf"),
                    "identical_clips": len(ps) - len(finite),
                    "ssim_mean": statistics.fmean(ss), "ssim_min": min(ss),
                }
                bv = table["bf16 sdpa-cudnn"]["verdicts"][:n]
                row["verdict_changes_vs_bf16"] = verdict_changes(row["verdicts"][:n], bv)
            del rt
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:800]
            row["traceback_tail"] = traceback.format_exc()[-1500:]
        finally:
            wan_attention.FUSE_FP8_QUANT = True
            set_switches(runtime_switches)  # as the runtime had them
        brief = {k: v for k, v in row.items() if k != "verdicts"}
        print("clips", label, json.dumps(brief), flush=True)
        table[label] = row
        gc.collect()
        res["clips"] = {"setup": f"wan-demo evaluator prompts x seeds {seeds}, 17x64x64, 20 steps, CFG {guidance:g}, "
                                 f"bf16 on {device}, deploy qk_norm_rope fused; PSNR/SSIM of uint8 frames vs the bf16 clips",
                        "configs": table}
        if save is not None:
            save()


# --------------------------------------------------------------------------------------------
# 4. linears
# --------------------------------------------------------------------------------------------

#: Wan linear shapes (in, out) at 480x832x81 (32,760 tokens): 1.3B dim 1536 / FFN 8960, 14B 5120 / 13824
GEMM_SHAPES = {"1.3b qkvo": (1536, 1536), "1.3b ffn up": (1536, 8960), "1.3b ffn down": (8960, 1536),
               "14b qkvo": (5120, 5120), "14b ffn up": (5120, 13824), "14b ffn down": (13824, 5120)}


def part_linears(res: dict[str, Any], device: str, smoke: bool) -> None:
    """FP8 linears on captured wan-demo activations (per layer) and, on the GPU, GEMM timings."""
    import omniloop_quant
    from omniloop_quant import FP8Linear

    out: dict[str, Any] = {}
    res["linears"] = out
    rt = demo_runtime(device, "sdpa", "reference")
    tf = rt.model.components["transformer"]
    stats: dict[str, dict[str, list[float]]] = {}
    fp8_layers: dict[str, FP8Linear] = {}
    hooks = []

    def hook_for(name: str, lin: torch.nn.Linear) -> Any:
        def hook(module: Any, args: tuple[Any, ...], output: torch.Tensor) -> None:
            x = args[0]
            with torch.no_grad():
                ref = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
                if name not in fp8_layers:
                    fp8_layers[name] = FP8Linear(lin)
                st = stats.setdefault(name, {"fp8": [], "dtype": []})
                st["fp8"].append(rel_rms(fp8_layers[name](x), ref))
                st["dtype"].append(rel_rms(output, ref))
        return hook

    for i, block in enumerate(tf.blocks):
        for name, mod in block.named_modules():
            if isinstance(mod, torch.nn.Linear) and omniloop_quant.shape_ok(mod):
                hooks.append(mod.register_forward_hook(hook_for(f"blocks.{i}.{name}", mod)))
    from omniloop_wan_demo.evaluate import default_prompts

    prompt = default_prompts()[0]
    try:
        wan_demo_clip(rt, prompt, 0, steps=2 if smoke else 20)
    finally:
        for h in hooks:
            h.remove()

    def summ(xs: list[float]) -> dict[str, float]:
        return {"mean": statistics.fmean(xs), "max": max(xs), "n": len(xs)}

    by_kind: dict[str, dict[str, list[float]]] = {}
    for name, st in stats.items():
        kind = name.split(".", 2)[2]
        for k, v in st.items():
            by_kind.setdefault(kind, {}).setdefault(k, []).extend(v)
    every = [e for st in stats.values() for e in st["fp8"]]
    out["activations"] = {
        "source": f"wan-demo, prompt {prompt!r}, seed 0, {2 if smoke else 20} steps CFG 5, "
                  f"{'bf16' if device == 'cuda' else 'float32'} on {device}; the input of every call of every "
                  f"block linear ({len(stats)} linears, {len(every)} calls)",
        "metric": "relative RMS error of the linear's output vs the float32 linear on the same input: 'fp8' = "
                  "omniloop_quant.FP8Linear (per-channel weight, per-token activation e4m3), 'dtype' = the model's "
                  "own linear",
        "all_fp8": summ(every) if every else None,
        "by_kind": {k: {m: summ(v) for m, v in d.items()} for k, d in sorted(by_kind.items())},
        "by_layer_fp8_mean": {n: statistics.fmean(st["fp8"]) for n, st in stats.items()},
    }
    print("linears", json.dumps({k: v for k, v in out["activations"].items() if k != "by_layer_fp8_mean"}, indent=1),
          flush=True)
    del rt
    gc.collect()
    if device != "cuda":
        return
    gemm: dict[str, Any] = {}
    out["gemm_h200"] = gemm
    tokens = 32760
    for label, (k, n) in GEMM_SHAPES.items():
        row: dict[str, Any] = {"tokens": tokens, "in": k, "out": n}
        try:
            row.update(gemm_timing(tokens, k, n))
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:600]
        print("gemm", label, row, flush=True)
        gemm[label] = row
        free_cuda()


def gemm_timing(tokens: int, k: int, n: int) -> dict[str, float]:
    """bf16 ``nn.Linear`` vs the FP8 GEMM alone (operands pre-quantised; also with cuBLAS/CUTLASS
    fast accumulation, which ``FP8Linear`` does not use) vs ``FP8Linear`` eager (with its per-token
    quantisation pass) on one ``[tokens, k] x [k, n]`` shape."""
    import omniloop_quant
    from omniloop_quant import FP8Linear

    g = torch.Generator("cuda").manual_seed(0)
    lin = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=g)
    layer = FP8Linear(lin)
    xq, sx = omniloop_quant.quantize_rows(x)
    flops = 2 * tokens * k * n
    with torch.no_grad():
        t_bf16 = bench(lambda: lin(x))
        t_gemm = bench(lambda: torch._scaled_mm(xq, layer.qweight.t(), scale_a=sx, scale_b=layer.weight_scale,
                                               bias=layer.bias, out_dtype=torch.bfloat16))
        t_fast = bench(lambda: torch._scaled_mm(xq, layer.qweight.t(), scale_a=sx, scale_b=layer.weight_scale,
                                               bias=layer.bias, out_dtype=torch.bfloat16, use_fast_accum=True))
        t_eager = bench(lambda: layer(x))
        t_quant = bench(lambda: omniloop_quant.quantize_rows(x))
        return {"bf16_ms": t_bf16 * 1e3, "fp8_gemm_ms": t_gemm * 1e3, "fp8_layer_eager_ms": t_eager * 1e3,
                "quant_pass_eager_ms": t_quant * 1e3, "bf16_tflops": flops / t_bf16 / 1e12,
                "fp8_gemm_tflops": flops / t_gemm / 1e12, "gemm_speedup": t_bf16 / t_gemm,
                "fp8_gemm_fast_accum_ms": t_fast * 1e3, "gemm_fast_accum_speedup": t_bf16 / t_fast,
                "layer_eager_speedup": t_bf16 / t_eager, "rel_rms_vs_bf16": rel_rms(layer(x), lin(x))}


def free_cuda() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="kernel,activations,clips,linears")
    ap.add_argument("--out", default=None)
    ap.add_argument("--clip-configs", default=",".join(CLIP_CONFIGS),
                    help=f"clips part: comma list of {', '.join(CLIP_CONFIGS)} (bf16, the reference, first)")
    ap.add_argument("--seeds", default="", help="clips part: comma list of seeds (default: the evaluator's)")
    ap.add_argument("--clip-budget-s", type=float, default=None,
                    help="clips part: start no clip after this many seconds; a configuration cut short keeps (and "
                         "compares) the clips it made, later ones are marked not_run")
    ap.add_argument("--guidance", type=float, default=5.0,
                    help="emulate and clips parts: the clips' CFG scale (5: the quality protocol; 2: wan-demo's shipped default)")
    ap.add_argument("--emulate-configs", default="fp8-model,fp8-model-self",
                    help=f"emulate part: comma list of {', '.join(EMULATED)} (each against plain SDPA)")
    ap.add_argument("--smoke", action="store_true", help="CPU: the activation part on a few calls, numerical model only")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    parts = [p for p in args.parts.split(",") if p]
    keys = [k for k in args.clip_configs.split(",") if k]
    if not keys or keys[0] != "bf16" or set(keys) - set(CLIP_CONFIGS):
        raise SystemExit(f"--clip-configs: a comma list of {', '.join(CLIP_CONFIGS)} starting with bf16, got {args.clip_configs!r}")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()] or None
    if args.clip_budget_s is not None and not (math.isfinite(args.clip_budget_s) and args.clip_budget_s > 0):
        raise SystemExit(f"--clip-budget-s: a positive number of seconds, got {args.clip_budget_s!r}")
    emulate = [k for k in args.emulate_configs.split(",") if k]
    if set(emulate) - set(EMULATED):
        raise SystemExit(f"--emulate-configs: a comma list of {', '.join(EMULATED)}, got {args.emulate_configs!r}")
    if device == "cpu":
        parts = [p for p in parts if p in ("activations", "linears", "emulate")]
    date = dt.date.today().isoformat()
    out_dir = Path(args.out or os.environ.get("OUT") or HERE / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"attention_fp8-{date}{'-smoke' if args.smoke else ''}.json"
    res: dict[str, Any] = {"bench": "attention_fp8_quality", "command": command_line("bench/attention_fp8_quality.py", argv),
                           "date": date, "machine": {**machine(cudnn=torch.backends.cudnn.version() if device == "cuda" else None),
                                                     **library_versions()}}
    t0 = time.perf_counter()

    def save() -> None:
        res["elapsed_s"] = round(time.perf_counter() - t0, 1)
        path.write_text(json.dumps(res, indent=1, default=str) + "\n")

    for p in parts:
        try:
            {"kernel": lambda: part_kernel(res), "plans": lambda: part_plans(res),
             "emulate": lambda: part_emulate(res, device, args.smoke, seeds, save, emulate, args.guidance), "activations": lambda: part_activations(res, device, args.smoke),
             "clips": lambda: part_clips(res, device, args.smoke, keys, seeds, save, args.guidance, args.clip_budget_s),
             "linears": lambda: part_linears(res, device, args.smoke)}[p]()
        except Exception as exc:
            res[f"{p}_error"] = f"{type(exc).__name__}: {exc}"[:800]
            res[f"{p}_traceback"] = traceback.format_exc()[-2000:]
            print(res[f"{p}_traceback"], flush=True)
        save()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
