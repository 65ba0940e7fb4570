"""Evaluating a flux-demo pipeline folder: images sampled for every prompt of the vocabulary
(6 colours x 4 shapes x 9 positions), scored with ``omniloop_wan_demo.evaluate.detect_image``.

The folder is loaded by the flux family's own loader (``FluxFamily.load``: every file checked,
each component built by the class ``model_index.json`` names), then sampled in batches with
:func:`omniloop_flux_demo_training.train.sample` (the family's flow-Euler loop, batched); a few
prompts are also run through ``omniloop.Runtime`` and compared with the batched sampler.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

ATTRS = ("color", "shape", "position")


def _detected(d: Any) -> dict[str, Any]:
    if isinstance(d, dict):
        return {a: d.get(a) for a in ATTRS}
    return {a: getattr(d, a, None) for a in ATTRS}


def score(images: torch.Tensor, labels: Sequence[tuple[str, str, str]]) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Accuracy per attribute of ``images`` (``[N, 3, H, W]`` in [0, 1]) against their labels."""
    from omniloop_wan_demo.evaluate import detect_image

    u8 = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    rows = []
    for img, lab in zip(u8, labels, strict=True):
        got = _detected(detect_image(img))
        rows.append({"want": dict(zip(ATTRS, lab, strict=True)), "got": got,
                     "ok": {a: got[a] == want for a, want in zip(ATTRS, lab, strict=True)}})
    acc = {a: round(float(np.mean([r["ok"][a] for r in rows])), 4) for a in ATTRS}
    acc["all"] = round(float(np.mean([all(r["ok"].values()) for r in rows])), 4)
    return acc, rows


def quick_eval(comps: dict[str, Any], *, steps: int = 20, seed: int = 0, smoke: bool = False) -> dict[str, float]:
    """Accuracy of in-memory ``comps`` on every prompt (216; 6 with ``smoke``) at one seed (training-time check)."""
    from omniloop_wan_demo.prompts import COLORS, POSITIONS, SHAPES, image_prompt_for

    from .train import sample

    labels = [(c, s, p) for c in COLORS for s in SHAPES for p in POSITIONS]
    if smoke:
        labels = labels[::37]
    imgs = sample(comps, [image_prompt_for(*lab) for lab in labels], [seed] * len(labels), steps=steps)
    return score(imgs, labels)[0]


def grid_png(images: torch.Tensor, path: Path, cols: int) -> None:
    from PIL import Image

    n, _, h, w = images.shape
    rows = (n + cols - 1) // cols
    canvas = np.full((rows * (h + 2), cols * (w + 2), 3), 255, np.uint8)
    u8 = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    for i in range(n):
        r, c = divmod(i, cols)
        canvas[r * (h + 2):r * (h + 2) + h, c * (w + 2):c * (w + 2) + w] = u8[i]
    Image.fromarray(canvas).save(path)


def load_folder(folder: Path, device: torch.device) -> dict[str, Any]:
    from omniloop_flux.family import FluxFamily

    return FluxFamily().load(Path(folder), device=device, dtype=torch.float32, options={}).components


def runtime_check(folder: Path, comps: dict[str, Any], device: torch.device, prompts: Sequence[str], steps: int) -> dict[str, Any]:
    """The same prompts through ``omniloop.Runtime`` (seed 0) vs the batched sampler: max |diff| of uint8 pixels."""
    import omniloop_flux.plugin as flux_plugin
    from omniloop import Runtime
    from omniloop.testing import make_manager

    from .train import sample

    # an explicit manager (the flux family alone): on the GPU machine the packages are on
    # PYTHONPATH, not installed, so entry-point discovery would find no family
    manager = make_manager(("flux", flux_plugin), toy=False)
    rt = Runtime.from_model(str(folder), device=str(device), dtype="float32", manager=manager)
    ours = sample(comps, prompts, [0] * len(prompts), steps=steps)
    ours_u8 = (ours * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    diffs = []
    for i, p in enumerate(prompts):
        out = rt.generate({"task": "t2i", "prompt": p, "diffusion": {"steps": steps, "seed": 0}})
        px = out.artifacts["image"].pixels.cpu()
        diffs.append(int((px.int() - ours_u8[i].int()).abs().max()))
    return {"prompts": list(prompts), "steps": steps, "max_abs_uint8_diff": diffs}


def evaluate_folder(folder: Path, *, device: torch.device | str, seeds: Sequence[int] = (0, 1),
                    samples_png: Path | None = None, smoke: bool = False,
                    log: Callable[[str], None] = print) -> dict[str, Any]:
    """Detector scores of ``folder``'s images at 20 steps (default request), 8 steps, and true CFG 3."""
    from omniloop_wan_demo.prompts import COLORS, POSITIONS, SHAPES, image_prompt_for

    from .train import sample

    device = torch.device(device)
    t0 = time.perf_counter()
    comps = load_folder(folder, device)
    labels = [(c, s, p) for c in COLORS for s in SHAPES for p in POSITIONS]
    if smoke:
        labels = labels[::37]
    prompts = [image_prompt_for(*lab) for lab in labels]
    report: dict[str, Any] = {"folder_loaded_with": "omniloop_flux.family.FluxFamily.load (float32)",
                              "prompts": len(prompts), "runs": []}
    plan = [("default: 20 steps, no CFG", 20, None, list(seeds)), ("8 steps, no CFG", 8, None, [0]),
            ("20 steps, true CFG 3.0 on ''", 20, 3.0, [0]), ("4 steps, no CFG", 4, None, [0])]
    for name, steps, cfg, run_seeds in plan:
        if smoke:
            steps = min(steps, 2)
        t = time.perf_counter()
        ps = [p for _ in run_seeds for p in prompts]
        ls = [lab for _ in run_seeds for lab in labels]
        ss = [sd for sd in run_seeds for _ in prompts]
        imgs = sample(comps, ps, ss, steps=steps, cfg_scale=cfg)
        acc, rows = score(imgs, ls)
        report["runs"].append({"name": name, "steps": steps, "cfg_scale": cfg, "seeds": run_seeds, "n": len(ps),
                               "accuracy": acc, "seconds": round(time.perf_counter() - t, 1),
                               "failures": [r for r in rows if not all(r["ok"].values())][:40]})
        log(f"eval {name}: n={len(ps)} {acc}")
        if samples_png is not None and name.startswith("default"):
            # one row per colour: shapes x positions (36 per row), seed 0
            grid_png(imgs[:len(prompts)], samples_png, cols=len(SHAPES) * len(POSITIONS) if not smoke else len(prompts))
    try:
        report["runtime_check"] = runtime_check(folder, comps, device, prompts[:: max(1, len(prompts) // 4)][:4],
                                                steps=2 if smoke else 20)
        log(f"runtime check: {report['runtime_check']['max_abs_uint8_diff']}")
    except Exception as exc:
        report["runtime_check"] = {"error": f"{type(exc).__name__}: {exc}"}
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report
