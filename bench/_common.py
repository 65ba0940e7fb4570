"""What the Wan GPU benchmarks share (``wan_gpu.py``, ``wan_vs_diffusers.py``, ``cache_dit_vs_library.py``).

The model configurations and prompts, the timed runs of one request on either side (diffusers'
``WanPipeline`` and omniloop's ``Execution``, each denoise step marked after a
``torch.cuda.synchronize()``), the parts of the JSON record every script writes (command line,
machine), and the video benchmarks' shared command line (:func:`video_parser`, :func:`add_output_args`,
:func:`publish`: also used by ``rl_gpu.py`` and ``wan_causal_stream.py``).

Imported like ``_repo_paths`` (``bench/`` put on ``sys.path`` by the script). Nothing from the repo
is imported at module level: the scripts call ``_repo_paths.add_repo_packages()`` first, and the
omniloop / diffusers imports happen inside the functions.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

#: Wan2.1 T2V 1.3B transformer
CFG_13B = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)
#: Wan2.1 T2V 14B transformer (the 1.3B's layout, wider and deeper)
CFG_14B = dict(CFG_13B, num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40)
#: a UMT5-XXL-sized text encoder
UMT5_XXL = dict(
    vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
    dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
)
#: toy sizes for ``--smoke`` (CPU)
SMOKE_TF = dict(CFG_13B, num_attention_heads=2, attention_head_dim=12, text_dim=32, ffn_dim=32, num_layers=2)
SMOKE_TE = dict(UMT5_XXL, vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
SMOKE_VAE = dict(base_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1)

PROMPT = "a red fox jumps over the lazy dog in the snow, close up shot"
NEGATIVE = "blurry, low quality, static"
GUIDANCE = 5.0


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cuda_ms(fn: Callable[[], Any], iters: int, rounds: int = 1, warmup: int = 1) -> float:
    """Milliseconds per call of ``fn`` on the GPU: ``warmup`` calls, then ``rounds`` rounds of ``iters``
    back-to-back calls between two CUDA events; the median round's mean."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) / iters)
    return statistics.median(out)


def rel_rms(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative RMS error of ``a`` against ``ref`` (float32, on the CPU)."""
    a, ref = a.float().cpu(), ref.float().cpu()
    return float((a - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-12))


def frames_psnr(a: Any, b: Any) -> float:
    """PSNR (dB) of two uint8 frame stacks ``[T, H, W, C]``; inf when equal."""
    import math

    import numpy as np

    mse = float(((np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)) ** 2).mean())
    return float("inf") if mse == 0 else 10 * math.log10(255.0**2 / mse)


def frames_ssim(a: Any, b: Any) -> float:
    """Mean SSIM of two uint8 frame stacks ``[T, H, W, C]`` over frames and channels: a 7x7
    uniform window with Wang et al.'s constants (the attention quality benches' measure;
    bench/cache_demo.py has the Gaussian-window one checked against scikit-image)."""
    import torch.nn.functional as F

    x = torch.as_tensor(a).float().permute(0, 3, 1, 2)
    y = torch.as_tensor(b).float().permute(0, 3, 1, 2)
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2

    def pool(t: torch.Tensor) -> torch.Tensor:
        return F.avg_pool2d(t, 7, 1)

    mx, my = pool(x), pool(y)
    vx, vy, cxy = pool(x * x) - mx * mx, pool(y * y) - my * my, pool(x * y) - mx * my
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    return float(s.mean())


def paired_verdicts(lost: int, gained: int) -> dict[str, Any]:
    """A change of arithmetic scored on the same clips: ``lost`` verdicts that held before and fail
    now, ``gained`` the reverse, and McNemar's exact two-sided p
    (:func:`omniloop_wan_demo.compare.mcnemar_p`; what ``omniloop eval compare`` reports): whether the
    loss stands out of the noise that any change of rounding makes on a detector at its threshold."""
    from omniloop_wan_demo.compare import mcnemar_p

    return {"lost": lost, "gained": gained, "net": gained - lost, "p_two_sided": round(mcnemar_p(lost, gained), 4)}


def verdict_changes(verdicts: list[dict[str, bool]], reference: list[dict[str, bool]],
                    checks: tuple[str, ...] = ("color", "direction", "shape")) -> dict[str, Any]:
    """Per check, the verdicts lost and gained against the reference clips (same prompts and seeds,
    same order) with McNemar's exact p (:func:`paired_verdicts`)."""
    pairs = list(zip(reference, verdicts, strict=True))
    return {k: paired_verdicts(sum(1 for a, b in pairs if a[k] and not b[k]), sum(1 for a, b in pairs if not a[k] and b[k]))
            for k in checks}


