"""Bench of the Qwen family's decode loop (issue 20): CPU on a small random Qwen2 model, or CUDA on
the Qwen2.5-0.5B architecture (random weights, bf16), against transformers in the same run.

Sections (a variant that fails is recorded with its error and the others go on). On CUDA
(``--isolate auto``/``yes``) the kernel section, each omniloop variant and transformers each run in
their own child process (this script with ``--child``; the parent merges their rows by batch and
computes the cross-side ratios), so a fault that poisons a CUDA context (an illegal memory access)
costs only that side's rows, recorded as ``<side>_error``; sides then run one after the other, not
interleaved. On CPU (``--isolate auto``/``no``) everything runs in one process, interleaved:

1. **kernel** (CUDA, or CPU under ``TRITON_INTERPRET=1``): one layer's paged attention for one new
   token per sequence at ``--context`` tokens, batch 1/16/64 — the Triton kernel
   (``omniloop_qwen.paged_attention``, reads the block table) vs the torch path (gather through the
   slot table + SDPA with a mask, what ``paged_attention: torch`` runs), time per call and the
   largest output difference; on CUDA also ``triton_graph_us``: the same calls replayed from one
   CUDA graph (the kernels' own time, without the host's launch cost).
2. **throughput** at batch 1 / 16 / 64: ``batch`` greedy requests of ``--new-tokens`` new tokens
   each (3 to 14 words of the tiny tokenizer's corpus) through ``Runtime`` with the ``step``
   scheduler (``max_batch = max_running =`` the largest batch: prefill per sequence, then every
   decode step batched), once per variant (``--variants``: ``triton``, ``triton-graphs`` — the
   kernel with decode steps replayed as CUDA graphs, deploy ``decode_cuda_graphs: true`` with
   ``decode_fused: false`` (the opt-out: graphs alone now default to the fused step) —,
   ``triton-fused`` — the graphs over the fused decode step, ``decode_fused: true``
   (``omniloop_qwen.fused``; what ``decode_cuda_graphs: true`` deploys by default) — and
   ``torch``; every variant passes all three options explicitly), vs
   transformers ``generate(do_sample=False)`` on the same prompts left-padded into one batch
   (``min_new_tokens`` so every side makes the same tokens). Tokens/s = new tokens / wall time,
   median over ``--repeats`` interleaved repeats after one warm-up run of each.
3. **decode vs re-prefill** at ``--context`` tokens, batch ``--decode-batches``: one decode step of
   our paged forward (every sequence appends one token over its cached context) vs re-running the
   whole contexts without a cache (what a loop without KV does per token: one transformers forward
   of ``[batch, context]``, ``use_cache=False``, last-position logits only), and transformers' own
   cached decode step, interleaved, medians. Speedup = re-prefill time / decode step time (per
   token the batch cancels). Graph variants also record ``graph_replay_ms``: the step's CUDA
   graph replayed back to back (its GPU time without the per-step host work). ``--profile``: at the smallest batch, each omniloop side's decode step
   (``PROFILE_STEPS`` of them) and the re-prefill also run under ``torch.profiler``: wall, host and
   GPU-kernel time per step, kernels and launches per step, the top kernels and host ops (on CUDA
   this says whether a step is launch-bound or kernel-bound, and how honest the re-prefill is).

    python bench/text_decode.py                     # CPU -> results/text_decode-cpu-<date>.json
    python bench/text_decode.py --device cuda       # H200: Qwen2.5-0.5B arch, bf16, ~2-3 min
    python bench/text_decode.py --device cuda --variants triton,triton-graphs,triton-fused --profile
    python bench/text_decode.py --smoke             # toy sizes, CPU, seconds (CI-sized check)

``--budget-s`` bounds the run: once it is spent, what is left is recorded as skipped; the JSON is
rewritten after every section, so a killed run still leaves what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _repo_paths

_repo_paths.add_repo_packages()

import torch  # noqa: E402
from _common import command_line, library_versions, machine, write_record  # noqa: E402

#: the CPU bench model: Qwen2 layout (q/k/v bias, tied embeddings, GQA 8/2), small enough for a CPU
BENCH_MODEL = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
               "num_key_value_heads": 2, "max_position_embeddings": 4096, "initializer_range": 0.02}
#: Qwen2.5-0.5B: hidden 896, 24 layers, 14 query / 2 KV heads (head_dim 64), intermediate 4864,
#: vocab 151936, tied embeddings, rope theta 1e6 (omniloop_qwen.tiny.QWEN25_05B)
PRESETS = ("tiny", "qwen2.5-0.5b")
#: --smoke sizes of each preset (the same layout: GQA, tied embeddings; a vocab larger than the tokenizer's)
SMOKE_MODELS = {
    "tiny": {**BENCH_MODEL, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4},
    "qwen2.5-0.5b": {"hidden_size": 224, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "vocab_size": 4096, "max_position_embeddings": 4096,
                     "rope_theta": 1000000.0, "tie_word_embeddings": True, "initializer_range": 0.02},
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def log(*parts: Any) -> None:
    print(*parts, flush=True)


def model_config(preset: str, smoke: bool) -> dict[str, Any]:
    if smoke:
        return dict(SMOKE_MODELS[preset])
    if preset == "tiny":
        return dict(BENCH_MODEL)
    from omniloop_qwen.tiny import QWEN25_05B

    return {**QWEN25_05B, "initializer_range": 0.02}


def build_model(out: Path, seed: int, config: dict[str, Any]) -> Path:
    """A random Qwen2-layout checkpoint of ``config`` (the tiny tokenizer; no EOS, so every request
    makes exactly the tokens asked for)."""
    from omniloop_qwen.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(out, arch="qwen2", seed=seed, **config)
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = []
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


def prompts(n: int, seed: int) -> list[str]:
    """``n`` prompts of 3 to 14 words from the tiny tokenizer's corpus (about 8 to 40 tokens)."""
    from omniloop_qwen.tiny import _CORPUS

    rng = random.Random(seed)
    words = _CORPUS.split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 14))) for _ in range(n)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, Any]:
    """(seconds, ``fn(*args, **kwargs)``), the device synchronized before and after."""
    sync(device)
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    sync(device)
    return time.perf_counter() - t0, out


