"""Wan on one GPU: omniloop's speed paths beside diffusers eager and diffusers + torch.compile.

Random weights, real architectures (timing does not depend on the values), built in-process from
diffusers configs (the ones in ../shared/bench/diffusers_wan_baseline.py):

* **1.3b** — Wan2.1 T2V 1.3B transformer, the real VAE, a UMT5-XXL-sized text encoder, UniPC
  flow shift 3; the whole pipeline (prompt → frames) at 480×832×81, bf16 (VAE float32), CFG 5.0.
  Per configuration: seconds per denoise step (median of steps 1..N-1 of every measured run; the
  first step also holds the loop's set-up), end-to-end seconds (prompt to frames; diffusers to its
  ``output_type="np"`` frames, omniloop to its uint8 ``video``), peak memory, achieved TFLOP/s.
* **14b** — Wan2.1 14B transformer, forward only (one forward of one video; the batched-CFG
  configuration times one forward of the cond+uncond batch of two); per step = the forwards of
  one CFG step.

Configurations (``--only`` picks any; ``default`` ones run without ``--only``):

====================================  ===========================================================
``diffusers``                         ``WanPipeline`` eager, diffusers' own attention processor
``diffusers-compile``                 same + ``transformer.compile_repeated_blocks`` (regional
                                      ``torch.compile``, ``--compile-mode``, fullgraph)
``omniloop-<be>[-compile][-batched]`` omniloop Wan family; ``be``: ``sdpa`` (core, torch picks
                                      the kernel), ``cudnn`` (omniloop-attention
                                      ``sdpa-cudnn``), ``fa4`` (``flash-attn-4``: FlashAttention's
                                      CuTe-DSL Hopper kernel, exact-class), ``fa3`` (``flash-attn-3``,
                                      exact-class), ``fa3fp8`` (``fa3-fp8``: FlashAttention-3's FP8
                                      forward, distribution-altering) or ``fp8`` (``cudnn-fp8``: FP8 attention,
                                      distribution-altering; with ``-fused`` q/k are quantised
                                      in the rope kernel, ``-sepq``: by a separate pass),
                                      ``sparse50``/``sparse30``/``sparse15`` (``sparse-tile``
                                      at density 0.5/0.3/0.15, distribution-altering);
                                      ``fp8t``: ``cudnn-fp8`` with ``attention_options:
                                      {plan: fastest}``;
                                      ``-compile``: deploy ``compile: true``
                                      (regional, each block ``fullgraph=True``); ``-batched``:
                                      batched CFG (cond+uncond in one forward); ``-fp8lin``:
                                      deploy ``linear_precision: fp8`` (omniloop-quant: the
                                      blocks' linears as e4m3 ``_scaled_mm`` GEMMs,
                                      distribution-altering); ``-fp8fast``: ``fp8-fast`` (the
                                      same with fast accumulation); ``-fp8fastx``:
                                      ``fp8-fast-except-down`` (fast accumulation except the
                                      feed-forwards' down projections); ``-nq`` (with FP8
                                      linears): ``options.norm_quant: fused`` (each block's norm +
                                      modulation + e4m3 rows in one kernel, omniloop_wan.blocks);
                                      ``-xq`` (FP8 attention): cross-attention's q/k quantised in
                                      the fused norm kernel too; ``-oq`` (with ``-nq``): the
                                      attention outputs quantised by omniloop-quant's row kernel
                                      (both the runtime's default since session 21; a row
                                      without the word switches it off, as earlier rows ran);
                                      ``-sk2``: the FFN down GEMM over two halves of its reduction;
                                      ``-qkv``: ``options.qkv:
                                      fused`` (one Q/K/V GEMM); ``-nogq``: the FP8 feed-forward's
                                      GELU + quantisation by inductor's fused ops instead of
                                      omniloop-quant's Triton pass
                                      (``omniloop_quant.fp8.FUSE_GELU_QUANT`` off; on by
                                      default since 2026-12-05; ``-gq``, its explicit "on",
                                      is kept for the older records' names); ``-mk``: deploy
                                      ``options.compile_inductor: {triton.multi_kernel: 1}``
                                      (persistent reductions for the norm / GELU +
                                      quantisation rows, picked by timing); ``-cd``: the same
                                      option with ``coordinate_descent_tuning: true`` (block
                                      sizes of inductor's kernels tuned at compile)
====================================  ===========================================================

Numerics: every configuration's final latents (and frames) are compared with diffusers eager on
the same modules, seed and CPU-generator noise. ``omniloop-sdpa`` runs the same kernels as
diffusers eager and should be bit-identical; everything else changes kernels or fusion, so in
bf16 we state a tolerance: relative RMS difference of the final latents ≤ ``BF16_REL_RMS_TOL``
(after 4 steps; diffusers' own compile vs eager is reported beside it as the reference spread).

Timing: ``torch.cuda.synchronize()`` at both ends of every measured interval; one warm-up run per
configuration (compiles; autotuning with max-autotune) is not measured. Results are written as
JSON after every configuration (partial results survive a timeout) to ``$OUT`` if set, else
``bench/results/``, with the command line. ``--budget-s`` stops starting new configurations once
that many seconds have passed (the rest are recorded as skipped).

    python bench/wan_gpu.py                                   # default subset, ~7 min on one H200 (estimate)
    python bench/wan_gpu.py --models 1.3b --only diffusers,omniloop-cudnn-compile --steps 8
    python bench/wan_gpu.py --smoke                           # tiny configs on a CPU: checks the script
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import gc
import itertools
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ (also when loaded by file path)
from _repo_paths import add_repo_packages  # noqa: E402

add_repo_packages()

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from _common import (  # noqa: E402
    CFG_13B,
    CFG_14B,
    GUIDANCE,
    SMOKE_TE,
    SMOKE_TF,
    SMOKE_VAE,
    UMT5_XXL,
    command_line,
    default_dtype,
    diffusers_compiled,
    kernel_profile,
    library_versions,
    machine,
    omniloop_request,
    rel_rms,
    run_diffusers,
    run_omniloop,
    sync,
    wan_components,
    wan_pipeline,
)

SMOKE_TF_14B = dict(SMOKE_TF, num_attention_heads=4, ffn_dim=48, num_layers=3)

SEED = 42
BF16_PEAK_TFLOPS = 790.0  # H200 dense bf16, for the "share of peak" column
#: bf16 tolerance of the final latents against diffusers eager (relative RMS, after the run)
BF16_REL_RMS_TOL = 5e-2

BACKENDS = {"sdpa": "sdpa", "cudnn": "sdpa-cudnn", "fp8": "cudnn-fp8", "fa4": "flash-attn-4",
            # FlashAttention-3 (module flash_attn_3): bf16 (exact-class) and its FP8 forward
            "fa3": "flash-attn-3", "fa3fp8": "fa3-fp8",
            # cudnn-fp8 with attention_options.plan: fastest (cuDNN's plans timed once per shape)
            "fp8t": "cudnn-fp8#fastest",
            # sparse-tile at a density (attention_options.density; distribution-altering)
            "sparse50": "sparse-tile@0.5", "sparse30": "sparse-tile@0.3", "sparse15": "sparse-tile@0.15"}
#: side words that set the deploy's ``options.compile_inductor`` (merged when several are given)
INDUCTOR_WORDS = {"mk": {"triton.multi_kernel": 1}, "cd": {"coordinate_descent_tuning": True}}
#: the default subset (~7 min on one H200 with max-autotune compiles); --only picks any
DEFAULT = {
    "1.3b": ["diffusers", "diffusers-compile", "omniloop-sdpa", "omniloop-cudnn-compile",
             "omniloop-cudnn-compile-batched"],
    "14b": ["diffusers", "omniloop-cudnn-compile"],
    # the 1.3B transformer forward alone (no pipeline): for --profile kernel breakdowns
    "1.3b-fwd": ["diffusers", "diffusers-compile", "omniloop-cudnn-compile"],
}


def all_configs() -> list[str]:
    out = ["diffusers", "diffusers-compile"]
    for be, comp, bat in itertools.product(BACKENDS, ("", "-compile"), ("", "-batched")):
        out.append(f"omniloop-{be}{comp}{bat}")
    # suffixes (any omniloop config): -rope options.qk_norm_rope fused, -ffn options.ffn_gelu fused, -fused both
    out += [f"omniloop-{be}-compile-{f}" for be in BACKENDS for f in ("rope", "ffn", "fused")]
    # -sepq (fp8 only): q/k quantised by a separate pass instead of inside the fused rope kernel
    out += ["omniloop-fp8-compile-fused-sepq"]
    # -fp8lin (any omniloop config): deploy linear_precision: fp8 (omniloop-quant, e4m3 block linears)
    out += [f"omniloop-{be}-compile-fused-fp8lin" for be in ("fp8", "cudnn")] + ["omniloop-sdpa-compile-fp8lin"]
    # -fp8fast: linear_precision: fp8-fast (fast accumulation); -qkv (any omniloop config): options.qkv: fused
    out += ["omniloop-fp8-compile-fused-fp8lin-qkv", "omniloop-fp8-compile-fused-fp8fast-qkv"]
    # -fp8fastx: linear_precision: fp8-fast-except-down (fast accumulation but the FFN down projections')
    out += ["omniloop-fa3fp8-compile-fused-fp8fastx", "omniloop-fp8-compile-fused-fp8fastx"]
    # -nq: options.norm_quant: fused (with FP8 linears)
    out += ["omniloop-fa3fp8-compile-fused-fp8fastx-nq", "omniloop-fa3fp8-compile-fused-fp8lin-nq",
            "omniloop-fa3fp8-compile-fused-fp8fast-nq"]
    # -xq (FP8 attention, fused rope): cross-attention's q/k quantised in the fused norm kernel too
    # (omniloop_wan.attention.FUSE_FP8_CROSS_QUANT); -oq (with -nq): the attention outputs quantised by
    # omniloop-quant's row kernel (FUSE_OUT_QUANT) -- both on in the runtime by default since session 21; a row
    # without the word switches it off (the arithmetic earlier rows were measured with)
    out += ["omniloop-fa3fp8-compile-fused-fp8fastx-nq-xq", "omniloop-fa3fp8-compile-fused-fp8fastx-nq-oq",
            "omniloop-fa3fp8-compile-fused-fp8fastx-nq-xq-oq"]
    # -sk2 (with FP8 linears): the FFN down GEMM as two GEMMs over halves of its reduction, summed
    # (omniloop_quant.fp8.SPLIT_DOWN_K = 2; with -fp8fast each half's fast-accumulation chain is half as long)
    out += ["omniloop-fa3fp8-compile-fused-fp8fast-nq-xq-oq-sk2"]
    # fp8t: cudnn-fp8 with attention_options.plan: fastest; -gq: omniloop_quant.fp8.FUSE_GELU_QUANT (the FFN's
    # GELU + FP8 quantisation as one Triton pass)
    out += ["omniloop-fp8t-compile-fused-fp8fast", "omniloop-fp8t-compile-fused-fp8fast-gq"]
    # -mk: options.compile_inductor {triton.multi_kernel: 1} (inductor's persistent reductions, picked by timing)
    out += ["omniloop-fp8-compile-fused-fp8fast-mk", "omniloop-fp8-compile-fused-fp8fast-gq-mk",
            "omniloop-fa4-compile-fused-mk", "omniloop-cudnn-compile-fused-mk",
            "omniloop-fp8-compile-fused-fp8fast-gq-mk-cd", "omniloop-fp8-compile-fused-fp8fast-nogq",
            "omniloop-fp8-compile-fused-fp8fast-cd"]
    return out


def restore_blocks(tf: Any) -> None:
    """diffusers' blocks back after a ``-nq`` configuration (omniloop_wan.blocks), and the compiled blocks
    dropped: they wrap the block objects they were made from, which the next configuration must not reuse."""
    from omniloop_kit.compile import uncompile
    from omniloop_wan import blocks as wan_blocks

    if wan_blocks.installed(tf):
        wan_blocks.restore(tf)
        uncompile(tf)


def parse_config(name: str) -> dict[str, Any]:
    if name in ("diffusers", "diffusers-compile"):
        return {"side": "diffusers", "compile": name.endswith("-compile"), "batched": False, "backend": None,
                "rope": False, "ffn": False, "sepq": False, "xq": False, "oq": False, "sk2": False, "fp8lin": False, "fp8fast": False, "fp8fastx": False,
                "linear_precision": "dtype", "qkv": False, "gq": True, "nq": False, "inductor": None}
    parts = name.split("-")
    if parts[0] != "omniloop" or len(parts) < 2 or parts[1] not in BACKENDS:
        raise SystemExit(f"unknown configuration {name!r}; known: {', '.join(all_configs())}")
    rest = set(parts[2:])
    if rest - {"compile", "batched", "fused", "rope", "ffn", "sepq", "xq", "oq", "sk2", "fp8lin", "fp8fast", "fp8fastx", "qkv", "gq",
               "nogq", "nq",
               *INDUCTOR_WORDS}:
        raise SystemExit(f"unknown configuration {name!r}; known: {', '.join(all_configs())}")
    if {"fp8fast", "fp8fastx"} <= rest:
        raise SystemExit(f"configuration {name!r}: -fp8fast (every GEMM fast) and -fp8fastx (all but the FFN down "
                         "projections) contradict each other; name one")
    linears = ("fp8-fast-except-down" if "fp8fastx" in rest else "fp8-fast" if "fp8fast" in rest
               else "fp8" if "fp8lin" in rest else "dtype")
    if "nq" in rest and linears == "dtype":
        raise SystemExit(f"configuration {name!r}: -nq (options.norm_quant: fused) feeds FP8 linears; add -fp8lin, "
                         "-fp8fast or -fp8fastx")
    return {"side": "omniloop", "backend": BACKENDS[parts[1]], "compile": "compile" in rest, "batched": "batched" in rest,
            "rope": bool(rest & {"fused", "rope"}), "ffn": bool(rest & {"fused", "ffn"}), "sepq": "sepq" in rest,
            "xq": "xq" in rest, "oq": "oq" in rest, "sk2": "sk2" in rest,
            "fp8lin": linears != "dtype", "fp8fast": "fp8fast" in rest, "fp8fastx": "fp8fastx" in rest,
            "linear_precision": linears, "qkv": "qkv" in rest,
            "gq": "nogq" not in rest, "nq": "nq" in rest,
            "inductor": {k: v for w in sorted(rest & set(INDUCTOR_WORDS)) for k, v in INDUCTOR_WORDS[w].items()} or None}


def fp8_linears(transformer: Any, mode: str = "fp8") -> tuple[list[Any], dict[str, Any]]:
    """Deploy ``linear_precision: <mode>`` (``fp8``, ``fp8-fast`` or ``fp8-fast-except-down``) on shared
    modules: the transformer's blocks' linears swapped for e4m3 ones (omniloop-quant; the originals kept,
    so :func:`omniloop_quant.restore` undoes it)."""
    import omniloop_quant
    from omniloop_wan.family import WanFamily

    found = omniloop_quant.denoiser_blocks({"transformer": transformer}, WanFamily())
    blocks = [b for _, b in found]
    accumulation = omniloop_quant.ACCUMULATION[mode]
    report = omniloop_quant.install(blocks, keep_original=True, names=[n for n, _ in found], **accumulation)
    return blocks, {"quantized": report["quantized"], "skipped": len(report["skipped"]), "blocks": len(blocks),
                    **accumulation}


def unfuse_qkv(transformer: Any) -> None:
    """Undo ``options.qkv: fused`` on shared modules (the next configuration starts from diffusers')."""
    for m in transformer.modules():
        if getattr(m, "fused_projections", False):
            m.unfuse_projections()


@contextlib.contextmanager
def module_flag(module: Any, name: str, value: bool) -> Iterator[None]:
    """``module.name = value`` for the ``with`` body, then the old value back (a configuration's switch
    on shared modules)."""
    before = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, before)


