"""Prompt adherence of a demo model vs denoising steps (video clips or images).

Video: color, direction, shape; image: color, shape, position.

    python bench/adherence.py                         # runtime on CPU, 50/20/8/4 steps, 24 prompts x seeds 0,1
    python bench/adherence.py --backend diffusers --device cuda --prompts full --seeds 0,1,2,3
    python bench/adherence.py --smoke                 # 2 prompts, 2 steps: checks the script
    python bench/adherence.py --model wan-demo-causal --rollout causal --steps 4,8   # streamed clips
    python bench/adherence.py --model wan-demo-causal --prompts full --steps 4 --workers 8   # 192 streamed clips, 8 processes
    python bench/adherence.py --model flux-demo       # an image model (omniloop.json adherence.kind: image)
    python bench/adherence.py --detector-check        # the detector itself on rendered ground truth (no model)

An image model (its ``omniloop.json`` holds ``"adherence": {"kind": "image"}``) is scored on image
prompts (``a {color} {shape} at the {position}``) generated as ``t2i`` requests through the
runtime; ``--steps`` then defaults to the checkpoint's own default steps and ``--guidance`` to its
default guidance (else 3.5).

``--rollout causal`` scores **streamed** clips: each request goes through ``Runtime.stream`` with
``rollout: causal`` and the clip scored is the concatenation of its PARTIAL ``video_chunk``
events (checked equal to the final video); ``--steps`` are then sampler steps per chunk and the
JSON also holds time to first chunk per clip. ``--model`` is the ``wan-demo-causal`` preset or a
checkpoint folder (its ``omniloop.json`` ``rollout_options`` are used, else the preset's).

Writes ``bench/results/adherence-<model>-<backend>-<device>-<date>.json`` (per-clip tables
included) unless ``--no-write``. Same machinery as ``omniloop eval adherence``
(``omniloop_wan_demo.evaluate``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def causal_generator(model: str, device: str, workers: int = 0, threads: int = 1):
    """``(StreamingRuntimeGenerator, backend, note)`` for ``--rollout causal``: the preset as it
    is registered, or a checkpoint folder with its ``omniloop.json`` rollout_options. With
    ``workers`` the clips are made by that many processes (``ParallelStreamingGenerator``)."""
    from omniloop_wan_demo.checkpoint_path import CAUSAL_ROLLOUT_OPTIONS
    from omniloop_wan_demo.evaluate import ParallelStreamingGenerator, StreamingRuntimeGenerator

    path = Path(model)
    if path.is_dir():
        meta = json.loads((path / "omniloop.json").read_text()) if (path / "omniloop.json").is_file() else {}
        ro = dict(meta.get("rollout_options") or CAUSAL_ROLLOUT_OPTIONS)
        options = {"rollout": "causal", "rollout_options": ro}
        gen = None if workers else StreamingRuntimeGenerator(str(path), device=device, options=options)
    else:
        options = None
        gen = StreamingRuntimeGenerator(model, device=device)
        ro = dict(gen.runtime.options.get("rollout_options") or {})
        if gen.runtime.options.get("rollout") != "causal":
            raise SystemExit(f"--rollout causal: the preset {model!r} does not deploy rollout: causal")
    if workers:
        gen = ParallelStreamingGenerator(str(model), workers=workers, threads=threads, device=device, options=options)
    gen.rollout_options = ro
    return gen, "runtime-stream", None


def main(argv: list[str] | None = None) -> int:
    from omniloop_wan_demo.cli import _checkpoint_meta
    from omniloop_wan_demo.evaluate import adherence_kind, evaluate, make_generator, prompt_set

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="wan-demo")
    ap.add_argument("--rollout", choices=["bidirectional", "causal"], default=None,
                    help="causal: streamed chunk rollout (default: causal for wan-demo-causal, else bidirectional)")
    ap.add_argument("--steps", default=None, help="comma list (default 50,20,8,4; causal: 4,8)")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--guidance", type=float, default=None, help="default: the checkpoint's (video 5.0; causal: its rollout_options.guidance_scale; image 3.5)")
    ap.add_argument("--prompts", default="default", choices=["default", "full"])
    ap.add_argument("--backend", default="runtime", choices=["auto", "runtime", "diffusers"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=os.environ.get("RESULTS_DIR", str(HERE / "results")))
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--workers", type=int, default=0,
                    help="--rollout causal: make the clips in this many processes (each --threads torch threads)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--detector-check", action="store_true",
                    help="score the detector on rendered ground-truth images and clips (clean, blurred, noisy) and exit")
    a = ap.parse_args(argv)
    if a.detector_check:
        from omniloop_wan_demo_training.detector_check import detector_check  # demos/wan-demo

        n_img, n_clip = (30, 6) if a.smoke else (1000, 200)
        print(json.dumps({"detector_check": detector_check(n_img, n_clip),
                          "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])])}, indent=1))
        return 0

    meta = _checkpoint_meta(a.model)
    kind = adherence_kind(meta)
    defaults = dict(meta.get("defaults") or {})
    if kind == "image" and a.rollout == "causal":
        ap.error(f"--rollout causal: {a.model} is an image model")
    rollout = a.rollout or ("causal" if a.model == "wan-demo-causal" else "bidirectional")
    default_steps = str(defaults.get("steps", 20)) if kind == "image" else ("4,8" if rollout == "causal" else "50,20,8,4")
    steps = [int(s) for s in (a.steps or default_steps).split(",")]
    seeds = [int(s) for s in a.seeds.split(",")]
    if a.workers < 0 or a.threads < 1:
        ap.error("--workers must be >= 0 and --threads >= 1")
    if a.workers and rollout != "causal":
        ap.error("--workers: only with --rollout causal (streamed clips)")
    prompts = prompt_set(kind, a.prompts)
    if a.smoke:
        steps, seeds, prompts = [2], [0], prompts[:2]
    timings = None
    if rollout == "causal":
        gen, backend, note = causal_generator(a.model, a.device, a.workers, a.threads)
        timings = gen.timings
    else:
        gen, backend, note = make_generator(a.backend, model=a.model, device=a.device, kind=kind)
    if a.guidance is None:  # causal: the rollout's own CFG scale (5.0 for a checkpoint that has none)
        a.guidance = (float(defaults.get("guidance_scale", 3.5)) if kind == "image" else
                      float((getattr(gen, "rollout_options", None) or {}).get("guidance_scale", 5.0)) if rollout == "causal"
                      else 5.0)
    reports = []
    for n in steps:
        start = len(timings) if timings is not None else 0
        rep = evaluate(gen, prompts=prompts, seeds=seeds, steps=n, guidance_scale=a.guidance, backend=backend, kind=kind)
        if timings is not None:
            t = timings[start:]
            rep.extra["first_chunk_s_median"] = round(statistics.median(x["first_chunk_s"] for x in t), 4)
            rep.extra["clip_s_median"] = round(statistics.median(x["total_s"] for x in t), 4)
            rep.extra["timings"] = t
        print(json.dumps({"steps": n, "n": rep.n, "accuracy": rep.accuracy, "seconds": round(rep.seconds, 1),
                          **{k: v for k, v in rep.extra.items() if k != "timings"}}), flush=True)
        reports.append(rep.to_dict())
    if hasattr(gen, "close"):
        gen.close()
    result = {
        "model": a.model, "kind": kind, "rollout": rollout, "rollout_options": getattr(gen, "rollout_options", None),
        "backend": backend, "note": note, "device": a.device, "guidance_scale": a.guidance,
        "prompt_set": a.prompts, "seeds": seeds, "workers": a.workers or None, "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "date": dt.date.today().isoformat(), "host": platform.node(), "cpus": os.cpu_count(),
        "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "summary": [{"steps": r["steps"], "n": r["n"], **r["accuracy"], "seconds": round(r["seconds"], 1),
                     **{k: v for k, v in r["extra"].items() if k != "timings"}} for r in reports],
        "reports": reports,
    }
    if not a.no_write and not a.smoke:
        name = Path(a.model).name if Path(a.model).name != "causal" else "causal-" + Path(a.model).parent.name
        out = Path(a.out) / f"adherence-{name}-{backend}-{a.device}-{result['date']}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
