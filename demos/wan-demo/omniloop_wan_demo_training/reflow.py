"""Reflow pairs with re-rendered endpoints: ``(noise, clean clip)`` couplings that teach the DiT to
turn the noise it used to split into two objects into one.

Why: wan-demo v2's duplicate objects are decided in the first denoising step — the x0 prediction
at sigma 1 already holds two objects for some initial noises (README, *Ghosts*). Rectified flow's
*reflow* (Liu et al., 2022) re-trains a flow on couplings ``(z, x0(z))`` taken from its own ODE,
which straightens the paths; here the endpoint is not the teacher's clip itself but the clip the
teacher *meant*: the synthetic renderer's clean clip of the prompt, placed where the teacher put
its object. For a noise that came out with one object this is about the teacher's own map (a
reflow pair); for one that came out with a duplicate it is the same clip with one object — the
track the detector follows from the middle frame — so the pair says "this noise -> one object".

:func:`fit_params` reads a generated clip back into the renderer's parameters (start, speed,
radius, background); :func:`make_pairs` runs the teacher (flow Euler with CFG, as
:func:`distill.teacher_ode`), decodes, fits and re-renders in parallel worker processes, and
encodes the rendered clips with the VAE. ``training.v2 --dit-reflow-clips N`` mixes the pairs
into the DiT phase (``--dit-reflow-share`` of each batch, the pair's own noise instead of fresh
noise). Noises come from a generator seeded apart from the evaluation's per-clip seeds.
"""

from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
import torch

from omniloop_wan_demo.evaluate import GHOST_MIN_AREA, _as_float_frames, ghosts, object_masks, regions

from .render import (
    COLOR_NAMES,
    DIRECTION_VECTORS,
    DIRECTIONS,
    FRAMES,
    RADIUS_RANGE,
    SHAPE_EXTENT,
    SHAPES,
    SIZE,
    SPEED_RANGE,
    ClipParams,
    parse_prompt,
    shape_alpha,
)

#: largest centroid jump (px) between consecutive frames that still follows the same object
MAX_JUMP = 9.0


def _area_per_r2() -> dict[str, float]:
    """Rendered area / r**2 of each shape (anti-aliased coverage summed at r = 10)."""
    n = 81
    yy, xx = torch.meshgrid(torch.arange(n, dtype=torch.float32) - n // 2, torch.arange(n, dtype=torch.float32) - n // 2,
                            indexing="ij")
    r = torch.tensor(10.0)
    return {s: float(shape_alpha(torch.tensor(i), xx, yy, r).sum()) / 100.0 for i, s in enumerate(SHAPES)}


AREA_PER_R2 = _area_per_r2()


