"""CPU bench of the Qwen family's decode loop (issue 20) on a small random Qwen2-architecture model.

Two measurements, each side by side in one process:

1. **Throughput** at batch 1 / 16 / 64: ``batch`` greedy requests of ``--new-tokens`` new tokens
   each (3 to 14 words of the tiny tokenizer's corpus), through ``Runtime`` with the ``step`` scheduler
   (``max_batch = max_running = batch``: prefill per sequence, then every decode step batched) vs
   transformers ``generate(do_sample=False)`` on the same prompts left-padded into one batch
   (``min_new_tokens`` so both make the same number of tokens). Tokens/s = new tokens / wall time,
   median over ``--repeats`` interleaved repeats.
2. **Decode vs re-prefill at ``--context`` tokens**: one decode step of our paged forward (one new
   token attending over the cached context) vs re-running the whole context without a cache (what
   a loop without KV does per token), and transformers' own cached decode step for reference,
   interleaved (4 decode steps of each, then one re-prefill, repeated), medians.

    python bench/text_decode.py                       # -> bench/results/text_decode-cpu-<date>.json
    python bench/text_decode.py --batches 1,4 --new-tokens 8 --context 256 --repeats 1   # quick
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _repo_paths

_repo_paths.add_repo_packages()

import torch  # noqa: E402
from _common import command_line, library_versions, machine, write_record  # noqa: E402

#: the bench model: Qwen2 layout (q/k/v bias, tied embeddings, GQA 8/2), small enough for a CPU
BENCH_MODEL = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
               "num_key_value_heads": 2, "max_position_embeddings": 4096, "initializer_range": 0.02}


def build_model(out: Path, seed: int) -> Path:
    from omniloop_qwen.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(out, arch="qwen2", seed=seed, **BENCH_MODEL)
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = []  # no EOS: every request makes exactly the tokens asked for
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


def prompts(n: int, seed: int) -> list[str]:
    """``n`` prompts of 3 to 14 words from the tiny tokenizer's corpus (about 8 to 40 tokens)."""
    from omniloop_qwen.tiny import _CORPUS

    rng = random.Random(seed)
    words = _CORPUS.split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 14))) for _ in range(n)]


def run_omniloop(rt: Any, texts: list[str], new_tokens: int) -> tuple[float, int]:
    reqs = [{"task": "reason", "inputs": [{"type": "text", "text": t}],
             "sampling": {"max_tokens": new_tokens, "temperature": 0.0}} for t in texts]
    t0 = time.perf_counter()
    streams = [rt.stream(r) for r in reqs]
    made = 0
    for s in streams:
        out = [e for e in s if e.output is not None][-1].output
        assert out.ok, out.error
        made += len(out.artifacts["text"].token_ids)
    return time.perf_counter() - t0, made


def run_transformers(hf: Any, tok: Any, texts: list[str], new_tokens: int) -> tuple[float, int]:
    batch_prompts = [tok(t)["input_ids"] for t in texts]
    width = max(len(p) for p in batch_prompts)
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch_prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch_prompts])
    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, pad_token_id=pad)
    return time.perf_counter() - t0, int((out.shape[1] - width) * len(batch_prompts))


def throughput(path: Path, batches: list[int], new_tokens: int, repeats: int, seed: int) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    from omniloop import Runtime

    rows = []
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for b in batches:
        rt = Runtime.from_model(path, scheduler="step", scheduler_options={"max_batch": b, "max_running": b},
                                options={"kv_cache_tokens": b * (40 + new_tokens) + 64 * 16})
        tok = rt.model.components["tokenizer"]
        ps = prompts(b, seed + b)
        run_omniloop(rt, ps[:1], 2)  # warm-up
        run_transformers(hf, tok, ps[:1], 2)
        ours, theirs = [], []
        for _ in range(repeats):  # interleaved
            dt, n = run_omniloop(rt, ps, new_tokens)
            ours.append(n / dt)
            dt, n = run_transformers(hf, tok, ps, new_tokens)
            theirs.append(n / dt)
        sizes = [len(d.request_ids) for d in rt.scheduler.trace if d.action == "batched_step"]
        row = {"batch": b, "new_tokens_per_request": new_tokens,
               "omniloop_tokens_per_s": round(statistics.median(ours), 2),
               "transformers_tokens_per_s": round(statistics.median(theirs), 2),
               "ratio_omniloop_over_transformers": round(statistics.median(ours) / statistics.median(theirs), 3),
               "largest_decode_batch": max(sizes, default=1), "repeats": repeats}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def decode_vs_reprefill(path: Path, context: int, steps: int, seed: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from omniloop.kvcache import CacheManager
    from omniloop_qwen.model import PagedQwen

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    paged = PagedQwen(hf)
    cache = CacheManager(paged.layout(), block_size=16, num_blocks=-(-(context + 4 * max(4, steps // 4) + 16) // 16))
    rng = random.Random(seed)
    ctx = [rng.randrange(3, hf.config.vocab_size) for _ in range(context)]
    import inspect

    kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"  # transformers >= 5.2x
    h = cache.allocate()
    paged.forward(cache, [h], [ctx])  # prefill
    with torch.no_grad():
        out = hf(torch.tensor([ctx]), use_cache=True)
    past, nxt, tok = out.past_key_values, torch.tensor([[ctx[-1]]]), ctx[-1]
    decode, reprefill, hf_steps = [], [], []
    rounds = max(4, steps // 4)
    for _ in range(rounds):  # interleaved: 4 decode steps each side, then one re-prefill
        for _ in range(4):
            t0 = time.perf_counter()
            logits = paged.forward(cache, [h], [[tok]])
            decode.append(time.perf_counter() - t0)
            tok = int(logits[0].argmax())
            t0 = time.perf_counter()
            with torch.no_grad():
                out = hf(nxt, use_cache=True, **{kw: past})
            hf_steps.append(time.perf_counter() - t0)
            past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        paged.full_logits(ctx)
        reprefill.append(time.perf_counter() - t0)
    d, r, hfd = statistics.median(decode), statistics.median(reprefill), statistics.median(hf_steps)
    row = {"context_tokens": context, "decode_steps": len(decode), "reprefills": len(reprefill),
           "omniloop_decode_ms_per_token": round(d * 1e3, 3), "reprefill_ms_per_token": round(r * 1e3, 3),
           "speedup_decode_vs_reprefill": round(r / d, 1), "transformers_cached_decode_ms_per_token": round(hfd * 1e3, 3),
           "target_speedup": 10.0, "target_met": r / d >= 10.0}
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()
    path = build_model(Path(tempfile.mkdtemp()) / "qwen2-bench", args.seed)
    batches = [int(b) for b in args.batches.split(",")]
    rows = throughput(path, batches, args.new_tokens, args.repeats, args.seed)
    reprefill = decode_vs_reprefill(path, args.context, args.decode_steps, args.seed)
    record = {
        "bench": "text_decode-cpu", "date": datetime.date.today().isoformat(),
        "command": command_line("bench/text_decode.py", argv),
        "machine": machine(torch_threads=torch.get_num_threads(), **library_versions()),
        "model": {"arch": "qwen2", "weights": f"random (seed {args.seed})", "dtype": "float32", **BENCH_MODEL},
        "throughput": rows, "decode_vs_reprefill": reprefill, "seconds": round(time.time() - t0, 1),
        "notes": ("omniloop: Runtime + step scheduler (events, per-request sampling, text detokenized every token); "
                  "transformers: generate on one left-padded batch. Decode vs re-prefill: our paged forward alone."),
    }
    print(f"wrote {write_record(record, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