# --------------------------------------------------------------------------------------------
# the model
# --------------------------------------------------------------------------------------------


def wan_components(transformer: Any, vae: Any, text_encoder: Any) -> dict[str, Any]:
    """The pipeline components around the given modules: a tiny tokenizer and UniPC (flow shift 3)."""
    from diffusers import UniPCMultistepScheduler
    from transformers import AutoTokenizer

    from omniloop_wan.tiny import _scheduler_config, build_tokenizer

    tok_dir = Path(tempfile.mkdtemp()) / "tokenizer"
    build_tokenizer(tok_dir)
    _, sched_cfg = _scheduler_config("t2v", "unipc")
    return {
        "transformer": transformer, "vae": vae, "text_encoder": text_encoder,
        "tokenizer": AutoTokenizer.from_pretrained(str(tok_dir)),
        "scheduler": UniPCMultistepScheduler.from_config(sched_cfg),
    }


def build_components(device: torch.device, dtype: torch.dtype, smoke: bool = False) -> dict[str, Any]:
    """The Wan2.1 T2V 1.3B architecture with random weights (seed 0): transformer and text encoder in
    ``dtype``, the VAE in float32."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    with torch.device(device):
        tf = WanTransformer3DModel(**(SMOKE_TF if smoke else CFG_13B)).to(dtype).eval().requires_grad_(False)
        vae = AutoencoderKLWan(**(SMOKE_VAE if smoke else {})).to(torch.float32).eval().requires_grad_(False)
        te = UMT5EncoderModel(UMT5Config(**(SMOKE_TE if smoke else UMT5_XXL))).to(dtype).eval().requires_grad_(False)
    return wan_components(tf, vae, te)


# --------------------------------------------------------------------------------------------
# timed runs
# --------------------------------------------------------------------------------------------


class TimedRun(NamedTuple):
    """One timed request: seconds end to end, seconds of each denoise step after the first (the
    first also holds the loop's set-up), and what the run returned."""

    total: float
    steps: list[float]
    result: Any


def step_times(marks: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(marks)]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Modules built inside the block are made directly in ``dtype`` (no float32 transient: 57 GB
    for the Wan 14B); torch's default dtype is restored after it."""
    with contextlib.ExitStack() as restore:
        restore.callback(torch.set_default_dtype, torch.get_default_dtype())
        torch.set_default_dtype(dtype)
        yield


@contextlib.contextmanager
def diffusers_compiled(transformer: Any, backend: str, mode: str | None = None) -> Iterator[None]:
    """diffusers' regional compile (``compile_repeated_blocks``; ``mode`` with inductor only),
    undone afterwards: the modules are shared with the omniloop sides."""
    kw: dict[str, Any] = {"fullgraph": True, "backend": backend}
    if mode and backend == "inductor":
        kw["mode"] = mode
    transformer.compile_repeated_blocks(**kw)
    try:
        yield
    finally:
        for m in transformer.modules():
            if getattr(m, "_compiled_call_impl", None) is not None:
                m._compiled_call_impl = None


def step_marker(steps: int, final_latents: dict[str, torch.Tensor] | None = None) -> tuple[list[float], Any]:
    """A diffusers ``callback_on_step_end`` timing each denoise step: ``(marks, on_step)``; each step
    end appends ``time.perf_counter()`` to ``marks`` after a ``sync()``. With ``final_latents``
    given, the last step's latents are copied into it under ``"latents"``."""
    marks: list[float] = []

    def on_step(_pipe: Any, i: int, t: Any, kw: dict[str, Any]) -> dict[str, Any]:
        sync()
        marks.append(time.perf_counter())
        if final_latents is not None and i == steps - 1:
            final_latents["latents"] = kw["latents"].detach().clone()
        return {}

    return marks, on_step


def wan_pipeline(comps: dict[str, Any]) -> Any:
    """A diffusers ``WanPipeline`` over the shared modules, with a fresh scheduler and no progress bar."""
    from diffusers import WanPipeline

    c = comps
    pipe = WanPipeline(tokenizer=c["tokenizer"], text_encoder=c["text_encoder"], vae=c["vae"],
                       scheduler=type(c["scheduler"]).from_config(c["scheduler"].config), transformer=c["transformer"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_diffusers(pipe: Any, steps: int, seed: int, size: tuple[int, int, int],
                  final_latents: dict[str, torch.Tensor] | None = None) -> TimedRun:
    """Time ``pipe`` (prompt to its ``output_type="np"`` float frames; CFG ``GUIDANCE``, CPU-generator
    noise); ``result`` is the frames as uint8 ``[T, H, W, 3]``, converted after the clock stops.
    With ``final_latents`` given, the last step's latents are copied into it under ``"latents"``."""
    marks, on_step = step_marker(steps, final_latents)
    frames_n, h, w = size
    sync()
    t0 = time.perf_counter()
    out = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, height=h, width=w, num_frames=frames_n,
               num_inference_steps=steps, guidance_scale=GUIDANCE, generator=torch.Generator("cpu").manual_seed(seed),
               output_type="np", callback_on_step_end=on_step, callback_on_step_end_tensor_inputs=["latents"])
    sync()
    total = time.perf_counter() - t0  # to diffusers' own output (float numpy), before our uint8 conversion
    frames = torch.from_numpy((out.frames[0] * 255).round().astype("uint8"))
    return TimedRun(total, step_times(marks), frames)


def omniloop_request(steps: int, seed: int, size: tuple[int, int, int]) -> dict[str, Any]:
    """The request body of the same text-to-video run (prompt, negative prompt, CFG ``GUIDANCE``)."""
    frames_n, h, w = size
    return {
        "task": "t2v",
        "inputs": [{"type": "text", "text": PROMPT}, {"type": "text", "text": NEGATIVE, "role": "negative_prompt"}],
        "diffusion": {"steps": steps, "guidance_scale": GUIDANCE, "seed": seed, "height": h, "width": w,
                      "frames": frames_n},
    }


def run_omniloop(built: Any, body: dict[str, Any]) -> TimedRun:
    """Time one request through ``Execution`` node by node (request to uint8 ``video``); ``result`` is
    the finished ``Execution`` (its ``output`` not checked here)."""
    from omniloop.execution import Execution
    from omniloop.schema import request_from_dict

    req = request_from_dict(body)
    sync()
    t0 = time.perf_counter()
    ex = Execution(built, req)
    marks: list[float] = []
    while not ex.done:
        node = ex.current_node
        ex.advance()
        if node is not None and node.name == "denoise":
            sync()
            marks.append(time.perf_counter())
    sync()
    total = time.perf_counter() - t0
    return TimedRun(total, step_times(marks), ex)


def run_omniloop_video(built: Any, steps: int, seed: int, size: tuple[int, int, int]) -> tuple[TimedRun, Any]:
    """:func:`run_omniloop` of :func:`omniloop_request` with its output checked: the run with the
    uint8 ``video`` frames as ``result`` (what :func:`run_interleaved` compares), and the output."""
    total, per_step, ex = run_omniloop(built, omniloop_request(steps, seed, size))
    out = ex.output
    assert out.ok, out.error
    return TimedRun(total, per_step, out.artifacts["video"].frames), out


def run_interleaved(sides: list[Any], steps: int, repeats: int, size: tuple[int, int, int],
                    seed: int = 42) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, torch.Tensor]]:
    """Warm up every side (2 steps, seed 0), then ``repeats`` rounds, every other one in reverse order.

    A side has a ``name`` and ``run(steps, seed, size) -> (total, step times, frames)``. Returns the
    totals and step times per side over all rounds and each side's frames of the last round; one
    JSON line is printed per run."""
    with torch.no_grad():
        for side in sides:  # warm-up: kernels, allocator, cuDNN plans
            side.run(2, 0, size)
        totals: dict[str, list[float]] = {s.name: [] for s in sides}
        per_steps: dict[str, list[float]] = {s.name: [] for s in sides}
        frames: dict[str, torch.Tensor] = {}
        for rep in range(repeats):
            for side in (sides if rep % 2 == 0 else sides[::-1]):
                total, per_step, fr = side.run(steps, seed, size)
                totals[side.name].append(total)
                per_steps[side.name].extend(per_step)
                frames[side.name] = fr
                print(json.dumps({"side": side.name, "rep": rep, "s_total": round(total, 3),
                                  "s_per_step_median": round(statistics.median(per_step), 4)}), flush=True)
    return totals, per_steps, frames


