"""LoRA adapters on one GPU: what an unfused adapter costs per denoise step, fused vs unfused, and a switch.

Random weights, the real Wan2.1 T2V 1.3B transformer architecture (timing does not depend on the
values), bf16, one transformer forward at 480×832×81 (latents ``[1, 16, 21, 60, 104]``, 512 text
tokens); a CFG step is two such forwards, so per-step ratios equal per-forward ratios.

The adapter: rank 32, alpha 32, on every attention and FFN linear of every block (``attn1`` /
``attn2`` ``to_q``, ``to_k``, ``to_v``, ``to_out.0``; ``ffn.net.0.proj``, ``ffn.net.2``), written as
a diffusers-layout ``.safetensors`` file and read by :class:`omniloop_adapters.AdapterBank` — the
same code a deployment runs.

Configurations, interleaved (every other round reversed) and repeated; medians and ratios to
``base`` of the same run:

==============  ===============================================================================
``base``        the transformer, no hooks at all
``hooked-idle`` adapters declared (hooks installed), the request names none
``unfused``     the adapter active at scale 1 (``base + B(A(x))·alpha/r`` in every hook)
``unfused-x2``  two rank-32 adapters stacked
``fused``       the adapter fused into a copy of the weights at load (``adapter_fuse``)
==============  ===============================================================================

Switch cost: (a) what changes between two requests with different adapter sets when unfused —
building the new active set (``AdapterBank.active_set``), plus the first forward after a switch vs
a steady one; (b) what the same switch costs a fused deployment: unfusing one adapter and fusing
another (two weight updates of every targeted linear). ``--compile`` adds the regional
``torch.compile`` (each block, fullgraph) variants of ``base`` and ``unfused``; a switch must not
recompile (the record counts dynamo's graphs before and after the switches).

Results go to ``$OUT`` if set, else ``bench/results/``, as ``lora_gpu-<date>[-smoke].json`` with
the command line and the machine.

    python bench/lora_gpu.py                      # H200: ~3 min (estimate; not yet run)
    python bench/lora_gpu.py --compile --repeats 7
    python bench/lora_gpu.py --smoke              # tiny transformer on a CPU: checks the script
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _repo_paths

_repo_paths.add_repo_packages()

from _common import CFG_13B, SMOKE_TF, command_line, library_versions, machine, sync  # noqa: E402

TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
           "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")


def write_adapter(tf: torch.nn.Module, path: Path, rank: int, seed: int) -> Path:
    """A random diffusers-layout LoRA file (rank ``rank``, alpha = rank) on every block's TARGETS."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for i, block in enumerate(tf.blocks):
        for t in TARGETS:
            lin = block.get_submodule(t)
            sd[f"transformer.blocks.{i}.{t}.lora_A.weight"] = torch.randn(rank, lin.in_features, generator=g) * 0.01
            sd[f"transformer.blocks.{i}.{t}.lora_B.weight"] = torch.randn(lin.out_features, rank, generator=g) * 0.01
    meta = {"lora_adapter_metadata": json.dumps({"transformer.r": rank, "transformer.lora_alpha": rank})}
    save_file(sd, str(path), metadata=meta)
    return path