def track(video: np.ndarray, *, threshold: float = 0.22, min_area: int = GHOST_MIN_AREA
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Follow one object through ``video`` (``[T, H, W, 3]``): the largest region of the middle
    frame, then frame by frame (forwards and backwards) the region whose centroid is nearest the
    previous one, within :data:`MAX_JUMP` px. Returns ``(ts, cx, cy, area)`` of the frames where
    it was found, and how many frames held a ghost (:func:`evaluate.ghosts`)."""
    frames = _as_float_frames(video)
    masks = object_masks(frames, threshold)
    T = frames.shape[0]
    parts = [[r for r in regions(m) if len(r) >= min_area] for m in masks]
    ghost_frames = sum(1 for p in parts if ghosts(p))
    mid = T // 2
    start = next((t for t in sorted(range(T), key=lambda t: abs(t - mid)) if parts[t]), None)
    if start is None:
        return np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0), ghost_frames
    found: dict[int, tuple[float, float, float]] = {}
    r0 = parts[start][0]
    found[start] = (float(r0[:, 1].mean()) + 0.5, float(r0[:, 0].mean()) + 0.5, float(len(r0)))
    for order in (range(start + 1, T), range(start - 1, -1, -1)):
        prev = found[start]
        for t in order:
            best, best_d = None, MAX_JUMP
            for r in parts[t]:
                c = (float(r[:, 1].mean()) + 0.5, float(r[:, 0].mean()) + 0.5)
                d = float(np.hypot(c[0] - prev[0], c[1] - prev[1]))
                if d <= best_d:
                    best, best_d = (c[0], c[1], float(len(r))), d
            if best is None:
                break  # lost it: the frames beyond are not used
            found[t] = best
            prev = best
    ts = np.array(sorted(found), dtype=np.float64)
    rows = np.array([found[int(t)] for t in ts], dtype=np.float64)
    return ts, rows[:, 0], rows[:, 1], rows[:, 2], ghost_frames


def fit_params(video: np.ndarray, prompt: str, *, frames: int = FRAMES, size: int = SIZE,
               min_frames: int = 6) -> dict[str, Any] | None:
    """The renderer's parameters for ``prompt``'s object where ``video`` put it: colour, shape and
    direction from the prompt; start along the motion axis and speed from a line fitted through
    the tracked centroids (:func:`track`), the perpendicular position their median, radius from the
    median area; background the frames' median colour outside the object (plain). Everything is
    clamped to the training distribution's ranges. ``None`` when the object is tracked in fewer
    than ``min_frames`` frames. The dict has one value per :class:`data.ClipParams` field, plus
    ``ghost_frames`` (of the generated clip)."""
    color, shape, direction = parse_prompt(prompt)
    ts, cx, cy, area, ghost_frames = track(video)
    if len(ts) < min_frames:
        return None
    dx, dy = DIRECTION_VECTORS[direction]
    along_c, perp_c = (cx, cy) if dx != 0 else (cy, cx)
    sign = dx if dx != 0 else dy
    slope, intercept = np.polyfit(ts, along_c, 1)
    speed = float(np.clip(slope * sign, *SPEED_RANGE))
    radius = float(np.clip(np.sqrt(np.median(area) / AREA_PER_R2[shape]), *RADIUS_RANGE))
    margin = radius * SHAPE_EXTENT[shape] + 1.5
    travel = speed * (frames - 1)
    # the frame-0 centre along the axis: the fitted line at t = 0, kept inside the frame for all frames
    start = float(intercept) if sign > 0 else size - float(intercept)  # distance from the entry edge
    start = float(np.clip(start, margin, max(margin, size - margin - travel)))
    along0 = start if sign > 0 else size - start
    perp = float(np.clip(np.median(perp_c), margin, size - margin))
    x0, y0 = (along0, perp) if dx != 0 else (perp, along0)
    fr = _as_float_frames(video)
    masks = object_masks(fr)
    bg = np.median(fr[~masks], axis=0) if (~masks).any() else np.median(fr.reshape(-1, 3), axis=0)
    return {"color": COLOR_NAMES.index(color), "shape": SHAPES.index(shape), "direction": DIRECTIONS.index(direction),
            "radius": radius, "speed": speed, "x0": x0, "y0": y0, "bg": [float(v) for v in bg],
            "ghost_frames": int(ghost_frames)}


def params_batch(rows: list[dict[str, Any]]) -> ClipParams:
    """:class:`data.ClipParams` for fitted rows (plain backgrounds: no texture, no pixel noise)."""
    n = len(rows)

    def col(k: str, dtype=np.float64) -> np.ndarray:
        return np.array([r[k] for r in rows], dtype=dtype)

    return ClipParams(col("color", np.int64), col("shape", np.int64), col("direction", np.int64), col("radius"),
                      col("speed"), col("x0"), col("y0"), np.array([r["bg"] for r in rows], dtype=np.float64).reshape(n, 3),
                      np.zeros(n), np.full((n, 2), 0.1), np.zeros((n, 2)), np.zeros(n, dtype=np.int64))


def _fit_many(args: tuple[list[np.ndarray], list[str]]) -> list[dict[str, Any] | None]:
    videos, prompts = args
    return [fit_params(v, p) for v, p in zip(videos, prompts, strict=True)]


def fit_all(videos: list[np.ndarray], prompts: list[str], *, pool: ProcessPoolExecutor | None = None,
            parts: int = 1) -> list[dict[str, Any] | None]:
    """:func:`fit_params` over many clips, split into ``parts`` jobs on ``pool`` (none: here)."""
    if pool is None or len(videos) < 64:
        return _fit_many((videos, prompts))
    k = -(-len(videos) // parts)
    chunks = [(videos[i : i + k], prompts[i : i + k]) for i in range(0, len(videos), k)]
    return [r for part in pool.map(_fit_many, chunks) for r in part]


@torch.no_grad()
def make_pairs(teacher, text_encoder, tokenizer, vae, *, n: int, guidance: float, steps: int, device: str, seed: int,
               budget_s: float, stats: tuple[list[float], list[float]], workers: int = 8,
               chunk: int = 1024) -> dict[str, Any]:
    """``n`` reflow pairs (fewer when ``budget_s`` runs out; at least one chunk): ``noise`` and
    ``x0`` (normalised latents of the re-rendered clips, fp16) ``[N, 16, 5, 16, 16]``, ``cov``
    (object cells, :func:`train_dit.latent_coverage`), ``pid`` (index into
    :data:`train_dit.PROMPTS`), ``ghost`` (the teacher's clip held a ghost: the pairs that correct
    it), and ``info`` (counts: generated, fitted, with a ghost, seconds).
    No clip fitted (an untrained teacher): empty tensors. Clips are fitted in ``workers`` spawned
    processes (1: in this one)."""
    import multiprocessing

    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) if workers > 1 else None
    try:
        return _make_pairs(teacher, text_encoder, tokenizer, vae, n=n, guidance=guidance, steps=steps, device=device,
                           seed=seed, budget_s=budget_s, stats=stats, pool=pool, parts=4 * workers, chunk=chunk)
    finally:
        if pool is not None:
            pool.shutdown()


def _make_pairs(teacher, text_encoder, tokenizer, vae, *, n: int, guidance: float, steps: int, device: str, seed: int,
                budget_s: float, stats: tuple[list[float], list[float]], pool: ProcessPoolExecutor | None, parts: int,
                chunk: int) -> dict[str, Any]:
    from .distill import _embed, teacher_ode
    from .render import render, to_uint8_frames
    from .train_dit import PROMPTS, latent_coverage

    t0 = time.perf_counter()
    gen = torch.Generator(device).manual_seed(seed)
    emb_all = _embed(text_encoder, tokenizer, PROMPTS, device)
    emb_u = _embed(text_encoder, tokenizer, [""], device)
    mean = torch.tensor(stats[0], device=device).view(1, -1, 1, 1, 1)
    std = torch.tensor(stats[1], device=device).view(1, -1, 1, 1, 1)
    amp = device.startswith("cuda")
    noises, x0s, covs, pids, ghost = [], [], [], [], []
    info: dict[str, Any] = {"generated": 0, "fitted": 0, "ghost_clips": 0, "duplicate_clips": 0,
                            "guidance": guidance, "teacher_steps": steps, "seed": seed}
    t_teacher = t_fit = t_enc = 0.0
    while info["generated"] < n and (time.perf_counter() - t0 < budget_s or info["generated"] == 0):
        b = min(chunk, n - info["generated"])
        ta = time.perf_counter()
        p = torch.randint(0, len(PROMPTS), (b,), device=device, generator=gen)
        z = torch.randn((b, 16, 5, 16, 16), device=device, generator=gen)
        x = teacher_ode(teacher, z, 1.0, emb_all[p], emb_u.expand(b, -1, -1), steps=steps, guidance=guidance)
        videos = []
        for i in range(0, b, 256):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                dec = vae.decode((x[i : i + 256] * std + mean).to(vae.dtype)).sample
            videos.extend(to_uint8_frames((v.float().clamp(-1, 1) + 1) / 2) for v in dec)
        tb = time.perf_counter()
        prompts = [PROMPTS[int(i)] for i in p.tolist()]
        rows = fit_all(videos, prompts, pool=pool, parts=parts)
        tc = time.perf_counter()
        keep = [i for i, r in enumerate(rows) if r is not None]
        info["generated"] += b
        info["fitted"] += len(keep)
        info["ghost_clips"] += sum(1 for r in rows if r is not None and r["ghost_frames"] > 0)
        info["duplicate_clips"] += sum(1 for r in rows if r is not None and r["ghost_frames"] >= 8)
        if keep:
            params = params_batch([rows[i] for i in keep])
            for i in range(0, len(keep), 256):
                sub = ClipParams(*(getattr(params, f)[i : i + 256] for f in params.__dataclass_fields__))
                clip, mask = render(sub, device=device, return_mask=True)
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                    lat = vae.encode(clip * 2 - 1).latent_dist.mode().float()
                x0s.append(((lat - mean) / std).half())
                covs.append(latent_coverage(mask))
            kt = torch.as_tensor(keep, device=device)
            noises.append(z[kt].half())
            pids.append(p[kt])
            ghost.append(torch.tensor([rows[i]["ghost_frames"] > 0 for i in keep], device=device))
        t_teacher, t_fit, t_enc = t_teacher + tb - ta, t_fit + tc - tb, t_enc + time.perf_counter() - tc
    info["seconds"] = {"teacher_and_decode": round(t_teacher, 1), "fit": round(t_fit, 1), "render_and_encode": round(t_enc, 1),
                       "total": round(time.perf_counter() - t0, 1)}
    if not x0s:
        empty = torch.zeros((0, 16, 5, 16, 16), device=device, dtype=torch.float16)
        return {"noise": empty, "x0": empty, "cov": torch.zeros((0, 1, 5, 16, 16), device=device, dtype=torch.bool),
                "pid": torch.zeros(0, device=device, dtype=torch.long),
                "ghost": torch.zeros(0, device=device, dtype=torch.bool), "info": info}
    return {"noise": torch.cat(noises), "x0": torch.cat(x0s), "cov": torch.cat(covs), "pid": torch.cat(pids),
            "ghost": torch.cat(ghost), "info": info}