@contextlib.contextmanager
def gelu_quant_kernel(on: bool, split_down: int = 1) -> Iterator[None]:
    """Whether omniloop-quant's FP8 feed-forward computes its GELU + activation quantisation in one Triton
    pass (the default; ``-nogq``: off, inductor's fused ops); ``split_down``: its down GEMM over that many
    slices of the reduction (``-sk2``: 2)."""
    from omniloop_quant import fp8

    with module_flag(fp8, "FUSE_GELU_QUANT", on), module_flag(fp8, "SPLIT_DOWN_K", split_down):
        yield


@contextlib.contextmanager
def fp8_quant_fusion(fused: bool, cross: bool = False, out: bool = False) -> Iterator[None]:
    """Whether the fused rope kernel quantises q/k for an FP8 backend (else the backend's own pass);
    ``cross``: cross-attention's too; ``out``: the attention outputs by the row kernel (with ``-nq``)."""
    from omniloop_wan import attention

    with (module_flag(attention, "FUSE_FP8_QUANT", fused), module_flag(attention, "FUSE_FP8_CROSS_QUANT", cross),
          module_flag(attention, "FUSE_OUT_QUANT", out)):
        yield


def flops_per_forward(cfg: dict[str, Any], tokens: int, text_tokens: int = 512) -> float:
    """Matmul FLOPs of one transformer forward (the shared baseline's formula)."""
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    n = cfg["num_layers"]
    per_layer_lin = (2 * tokens * (4 * d * d) + 2 * tokens * (2 * d * d) + 2 * text_tokens * (2 * d * d)
                     + 2 * tokens * (2 * d * cfg["ffn_dim"]))
    attn = 4 * tokens * tokens * d + 4 * tokens * text_tokens * d
    return float(n * (per_layer_lin + attn))


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def cuda() -> bool:
    return torch.cuda.is_available()


