"""``sparse-tile`` on a real model: the shipped wan-demo's clips vs dense attention (CPU is enough).

wan-demo's clips (17 x 64 x 64) are a 5 x 8 x 8 = 320-token grid after the VAE and the 2 x 2 patch.
At the backend's 128-token block that is 3 blocks — too few for a density to mean much — so the
sparse runs here use tile ``[1, 4, 4]`` (16 tokens) with 16-token blocks (the module's ``BLOCK``,
set for the run as the tests do; the block size is not a deploy option): 20 blocks, each query
block keeping the nearest ``round(density * 20)`` key blocks. Also the default tile ``[2, 8, 8]``
(128-token blocks, what a deploy gets) at density 0.5 (``--default-tile``).

Each configuration generates the wan-demo evaluator's prompts (24: every color x direction) x
seeds (default 0) through ``Runtime.generate`` (``attention_backend: sparse-tile`` with
``attention_options``; 20 steps, CFG 5, float32), scored by the project's evaluator
(``omniloop_wan_demo.evaluate.score``: color / direction / shape verdicts), and compared with the
dense clips (core ``sdpa``) of the same prompt and seed: PSNR and SSIM of the uint8 frames, and
which verdicts each clip lost or gained.

    OMP_NUM_THREADS=1 python bench/attention_sparse_quality.py             # CPU, ~24 clips per config
    python bench/attention_sparse_quality.py --smoke --out /tmp             # 2 prompts, 3 steps: checks the script

Writes ``attention_sparse_quality-wan-demo-<device>-<date>[-smoke].json`` to ``--out`` (default
``$OUT``, else bench/results).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import math
import os
import statistics
import subprocess
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
from _common import (  # noqa: E402
    command_line,
    frames_psnr,
    frames_ssim,
    library_versions,
    machine,
    verdict_changes,
    wan_demo_clip,
)

ATTRS = ("color", "direction", "shape")




def demo_runtime(device: str, backend: str, options: dict[str, Any] | None) -> Any:
    import omniloop_attention.plugin as attn_plugin
    import omniloop_wan.plugin as wan_plugin
    from omniloop.runtime import Runtime
    from omniloop.testing import make_manager
    from omniloop_wan_demo.checkpoint_path import checkpoint_dir

    extra: dict[str, Any] = {"attention_options": options} if options else {}
    return Runtime.from_model(checkpoint_dir(), device=device, dtype="bfloat16" if device == "cuda" else "float32",
                              manager=make_manager(("wan", wan_plugin), ("attention", attn_plugin), toy=False),
                              attention_backend=backend, **extra)



def weights_id() -> dict[str, Any]:
    """Which wan-demo weights ran: the transformer file's sha256 prefix and the checkpoint's last commit."""
    from omniloop_wan_demo.checkpoint_path import checkpoint_dir

    root = Path(checkpoint_dir())
    f = root / "transformer" / "diffusion_pytorch_model.safetensors"
    info: dict[str, Any] = {"transformer_sha256": hashlib.sha256(f.read_bytes()).hexdigest()[:16] if f.is_file() else None}
    try:
        info["checkpoint_commit"] = subprocess.run(
            ["git", "log", "-1", "--format=%h %s", "--", str(root)], cwd=root, capture_output=True, text=True,
            timeout=20).stdout.strip()[:160]
        info["checkpoint_dirty"] = bool(subprocess.run(
            ["git", "status", "--porcelain", "--", str(root)], cwd=root, capture_output=True, text=True,
            timeout=20).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    meta = root / "omniloop.json"
    if meta.is_file():
        info["variant"] = json.loads(meta.read_text()).get("variant")
    return info


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--densities", default="0.5,0.3")
    ap.add_argument("--tile", default="1,4,4", help="tile T,H,W in latent tokens (its size is the block)")
    ap.add_argument("--default-tile", action="store_true", help="also the deploy default tile [2,8,8] at density 0.5")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else bench/results)")
    ap.add_argument("--smoke", action="store_true", help="2 prompts, 3 steps")
    args = ap.parse_args(argv)

    from omniloop_attention import sparse
    from omniloop_wan_demo.evaluate import default_prompts, score

    tile = [int(x) for x in args.tile.split(",")]
    block = tile[0] * tile[1] * tile[2]
    prompts = default_prompts()[: 2 if args.smoke else None]
    seeds = [int(s) for s in args.seeds.split(",")]
    steps = 3 if args.smoke else args.steps
    pairs = [(p, s) for s in seeds for p in prompts]
    date = dt.date.today().isoformat()
    out_dir = Path(args.out or os.environ.get("OUT") or HERE / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"attention_sparse_quality-wan-demo-{args.device}-{date}{'-smoke' if args.smoke else ''}.json"

    configs: list[tuple[str, str, dict[str, Any] | None, int]] = [("dense sdpa", "sdpa", None, sparse.BLOCK)]
    for d in (float(x) for x in args.densities.split(",")):
        configs.append((f"sparse-tile {d} tile {tile}", "sparse-tile", {"density": d, "tile": tile}, block))
    if args.default_tile:
        configs.append(("sparse-tile 0.5 tile [2, 8, 8] (defaults)", "sparse-tile", {"density": 0.5}, sparse.BLOCK))

    record: dict[str, Any] = {
        "bench": "attention_sparse_quality", "command": command_line("bench/attention_sparse_quality.py", argv),
        "date": date, "machine": {**machine(), **library_versions(), "torch_threads": torch.get_num_threads()},
        "weights": weights_id(),
        "setup": {"model": "wan-demo", "clip": "17 x 64 x 64 (latent token grid 5 x 8 x 8 = 320)", "steps": steps,
                  "guidance_scale": 5.0, "dtype": "bfloat16" if args.device == "cuda" else "float32",
                  "prompts": len(prompts), "seeds": seeds,
                  "psnr_ssim": "uint8 frames vs the dense clip of the same prompt and seed (SSIM: 7x7 uniform window)",
                  "block": "tokens per attention block = the tile's size (the module's BLOCK, set for the run)"},
        "configs": {}, "errors": [],
    }

    def write() -> None:
        path.write_text(json.dumps(record, indent=1, default=str) + "\n")

    print(f"wan-demo sparse quality on {args.device}; {len(pairs)} clips per config; writing {path}", flush=True)
    base: list[np.ndarray] | None = None
    base_verdicts: list[dict[str, bool]] | None = None
    default_block = sparse.BLOCK
    for label, backend, options, blk in configs:
        row: dict[str, Any] = {"attention_backend": backend, "attention_options": options, "block": blk}
        try:
            sparse.BLOCK = blk
            rt = demo_runtime(args.device, backend, options)
            fn = rt.attention.fn
            t = time.perf_counter()
            vids = [wan_demo_clip(rt, p, s, steps) for p, s in pairs]
            row["seconds"] = round(time.perf_counter() - t, 2)
            if hasattr(fn, "_layouts"):
                row["layouts"] = [{"grid": list(lay.grid), "blocks": lay.n_blocks, "kept_blocks_per_query_block": lay.keep,
                                   "kept_token_pairs": round(lay.density, 4)} for lay in fn._layouts.values()]
            acc, clips = score(vids, [p for p, _ in pairs], [s for _, s in pairs])
            row["accuracy"] = acc
            row["n"] = len(clips)
            verdicts = [{k: c.ok[k] for k in ATTRS} for c in clips]
            row["clips"] = [{"prompt": c.prompt, "seed": c.seed, "ok": c.ok, "detected": c.detected} for c in clips]
            if base is None:
                base, base_verdicts = vids, verdicts
            else:
                assert base_verdicts is not None
                ps = [frames_psnr(a, b) for a, b in zip(vids, base, strict=True)]
                ss = [frames_ssim(a, b) for a, b in zip(vids, base, strict=True)]
                finite = [p for p in ps if math.isfinite(p)]
                row["vs_dense"] = {
                    "psnr_db_mean": round(statistics.fmean(finite), 2) if finite else float("inf"),
                    "psnr_db_median": round(statistics.median(finite), 2) if finite else float("inf"),
                    "psnr_db_min": round(min(finite), 2) if finite else float("inf"),
                    "identical_clips": len(ps) - len(finite),
                    "ssim_mean": round(statistics.fmean(ss), 4), "ssim_min": round(min(ss), 4),
                    "psnr_db_per_clip": [round(p, 2) if math.isfinite(p) else None for p in ps],
                }
                row["verdict_changes_vs_dense"] = verdict_changes(verdicts, base_verdicts, ATTRS)
            del rt
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:800]
            row["traceback_tail"] = traceback.format_exc()[-1500:]
            record["errors"].append({"config": label, "error": row["error"]})
        finally:
            sparse.BLOCK = default_block
        print("config", label, json.dumps({k: v for k, v in row.items() if k not in ("clips",)}
                                          | ({"vs_dense": {k: v for k, v in row["vs_dense"].items()
                                                           if k != "psnr_db_per_clip"}} if "vs_dense" in row else {})),
              flush=True)
        record["configs"][label] = row
        write()
    print(f"wrote {path}", flush=True)
    return 1 if record["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