# --------------------------------------------------------------------------------------------
# the JSON record
# --------------------------------------------------------------------------------------------


def video_parser(doc: str | None, *, steps: int, repeats: int, frames: int, height: int, width: int,
                 ) -> argparse.ArgumentParser:
    """The options every video benchmark takes, with the script's own defaults: ``--steps``,
    ``--repeats`` and the clip size (``--frames``, ``--height``, ``--width``); the description is
    the first line of the script's docstring ``doc``."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    for flag, default in (("--steps", steps), ("--repeats", repeats), ("--frames", frames), ("--height", height),
                          ("--width", width)):
        ap.add_argument(flag, type=int, default=default)
    return ap


def add_output_args(ap: argparse.ArgumentParser, default_dir: Path) -> None:
    """``--out`` (the results folder: ``$RESULTS_DIR`` or ``default_dir``), ``--no-write`` and
    ``--smoke`` (toy sizes on a CPU), read by :func:`publish`."""
    ap.add_argument("--out", default=os.environ.get("RESULTS_DIR", str(default_dir)))
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="toy sizes, to check the script on a CPU")


def publish(record: dict[str, Any], args: argparse.Namespace) -> int:
    """Print ``record`` as JSON and, unless ``--no-write``, write it with :func:`write_record` into
    ``--out`` (saying where); returns the exit code 0."""
    print(json.dumps(record, indent=1), flush=True)
    if not args.no_write:
        print(f"wrote {write_record(record, args.out)}")
    return 0


def command_line(script: str, argv: list[str]) -> str:
    return "python " + " ".join(shlex.quote(a) for a in [script, *argv])


def machine(**extra: Any) -> dict[str, Any]:
    """Platform, CPUs, torch, CUDA and GPU, then ``extra``."""
    return {
        "platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        **extra,
    }


def cpu_machine(threads: int, **extra: Any) -> dict[str, Any]:
    """The CPU benchmarks' machine record (platform, Python, torch, CPUs, torch's thread count,
    processor, CUDA present), then ``extra`` (the load average as each script reports it)."""
    return {
        "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "cpu_count": os.cpu_count(), "torch_threads": threads,
        "processor": platform.processor() or platform.machine(), "cuda": torch.cuda.is_available(), **extra,
    }


def write_dated_record(out_dir: Path, name: str, benchmark: str, what: str, machine: dict[str, Any], results: Any,
                       **extra: Any) -> Path:
    """``<out_dir>/<name>-<UTC date>.json`` (indent 2) holding ``benchmark``, the date and time, the
    command line as run, ``what``, ``extra`` (e.g. ``config``), ``machine`` and ``results``."""
    now = datetime.datetime.now(datetime.UTC)
    doc = {
        "benchmark": benchmark,
        "date": now.isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [sys.executable.split(os.sep)[-1], *sys.argv]),
        "what": what, **extra, "machine": machine, "results": results,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}-{now.date().isoformat()}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def library_versions() -> dict[str, str]:
    """The diffusers and transformers versions (those importable), and the attention kernel
    packages' (flash-attn-4 and its CuTe DSL) where installed."""
    import importlib.metadata as md

    out: dict[str, str] = {}
    for mod in ("diffusers", "transformers"):
        with contextlib.suppress(ImportError):
            out[mod] = __import__(mod).__version__
    for dist in ("flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-cu13", "nvidia-cudnn-frontend"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[dist] = md.version(dist)
    return out


def write_record(record: dict[str, Any], out_dir: str | Path) -> Path:
    """Write ``record`` to ``<out_dir>/<bench>-<date>.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{record['bench']}-{record['date']}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def wan_demo_clip(runtime: Any, prompt: str, seed: int, steps: int = 20, guidance: float = 5.0) -> Any:
    """One wan-demo clip (17x64x64, guidance 5 — the attention quality benches' protocol; the shipped
    checkpoint's default is 2) through ``runtime``: uint8 frames ``[T, H, W, C]``."""
    import numpy as np

    out = runtime.generate({"task": "t2v", "inputs": [{"type": "text", "text": prompt}],
                            "diffusion": {"steps": steps, "guidance_scale": guidance, "seed": seed, "frames": 17,
                                          "height": 64, "width": 64}})
    if not out.ok:
        raise RuntimeError(f"{prompt!r}: {out.error}")
    frames = out.artifacts["video"].frames
    return np.asarray(frames.cpu() if hasattr(frames, "cpu") else frames, dtype=np.uint8)


def _kernel_times(events: Any, cuda: bool) -> dict[str, list[float]]:
    """{name: [microseconds, calls]} of the profiler's events: on CUDA the device-side (kernel and
    memcpy) events only -- ops (``aten::mm``) are host events, and a kernel's name may hold ``::``
    (FlashAttention-3's ``flash::FlashAttnFwdSm90<...>``, CUTLASS templates), so names cannot tell
    them apart; on CPU the ops' own time."""
    out: dict[str, list[float]] = {}
    for ev in events:
        if cuda:
            if getattr(getattr(ev, "device_type", None), "name", "") != "CUDA":
                continue
            us = float(ev.device_time_total)
        else:
            us = float(ev.self_cpu_time_total)
        row = out.setdefault(ev.name, [0.0, 0.0])
        row[0] += us
        row[1] += 1.0
    return out


def kernel_times(fn: Callable[[], Any]) -> dict[str, list[float]]:
    """{kernel name: [microseconds, calls]} over one call of ``fn`` (on the CPU: the ops' own time)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    return _kernel_times(prof.events(), cuda)


def kernel_group(name: str) -> str:
    """attention / matmul / other. Convolutions (cuDNN's implicit GEMMs, the VAE's) are matmuls, not
    attention, though their names may say cudnn; cuDNN's layout transposes are other."""
    low = name.lower()
    if "implicit_gemm" in low or "conv" in low:
        return "matmul"
    if "nchwtonhwc" in low or "nhwctonchw" in low:
        return "other"
    if any(t in low for t in ("attention", "flash", "fmha", "cudnn", "sdpa", "mha")):
        return "attention"
    if any(t in low for t in ("gemm", "sm90_xmma", "cutlass", "triton_mm", "matmul", "nvjet", "ampere_", "sm80_")):
        return "matmul"
    return "other"


def kernel_summary(kernels: dict[str, list[float]], top: int = 12) -> dict[str, Any]:
    """:func:`kernel_times`' rows grouped (attention / matmul / other), plus the top kernels."""
    groups = {"attention": 0.0, "matmul": 0.0, "other": 0.0}
    for name, (us, _) in kernels.items():
        groups[kernel_group(name)] += us
    total = sum(groups.values()) or 1.0
    top_rows = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "kernel_ms_total": round(total / 1e3, 2),
        "groups_ms": {k: round(v / 1e3, 2) for k, v in groups.items()},
        "groups_share": {k: round(v / total, 3) for k, v in groups.items()},
        "top_kernels": [{"name": n[:120], "ms": round(us / 1e3, 2), "calls": round(c), "group": kernel_group(n)}
                        for n, (us, c) in top_rows],
    }


def kernel_profile(fn: Callable[[], Any], top: int = 12) -> dict[str, Any]:
    """GPU kernel time of one call of ``fn``: grouped (attention / matmul / other) plus the top kernels."""
    return kernel_summary(kernel_times(fn), top)


def step_kernels(one: dict[str, list[float]], two: dict[str, list[float]]) -> dict[str, list[float]]:
    """One denoise step's kernels: a two-step request's minus a one-step request's, kernel by kernel
    (what is not a step -- text encoding, the VAE decode, set-up -- is in both and cancels); rows that
    do not grow are dropped."""
    out: dict[str, list[float]] = {}
    for name, (us, calls) in two.items():
        us0, calls0 = one.get(name, (0.0, 0.0))
        if us - us0 > 0.0 and calls - calls0 > 0.0:
            out[name] = [us - us0, calls - calls0]
    return out


def step_profile(run_steps: Callable[[int], Any], top: int = 12) -> dict[str, Any]:
    """:func:`kernel_summary` of one denoise step: ``run_steps(n)`` runs an ``n``-step request;
    :func:`step_kernels` of a two- and a one-step request."""
    one = kernel_times(lambda: run_steps(1))
    two = kernel_times(lambda: run_steps(2))
    return {**kernel_summary(step_kernels(one, two), top), "how": "a 2-step request's kernels minus a 1-step request's"}