def reset_peak() -> None:
    if cuda():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda() else None


def free() -> None:
    gc.collect()
    if cuda():
        torch.cuda.empty_cache()



def numerics(lat: torch.Tensor | None, ref: torch.Tensor | None, frames: torch.Tensor | None = None,
             ref_frames: torch.Tensor | None = None) -> dict[str, Any]:
    if lat is None or ref is None:
        return {}
    out: dict[str, Any] = {
        "latents_bit_equal": bool(torch.equal(lat.cpu(), ref.cpu())),
        "latents_max_abs": float((lat.float().cpu() - ref.float().cpu()).abs().max()),
        "latents_rel_rms": rel_rms(lat, ref),
    }
    out["within_bf16_tolerance"] = out["latents_rel_rms"] <= BF16_REL_RMS_TOL
    if frames is not None and ref_frames is not None:
        d = (frames.int() - ref_frames.int()).abs()
        out["frames_mean_abs_u8"] = round(float(d.float().mean()), 4)
        out["frames_max_abs_u8"] = int(d.max())
    return out


def backend_spec(name: str) -> tuple[Any, str | None]:
    """(AttentionBackendSpec, reason it cannot run here or None)."""
    if name == "sdpa":
        from omniloop.builtin import sdpa
        from omniloop.family import AttentionBackendSpec

        return AttentionBackendSpec(name="sdpa", fn=sdpa), None
    from omniloop_attention.backends import BACKENDS as SPECS

    base, _, density = name.partition("@")
    base, _, plan = base.partition("#")
    spec = next(s for s in SPECS if s.name == base)
    if plan:  # cudnn-fp8's attention_options.plan
        import attrs

        spec = attrs.evolve(spec, fn=spec.configure(spec.options_schema(plan=plan)))
    if density:  # the deploy's attention_options, as the runtime applies them at load
        import attrs

        spec = attrs.evolve(spec, fn=spec.configure(spec.options_schema(density=float(density))))
    return spec, spec.available()