def error_of(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:600]


class Budget:
    def __init__(self, seconds: float) -> None:
        self.t0, self.seconds = time.time(), seconds

    @property
    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def hf_model(path: Path, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    m.requires_grad_(False)
    return m


#: bench variant -> (paged_attention, decode_cuda_graphs, decode_fused)
VARIANTS = {"triton": ("triton", False, False), "triton-graphs": ("triton", True, False),
            "triton-fused": ("triton", True, True), "torch": ("torch", False, False)}


def qwen_runtime(path: Path, device: torch.device, dtype: str, variant: str, max_batch: int, kv_tokens: int) -> Any:
    """A runtime over the qwen family and the step scheduler, without entry points (the GPU
    machine runs from a bare checkout)."""
    import omniloop_qwen.plugin as qwen_plugin
    import omniloop_scheduler.plugin as scheduler_plugin
    from omniloop import Runtime
    from omniloop.testing import make_manager

    manager = make_manager(("qwen", qwen_plugin), ("scheduler", scheduler_plugin), toy=False, scheduler=False)
    return Runtime.from_model(path, device=str(device), dtype=dtype, manager=manager, scheduler="step",
                              scheduler_options={"max_batch": max_batch, "max_running": max_batch},
                              options={"kv_cache_tokens": kv_tokens, "paged_attention": VARIANTS[variant][0],
                                       "decode_cuda_graphs": VARIANTS[variant][1], "decode_fused": VARIANTS[variant][2]})


# ------------------------------------------------------------------------------------------------
# 1. the kernel alone
# ------------------------------------------------------------------------------------------------


def kernel_bench(cfg: dict[str, Any], device: torch.device, dtype: torch.dtype, batches: list[int], context: int,
                 iters: int, budget: Budget) -> list[dict[str, Any]]:
    rows = []
    for b in batches:
        if budget.left() < 0:
            rows.append({"batch": b, "skipped": "budget"})
            continue
        row: dict[str, Any] = {"batch": b, "context_tokens": context}
        try:
            row.update(_kernel_row(cfg, device, dtype, b, context, iters))
        except Exception as exc:
            row["error"] = error_of(exc)
            traceback.print_exc()
        log(json.dumps({"kernel": row}))
        rows.append(row)
        free_memory(device)
    return rows


def _kernel_row(cfg: dict[str, Any], device: torch.device, dtype: torch.dtype, b: int, context: int,
                iters: int) -> dict[str, Any]:
    import torch.nn.functional as F

    from omniloop_kvcache import CacheManager, KVLayout
    from omniloop_qwen import paged_attention as pa

    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // hq
    scale = d**-0.5
    row: dict[str, Any] = {"q_heads": hq, "kv_heads": hkv, "head_dim": d}
    bs = 16
    cache = CacheManager(KVLayout(layers=1, kv_heads=hkv, head_dim=d, dtype=dtype, device=device), block_size=bs,
                         num_blocks=b * (-(-context // bs)) + b)
    g = torch.Generator(device="cpu").manual_seed(b)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g).to(dtype))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g).to(dtype))
    # interleave the sequences' blocks (as a running server's pool would be)
    handles = [cache.allocate() for _ in range(b)]
    for _ in range(-(-context // bs)):
        for h in handles:
            cache.append(h, min(bs, context - cache.length(h)))
    table, held = cache.block_tables(handles)
    row_seq, kv_lens = pa.attention_rows(held.tolist(), [1] * b)
    meta = torch.tensor([row_seq, kv_lens], dtype=torch.int32, device=device)
    table = table.to(device)
    q = torch.randn(b, hq, d, generator=g).to(dtype).to(device)
    slots, lengths = cache.slot_table(handles)
    slots = slots.to(device)
    mask = (torch.arange(slots.shape[1])[None, :] < lengths[:, None])[:, None, None, :].to(device)  # [B,1,1,L]

    def triton_call() -> torch.Tensor:
        return pa.paged_attention(q, cache.k[0], cache.v[0], table, meta[1], meta[0], block_size=bs, scale=scale,
                                  max_len=context)

    def torch_call() -> torch.Tensor:  # what PagedQwen's torch path does per layer
        kc, vc = cache.gather(0, slots)
        o = F.scaled_dot_product_attention(q[:, :, None], kc.transpose(1, 2), vc.transpose(1, 2), attn_mask=mask,
                                           scale=scale, enable_gqa=hq != hkv)
        return o[:, :, 0]

    ref = pa.paged_attention_torch(q, cache.k[0], cache.v[0], table, meta[1], meta[0], block_size=bs, scale=scale)
    times: dict[str, list[float]] = {"triton": [], "torch": []}
    outs = {"triton": triton_call(), "torch": torch_call()}  # warm-up (compiles the kernel)
    for _ in range(5):
        for name, fn in (("triton", triton_call), ("torch", torch_call)):
            dt, _ = timed(device, _repeat, fn, iters)
            times[name].append(dt / iters)
    kv_bytes = 2 * b * context * hkv * d * torch.empty((), dtype=dtype).element_size()
    for name in times:
        t = statistics.median(times[name])
        row[f"{name}_us"] = round(t * 1e6, 2)
        row[f"{name}_kv_gb_per_s"] = round(kv_bytes / t / 1e9, 1)
        row[f"{name}_max_abs_diff_vs_fp32_reference"] = float((outs[name].float() - ref.float()).abs().max())
    row["speedup_triton_over_torch"] = round(row["torch_us"] / row["triton_us"], 2)
    row["splits"] = pa.choose_splits(b, hkv, context, device)
    if device.type == "cuda":  # the kernel's own time: iters calls replayed from one CUDA graph (no host launch cost)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                _repeat(triton_call, iters)
            graph.replay()
            reps = []
            for _ in range(5):
                dt, _ = timed(device, graph.replay)
                reps.append(dt / iters)
            t = statistics.median(reps)
            row["triton_graph_us"] = round(t * 1e6, 2)
            row["triton_graph_kv_gb_per_s"] = round(kv_bytes / t / 1e9, 1)
            row["triton_launch_overhead_us"] = round(row["triton_us"] - t * 1e6, 2)
            del graph
        except Exception as exc:
            row["triton_graph_error"] = error_of(exc)
            traceback.print_exc()
    return row


def _repeat(fn: Callable[[], Any], n: int) -> None:
    for _ in range(n):
        fn()


# ------------------------------------------------------------------------------------------------
# 2. throughput through the runtime vs transformers generate
# ------------------------------------------------------------------------------------------------


def run_omniloop(rt: Any, texts: list[str], new_tokens: int) -> tuple[float, int, set[str]]:
    reqs = [{"task": "reason", "inputs": [{"type": "text", "text": t}],
             "sampling": {"max_tokens": new_tokens, "temperature": 0.0}} for t in texts]
    device = torch.device(rt.model.device) if rt.model.device is not None else torch.device("cpu")
    sync(device)
    t0 = time.perf_counter()
    streams = [rt.stream(r) for r in reqs]
    made, ids = 0, set()
    for s in streams:
        out = [e for e in s if e.output is not None][-1].output
        if not out.ok:
            raise RuntimeError(f"omniloop request failed: {out.error}")
        made += len(out.artifacts["text"].token_ids)
        ids.add(out.request_id)
    sync(device)
    return time.perf_counter() - t0, made, ids


def run_transformers(hf: Any, tok: Any, texts: list[str], new_tokens: int) -> tuple[float, int]:
    batch_prompts = [tok(t)["input_ids"] for t in texts]
    width = max(len(p) for p in batch_prompts)
    pad = tok.pad_token_id
    dev = hf.device
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch_prompts], device=dev)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch_prompts], device=dev)
    sync(dev)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, pad_token_id=pad)
    sync(dev)
    return time.perf_counter() - t0, int((out.shape[1] - width) * len(batch_prompts))


