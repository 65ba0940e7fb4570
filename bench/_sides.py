"""The side runner the diffusers-vs-omniloop GPU benchmarks share (``sd3_gpu.py``, ``stable_audio_gpu.py``).

A *side* is one way of running the same request (diffusers eager, diffusers + compile, omniloop
with some deploy) with a ``name``, a ``note`` and ``run(steps) -> {"total", "steps", "latents",
...}``. :func:`build_sides` makes them (a side that cannot be made here is recorded as skipped),
:func:`warm_up` runs each once untimed (compilation), :func:`measure` runs them in interleaved
rounds (every other round reversed), recording peak memory, and :func:`summarize` writes per side
the median seconds per step and end to end, the final latents' relative RMS difference to
diffusers eager, and the speedups against ``diffusers`` and ``diffusers-compile``. Every phase
stops starting new work once ``budget_s`` seconds have passed since ``t_start``, and the record is
saved after each phase (``save``), so a run cut short keeps what it measured.
:func:`omniloop_options` builds an omniloop side's deploy options (with the attention backend's
spec), :func:`finish` writes the last summary and the wall time.

Imported like ``_common`` (``bench/`` on ``sys.path``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from _common import rel_rms, run_omniloop, step_profile


def parser(description: str, *, steps: int, budget_s: float, sides: Sequence[str]) -> argparse.ArgumentParser:
    """The options every side-by-side script takes: ``--smoke``, ``--steps``, ``--repeats``,
    ``--only``, ``--budget-s``, ``--out`` (default ``$OUT`` or ``bench/results/``)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--smoke", action="store_true", help="tiny configs on CPU (compile backend 'eager')")
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--only", default=",".join(sides))
    ap.add_argument("--budget-s", type=float, default=budget_s, help="start no new phase after this many seconds")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--profile", action="store_true",
                    help="after the timed rounds, each side's kernels over one step (torch.profiler): attention / "
                         "matmul / other and the top kernels, in the side's record as profile_one_step")
    return ap


def setting(ap: argparse.ArgumentParser, args: argparse.Namespace, known: Sequence[str]
            ) -> tuple[torch.device, torch.dtype, str, list[str]]:
    """The device (CPU for ``--smoke`` or without CUDA), dtype (bf16 on CUDA), compile backend
    (``eager`` on CPU) and the ``--only`` sides checked against ``known``; dynamo's cache limit
    raised for the many compiled copies."""
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    only = [s for s in args.only.split(",") if s]
    for s in only:
        if s not in known:
            ap.error(f"--only: unknown side {s!r} (known: {', '.join(known)})")
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return (device, torch.float32 if device.type == "cpu" else torch.bfloat16,
            "eager" if device.type == "cpu" else "inductor", only)


def saver(record: dict[str, Any], out_path: Path) -> Callable[[], None]:
    """``save()``: write ``record`` to ``out_path`` (its folder made)."""

    def save() -> None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(record, indent=1) + "\n")

    return save


def omniloop_options(device: torch.device, dtype: torch.dtype, *, compiled: bool, compile_backend: str,
                     attention: str) -> dict[str, Any]:
    """The options an omniloop side hands its family: the ``deploy`` (device, dtype, compile,
    attention backend), the ``compile_backend`` and, for an attention backend other than plain
    ``sdpa``, its spec as ``attention`` (a backend that cannot run here raises, naming why)."""
    from omniloop.deploy import DeployConfig

    deploy = DeployConfig(device=str(device), dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
                          compile=compiled, attention_backend=attention)
    options: dict[str, Any] = {"deploy": deploy, "compile_backend": compile_backend}
    if attention != "sdpa":
        from omniloop_attention.backends import BACKENDS

        backend = {s.name: s for s in BACKENDS}[attention]
        why = backend.available()
        if why:
            raise RuntimeError(f"attention backend {attention!r} cannot run here: {why}")
        options["attention"] = backend
    return options


def finish(record: dict[str, Any], runs: dict[str, list[dict[str, Any]]], *, t_start: float,
           save: Callable[[], None], out_path: Path,
           summarize: Callable[[dict[str, Any], dict[str, list[dict[str, Any]]]], None]) -> int:
    """The last summary, the wall time, the record saved and where it went printed; returns 0."""
    summarize(record, runs)
    record["wall_s"] = round(time.perf_counter() - t_start, 1)
    save()
    print(json.dumps({"wrote": str(out_path), "summary": record.get("summary")}, indent=1))
    return 0