def inputs(smoke: bool, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator("cpu").manual_seed(0)
    frames, h, w, text_dim, text_len = (2, 8, 8, SMOKE_TF["text_dim"], 16) if smoke else (21, 60, 104, CFG_13B["text_dim"], 512)
    return {
        "hidden_states": torch.randn(1, 16, frames, h, w, generator=g).to(device, dtype),
        "timestep": torch.tensor([500.0], device=device),
        "encoder_hidden_states": torch.randn(1, text_len, text_dim, generator=g).to(device, dtype),
    }


def _rel_rms(got: Any, ref: Any) -> float:
    return float(((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny transformer on the CPU (checks the script)")
    ap.add_argument("--repeats", type=int, default=5, help="rounds of every configuration")
    ap.add_argument("--forwards", type=int, default=4, help="timed forwards per configuration per round")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--compile", action="store_true", help="also the regional torch.compile variants")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)

    from diffusers import WanTransformer3DModel

    from omniloop.request import AdapterRef
    from omniloop_adapters import AdapterBank, activate
    from omniloop_wan.lora import WAN_ADAPTERS
    from omniloop_wan.transformer import wan_forward

    smoke = args.smoke
    device = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(device):
        tf = WanTransformer3DModel(**(SMOKE_TF if smoke else CFG_13B)).to(dtype).eval().requires_grad_(False)
    clean = copy.deepcopy(tf)  # never hooked: the base
    fused_tf = copy.deepcopy(tf)  # adapter a fused into its weights
    tmp = Path(tempfile.mkdtemp())
    files = {n: str(write_adapter(tf, tmp / f"{n}.safetensors", args.rank, seed)) for n, seed in (("a", 1), ("b", 2))}
    t0 = time.perf_counter()
    bank = AdapterBank(files, {"transformer": tf}, WAN_ADAPTERS, max_loaded=4)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    fused_bank = AdapterBank({"a": files["a"]}, {"transformer": fused_tf}, WAN_ADAPTERS, fuse={"a": 1.0})
    sync()
    fuse_load_s = time.perf_counter() - t0
    x = inputs(smoke, device, dtype)
    one = bank.active_set([AdapterRef("a", 1.0)])
    two = bank.active_set([AdapterRef("a", 1.0), AdapterRef("b", 0.5)])

    def fwd(model: Any, blocks: Any = None) -> torch.Tensor:
        return wan_forward(model, x["hidden_states"], x["timestep"], x["encoder_hidden_states"], blocks=blocks)

    configs: dict[str, Any] = {
        "base": lambda: fwd(clean),
        "hooked-idle": lambda: fwd(tf),
        "unfused": lambda: _with(one, lambda: fwd(tf)),
        "unfused-x2": lambda: _with(two, lambda: fwd(tf)),
        "fused": lambda: fwd(fused_tf),
    }

    def _with(active: Any, fn: Any) -> Any:
        with activate(active):
            return fn()

    graphs_before_switch = graphs_after_switch = None
    if args.compile:
        kw: dict[str, Any] = {"fullgraph": True, "dynamic": False, "backend": "eager" if smoke else "inductor"}
        cblocks_clean = [torch.compile(b, **kw) for b in clean.blocks]
        cblocks = [torch.compile(b, **kw) for b in tf.blocks]
        configs["base-compile"] = lambda: fwd(clean, cblocks_clean)
        configs["unfused-compile"] = lambda: _with(one, lambda: fwd(tf, cblocks))

    rows: dict[str, list[float]] = {k: [] for k in configs}
    with torch.no_grad():
        for fn in configs.values():  # warm-up (and compile)
            fn()
        # numerics: fused vs unfused (the same adapter), and idle hooks vs base (must be equal)
        ref, got = configs["unfused"]().float(), configs["fused"]().float()
        fused_rel_rms = _rel_rms(got, ref)
        idle_equal = bool(torch.equal(configs["hooked-idle"](), configs["base"]()))
        base_out = configs["base"]().float()
        numerics = {"fused_vs_unfused_rel_rms": fused_rel_rms, "hooked_idle_equals_base": idle_equal,
                    # the adapter really changes the output (a rank-32 delta of random weights)
                    "unfused_vs_base_rel_rms": _rel_rms(ref, base_out)}
        if args.compile:  # the compiled blocks apply the same adapter (the custom op reads the set at run time)
            numerics["unfused_compile_vs_unfused_rel_rms"] = _rel_rms(configs["unfused-compile"]().float(), ref)
            numerics["base_compile_vs_base_rel_rms"] = _rel_rms(configs["base-compile"]().float(), base_out)
        if args.compile:
            from torch._dynamo.utils import counters

            graphs_before_switch = int(counters["stats"]["unique_graphs"])
        names = list(configs)
        for rep in range(args.repeats):
            for name in (names if rep % 2 == 0 else names[::-1]):
                for _ in range(args.forwards):
                    sync()
                    t = time.perf_counter()
                    configs[name]()
                    sync()
                    rows[name].append(time.perf_counter() - t)
            print(json.dumps({"rep": rep, **{k: round(statistics.median(v), 5) for k, v in rows.items()}}), flush=True)

        # switching, unfused: a new active set, then its first forward vs a steady one
        switch_set_s: list[float] = []
        first_after_switch: list[float] = []
        refs = [[AdapterRef("a", 1.0)], [AdapterRef("b", 1.0)], [AdapterRef("a", 0.3), AdapterRef("b", 1.0)]]
        for i in range(3 * args.repeats):
            sync()
            t = time.perf_counter()
            active = bank.active_set(refs[i % 3])
            switch_set_s.append(time.perf_counter() - t)
            sync()
            t = time.perf_counter()
            _with(active, lambda: fwd(tf, cblocks if args.compile else None))
            sync()
            first_after_switch.append(time.perf_counter() - t)
        if args.compile:
            graphs_after_switch = int(counters["stats"]["unique_graphs"])
        # switching, fused: take adapter a out of the weights, put b in (and back)
        fused_switch_s: list[float] = []
        from omniloop_adapters import load_adapter

        b_loaded = load_adapter("b", files["b"], {"transformer": fused_tf}, WAN_ADAPTERS)
        a_loaded = fused_bank.get("a")
        for _ in range(args.repeats):
            sync()
            t = time.perf_counter()
            fused_bank._fuse(a_loaded, -1.0)
            fused_bank._fuse(b_loaded, 1.0)
            sync()
            fused_switch_s.append(time.perf_counter() - t)
            fused_bank._fuse(b_loaded, -1.0)
            fused_bank._fuse(a_loaded, 1.0)

    med = {k: statistics.median(v) for k, v in rows.items()}
    results = {
        "s_per_forward_median": {k: round(v, 6) for k, v in med.items()},
        "ratio_to_base": {k: round(v / med["base"], 4) for k, v in med.items()},
        "unfused_overhead_per_cfg_step_s": round(2 * (med["unfused"] - med["base"]), 6),
        "switch": {
            "unfused_active_set_s_median": round(statistics.median(switch_set_s), 7),
            "unfused_first_forward_after_switch_s_median": round(statistics.median(first_after_switch), 6),
            "unfused_steady_forward_s_median": round(med["unfused-compile" if args.compile else "unfused"], 6),
            "fused_unfuse_then_fuse_s_median": round(statistics.median(fused_switch_s), 6),
        },
        "numerics": numerics,
        "load_s": {"unfused_two_adapters": round(load_s, 4), "fused_one_adapter": round(fuse_load_s, 4)},
        "adapter": {"rank": args.rank, "alpha": args.rank, "targets_per_block": list(TARGETS),
                    "modules": len(bank.get("a").layers), "mbytes": round(bank.get("a").nbytes / 2**20, 2)},
    }
    if args.compile:
        results["compile"] = {"graphs_before_switches": graphs_before_switch, "graphs_after_switches": graphs_after_switch}
    date = dt.date.today().isoformat()
    argv_ = sys.argv[1:] if argv is None else argv
    record = {
        "bench": "lora_gpu", "date": date, "command": command_line("bench/lora_gpu.py", list(argv_)),
        "machine": machine(dtype=str(dtype), device=str(device), threads=torch.get_num_threads(), **library_versions()),
        "shape": {k: list(v.shape) for k, v in x.items()}, "repeats": args.repeats, "forwards": args.forwards,
        "smoke": smoke, "results": results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"lora_gpu-{date}{'-smoke' if smoke else ''}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")
    bank.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