def throughput(path: Path, device: torch.device, dtype: str, variants: list[str], batches: list[int], new_tokens: int,
               repeats: int, seed: int, budget: Budget, hf: Any, with_hf: bool = True) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    top = max(batches)
    runtimes: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for v in variants:
        try:
            rt = qwen_runtime(path, device, dtype, v, top, kv_tokens=top * (64 + new_tokens) + 64 * 16)
            got = tuple(rt.model.config.get(k) for k in ("paged_attention", "decode_cuda_graphs", "decode_fused"))
            if got != VARIANTS[v]:
                raise RuntimeError(f"asked for {VARIANTS[v]} (paged_attention, decode_cuda_graphs, decode_fused), "
                                   f"the runtime runs {got}")
            runtimes[v] = rt
            log(f"[throughput] runtime {v} loaded ({budget.elapsed:.0f} s)")
        except Exception as exc:
            errors[v] = error_of(exc)
            traceback.print_exc()
    tok = next(iter(runtimes.values())).model.components["tokenizer"] if runtimes else None
    if tok is None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
    sides: list[tuple[str, Callable[[list[str]], tuple[float, int]]]] = []
    for v, rt in runtimes.items():
        def ours(texts: list[str], rt: Any = rt, v: str = v) -> tuple[float, int]:
            dt, n, ids = run_omniloop(rt, texts, new_tokens)
            last_ids[v] = ids
            return dt, n

        sides.append((f"omniloop_{v}", ours))
    if with_hf:
        sides.append(("transformers", lambda texts: run_transformers(hf, tok, texts, new_tokens)))
    last_ids: dict[str, set[str]] = {}
    for b in batches:
        row: dict[str, Any] = {"batch": b, "new_tokens_per_request": new_tokens, "repeats": repeats}
        for v, e in errors.items():
            row[f"omniloop_{v}_error"] = e
        if budget.left() < 0:
            row["skipped"] = "budget"
            rows.append(row)
            log(json.dumps({"throughput": row}))
            continue
        ps = prompts(b, seed + b)
        rates: dict[str, list[float]] = {name: [] for name, _ in sides}
        failed: dict[str, str] = {}
        for name, fn in sides:  # warm-up: the whole batch once (kernel variants compile here)
            try:
                fn(ps)
            except Exception as exc:
                failed[name] = error_of(exc)
                traceback.print_exc()
        for rep in range(repeats):  # interleaved
            if rep and budget.left() < 0:
                row["repeats_cut_by_budget"] = rep
                break
            for name, fn in sides:
                if name in failed:
                    continue
                try:
                    dt, n = fn(ps)
                    rates[name].append(n / dt)
                except Exception as exc:
                    failed[name] = error_of(exc)
                    traceback.print_exc()
        for name, _ in sides:
            if name in failed:
                row[f"{name}_error"] = failed[name]
            if rates[name]:
                row[f"{name}_tokens_per_s"] = round(statistics.median(rates[name]), 2)
        base = row.get("transformers_tokens_per_s")
        for v in runtimes:
            ours_rate = row.get(f"omniloop_{v}_tokens_per_s")
            if ours_rate and base:
                row[f"ratio_omniloop_{v}_over_transformers"] = round(ours_rate / base, 3)
            with_ids = last_ids.get(v, set())
            try:
                sizes = [len(d.request_ids) for d in runtimes[v].scheduler.trace
                         if d.action == "batched_step" and with_ids & set(d.request_ids)]
                row[f"omniloop_{v}_largest_decode_batch"] = max(sizes, default=1)
            except Exception as exc:  # (the trace is a scheduler detail; never fail the bench on it)
                row[f"omniloop_{v}_largest_decode_batch"] = error_of(exc)
        log(json.dumps({"throughput": row}))
        rows.append(row)
    runtimes.clear()
    free_memory(device)
    return rows