# --------------------------------------------------------------------------------------------
# 1.3B: the whole pipeline
# --------------------------------------------------------------------------------------------


def build_components(device: torch.device, dtype: torch.dtype, smoke: bool) -> dict[str, Any]:
    """Like ``_common.build_components``, but the bf16 modules are built directly in ``dtype``."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    with torch.device(device):
        with default_dtype(dtype):
            tf = WanTransformer3DModel(**(SMOKE_TF if smoke else CFG_13B)).to(dtype).eval().requires_grad_(False)
            te = UMT5EncoderModel(UMT5Config(**(SMOKE_TE if smoke else UMT5_XXL))).to(dtype).eval().requires_grad_(False)
        vae = AutoencoderKLWan(**(SMOKE_VAE if smoke else {})).to(torch.float32).eval().requires_grad_(False)
    return wan_components(tf, vae, te)


class DiffusersPipelineSide:
    def __init__(self, comps: dict[str, Any], compile_mode: str | None, compile_backend: str, compiled: bool) -> None:
        self.comps = comps
        self.compiled = compiled
        self.compile_mode = compile_mode
        self.compile_backend = compile_backend
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> DiffusersPipelineSide:
        from omniloop_wan.attention import diffusers_attention

        tf = self.comps["transformer"]
        self.stack.enter_context(diffusers_attention(tf))
        if self.compiled:
            self.stack.enter_context(diffusers_compiled(tf, self.compile_backend, self.compile_mode))
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stack.close()

    def run(self, steps: int, size: tuple[int, int, int]) -> dict[str, Any]:
        final: dict[str, torch.Tensor] = {}
        run = run_diffusers(wan_pipeline(self.comps), steps, SEED, size, final_latents=final)
        return {"total": run.total, "steps": run.steps, "latents": final["latents"], "frames": run.result}


class OmniloopPipelineSide:
    def __init__(self, comps: dict[str, Any], backend: Any, compiled: bool, batched: bool, compile_mode: str | None,
                 compile_backend: str, device: torch.device, dtype: torch.dtype, rope: bool = False,
                 ffn: bool = False, linear_precision: str = "dtype", qkv: bool = False,
                 inductor: dict[str, Any] | None = None, nq: bool = False) -> None:
        from omniloop.deploy import DeployConfig
        from omniloop.execution import BuiltPipeline
        from omniloop.request import TaskType
        from omniloop_wan.family import WanFamily

        deploy = DeployConfig(device=str(device), dtype="bfloat16", compile=compiled, attention_backend=backend.name,
                              linear_precision=linear_precision)
        options: dict[str, Any] = {"deploy": deploy, "attention": backend, "compile_backend": compile_backend,
                                   "qk_norm_rope": "fused" if rope else "reference",
                                   "ffn_gelu": "fused" if ffn else "reference", "qkv": "fused" if qkv else "separate",
                                   "norm_quant": "fused" if nq else "reference"}
        if compile_mode and compile_backend == "inductor":
            options["compile_mode"] = compile_mode
        if inductor and compile_backend == "inductor":  # (a smoke run's eager backend takes no inductor settings)
            options["compile_inductor"] = dict(inductor)
        fam = WanFamily()
        self.model = fam.from_components(comps, device=device, dtype=dtype, options=options)
        spec = fam.build_pipeline(self.model, TaskType.T2V, options)
        self.built = BuiltPipeline(spec=spec, components=comps, device=device, dtype=dtype, options=options)
        self.batched = batched
        self.transformer = comps["transformer"]
        # linear_precision: fp8 after the family's set-up (fused GELU, lazy compile), as the runtime does
        self.fp8_blocks, self.fp8_report = (fp8_linears(self.transformer, linear_precision)
                                            if linear_precision != "dtype" else ([], None))

    def __enter__(self) -> OmniloopPipelineSide:
        return self

    def __exit__(self, *exc: Any) -> None:
        import omniloop_quant
        from omniloop_wan import ffn

        omniloop_quant.restore(self.fp8_blocks)  # first: it puts back the fused GELU modules it replaced
        ffn.restore(self.transformer)  # the next configuration starts from diffusers' modules
        unfuse_qkv(self.transformer)
        restore_blocks(self.transformer)

    def run(self, steps: int, size: tuple[int, int, int]) -> dict[str, Any]:
        from omniloop.artifacts import Latents

        body = omniloop_request(steps, SEED, size)
        if self.batched:
            body["node_params"] = {"denoise": {"cfg": "batched"}}
        total, per_step, ex = run_omniloop(self.built, body)
        out = ex.output
        if not out.ok:
            raise RuntimeError(f"omniloop request failed: {out.error}")
        return {"total": total, "steps": per_step,
                "latents": ex.state.read("denoised", Latents).tensor, "frames": out.artifacts["video"].frames,
                "metrics": {k: out.metrics.get(k) for k in ("node_seconds", "denoise", "text_cache", "policies")}}


def bench_pipeline(args: argparse.Namespace, rec: Recorder, device: torch.device, dtype: torch.dtype) -> None:
    size = (9, 32, 32) if args.smoke else (args.frames, args.height, args.width)
    cfg = SMOKE_TF if args.smoke else CFG_13B
    lt, lh, lw = (size[0] - 1) // 4 + 1, size[1] // 8, size[2] // 8
    tokens = lt * (lh // 2) * (lw // 2)
    flops = flops_per_forward(cfg, tokens)
    t = time.perf_counter()
    comps = build_components(device, dtype, args.smoke)
    rec.note(f"1.3b: built components in {time.perf_counter() - t:.1f} s")
    ref: dict[str, Any] = {}
    diffusers_compile_spread = None
    for name in rec.selected("1.3b"):
        c = parse_config(name)
        row: dict[str, Any] = {"model": "1.3b", "config": name, "what": "pipeline, prompt to frames",
                               "frames": size[0], "height": size[1], "width": size[2], "tokens": tokens,
                               "steps": args.steps, "repeats": args.repeats, **{k: c[k] for k in ("compile", "batched", "rope", "ffn", "fp8lin", "fp8fast", "fp8fastx", "linear_precision", "qkv", "gq", "nq", "xq", "oq", "sk2", "inductor")},
                               "attention_backend": c["backend"] or "diffusers dispatch (native SDPA)"}
        if rec.over_budget():
            rec.add({**row, "skipped": f"time budget of {args.budget_s:.0f} s spent"})
            continue
        try:
            if c["side"] == "diffusers":
                side: Any = DiffusersPipelineSide(comps, args.compile_mode, args.compile_backend, c["compile"])
            else:
                spec, why = backend_spec(c["backend"])
                if why:
                    rec.add({**row, "skipped": f"attention backend {c['backend']!r}: {why}"})
                    continue
                side = OmniloopPipelineSide(comps, spec, c["compile"], c["batched"], args.compile_mode,
                                            args.compile_backend, device, dtype, rope=c["rope"], ffn=c["ffn"],
                                            linear_precision=c["linear_precision"], qkv=c["qkv"], inductor=c["inductor"],
                                            nq=c["nq"])
                if side.fp8_report is not None:
                    row["fp8_linears"] = side.fp8_report
            with torch.no_grad(), side, fp8_quant_fusion(not c["sepq"], c["xq"], c["oq"]), gelu_quant_kernel(c["gq"], 2 if c["sk2"] else 1):
                t = time.perf_counter()
                side.run(2, size)  # warm-up: kernels, allocator, compilation (+ autotuning)
                row["warmup_s"] = round(time.perf_counter() - t, 2)
                reset_peak()
                runs = [side.run(args.steps, size) for _ in range(args.repeats)]
            per_step = [s for r in runs for s in r["steps"]]
            s_step = statistics.median(per_step) if per_step else float("nan")
            row.update(
                s_per_step=round(s_step, 4), s_per_step_min=round(min(per_step), 4) if per_step else None,
                s_end_to_end=round(statistics.median(r["total"] for r in runs), 3),
                peak_mem_gib=peak_gib(),
                achieved_tflops=round(2 * flops / s_step / 1e12, 1) if per_step else None,
                share_of_bf16_peak=round(2 * flops / s_step / 1e12 / BF16_PEAK_TFLOPS, 3) if per_step and cuda() else None,
            )
            if "metrics" in runs[-1]:
                row["omniloop_metrics"] = runs[-1]["metrics"]
            last = runs[-1]
            if name == "diffusers":
                ref = {"latents": last["latents"], "frames": last["frames"], "s_per_step": s_step,
                       "s_end_to_end": row["s_end_to_end"]}
            elif ref:
                row["vs_diffusers_eager"] = numerics(last["latents"], ref["latents"], last["frames"], ref["frames"])
                row["speedup_per_step_vs_diffusers"] = round(ref["s_per_step"] / s_step, 3)
                row["speedup_end_to_end_vs_diffusers"] = round(ref["s_end_to_end"] / row["s_end_to_end"], 3)
                if name == "diffusers-compile":
                    diffusers_compile_spread = row["vs_diffusers_eager"].get("latents_rel_rms")
                    ref["compiled_s_per_step"] = s_step
            if name.startswith("omniloop") and "compiled_s_per_step" in ref:
                row["speedup_per_step_vs_diffusers_compile"] = round(ref["compiled_s_per_step"] / s_step, 3)
            if diffusers_compile_spread is not None and name != "diffusers-compile":
                row["diffusers_compile_rel_rms_for_reference"] = diffusers_compile_spread
        except Exception as exc:  # record and go on: one configuration must not sink the run
            row["error"] = f"{type(exc).__name__}: {exc}"[:800]
            row["traceback_tail"] = traceback.format_exc()[-1500:]
        rec.add(row)
        free()
    del comps
    torch._dynamo.reset()  # drop the compiled 1.3B graphs (they hold the modules)
    free()


# --------------------------------------------------------------------------------------------
# 14B: transformer forward only
# --------------------------------------------------------------------------------------------


def time_fn(fn: Callable[[], Any], warm: int, reps: int) -> tuple[list[float], Any]:
    out = None
    for _ in range(warm):
        out = fn()
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t)
    return times, out


def _diffusers_forward(tf: Any, x: torch.Tensor, ts: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
    return tf(hidden_states=x, timestep=ts, encoder_hidden_states=pe, return_dict=False)[0]


def bench_forward(args: argparse.Namespace, rec: Recorder, device: torch.device, dtype: torch.dtype,
                  model: str = "14b") -> None:
    from diffusers import WanTransformer3DModel

    from omniloop_wan import ffn
    from omniloop_wan.attention import diffusers_attention, install
    from omniloop_wan.compile import compile_blocks
    from omniloop_wan.transformer import wan_forward

    if model == "1.3b-fwd":
        cfg = SMOKE_TF if args.smoke else CFG_13B
    else:
        cfg = SMOKE_TF_14B if args.smoke else CFG_14B
    frames, h, w = (9, 32, 32) if args.smoke else (args.frames, args.height, args.width)
    lt, lh, lw = (frames - 1) // 4 + 1, h // 8, w // 8
    tokens = lt * (lh // 2) * (lw // 2)
    flops = flops_per_forward(cfg, tokens)
    t = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device), default_dtype(dtype):
        tf = WanTransformer3DModel(**cfg).to(dtype).eval().requires_grad_(False)
    g = torch.Generator(device).manual_seed(0)
    x = torch.randn(1, 16, lt, lh, lw, device=device, dtype=dtype, generator=g)
    pe = torch.randn(1, 512, cfg["text_dim"], device=device, dtype=dtype, generator=g)
    ne = torch.randn(1, 512, cfg["text_dim"], device=device, dtype=dtype, generator=g)
    ts = torch.tensor([500.0], device=device)
    rec.note(f"{model}: built the transformer in {time.perf_counter() - t:.1f} s")
    ref_out = None
    ref_step = ref_compiled_step = None
    warm, reps = (1, 1) if args.smoke else (2, 3)
    fp8_blocks: list[Any] = []
    for name in rec.selected(model):
        c = parse_config(name)
        row: dict[str, Any] = {"model": model, "config": name, "what": "transformer forward only", "frames": frames,
                               "height": h, "width": w, "tokens": tokens, **{k: c[k] for k in ("compile", "batched", "rope", "ffn", "fp8lin", "fp8fast", "fp8fastx", "linear_precision", "qkv", "gq", "nq", "xq", "oq", "sk2", "inductor")},
                               "attention_backend": c["backend"] or "diffusers dispatch (native SDPA)",
                               "tflops_per_forward": round(flops / 1e12, 1)}
        if rec.over_budget():
            rec.add({**row, "skipped": f"time budget of {args.budget_s:.0f} s spent"})
            continue
        try:
            with torch.no_grad(), contextlib.ExitStack() as stack:
                stack.enter_context(fp8_quant_fusion(not c["sepq"], c["xq"], c["oq"]))
                stack.enter_context(gelu_quant_kernel(c["gq"], 2 if c["sk2"] else 1))
                if c["side"] == "diffusers":
                    stack.enter_context(diffusers_attention(tf))
                    if c["compile"]:
                        stack.enter_context(diffusers_compiled(tf, args.compile_backend, args.compile_mode))
                    fn = functools.partial(_diffusers_forward, tf, x, ts, pe)
                else:
                    spec, why = backend_spec(c["backend"])
                    if why:
                        rec.add({**row, "skipped": f"attention backend {c['backend']!r}: {why}"})
                        continue
                    if c["qkv"]:  # options.qkv: fused, before the processors (as the family's configure)
                        from omniloop_wan.attention import fuse_projections

                        fuse_projections(tf)
                    install(tf, spec, qk_norm_rope="fused" if c["rope"] else "reference")
                    if c["ffn"]:
                        ffn.install(tf)
                    if c["nq"]:  # options.norm_quant: fused -- omniloop's block forward, before FP8 (as the family)
                        from omniloop_wan import blocks as wan_blocks

                        restore_blocks(tf)
                        wan_blocks.install(tf)
                    if c["fp8lin"]:  # deploy linear_precision: fp8, after the fused GELU (as the runtime)
                        fp8_blocks, row["fp8_linears"] = fp8_linears(tf, c["linear_precision"])
                    blocks = tf.blocks
                    if c["compile"]:
                        kw = {"backend": args.compile_backend, "dynamic": False,
                              "mode": args.compile_mode if args.compile_backend == "inductor" else None,
                              "options": c["inductor"] if args.compile_backend == "inductor" else None}
                        blocks = compile_blocks(tf, **kw).blocks
                    if c["batched"]:  # cond and uncond in one forward
                        fn = functools.partial(wan_forward, tf, torch.cat([x, x]), ts.expand(2), torch.cat([pe, ne]),
                                               None, None, blocks=blocks)
                    else:
                        fn = functools.partial(wan_forward, tf, x, ts, pe, None, None, blocks=blocks)
                t = time.perf_counter()
                fn()
                sync()
                row["warmup_s"] = round(time.perf_counter() - t, 2)
                reset_peak()
                times, out = time_fn(fn, warm, reps)
                if args.profile:
                    row["profile_one_forward"] = kernel_profile(fn, args.profile_top)
            s_fwd = statistics.median(times)
            s_step = s_fwd if c["batched"] else 2 * s_fwd  # one CFG step: cond + uncond
            row.update(s_forward=round(s_fwd, 4), s_forward_min=round(min(times), 4), s_per_step=round(s_step, 4),
                       peak_mem_gib=peak_gib(), achieved_tflops=round(2 * flops / s_step / 1e12, 1),
                       share_of_bf16_peak=round(2 * flops / s_step / 1e12 / BF16_PEAK_TFLOPS, 3) if cuda() else None)
            cond = out[:1]
            if name == "diffusers":
                ref_out, ref_step = cond.float().cpu(), s_step
            elif ref_out is not None:
                row["vs_diffusers_eager"] = {
                    "bit_equal": bool(torch.equal(cond.float().cpu(), ref_out)),
                    "max_abs": float((cond.float().cpu() - ref_out).abs().max()),
                    "rel_rms": rel_rms(cond, ref_out),
                }
                row["speedup_per_step_vs_diffusers"] = round(ref_step / s_step, 3) if ref_step else None
                if name == "diffusers-compile":
                    ref_compiled_step = s_step
            if name.startswith("omniloop") and ref_compiled_step:
                row["speedup_per_step_vs_diffusers_compile"] = round(ref_compiled_step / s_step, 3)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:800]
            row["traceback_tail"] = traceback.format_exc()[-1500:]
        finally:
            import omniloop_quant

            omniloop_quant.restore(fp8_blocks)  # before ffn.restore: it puts back the fused GELU it replaced
            fp8_blocks = []
            ffn.restore(tf)  # the next configuration starts from diffusers' modules
            unfuse_qkv(tf)
            restore_blocks(tf)
        rec.add(row)
        free()
    del tf
    free()


# --------------------------------------------------------------------------------------------
# recording
# --------------------------------------------------------------------------------------------


class Recorder:
    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        self.args = args
        self.t0 = time.perf_counter()
        only = [s for s in (args.only or "").split(",") if s]
        for name in only:
            parse_config(name)
        self.only = only
        date = dt.date.today().isoformat()
        out_dir = Path(args.out or os.environ.get("OUT") or HERE / "results")
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / f"wan_gpu-{date}{'-smoke' if args.smoke else ''}.json"
        self.record: dict[str, Any] = {
            "bench": "wan_gpu",
            "command": command_line("bench/wan_gpu.py", argv),
            "date": date,
            "machine": {**machine(cudnn=torch.backends.cudnn.version() if cuda() else None), **library_versions()},
            "setup": {
                "weights": "random (timing only)", "dtype": "bfloat16 (VAE float32)", "guidance_scale": GUIDANCE,
                "scheduler": "UniPC flow shift 3", "steps": args.steps, "repeats": args.repeats,
                "size": "9x32x32 (smoke)" if args.smoke else f"{args.frames}x{args.height}x{args.width}",
                "compile": {"backend": args.compile_backend, "mode": args.compile_mode,
                            "diffusers": "transformer.compile_repeated_blocks(fullgraph=True)",
                            "omniloop": "deploy compile: true (each block torch.compile(fullgraph=True, dynamic=False))"},
                "bf16_tolerance": f"final latents relative RMS vs diffusers eager <= {BF16_REL_RMS_TOL}",
                "per_step": "median of steps 1..N-1 of every measured run (1.3b); 2 forwards (or 1 batched) (14b)",
                "achieved_tflops": "matmul FLOPs of the step's forwards / seconds per step",
                "text_encoder": "UMT5-XXL size, random; omniloop's measured runs hit its text-embedding cache "
                                "(the warm-up encoded the prompts), diffusers encodes every run",
            },
            "notes": [],
            "results": [],
            "elapsed_s": 0.0,
        }

    def selected(self, model: str) -> list[str]:
        """The configurations to run, diffusers' first (they are the reference of the others)."""
        names = self.only or DEFAULT[model]
        return sorted(names, key=lambda n: (not n.startswith("diffusers"), names.index(n)))

    def over_budget(self) -> bool:
        return time.perf_counter() - self.t0 > self.args.budget_s

    def note(self, text: str) -> None:
        print(text, flush=True)
        self.record["notes"].append(text)
        self.write()

    def add(self, row: dict[str, Any]) -> None:
        brief = {k: row.get(k) for k in ("model", "config", "s_per_step", "s_end_to_end", "peak_mem_gib",
                                         "achieved_tflops", "speedup_per_step_vs_diffusers", "skipped", "error")
                 if row.get(k) is not None}
        print(json.dumps(brief), flush=True)
        self.record["results"].append(row)
        self.write()

    def write(self) -> None:
        self.record["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        if not self.args.no_write:
            self.path.write_text(json.dumps(self.record, indent=1, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="1.3b,14b", help="comma list of 1.3b, 14b, 1.3b-fwd (forward only)")
    ap.add_argument("--only", default="", help=f"comma list of configurations (default: a subset); any of {', '.join(all_configs())}")
    ap.add_argument("--steps", type=int, default=4, help="denoise steps per measured 1.3b run")
    ap.add_argument("--repeats", type=int, default=2, help="measured 1.3b runs per configuration")
    ap.add_argument("--frames", type=int, default=81)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--compile-mode", default="max-autotune-no-cudagraphs", help="torch.compile mode ('' for default)")
    ap.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; eager with --smoke)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no new configuration after this many seconds")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else bench/results)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--profile", action="store_true", help="forward-only models: GPU kernel breakdown of one forward")
    ap.add_argument("--profile-top", type=int, default=12, help="--profile: how many of the longest kernels to list")
    ap.add_argument("--smoke", action="store_true", help="tiny configs (CPU is fine): checks the script")
    args = ap.parse_args(argv)
    if args.compile_backend is None:
        args.compile_backend = "eager" if args.smoke else "inductor"
    args.compile_mode = args.compile_mode or None
    if args.smoke:
        args.steps, args.repeats = min(args.steps, 3), 1
    models = [m.strip().lower() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in DEFAULT:
            raise SystemExit(f"--models: unknown model {m!r} (1.3b, 14b, 1.3b-fwd)")
    # every configuration recompiles the shared block code (other processor, other batch size)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    if hasattr(torch._dynamo.config, "accumulated_cache_size_limit"):
        torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 512)

    device = torch.device("cuda" if cuda() else "cpu")
    dtype = torch.bfloat16
    rec = Recorder(args, argv)
    print(f"torch {torch.__version__} on {rec.record['machine']['gpu'] or 'CPU'}; writing {rec.path}", flush=True)
    for m in models:  # in the order given
        if m == "1.3b":
            bench_pipeline(args, rec, device, dtype)
        else:
            bench_forward(args, rec, device, dtype, model=m)
    rec.note(f"done in {time.perf_counter() - rec.t0:.0f} s")
    if args.no_write:
        print(json.dumps(rec.record, indent=1, default=str))
    else:
        print(f"wrote {rec.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