def omniloop_run(built: Any, body: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """One timed omniloop request: ``({"total", "steps", "latents", "metrics"}, output)``; raises
    when the request did not complete."""
    from omniloop.artifacts import Latents

    run = run_omniloop(built, body)
    out = run.result.output
    if not out.ok:
        raise RuntimeError(f"omniloop request failed: {out.error}")
    return ({"total": run.total, "steps": run.steps, "latents": run.result.state.read("denoised", Latents).tensor,
             "metrics": {"denoise": out.metrics.get("denoise")}}, out)


#: short names of attention backends in side names (``omniloop-fa4-compile-graphs``)
BACKENDS = {"cudnn": "sdpa-cudnn", "fa4": "flash-attn-4", "fp8": "cudnn-fp8", "fa3": "flash-attn-3", "fa3fp8": "fa3-fp8"}
#: what an omniloop side name may say after ``omniloop``: a backend, ``fp8lin`` (deploy
#: ``linear_precision: fp8``, omniloop-quant's FP8 block linears), ``fused`` (``options.qkv: fused``),
#: ``compile`` (deploy ``compile: true``), ``graphs`` (``options.cuda_graphs``), ``gelu`` (``options.ffn_gelu:
#: fused``, the feed-forward projection with cuBLASLt's GELU epilogue; FLUX), ``mod`` (``options.modulation:
#: per-request``, the AdaLN modulations computed once per request; FLUX), ``rope`` (``options.qk_norm_rope:
#: fused``, omniloop-kit's q/k norm + rotary kernel; FLUX), ``keepv`` (with ``fp8lin``: the attention value
#: projections left in the deploy dtype, ``linear_precision_options: {keep: KEEP_V}``; diffusers' names; with
#: ``fused`` FLUX keeps them as the value rows of the fused ``to_qkv`` (omniloop-quant's ``FP8PartLinear``), SD3's
#: fused weight buffer is refused by omniloop-quant at load), ``keepqkv`` (the same for the attention query, key and
#: value projections of both streams: ``KEEP_QKV``), ``keepqkvmod`` (those and the AdaLN modulation linears: ``KEEP_QKV_MOD``,
#: omniloop-quant README's keep list for adherence)
SIDE_WORDS = ("fp8lin", "keepv", "keepqkv", "keepqkvmod", "fused", "gelu", "mod", "rope", "compile", "autotune", "graphs", *BACKENDS)
#: ``keepv``'s keep globs: FLUX's / SD3's joint blocks (``attn.to_v``, ``attn.add_v_proj``)
KEEP_V = ("attn.to_v", "attn.add_v_proj")
#: ``keepqkv``'s keep globs: every attention input projection of FLUX's / SD3's blocks
KEEP_QKV = ("attn.to_[qkv]", "attn.add_[qkv]_proj")
#: ``keepqkvmod``'s: q/k/v and the modulation linears of FLUX's double (``norm1``, ``norm1_context``) and single
#: (``norm``) blocks
KEEP_QKV_MOD = (*KEEP_QKV, "norm1.linear", "norm1_context.linear", "norm.linear")
#: each keep word's globs
KEEPS = {"keepv": KEEP_V, "keepqkv": KEEP_QKV, "keepqkvmod": KEEP_QKV_MOD}


def omniloop_setting(name: str) -> dict[str, Any]:
    """An omniloop side's deploy from its name: ``omniloop[-<backend>][-fp8lin][-keepv|-keepqkv|-keepqkvmod][-fused][-gelu][-mod][-rope][-compile][-autotune][-graphs]``
    → ``{"attention", "linears", "keep", "qkv", "ffn_gelu", "modulation", "qk_norm_rope", "compile", "compile_mode", "graphs"}`` (unknown words raise ``ValueError``;
    ``autotune``: inductor's ``max-autotune-no-cudagraphs``, which tries Triton GEMM templates beside cuBLAS)."""
    words = name.split("-")
    if words[0] != "omniloop" or any(w not in SIDE_WORDS for w in words[1:]):
        raise ValueError(f"side {name!r}: omniloop[-{'|'.join(BACKENDS)}][-fp8lin][-keepv|-keepqkv|-keepqkvmod][-fused][-gelu][-mod][-rope][-compile][-autotune][-graphs]")
    if "autotune" in words and "compile" not in words:
        raise ValueError(f"side {name!r}: 'autotune' is a compile mode, it needs 'compile'")
    keeps = [w for w in words if w in KEEPS]
    if keeps and "fp8lin" not in words:
        raise ValueError(f"side {name!r}: {keeps[0]!r} keeps layers out of the FP8 linears, it needs 'fp8lin'")
    if len(keeps) > 1:
        raise ValueError(f"side {name!r}: one keep word at most ({', '.join(keeps)})")
    backend = [BACKENDS[w] for w in words[1:] if w in BACKENDS]
    return {"attention": backend[0] if backend else "sdpa", "linears": "fp8" if "fp8lin" in words else "dtype",
            "qkv": "fused" if "fused" in words else "separate", "ffn_gelu": "fused" if "gelu" in words else "reference",
            "modulation": "per-request" if "mod" in words else "per-step",
            "qk_norm_rope": "fused" if "rope" in words else "reference",
            "keep": KEEPS[keeps[0]] if keeps else (),
            "compile": "compile" in words, "graphs": "graphs" in words,
            "compile_mode": "max-autotune-no-cudagraphs" if "autotune" in words else None}


def attention_spec(name: str) -> Any:
    """omniloop-attention's backend ``name`` (None for the core ``sdpa``); raises when it cannot run here."""
    if name == "sdpa":
        return None
    from omniloop_attention.backends import BACKENDS as SPECS

    spec = {s.name: s for s in SPECS}[name]
    why = spec.available()
    if why:
        raise RuntimeError(f"attention backend {name!r} cannot run here: {why}")
    return spec


def apply_linear_precision(model: Any, family: Any, deploy: Any) -> str:
    """Deploy ``linear_precision`` on a side's freshly loaded model, as the runtime does between the
    family's load and its pipeline build (omniloop-quant's check, then its in-place swap); the note."""
    if deploy.linear_precision == "dtype":
        return ""
    from omniloop_quant import blocks

    blocks.check_deploy(deploy, family, torch.device(deploy.device), getattr(torch, deploy.dtype))
    report = blocks.apply(model, family, deploy) or {}
    kept = "".join(f", {p} x{n} kept" for p, n in (report.get("kept") or {}).items())
    kept += "".join(f", as rows of {f}: {' '.join(ps)}" for f, ps in (report.get("kept_in_fused") or {}).items())
    return f" linear_precision={deploy.linear_precision} ({report.get('quantized')} linears{kept})"


#: GPU memory a side's forward needs beside the weights (FLUX.1-dev 1024^2, bf16: ~5 GiB)
COPY_HEADROOM_GIB = 8.0


def copy_if_room(module: Any, headroom_gib: float = COPY_HEADROOM_GIB) -> Any:
    """A deep copy of ``module`` for a side of its own -- refused with one line when, on the GPU, it
    would leave less than ``headroom_gib`` free (a third copy of FLUX.1-dev's 12B transformer does
    not fit an 80 GB card: the copy itself ran out of memory and the sides already built then failed
    in cuBLAS). The side is then skipped (``build_sides``) and the others run."""
    need = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
    device = next(module.parameters()).device
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if need + headroom_gib * 2**30 > free:
            raise RuntimeError(f"no room for another copy of the {type(module).__name__} ({need / 2**30:.1f} GiB; "
                               f"{free / 2**30:.1f} GiB free, {headroom_gib:g} GiB kept for the forward): run this "
                               "side in a process of its own")
    return copy.deepcopy(module)


def build_sides(names: Iterable[str], record: dict[str, Any], make: Callable[[str], Any]) -> list[Any]:
    """``make(name)`` for each name; what raises is recorded as ``{"skipped": ...}``."""
    sides: list[Any] = []
    for name in names:
        try:
            side = make(name)
        except Exception as exc:  # a side that cannot run here is recorded, the others go on
            record["sides"][name] = {"skipped": f"{type(exc).__name__}: {exc}"}
            continue
        sides.append(side)
        record["sides"][name] = {"setup": side.note}
    return sides


def _over(t_start: float, budget_s: float) -> bool:
    return time.perf_counter() - t_start > budget_s


def warm_up(sides: list[Any], record: dict[str, Any], run: Callable[[Any, int], Any], *, t_start: float,
            budget_s: float, save: Callable[[], None], steps: int = 2) -> None:
    """Run each side once (``steps`` steps, untimed); drop the ones out of time or failing."""
    for side in list(sides):
        entry = record["sides"][side.name]
        if _over(t_start, budget_s):
            entry["skipped"] = "time budget"
            sides.remove(side)
            continue
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        try:
            run(side, steps)
        except Exception as exc:
            entry["skipped"] = f"warm-up failed: {type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc()[-2000:]
            sides.remove(side)
            continue
        entry["warmup_s"] = round(time.perf_counter() - t, 3)
        print(json.dumps({"side": side.name, "warmup_s": entry["warmup_s"]}), flush=True)
        save()


def measure(sides: list[Any], record: dict[str, Any], run: Callable[[Any, int], dict[str, Any]], *, steps: int,
            repeats: int, t_start: float, budget_s: float, save: Callable[[], None],
            summarize: Callable[[dict[str, Any], dict[str, list[dict[str, Any]]]], None]) -> dict[str, list[dict[str, Any]]]:
    """``repeats`` interleaved rounds (the first always runs); the record summarized and saved after each."""
    runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in sides}
    cuda = torch.cuda.is_available() and any(True for _ in sides)
    for rep in range(repeats):
        if rep and _over(t_start, budget_s):
            record["notes"].append(f"time budget reached after {rep} rounds")
            break
        for side in (sides if rep % 2 == 0 else sides[::-1]):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            r = run(side, steps)
            if cuda:
                r["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            runs[side.name].append(r)
            print(json.dumps({"side": side.name, "rep": rep, "total_s": round(r["total"], 4),
                              "step_s": round(statistics.median(r["steps"]), 5)}), flush=True)
        summarize(record, runs)
        save()
    return runs


def profile(sides: list[Any], record: dict[str, Any], run: Callable[[Any, int], Any], *,
            save: Callable[[], None]) -> None:
    """``--profile``: one denoise step of each side under the profiler (after the timed rounds, so
    compiled code and CUDA graphs are warm); ``record["sides"][name]["profile_one_step"]``: a two-step
    request's kernels minus a one-step request's (``_common.step_profile``), so text encoding and the
    VAE decode, which a one-step request also runs, are not in it."""
    for side in sides:
        entry = record["sides"][side.name]
        try:
            entry["profile_one_step"] = step_profile(lambda n, side=side: run(side, n))
        except Exception as exc:  # the timing stands without it
            entry["profile_error"] = f"{type(exc).__name__}: {exc}"[:400]
        print(json.dumps({"side": side.name, "profile": entry.get("profile_one_step", {}).get("groups_ms")}), flush=True)
        save()


def summarize(record: dict[str, Any], runs: dict[str, list[dict[str, Any]]],
              extra: Callable[[str, list[dict[str, Any]], dict[str, list[dict[str, Any]]]], dict[str, Any]] | None = None
              ) -> None:
    """Per side: medians, totals, peak memory, the last run's metrics, latents vs diffusers eager
    and ``extra(name, side_runs, all_runs)``; ``record["summary"]`` with the speedups."""
    ref = runs.get("diffusers") or []
    ref_lat = ref[-1]["latents"] if ref else None
    summary: dict[str, Any] = {}
    for name, rs in runs.items():
        if not rs:
            continue
        entry = record["sides"][name]
        entry.update(s_per_step=round(statistics.median(s for r in rs for s in r["steps"]), 5),
                     s_end_to_end=round(statistics.median(r["total"] for r in rs), 4),
                     runs=len(rs), totals=[round(r["total"], 4) for r in rs])
        if "peak_gib" in rs[-1]:
            entry["peak_gib"] = round(max(r["peak_gib"] for r in rs), 2)
        if rs[-1].get("metrics"):
            entry["metrics"] = rs[-1]["metrics"]
        if ref_lat is not None:
            lat = rs[-1]["latents"].to(ref_lat.device).reshape(ref_lat.shape)
            entry["latents_rel_rms_vs_diffusers"] = rel_rms(lat, ref_lat)
            entry["latents_bit_equal_diffusers"] = bool(torch.equal(lat, ref_lat))
        if extra is not None:
            entry.update(extra(name, rs, runs))
        summary[name] = {"s_per_step": entry["s_per_step"], "s_end_to_end": entry["s_end_to_end"]}
    for ref_name in ("diffusers", "diffusers-compile"):
        if ref_name in summary:
            for s in summary.values():
                s[f"step_speedup_vs_{ref_name}"] = round(summary[ref_name]["s_per_step"] / s["s_per_step"], 3)
                s[f"e2e_speedup_vs_{ref_name}"] = round(summary[ref_name]["s_end_to_end"] / s["s_end_to_end"], 3)
    record["summary"] = summary


__all__ = ["BACKENDS", "apply_linear_precision", "attention_spec", "build_sides", "finish", "measure", "omniloop_options", "omniloop_run", "omniloop_setting", "parser", "profile", "saver", "setting", "summarize", "warm_up"]