# ------------------------------------------------------------------------------------------------
# 3. decode step vs re-prefilling the whole context
# ------------------------------------------------------------------------------------------------


#: the first decode step's logits of each (batch, variant) (a child process saves them for the parent to compare)
FIRST_LOGITS: dict[tuple[int, str], torch.Tensor] = {}


def decode_vs_reprefill(hf: Any, device: torch.device, variants: list[str], batches: list[int], context: int,
                        steps: int, seed: int, budget: Budget, with_hf: bool = True, profile: bool = False,
                        on_rows: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    from omniloop_kvcache import CacheManager
    from omniloop_qwen.model import PagedQwen

    vocab = hf.config.vocab_size
    fwd = inspect.signature(hf.forward).parameters
    past_kw = "cache" if "cache" in fwd else "past_key_values"  # transformers >= 5.2x renamed it
    keep = {"logits_to_keep": 1} if "logits_to_keep" in fwd else {}
    rows: list[dict[str, Any]] = []
    rng = random.Random(seed)
    rounds = max(2, steps // 4)
    for b in batches:
        row: dict[str, Any] = {"batch": b, "context_tokens": context, "target_speedup": 10.0}
        if budget.left() < 0:
            row["skipped"] = "budget"
            rows.append(row)
            log(json.dumps({"decode_vs_reprefill": row}))
            continue
        ctxs = [[rng.randrange(3, min(vocab, 100000)) for _ in range(context)] for _ in range(b)]
        ids = torch.tensor(ctxs, device=device)
        state: dict[str, Any] = {}
        times: dict[str, list[float]] = {}
        first_logits: dict[str, torch.Tensor] = {}
        failed: dict[str, str] = {}

        # set-up of every side: transformers' cache, and each backend's paged cache, prefilled
        with torch.no_grad():
            try:
                if not with_hf:
                    raise _Skip
                out = hf(ids, use_cache=True, **keep)
                state["hf"] = [out.past_key_values, out.logits[:, -1:].argmax(-1)]
                del out
                timed(device, hf, ids, use_cache=False, **keep)  # warm-up
                times["reprefill"], times["hf_step"] = [], []
            except _Skip:
                pass
            except Exception as exc:
                failed["transformers"] = error_of(exc)
                traceback.print_exc()
            for v in variants:
                try:
                    model = PagedQwen(hf, attention=VARIANTS[v][0], cuda_graphs=VARIANTS[v][1], fused=VARIANTS[v][2])
                    room = context + 4 * rounds + 8 + (PROFILE_STEPS + 4 if profile else 0)
                    cache = CacheManager(model.layout(), block_size=16, num_blocks=b * (-(-room // 16)))
                    hs = [cache.allocate() for _ in range(b)]
                    chunk = max(1, 8192 // context)
                    toks: list[list[int]] = []
                    for i in range(0, b, chunk):  # prefill, a few sequences per forward
                        model.forward(cache, hs[i : i + chunk], ctxs[i : i + chunk])
                    # warm-up; the first step's input is the same for every variant, so its logits compare
                    first = model.forward(cache, hs, [[c[-1]] for c in ctxs])
                    first_logits[v] = FIRST_LOGITS[(b, v)] = first.float().cpu()
                    toks = [[t] for t in first.argmax(-1).tolist()]
                    toks = [[t] for t in model.forward(cache, hs, toks).argmax(-1).tolist()]
                    state[v] = [model, cache, hs, toks]
                    times[v] = []
                except Exception as exc:
                    failed[f"omniloop_{v}"] = error_of(exc)
                    traceback.print_exc()

            # interleaved: 4 decode steps of each side, then one re-prefill, repeated
            for _ in range(rounds):
                if budget.left() < 0:
                    row["rounds_cut_by_budget"] = True
                    break
                for v in variants:
                    if v not in state or f"omniloop_{v}" in failed:
                        continue
                    model, cache, hs, toks = state[v]
                    try:
                        for _ in range(4):
                            dt, logits = timed(device, model.forward, cache, hs, toks)
                            times[v].append(dt)
                            toks = [[t] for t in logits.argmax(-1).tolist()]
                        state[v][3] = toks
                    except Exception as exc:
                        failed[f"omniloop_{v}"] = error_of(exc)
                        traceback.print_exc()
                if "hf" in state and "transformers" not in failed:
                    try:
                        past, nxt = state["hf"]
                        for _ in range(4):
                            dt, out = timed(device, hf, nxt, use_cache=True, **{past_kw: past})
                            times["hf_step"].append(dt)
                            past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                        state["hf"] = [past, nxt]
                        del out
                        dt, _ = timed(device, hf, ids, use_cache=False, **keep)
                        times["reprefill"].append(dt)
                    except Exception as exc:
                        failed["transformers"] = error_of(exc)
                        traceback.print_exc()
        for v in variants:
            graphs = getattr(state.get(v, [None])[0], "graphs", None)
            if graphs is not None:
                row[f"omniloop_{v}_graph_captures"], row[f"omniloop_{v}_graph_replays"] = graphs.captures, graphs.replays
                if graphs.graphs and budget.left() > 0:  # the step's GPU time alone: its graph replayed back to back
                    try:
                        entry = list(graphs.graphs.values())[-1]  # (re-writes the last step's K/V: the same values)
                        reps = []
                        for _ in range(3):
                            dt, _ = timed(device, _repeat, entry.graph.replay, 10)
                            reps.append(dt / 10)
                        row[f"omniloop_{v}_graph_replay_ms"] = round(statistics.median(reps) * 1e3, 4)
                    except Exception as exc:
                        row[f"omniloop_{v}_graph_replay_error"] = error_of(exc)
                        traceback.print_exc()

        for side, err in failed.items():
            row[f"{side}_error"] = err
        ref_side = "triton" if "triton" in first_logits else "triton-graphs"  # (no eager kernel side: the unfused graphs)
        ref_logits = first_logits.get(ref_side)
        for v, lg in first_logits.items():  # numerics of the first decode step vs the eager kernel path
            if ref_logits is not None and lg is not ref_logits:
                row[f"omniloop_{v}_first_step_max_abs_logit_diff_vs_{ref_side}"] = round(float((lg - ref_logits).abs().max()), 5)
                row[f"omniloop_{v}_first_step_argmax_agree_vs_{ref_side}"] = float(
                    (lg.argmax(-1) == ref_logits.argmax(-1)).float().mean())
        r = statistics.median(times["reprefill"]) if times.get("reprefill") else None
        if r is not None:
            row.update(reprefill_ms=round(r * 1e3, 3), reprefill_ms_per_token=round(r * 1e3 / b, 4),
                       reprefills=len(times["reprefill"]))
        if times.get("hf_step"):
            row["transformers_cached_decode_ms"] = round(statistics.median(times["hf_step"]) * 1e3, 3)
        for v in variants:
            if not times.get(v):
                continue
            dd = statistics.median(times[v])
            row[f"omniloop_{v}_decode_ms"] = round(dd * 1e3, 3)
            row[f"omniloop_{v}_decode_ms_per_token"] = round(dd * 1e3 / b, 4)
            row[f"omniloop_{v}_decode_steps"] = len(times[v])
            if r is not None:
                row[f"speedup_{v}_decode_vs_reprefill"] = round(r / dd, 2)
                row[f"target_met_{v}"] = r / dd >= 10.0
        log(json.dumps({"decode_vs_reprefill": row}))
        rows.append(row)
        if profile and b == min(batches) and budget.left() > 0:  # explain the smallest batch's step
            if on_rows is not None:  # the measured row is saved first: a profiler fault cannot cost it
                on_rows(rows)
            with torch.no_grad():
                _profile_sides(row, state, variants, failed, hf, ids, keep, device)
            log(json.dumps({"decode_vs_reprefill_profiled_batch": b}))
            if on_rows is not None:
                on_rows(rows)
        state.clear()
        free_memory(device)
    return rows


#: decode steps each omniloop side runs under torch.profiler with --profile (re-prefills: PROFILE_REPREFILLS)
PROFILE_STEPS = 20
PROFILE_REPREFILLS = 3
#: host-side CUDA runtime / driver calls counted per step (launches, copies, syncs)
_API_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
              "cudaMemcpyAsync", "cudaMemcpy", "cudaMemsetAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize",
              "cudaEventSynchronize", "cudaStreamWaitEvent", "cudaEventRecord")
_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


def _us(avg: Any, *names: str) -> float:
    for n in names:
        v = getattr(avg, n, None)
        if v is not None:
            return float(v)
    return 0.0


def profile_summary(device: torch.device, fn: Callable[[], Any], steps: int) -> dict[str, Any]:
    """``fn`` run ``steps`` times under torch.profiler (CPU, plus CUDA activity on CUDA), each run
    synchronized: wall and host (CPU) time per step, GPU kernel time and kernels per step, the CUDA
    API calls per step (launches, copies, syncs), the top kernels by GPU time and the top CPU ops by
    self CPU time. Kernels replayed from a CUDA graph are counted as kernels, their one
    ``cudaGraphLaunch`` as one launch."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    walls: list[float] = []
    fn()  # (one unprofiled call: a lazy capture or compile stays out of the trace)
    sync(device)
    with profile(activities=acts) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            with record_function("bench_step"):
                fn()
            sync(device)
            walls.append(time.perf_counter() - t0)
    avgs = prof.key_averages()
    out: dict[str, Any] = {"steps": steps, "wall_ms_per_step": round(statistics.median(walls) * 1e3, 4)}
    step = next((a for a in avgs if a.key == "bench_step"), None)
    if step is not None:  # host time issuing one step (launches, Python, any sync inside the step)
        out["cpu_ms_per_step"] = round(_us(step, "cpu_time_total") / steps / 1e3, 4)
    # (the bench_step annotation also shows up on the GPU timeline, as a range spanning the step's
    # kernels: counted as a kernel it inflated gpu_kernel_ms / gpu_kernels_per_step up to the
    # 2026-12-01 fused run, whose JSON keeps the inflated figures)
    gpu = [a for a in avgs if getattr(a, "device_type", None) == DeviceType.CUDA and a.key != "bench_step"]
    if device.type == "cuda":
        kern_us = sum(_us(a, "self_device_time_total", "self_cuda_time_total") for a in gpu)
        out["gpu_kernel_ms_per_step"] = round(kern_us / steps / 1e3, 4)
        out["gpu_kernels_per_step"] = round(sum(a.count for a in gpu) / steps, 2)
        top = sorted(gpu, key=lambda a: -_us(a, "self_device_time_total", "self_cuda_time_total"))[:12]
        out["top_kernels"] = [{"name": a.key[:100], "calls_per_step": round(a.count / steps, 2),
                               "us_per_step": round(_us(a, "self_device_time_total", "self_cuda_time_total") / steps, 2),
                               "us_per_call": round(_us(a, "self_device_time_total", "self_cuda_time_total") / max(1, a.count), 2)}
                              for a in top]
    calls = {a.key: a.count for a in avgs if a.key in _API_CALLS}
    out["api_calls_per_step"] = {k: round(v / steps, 2) for k, v in sorted(calls.items())}
    out["launches_per_step"] = round(sum(calls.get(k, 0) for k in _LAUNCHES) / steps, 2)
    cpu_ops = [a for a in avgs if getattr(a, "device_type", None) != DeviceType.CUDA and a.key not in ("bench_step",)]
    cpu_ops.sort(key=lambda a: -_us(a, "self_cpu_time_total"))
    out["top_cpu_ops"] = [{"name": a.key[:100], "calls_per_step": round(a.count / steps, 2),
                           "self_us_per_step": round(_us(a, "self_cpu_time_total") / steps, 2)} for a in cpu_ops[:12]]
    out["note"] = ("wall includes the bench's synchronize after each step; cpu_ms_per_step is the host time inside the "
                   "step (Python, launches, any sync it makes); the sync itself is cudaDeviceSynchronize (1 per step)")
    return out


def _profile_sides(row: dict[str, Any], state: dict[str, Any], variants: list[str], failed: dict[str, str], hf: Any,
                   ids: torch.Tensor, keep: dict[str, Any], device: torch.device) -> None:
    """``--profile``: each omniloop side's decode step (``PROFILE_STEPS`` of them) and transformers'
    re-prefill into ``row`` (``omniloop_<v>_profile``, ``reprefill_profile``); a failure is recorded, never raised."""
    for v in variants:
        if v not in state or f"omniloop_{v}" in failed:
            continue
        model, cache, hs, toks = state[v]
        try:
            def step(model: Any = model, cache: Any = cache, hs: Any = hs, toks: Any = toks) -> Any:
                return model.forward(cache, hs, toks)

            row[f"omniloop_{v}_profile"] = profile_summary(device, step, PROFILE_STEPS)
        except Exception as exc:
            row[f"omniloop_{v}_profile_error"] = error_of(exc)
            traceback.print_exc()
    if "hf" in state and "transformers" not in failed:
        try:
            row["reprefill_profile"] = profile_summary(device, lambda: hf(ids, use_cache=False, **keep), PROFILE_REPREFILLS)
        except Exception as exc:
            row["reprefill_profile_error"] = error_of(exc)
            traceback.print_exc()


# ------------------------------------------------------------------------------------------------


class _Skip(Exception):
    """A side left out of this process (run in another child)."""


# ------------------------------------------------------------------------------------------------
# isolation: each variant in its own child process
# ------------------------------------------------------------------------------------------------

#: keys a child's row shares with the other children's rows of the same batch
_COMMON = ("batch", "context_tokens", "new_tokens_per_request", "repeats", "target_speedup", "q_heads", "kv_heads",
           "head_dim")
#: test hook: the child running this side aborts at once (stands in for a CUDA fault that kills the process)
FAULT_ENV = "TEXT_DECODE_BENCH_FAULT"


def _merge_rows(dst: list[dict[str, Any]], src: list[dict[str, Any]], side: str) -> None:
    """Merge a child's rows (one side) into ``dst`` by batch: side keys as they are, its skips prefixed."""
    for row in src:
        into = next((r for r in dst if r.get("batch") == row.get("batch")), None)
        if into is None:
            into = {k: row[k] for k in _COMMON if k in row}
            dst.append(into)
        for k, val in row.items():
            if k in _COMMON:
                into.setdefault(k, val)
            elif k in ("skipped", "repeats_cut_by_budget", "rounds_cut_by_budget"):
                into[f"{side}_{k}"] = val
            else:
                into[k] = val
    dst.sort(key=lambda r: r.get("batch", 0))


def _derive(record: dict[str, Any], variants: list[str], first: dict[tuple[int, str], torch.Tensor]) -> None:
    """The cross-side figures of merged rows (each side ran in its own process)."""

    def ratio(row: dict[str, Any], num: str, den: str) -> float | None:
        a, b = row.get(num), row.get(den)
        return a / b if a and b else None

    for row in record.get("throughput") or []:
        for v in variants:
            if (q := ratio(row, f"omniloop_{v}_tokens_per_s", "transformers_tokens_per_s")) is not None:
                row[f"ratio_omniloop_{v}_over_transformers"] = round(q, 3)
    for row in record.get("decode_vs_reprefill") or []:
        for v in variants:
            if (q := ratio(row, "reprefill_ms", f"omniloop_{v}_decode_ms")) is not None:
                row[f"speedup_{v}_decode_vs_reprefill"] = round(q, 2)
                row[f"target_met_{v}"] = q >= 10.0
            ref_side = "triton" if (row.get("batch"), "triton") in first else "triton-graphs"
            ref, lg = first.get((row.get("batch"), ref_side)), first.get((row.get("batch"), v))
            if v != ref_side and ref is not None and lg is not None and ref.shape == lg.shape:
                row[f"omniloop_{v}_first_step_max_abs_logit_diff_vs_{ref_side}"] = round(float((lg - ref).abs().max()), 5)
                row[f"omniloop_{v}_first_step_argmax_agree_vs_{ref_side}"] = float((lg.argmax(-1) == ref.argmax(-1)).float().mean())


def _run_children(args: argparse.Namespace, path: Path, variants: list[str], sections: set[str], budget: Budget,
                  record: dict[str, Any], save: Callable[[], None], with_kernel: bool,
                  batches_of: dict[str, list[int]]) -> None:
    """Each side in its own process (``--child``): the kernel section, each omniloop variant's
    throughput + re-prefill rows, then transformers' — a fault (an illegal memory access poisons a
    CUDA context for good) costs only that side's rows, recorded as errors."""
    import subprocess

    side_sections = [s for s in ("throughput", "reprefill") if s in sections]
    jobs: list[tuple[str, list[str]]] = []
    if with_kernel:
        jobs.append(("kernel", ["--sections", "kernel", "--variants", "none", "--no-transformers"]))
    if side_sections:
        for v in variants:
            jobs.append((f"omniloop_{v}", ["--sections", ",".join(side_sections), "--variants", v, "--no-transformers"]))
        jobs.append(("transformers", ["--sections", ",".join(side_sections), "--variants", "none"]))
    passed = ["--device", args.device, "--batches", args.batches, "--context", str(args.context),
              "--decode-steps", str(args.decode_steps), "--repeats", str(args.repeats), "--kernel-iters",
              str(args.kernel_iters), "--threads", str(args.threads), "--seed", str(args.seed), "--isolate", "no",
              "--model-path", str(path)]
    for flag, val in (("--preset", args.preset), ("--dtype", args.dtype), ("--decode-batches", args.decode_batches),
                      ("--new-tokens", args.new_tokens)):
        if val is not None:
            passed += [flag, str(val)]
    if args.smoke:
        passed.append("--smoke")
    if args.profile:
        passed.append("--profile")
    first: dict[tuple[int, str], torch.Tensor] = {}
    record["children"] = {}
    tmp = Path(tempfile.mkdtemp(prefix="text_decode-children-"))
    for i, (side, extra) in enumerate(jobs):
        left = len(jobs) - i
        share = max(5.0, (budget.left() - 8.0 * left) / left)  # (~8 s of start-up per child: imports, CUDA init)
        out = tmp / f"{i}-{side}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), *passed, *extra, "--budget-s", f"{share:.1f}",
               "--child", str(out)]
        info: dict[str, Any] = {"budget_s": round(share, 1)}
        t0 = time.time()
        if budget.left() < 0:
            info["skipped"] = "budget"
            rc, tail = None, ""
        else:
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=share + 60, check=False)
                rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-2500:]
            except subprocess.TimeoutExpired as exc:
                rc, tail = "timeout", (str(exc.stdout or "") + str(exc.stderr or ""))[-2500:]
            info.update(rc=rc, seconds=round(time.time() - t0, 1))
            log(f"[text_decode] child {side}: exit {rc} after {info['seconds']} s (budget {share:.0f} s); its output's tail:\n"
                + tail[-1500:])
        sub = json.loads(out.read_text()) if out.exists() else {}
        logits = out.with_suffix(".logits.pt")
        if logits.exists():
            first.update(torch.load(logits))
        if "max_memory_allocated_gib" in sub:
            info["max_memory_allocated_gib"] = sub["max_memory_allocated_gib"]
        err = None if rc in (0, None) else f"child process for {side} died (exit {rc}): " + (tail[-400:] or "no output")
        if side == "kernel":
            record["kernel"] = sub.get("kernel") or ({"error": err} if err else {"skipped": info.get("skipped", "no rows")})
            if err and isinstance(record["kernel"], list):
                record["kernel"].append({"error": err})
        else:
            for sec, key in (("throughput", "throughput"), ("reprefill", "decode_vs_reprefill")):
                if sec not in side_sections:
                    continue
                rows = record.setdefault(key, [])
                _merge_rows(rows, sub.get(key) or [], side)
                if err is None and not info.get("skipped"):
                    continue
                # every batch this side did not measure says why
                note_key, note = (f"{side}_error", err) if err else (f"{side}_skipped", "budget")
                measured = ("transformers_tokens_per_s" if sec == "throughput" else "reprefill_ms") if side == "transformers" \
                    else f"{side}_tokens_per_s" if sec == "throughput" else f"{side}_decode_ms"
                want = batches_of[sec]
                for b in want:
                    row = next((r for r in rows if r.get("batch") == b), None)
                    if row is None:
                        rows.append(row := {"batch": b})
                    if measured not in row and note_key not in row:
                        row[note_key] = note
                rows.sort(key=lambda r: r.get("batch", 0))
        info["error"] = err
        record["children"][side] = info
        _derive(record, variants, first)
        save()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--preset", choices=PRESETS, default=None,
                    help="model: 'tiny' (CPU default: hidden 256, 4 layers) or 'qwen2.5-0.5b' (CUDA default)")
    ap.add_argument("--dtype", choices=tuple(_DTYPES), default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--variants", default=None,
                    help="omniloop variants, comma-separated from triton,triton-graphs,triton-fused,torch, or none (default: "
                         "all four on CUDA; torch on CPU, plus triton under TRITON_INTERPRET=1)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--decode-batches", default=None, help="batches of the decode-vs-re-prefill section (default: --batches)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 32 (CPU) / 64 (CUDA)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kernel-iters", type=int, default=50)
    ap.add_argument("--sections", default="kernel,throughput,reprefill")
    ap.add_argument("--budget-s", type=float, default=220.0,
                    help="wall-clock budget: sections/variants not started by then are recorded as skipped")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (CPU runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="toy sizes of the preset, 1 repeat: checks the script, seconds")
    ap.add_argument("--profile", action="store_true",
                    help=f"decode vs re-prefill: also run {PROFILE_STEPS} decode steps of each side at the smallest batch under "
                         "torch.profiler (kernels, GPU time, launches and host time per step) into the JSON")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--isolate", choices=("auto", "yes", "no"), default="auto",
                    help="run the kernel section and each variant (and transformers) in its own child process, so a "
                         "CUDA fault costs only that side's rows (auto: yes on CUDA, no on CPU)")
    # internal (the parent's children): write the record here as JSON, reuse the parent's checkpoint, no transformers side
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--no-transformers", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    from omniloop_qwen import paged_attention as pa

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available")
    preset = args.preset or ("qwen2.5-0.5b" if device.type == "cuda" else "tiny")
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = _DTYPES[dtype_name]
    kernel_ok = pa.triton_unavailable(device) is None
    default = ["triton", "triton-graphs", "triton-fused", "torch"] if device.type == "cuda" else ["triton", "torch"] if kernel_ok else ["torch"]
    variants = [] if args.variants == "none" else args.variants.split(",") if args.variants else default
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"--variants: unknown {bad}")
    batches = [int(b) for b in args.batches.split(",")]
    decode_batches = [int(b) for b in (args.decode_batches or args.batches).split(",")]
    new_tokens = args.new_tokens or (64 if device.type == "cuda" else 32)
    context, repeats, steps, iters = args.context, args.repeats, args.decode_steps, args.kernel_iters
    if args.smoke:
        batches, decode_batches = [b for b in batches if b <= 2] or [1, 2], [1, 2]
        new_tokens, context, repeats, steps, iters = min(new_tokens, 4), min(context, 80), 1, 4, 2
    sections = set(args.sections.split(","))
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    budget = Budget(args.budget_s)

    cfg = model_config(preset, args.smoke)
    name = f"text_decode-{device.type}" + ("" if preset == "tiny" else f"-{preset}") + ("-smoke" if args.smoke else "")
    record: dict[str, Any] = {
        "bench": name, "date": datetime.date.today().isoformat(),
        "command": command_line("bench/text_decode.py", argv),
        "machine": machine(torch_threads=torch.get_num_threads(), **library_versions(),
                           triton=_triton_version()),
        "model": {"arch": "qwen2", "preset": preset, "weights": f"random (seed {args.seed})", "dtype": dtype_name, **cfg},
        "variants": variants, "budget_s": args.budget_s,
        "notes": ("omniloop_<variant>: Runtime + step scheduler (events, per-request sampling, text detokenized every "
                  "token) with options.paged_attention = triton|torch (triton-graphs: triton + decode_cuda_graphs; triton-fused: "
                  "triton + decode_cuda_graphs + decode_fused); "
                  "transformers: generate on one left-padded batch "
                  "(sdpa). decode_vs_reprefill: our paged forward alone vs transformers forward of the whole "
                  "[batch, context] with use_cache=False (last-position logits), bf16 sdpa, warmed up; both timed with a "
                  "synchronize after each call. --profile: <side>_profile / reprefill_profile (torch.profiler at the "
                  "smallest batch) say how much of each wall time is GPU kernel time."),
    }

    def save() -> None:
        record["seconds"] = round(budget.elapsed, 1)
        if args.child:  # a child: the parent merges this (and the first decode steps' logits, compared across sides)
            Path(args.child).write_text(json.dumps(record, default=str))
            if FIRST_LOGITS:
                torch.save(dict(FIRST_LOGITS), Path(args.child).with_suffix(".logits.pt"))
            return
        log(f"wrote {write_record(record, args.out)}")

    isolate = args.isolate == "yes" or (args.isolate == "auto" and device.type == "cuda")
    if args.child:
        isolate = False
        side = "transformers" if not variants and not args.no_transformers else (variants or ["kernel"])[0]
        if os.environ.get(FAULT_ENV) == side:
            os.abort()  # (test hook: what a fatal CUDA fault does to the process)

    log(f"[text_decode] device={device} preset={preset} dtype={dtype_name} variants={variants} batches={batches} "
        f"new_tokens={new_tokens} context={context} budget={args.budget_s}s")
    t_build = time.time()
    if args.model_path:
        path = Path(args.model_path)
    else:
        path = build_model(Path(tempfile.mkdtemp()) / f"qwen2-{preset}", args.seed, cfg)
        record["build_s"] = round(time.time() - t_build, 1)
        log(f"[text_decode] checkpoint built in {record['build_s']} s")
    if isolate:
        record["isolation"] = "each side in its own child process (kernel, every omniloop variant, transformers)"
        if "kernel" in sections and not kernel_ok:
            record["kernel"] = {"skipped": f"the Triton kernel cannot run here: {pa.triton_unavailable(device)}"}
        _run_children(args, path, variants, sections, budget, record, save, with_kernel="kernel" in sections and kernel_ok,
                      batches_of={"throughput": batches, "reprefill": decode_batches})
        save()
        return 0

    if "kernel" in sections:
        if kernel_ok:
            record["kernel"] = kernel_bench(cfg, device, dtype, batches, context, iters, budget)
        else:
            record["kernel"] = {"skipped": f"the Triton kernel cannot run here: {pa.triton_unavailable(device)}"}
        save()
    hf = None
    try:
        if sections & {"throughput", "reprefill"}:
            hf = hf_model(path, device, dtype)
    except Exception as exc:
        record["transformers_error"] = error_of(exc)
        traceback.print_exc()
    with_hf = not args.no_transformers
    both = {"throughput", "reprefill"} <= sections
    # a child's share: throughput may use 60 % of it, so its re-prefill rows are not all skipped
    tp_budget = Budget(args.budget_s * 0.6) if args.child and both else budget
    if "throughput" in sections and hf is not None:
        record["throughput"] = throughput(path, device, dtype_name, variants, batches, new_tokens, repeats, args.seed,
                                          tp_budget, hf, with_hf=with_hf)
        save()
    if "reprefill" in sections and hf is not None:
        rp_budget = Budget(max(budget.left(), args.budget_s * 0.4)) if args.child and both else budget
        record["decode_vs_reprefill"] = decode_vs_reprefill(hf, device, variants, decode_batches, context, steps,
                                                            args.seed, rp_budget, with_hf=with_hf, profile=args.profile,
                                                            on_rows=lambda rows: (record.__setitem__("decode_vs_reprefill", rows),
                                                                                  save()))
        save()
    if device.type == "cuda":
        record["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    save()
    return 0


def _triton_version() -> str | None:
    try:
        import triton

        return str(triton.__version__)
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
