"""Prompt adherence by simple image analysis: which color, which shape, which way does it move
(clips) or where is it (images).

Detector (:func:`detect` for clips, :func:`detect_image` for images): per frame, the background
is the frame's median color (the object covers < 10 % of the frame); object pixels are those
farther than ``threshold`` from it. The object's color is the mean color of object pixels (over
all frames), named by the nearest entry of :data:`omniloop_wan_demo.prompts.COLORS`; a clip's
direction is the sign of the dominant axis of a least-squares line through the per-frame
centroids (``none`` when it moves less than ``min_travel`` px over the clip); an image's position
is the nearest of the 9 :data:`omniloop_wan_demo.prompts.POSITIONS` to the object's centroid.

Shape (:func:`classify_shape`, numpy only) is read from the largest 4-connected object region of
a frame by three numbers (:func:`shape_features`): ``fill`` = area / bounding-box area,
``convexity`` = area / convex-hull area and ``hull_fill`` = convex-hull area / bounding-box area
(ideal values: square 1 / 1 / 1, circle 0.79 / 1 / 0.79, triangle 0.5 / 1 / 0.5, 5-pointed star
0.43 / 0.62 / 0.69). A star is the one shape that is far from convex yet fills its box like a
pentagon; the others are told apart by ``fill + hull_fill`` (triangle ~1.0, circle ~1.6, square
~2.0). A clip's shape is the majority over its frames. Measured on rendered ground truth
(tests/wan_demo/test_evaluate.py; ``omniloop_wan_demo_training.detector_check`` in demos/wan-demo
scores the detector on the training renderer's clips and images): every shape exact on clean
data, >= 98 % per image with a 3x3 blur plus noise.

Ghosts (:func:`ghost_regions`): a frame holds a ghost when, besides the object (its largest
region), an object region of at least 8 pixels lies apart from it (no pixel within 2 px of the
object's bounding box) — a duplicate object, a trail, a fading blob. A clip is *clean* when no
frame holds one; ``accuracy["clean"]`` is the share of clean clips (video only; not a prompt
attribute). Rendered ground truth is 100 % clean, also blurred and noised.

Evaluator (:func:`evaluate`): a fixed list of prompts x seeds goes through a pluggable
``generate(prompts, seeds, *, steps, guidance_scale)`` returning uint8 ``[T, H, W, 3]`` clips
(``kind="video"``: color, direction, shape) or uint8 ``[H, W, 3]`` images (``kind="image"``:
color, shape, position); the result holds accuracy per attribute and a per-sample table. Which
kind a checkpoint is evaluated as is its ``omniloop.json``'s ``"adherence": {"kind": "image"}``
(:func:`adherence_kind`; absent: ``"video"``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .prompts import (
    COLORS,
    DIRECTIONS,
    POSITIONS,
    SHAPES,
    image_prompt_for,
    parse_image_prompt,
    parse_prompt,
    prompt_for,
)

Generate = Callable[..., list[np.ndarray]]

_PALETTE = np.array(list(COLORS.values()), dtype=np.float32)
_PALETTE_NAMES = list(COLORS)


@dataclass
class Detection:
    color: str | None
    direction: str
    shape: str | None
    mean_rgb: tuple[float, float, float] | None
    velocity: tuple[float, float]  # px / frame (x right, y down)
    travel: float  # px over the clip along the dominant axis
    area: float  # mean object pixels per frame
    frames_found: int
    #: frames voting for each shape (the shape is the majority)
    shape_votes: dict[str, int] = field(default_factory=dict)
    #: frames holding a ghost (:func:`ghost_regions`): a clip is clean when this is 0
    ghost_frames: int = 0
    #: the largest ghost over the clip as a share of its frame's object area (0 when clean): about
    #: 1 for a duplicate object, small for a speck or a thin trail
    ghost_size: float = 0.0


@dataclass
class ImageDetection:
    color: str | None
    shape: str | None
    position: str | None
    mean_rgb: tuple[float, float, float] | None
    centroid: tuple[float, float] | None  # as a fraction of the frame (x right, y down)
    area: float  # object pixels
    features: dict[str, float] = field(default_factory=dict)


def _as_float_frames(video: np.ndarray) -> np.ndarray:
    v = np.asarray(video)
    if v.ndim != 4:
        raise ValueError(f"expected [T, H, W, 3] frames, got shape {v.shape}")
    if v.shape[-1] != 3 and v.shape[0] == 3:  # [3, T, H, W]
        v = np.moveaxis(v, 0, -1)
    if v.dtype == np.uint8:
        return v.astype(np.float32) / 255.0
    return v.astype(np.float32)


def object_masks(frames: np.ndarray, threshold: float = 0.22) -> np.ndarray:
    """Boolean ``[T, H, W]`` object masks: pixels far from the frame's median color."""
    bg = np.median(frames.reshape(frames.shape[0], -1, 3), axis=1)  # [T, 3]
    dist = np.linalg.norm(frames - bg[:, None, None, :], axis=-1)
    return dist > threshold


def name_color(rgb: Sequence[float]) -> str:
    d = np.linalg.norm(_PALETTE - np.asarray(rgb, dtype=np.float32)[None], axis=1)
    return _PALETTE_NAMES[int(np.argmin(d))]


# ------------------------------------------------------------------------------------------
# Shape
# ------------------------------------------------------------------------------------------

#: a star: convexity below this and hull_fill above STAR_HULL_FILL (a triangle's hull fills ~0.5
#: of its box, a star's pentagon ~0.69; blur raises a star's convexity to ~0.83 at worst)
STAR_CONVEXITY = 0.845
STAR_HULL_FILL = 0.665
#: fill + hull_fill: below TRIANGLE_BELOW a triangle, from SQUARE_FROM a square, else a circle
TRIANGLE_BELOW = 1.44
SQUARE_FROM = 1.76


def regions(mask: np.ndarray) -> list[np.ndarray]:
    """The 4-connected regions of a boolean ``[H, W]`` mask, largest first, each as an ``[N, 2]``
    array of ``(y, x)`` pixels (a tie keeps scan order)."""
    m = np.asarray(mask, dtype=bool)
    h, w = m.shape
    seen = np.zeros_like(m)
    found: list[np.ndarray] = []
    for y0, x0 in zip(*np.nonzero(m), strict=True):
        if seen[y0, x0]:
            continue
        seen[y0, x0] = True
        stack, comp = [(int(y0), int(x0))], []
        while stack:
            y, x = stack.pop()
            comp.append((y, x))
            for yy, xx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= yy < h and 0 <= xx < w and m[yy, xx] and not seen[yy, xx]:
                    seen[yy, xx] = True
                    stack.append((yy, xx))
        found.append(np.asarray(comp))
    return sorted(found, key=len, reverse=True)


def _region_mask(shape: tuple[int, ...], region: np.ndarray | None) -> np.ndarray:
    out = np.zeros(shape, dtype=bool)
    if region is not None and len(region):
        out[region[:, 0], region[:, 1]] = True
    return out


def largest_component(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected region of a boolean ``[H, W]`` mask (stray pixels and ghosts go)."""
    found = regions(mask)
    return _region_mask(np.shape(mask), found[0] if found else None)


#: a ghost: a second object region of at least GHOST_MIN_AREA pixels with no pixel within
#: GHOST_GAP pixels of the object's bounding box (so fragments of the object itself do not count)
GHOST_MIN_AREA = 8
GHOST_GAP = 2


def ghosts(found: Sequence[np.ndarray], *, min_area: int = GHOST_MIN_AREA, gap: int = GHOST_GAP) -> list[np.ndarray]:
    """The ghosts among ``found`` (:func:`regions`, largest first = the object): regions of
    ``min_area`` pixels or more lying apart from the object (no pixel within ``gap`` pixels of its
    bounding box) — a duplicate object, a trail left behind, a blob that fades."""
    if len(found) < 2:
        return []
    (y0, x0), (y1, x1) = found[0].min(0) - gap, found[0].max(0) + gap
    return [r for r in found[1:] if len(r) >= min_area and not (
        (r[:, 0] >= y0) & (r[:, 0] <= y1) & (r[:, 1] >= x0) & (r[:, 1] <= x1)).any()]


def ghost_regions(found: Sequence[np.ndarray], *, min_area: int = GHOST_MIN_AREA, gap: int = GHOST_GAP) -> int:
    """How many of ``found`` are ghosts (:func:`ghosts`)."""
    return len(ghosts(found, min_area=min_area, gap=gap))


def _hull_area(points: list[tuple[int, int]]) -> float:
    """Area of the convex hull of integer points (Andrew's monotone chain + the shoelace formula)."""
    pts = sorted(set(points))
    if len(pts) < 3:
        return 0.0

    def cross(o: tuple[int, int], a: tuple[int, int], b: tuple[int, int]) -> int:
        return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])

    hull: list[tuple[int, int]] = []
    for seq in (pts, pts[::-1]):  # lower chain, then upper chain
        chain: list[tuple[int, int]] = []
        for q in seq:
            while len(chain) >= 2 and cross(chain[-2], chain[-1], q) <= 0:
                chain.pop()
            chain.append(q)
        hull.extend(chain[:-1])
    xs = np.array([q[0] for q in hull], dtype=np.float64)
    ys = np.array([q[1] for q in hull], dtype=np.float64)
    return float(0.5 * abs(np.dot(xs, np.roll(ys, -1)) - np.dot(ys, np.roll(xs, -1))))


def shape_features(mask: np.ndarray) -> dict[str, float] | None:
    """``{area, fill, convexity, hull_fill}`` of a boolean ``[H, W]`` object mask (pixels as unit
    squares: the hull is that of the pixels' corners); ``None`` for fewer than 3 pixels."""
    ys, xs = np.nonzero(mask)
    area = len(ys)
    if area < 3:
        return None
    box = float((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
    corners: list[tuple[int, int]] = []
    for y in np.unique(ys):  # per row only the outermost pixels can be on the hull
        row = xs[ys == y]
        for x in (int(row.min()), int(row.max()) + 1):
            corners += [(x, int(y)), (x, int(y) + 1)]
    hull = _hull_area(corners)
    return {"area": float(area), "fill": area / box, "convexity": area / hull, "hull_fill": hull / box}


def classify_shape(features: dict[str, float] | None) -> str | None:
    """circle / square / triangle / star from :func:`shape_features` (``None`` for no object)."""
    if features is None:
        return None
    if features["convexity"] < STAR_CONVEXITY and features["hull_fill"] > STAR_HULL_FILL:
        return "star"
    both = features["fill"] + features["hull_fill"]
    if both < TRIANGLE_BELOW:
        return "triangle"
    return "square" if both >= SQUARE_FROM else "circle"


def frame_shape(mask: np.ndarray, found: Sequence[np.ndarray] | None = None) -> tuple[str | None, dict[str, float] | None]:
    """Shape of one frame's object mask: its largest region (of ``found``, the mask's
    :func:`regions` when already computed), classified."""
    found = regions(mask) if found is None else found
    feats = shape_features(_region_mask(np.shape(mask), found[0] if found else None))
    return classify_shape(feats), feats


def detect(video: np.ndarray, *, threshold: float = 0.22, min_travel: float = 6.0, min_area: int = 8) -> Detection:
    """Color, direction and shape of the single object in ``video`` (``[T, H, W, 3]``)."""
    frames = _as_float_frames(video)
    masks = object_masks(frames, threshold)
    T = frames.shape[0]
    areas = masks.reshape(T, -1).sum(1)
    found = areas >= min_area
    if not found.any():
        return Detection(None, "none", None, None, (0.0, 0.0), 0.0, float(areas.mean()), 0)
    pix = frames[masks & found[:, None, None]]
    mean_rgb = pix.mean(0)
    color = name_color(mean_rgb)

    ys, xs = np.mgrid[0 : frames.shape[1], 0 : frames.shape[2]]
    ts, cxs, cys = [], [], []
    votes: dict[str, int] = {}
    ghost_frames, ghost_size = 0, 0.0
    for t in np.nonzero(found)[0]:
        m = masks[t]
        ts.append(t)
        cxs.append(xs[m].mean())
        cys.append(ys[m].mean())
        parts = regions(m)
        extra = ghosts(parts)
        if extra:
            ghost_frames += 1
            ghost_size = max(ghost_size, max(len(r) for r in extra) / len(parts[0]))
        shape_t, _ = frame_shape(m, parts)
        if shape_t is not None:
            votes[shape_t] = votes.get(shape_t, 0) + 1
    ts_a = np.asarray(ts, dtype=np.float64)
    if len(ts) >= 2 and np.ptp(ts_a) > 0:
        vx = float(np.polyfit(ts_a, cxs, 1)[0])
        vy = float(np.polyfit(ts_a, cys, 1)[0])
    else:
        vx = vy = 0.0
    span = T - 1
    if abs(vx) >= abs(vy):
        travel = abs(vx) * span
        direction = ("right" if vx > 0 else "left") if travel >= min_travel else "none"
    else:
        travel = abs(vy) * span
        direction = ("down" if vy > 0 else "up") if travel >= min_travel else "none"
    # majority over frames; a tie goes to the shape listed first in SHAPES
    shape = max(SHAPES, key=lambda k: votes.get(k, 0)) if votes else None
    return Detection(
        color=color,
        direction=direction,
        shape=shape,
        mean_rgb=tuple(float(c) for c in mean_rgb),
        velocity=(vx, vy),
        travel=float(travel),
        area=float(areas.mean()),
        frames_found=int(found.sum()),
        shape_votes=votes,
        ghost_frames=int(ghost_frames),
        ghost_size=float(ghost_size),
    )


def name_position(fx: float, fy: float) -> str:
    """The nearest of the 9 :data:`POSITIONS` to a centre given as fractions of the frame."""
    names = list(POSITIONS)
    d = [(fx - px) ** 2 + (fy - py) ** 2 for px, py in POSITIONS.values()]
    return names[int(np.argmin(d))]


def _as_float_image(image: np.ndarray) -> np.ndarray:
    v = np.asarray(image)
    if v.ndim != 3:
        raise ValueError(f"expected an [H, W, 3] image, got shape {v.shape}")
    if v.shape[-1] != 3 and v.shape[0] == 3:  # [3, H, W]
        v = np.moveaxis(v, 0, -1)
    if v.shape[-1] != 3:
        raise ValueError(f"expected an [H, W, 3] image, got shape {v.shape}")
    if v.dtype == np.uint8:
        return v.astype(np.float32) / 255.0
    v = v.astype(np.float32)
    if not np.isfinite(v).all():
        raise ValueError("image has non-finite pixels")
    return v


def detect_image(image: np.ndarray, *, threshold: float = 0.22, min_area: int = 8) -> ImageDetection:
    """Color, shape and position of the single object in ``image`` (``[H, W, 3]`` uint8, or float
    in [0, 1]; ``[3, H, W]`` is accepted too). Color is the mean of all object pixels; shape and
    position come from the largest object region (so a stray speck does not move it)."""
    img = _as_float_image(image)
    mask = object_masks(img[None], threshold)[0]
    if int(mask.sum()) < min_area:
        return ImageDetection(None, None, None, None, None, float(mask.sum()))
    color = name_color(img[mask].mean(0))
    main = largest_component(mask)
    feats = shape_features(main)
    h, w = mask.shape
    ys, xs = np.nonzero(main)
    fx, fy = float((xs + 0.5).mean() / w), float((ys + 0.5).mean() / h)
    return ImageDetection(
        color=color,
        shape=classify_shape(feats),
        position=name_position(fx, fy),
        mean_rgb=tuple(float(c) for c in img[mask].mean(0)),
        centroid=(fx, fy),
        area=float(mask.sum()),
        features={k: round(v, 4) for k, v in (feats or {}).items()},
    )


# ------------------------------------------------------------------------------------------
# The fixed evaluation set
# ------------------------------------------------------------------------------------------


def _rotating_shapes(make: Callable[[str, str, str], str], places: Sequence[str]) -> list[str]:
    """``make(color, shape, place)`` for every color x every place, the shape rotating with both."""
    return [make(c, SHAPES[(i + j) % len(SHAPES)], q) for i, c in enumerate(COLORS) for j, q in enumerate(places)]


def default_prompts() -> list[str]:
    """Every color x every direction (24 prompts); shapes rotate so each appears 8 times."""
    return _rotating_shapes(prompt_for, DIRECTIONS)


def full_prompts() -> list[str]:
    """Every color x shape x direction (96 prompts)."""
    return [prompt_for(c, s, d) for c in COLORS for s in SHAPES for d in DIRECTIONS]


def default_image_prompts() -> list[str]:
    """Every color x every position (54 prompts); shapes rotate (13-14 prompts each)."""
    return _rotating_shapes(image_prompt_for, POSITIONS)


def full_image_prompts() -> list[str]:
    """Every color x shape x position (216 prompts)."""
    return [image_prompt_for(c, s, q) for c in COLORS for s in SHAPES for q in POSITIONS]


KINDS = ("video", "image")


def adherence_kind(meta: dict[str, Any] | None) -> str:
    """What a checkpoint is evaluated as, from its ``omniloop.json`` (``meta``):
    ``{"adherence": {"kind": "image"}}`` -> ``"image"``; no ``adherence`` key -> ``"video"``.
    Anything else there is a ``ValueError`` naming the key."""
    block = (meta or {}).get("adherence")
    if block is None:
        return "video"
    if not isinstance(block, dict):
        raise ValueError(f"omniloop.json adherence: expected an object like {{\"kind\": \"image\"}}, got {type(block).__name__}")
    kind = block.get("kind", "video")
    if kind not in KINDS:
        raise ValueError(f"omniloop.json adherence.kind: expected one of {', '.join(KINDS)}, got {str(kind)[:40]!r}")
    return str(kind)


def prompt_set(kind: str, which: str) -> list[str]:
    """The evaluation prompts of ``kind`` (video/image), ``which`` = default or full."""
    table = {("video", "default"): default_prompts, ("video", "full"): full_prompts,
             ("image", "default"): default_image_prompts, ("image", "full"): full_image_prompts}
    if (kind, which) not in table:
        raise ValueError(f"no prompt set {which!r} for kind {kind!r}")
    return table[(kind, which)]()


DEFAULT_SEEDS: tuple[int, ...] = (0, 1)


@dataclass
class ClipResult:
    prompt: str
    seed: int
    expected: dict[str, str]
    detected: dict[str, Any]
    ok: dict[str, bool]


@dataclass
class AdherenceReport:
    steps: int
    guidance_scale: float
    n: int
    accuracy: dict[str, float]
    clips: list[ClipResult] = field(default_factory=list)
    seconds: float = 0.0
    backend: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    kind: str = "video"

    def to_dict(self, *, with_clips: bool = True) -> dict[str, Any]:
        d = asdict(self)
        if not with_clips:
            d.pop("clips")
        return d


ATTRIBUTES = ("color", "direction", "shape")
IMAGE_ATTRIBUTES = ("color", "shape", "position")


def attributes_of(kind: str) -> tuple[str, ...]:
    return IMAGE_ATTRIBUTES if kind == "image" else ATTRIBUTES


def _judged(det: Any, **expected: str) -> tuple[dict[str, str], dict[str, Any], dict[str, bool]]:
    """``(expected, got, ok)``: the prompt's attributes, the detector's ``det`` reading of each,
    and whether they agree, keyed in ``expected``'s order."""
    got = {k: getattr(det, k) for k in expected}
    return expected, got, {k: got[k] == v for k, v in expected.items()}


def score(videos: Sequence[np.ndarray], prompts: Sequence[str], seeds: Sequence[int]) -> tuple[dict[str, float], list[ClipResult]]:
    clips = []
    for video, prompt, seed in zip(videos, prompts, seeds, strict=True):
        color, shape, direction = parse_prompt(prompt)
        det = detect(video)
        expected, got, ok = _judged(det, color=color, direction=direction, shape=shape)
        detected = dict(got, velocity=[round(v, 3) for v in det.velocity], travel=round(det.travel, 2), area=round(det.area, 1),
                        ghost_frames=det.ghost_frames, ghost_size=round(det.ghost_size, 3))
        clips.append(ClipResult(prompt, int(seed), expected, detected, ok))
    n = max(len(clips), 1)
    acc = {k: sum(c.ok[k] for c in clips) / n for k in ATTRIBUTES}
    acc["all"] = sum(all(c.ok[k] for k in ("color", "direction")) for c in clips) / n
    # not an attribute of the prompt: the share of clips with no ghost in any frame
    acc["clean"] = sum(c.detected["ghost_frames"] == 0 for c in clips) / n
    return acc, clips


def score_images(images: Sequence[np.ndarray], prompts: Sequence[str],
                 seeds: Sequence[int]) -> tuple[dict[str, float], list[ClipResult]]:
    """Per-attribute accuracy of images (``all``: color, shape and position all right)."""
    rows = []
    for image, prompt, seed in zip(images, prompts, seeds, strict=True):
        color, shape, position = parse_image_prompt(prompt)
        det = detect_image(image)
        expected, got, ok = _judged(det, color=color, shape=shape, position=position)
        centroid = [round(v, 3) for v in det.centroid] if det.centroid else None
        shape_feats = {k: v for k, v in det.features.items() if k != "area"}
        detected = dict(got, centroid=centroid, area=round(det.area, 1), **shape_feats)
        rows.append(ClipResult(prompt, int(seed), expected, detected, ok))
    n = max(len(rows), 1)
    acc = {k: sum(r.ok[k] for r in rows) / n for k in IMAGE_ATTRIBUTES}
    acc["all"] = sum(all(r.ok.values()) for r in rows) / n
    return acc, rows


def evaluate(
    generate: Generate,
    *,
    prompts: Sequence[str] | None = None,
    seeds: Sequence[int] = DEFAULT_SEEDS,
    steps: int = 20,
    guidance_scale: float = 5.0,
    backend: str = "",
    kind: str = "video",
    progress: Callable[[int], None] | None = None,
    chunk: int = 1,
) -> AdherenceReport:
    """Generate every (prompt, seed) pair with ``generate`` and score it (``kind``: ``video``
    clips or ``image`` images). With ``progress``, the pairs are generated ``chunk`` at a time
    (use the generator's batch size) and ``progress(n)`` is called after each chunk of ``n``."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    prompts = list(prompts or prompt_set(kind, "default"))
    pairs = [(p, s) for s in seeds for p in prompts]
    t0 = time.perf_counter()
    if progress is None:
        samples = generate([p for p, _ in pairs], [s for _, s in pairs], steps=steps, guidance_scale=guidance_scale)
    else:
        samples = []
        step = max(1, int(chunk))
        for i in range(0, len(pairs), step):
            part = pairs[i : i + step]
            samples.extend(generate([p for p, _ in part], [s for _, s in part], steps=steps, guidance_scale=guidance_scale))
            progress(len(part))
    seconds = time.perf_counter() - t0
    scorer = score_images if kind == "image" else score
    acc, clips = scorer(samples, [p for p, _ in pairs], [s for _, s in pairs])
    return AdherenceReport(steps, guidance_scale, len(clips), acc, clips, seconds, backend, kind=kind)


# ------------------------------------------------------------------------------------------
# Generation backends
# ------------------------------------------------------------------------------------------


class DiffusersGenerator:
    """Stand-in generator: diffusers' own ``WanPipeline`` on a local checkpoint folder (or a
    pipeline object already built)."""

    name = "diffusers"

    def __init__(self, path_or_pipe: Any, *, device: str = "cpu", dtype: str = "float32", batch_size: int = 48,
                 frames: int = 17, height: int = 64, width: int = 64, max_sequence_length: int = 512):
        import torch

        if isinstance(path_or_pipe, (str, bytes)) or hasattr(path_or_pipe, "__fspath__"):
            from diffusers import WanPipeline

            self.pipe = WanPipeline.from_pretrained(str(path_or_pipe), torch_dtype=getattr(torch, dtype))
            self.pipe.to(device)
        else:
            self.pipe = path_or_pipe
        self.pipe.set_progress_bar_config(disable=True)
        self.device = device
        self.batch_size = batch_size
        self.frames, self.height, self.width = frames, height, width
        self.max_sequence_length = max_sequence_length

    def __call__(self, prompts: Sequence[str], seeds: Sequence[int], *, steps: int, guidance_scale: float) -> list[np.ndarray]:
        import torch

        out: list[np.ndarray] = []
        for i in range(0, len(prompts), self.batch_size):
            ps = list(prompts[i : i + self.batch_size])
            gens = [torch.Generator("cpu").manual_seed(int(s)) for s in seeds[i : i + self.batch_size]]
            with torch.no_grad():
                res = self.pipe(
                    prompt=ps,
                    num_frames=self.frames,
                    height=self.height,
                    width=self.width,
                    num_inference_steps=steps,
                    guidance_scale=guidance_scale,
                    generator=gens,
                    output_type="np",
                    max_sequence_length=self.max_sequence_length,
                )
            frames = np.asarray(res.frames)  # [B, T, H, W, 3] float in [0, 1]
            out.extend((np.clip(f, 0, 1) * 255).round().astype(np.uint8) for f in frames)
        return out


def _t2v_request(prompt: str, seed: int, steps: int, guidance_scale: float, frames: int, height: int,
                 width: int) -> dict[str, Any]:
    """The omniloop request of one clip (the runtime generators')."""
    return {
        "task": "t2v",
        "inputs": [{"type": "text", "text": prompt}],
        "diffusion": {"steps": int(steps), "guidance_scale": float(guidance_scale), "seed": int(seed),
                      "frames": frames, "height": height, "width": width},
    }


class RuntimeGenerator:
    """Generation through omniloop's runtime (``Runtime.from_model(model)``), one request per clip."""

    name = "runtime"

    def __init__(self, model: str = "wan-demo", *, device: str = "cpu", dtype: str = "float32",
                 frames: int = 17, height: int = 64, width: int = 64, deploy: dict[str, Any] | None = None):
        from omniloop.runtime import Runtime

        self.runtime = Runtime.from_model(model, device=device, dtype=dtype, **dict(deploy or {}))
        self.frames, self.height, self.width = frames, height, width

    def __call__(self, prompts: Sequence[str], seeds: Sequence[int], *, steps: int, guidance_scale: float) -> list[np.ndarray]:
        out = []
        for p, s in zip(prompts, seeds, strict=True):
            output = self.runtime.generate(_t2v_request(p, s, steps, guidance_scale, self.frames, self.height, self.width))
            if not output.ok:
                raise RuntimeError(f"runtime failed on {p!r}: {output.error}")
            video = output.artifacts["video"]
            frames = getattr(video, "frames", video)
            out.append(np.asarray(frames.cpu() if hasattr(frames, "cpu") else frames, dtype=np.uint8))
        return out


class ImageRuntimeGenerator:
    """Images through omniloop's runtime (``Runtime.from_model(model)``), one ``t2i`` request per
    prompt (an image family, e.g. FLUX.1); returns uint8 ``[H, W, 3]`` per prompt."""

    name = "runtime"
    kind = "image"

    def __init__(self, model: str, *, device: str = "cpu", dtype: str = "float32",
                 height: int | None = 64, width: int | None = 64, deploy: dict[str, Any] | None = None):
        from omniloop.runtime import Runtime

        self.runtime = Runtime.from_model(model, device=device, dtype=dtype, **dict(deploy or {}))
        self.height, self.width = height, width

    def request(self, prompt: str, seed: int, steps: int, guidance_scale: float | None) -> dict[str, Any]:
        diffusion: dict[str, Any] = {"steps": int(steps), "seed": int(seed)}
        if guidance_scale is not None:
            diffusion["guidance_scale"] = float(guidance_scale)
        if self.height is not None and self.width is not None:
            diffusion.update(height=int(self.height), width=int(self.width))
        return {"task": "t2i", "inputs": [{"type": "text", "text": prompt}], "diffusion": diffusion}

    def __call__(self, prompts: Sequence[str], seeds: Sequence[int], *, steps: int,
                 guidance_scale: float | None) -> list[np.ndarray]:
        out = []
        for p, s in zip(prompts, seeds, strict=True):
            output = self.runtime.generate(self.request(p, s, steps, guidance_scale))
            if not output.ok:
                raise RuntimeError(f"runtime failed on {p!r}: {output.error}")
            pixels = output.artifacts["image"].pixels
            out.append(np.asarray(pixels.cpu() if hasattr(pixels, "cpu") else pixels, dtype=np.uint8))
        return out


class FamilyLoopGenerator:
    """Generation through the Wan family's own pipeline and denoise loop (``omniloop_wan``) over
    modules already in memory — what training validation uses: ``WanFamily.from_components`` →
    ``build_pipeline(t2v)`` → ``omniloop.execution.Execution`` stepped to completion, one request
    per clip."""

    name = "family-loop"

    def __init__(self, components: dict[str, Any], *, device: Any = "cpu", dtype: Any = None,
                 frames: int = 17, height: int = 64, width: int = 64):
        import torch

        from omniloop.execution import BuiltPipeline
        from omniloop.request import TaskType
        from omniloop_wan.family import WanFamily

        device = torch.device(device)
        dtype = dtype or torch.float32
        fam = WanFamily()
        self.model = fam.from_components(components, device=device, dtype=dtype)
        spec = fam.build_pipeline(self.model, TaskType.T2V, {})
        self.built = BuiltPipeline(spec=spec, components=components, device=device, dtype=dtype)
        self.frames, self.height, self.width = frames, height, width

    def __call__(self, prompts: Sequence[str], seeds: Sequence[int], *, steps: int, guidance_scale: float) -> list[np.ndarray]:
        import torch

        from omniloop.execution import Execution
        from omniloop.schema import request_from_dict

        out = []
        for p, s in zip(prompts, seeds, strict=True):
            req = request_from_dict({
                "task": "t2v",
                "inputs": [{"type": "text", "text": p}],
                "diffusion": {"steps": int(steps), "guidance_scale": float(guidance_scale), "seed": int(s),
                              "frames": self.frames, "height": self.height, "width": self.width},
            })
            ex = Execution(self.built, req)
            with torch.no_grad():
                while not ex.done:
                    ex.advance()
            res = ex.output
            if not res.ok:
                raise RuntimeError(f"family loop failed on {p!r}: {res.error}")
            out.append(np.asarray(res.artifacts["video"].frames.cpu(), dtype=np.uint8))
        return out


class StreamingRuntimeGenerator:
    """Streamed clips through omniloop's runtime: ``Runtime.stream(request)`` of a deployment with
    ``rollout: causal`` (the ``wan-demo-causal`` preset, or a checkpoint path plus ``options``);
    the clip scored is the concatenation of the PARTIAL ``video_chunk`` artifacts as they were
    emitted (checked against the final ``video``). ``steps`` are the sampler steps *per chunk*;
    ``guidance_scale`` other than 1 runs causal CFG. ``self.timings`` keeps each clip's time to
    first chunk and total seconds."""

    name = "runtime-stream"

    def __init__(self, model: str = "wan-demo-causal", *, device: str = "cpu", dtype: str = "float32",
                 options: dict[str, Any] | None = None, frames: int = 17, height: int = 64, width: int = 64,
                 deploy: dict[str, Any] | None = None):
        from omniloop.runtime import Runtime

        extra = {**dict(deploy or {}), **({"options": dict(options)} if options else {})}
        self.runtime = Runtime.from_model(model, device=device, dtype=dtype, **extra)
        self.frames, self.height, self.width = frames, height, width
        self.timings: list[dict[str, float]] = []

    def __call__(self, prompts: Sequence[str], seeds: Sequence[int], *, steps: int, guidance_scale: float) -> list[np.ndarray]:
        out = []
        for p, s in zip(prompts, seeds, strict=True):
            request = _t2v_request(p, s, steps, guidance_scale, self.frames, self.height, self.width)
            request["outputs"] = {"stream_partial": True}
            chunks: list[np.ndarray] = []
            final = None
            t0 = time.perf_counter()
            first = None
            for ev in self.runtime.stream(request):
                if ev.kind == "partial" and ev.artifact == "video_chunk":
                    chunks.append(np.asarray(ev.value.frames.cpu(), dtype=np.uint8))
                    if first is None:
                        first = time.perf_counter() - t0
                elif ev.kind == "error":
                    raise RuntimeError(f"runtime failed on {p!r}: {ev.message}")
                elif ev.kind == "final":
                    final = ev
            if final is None or not chunks:
                raise RuntimeError(f"runtime stream of {p!r} ended without {'a final event' if final is None else 'chunks'}")
            output = getattr(final, "output", None)
            if output is not None and not output.ok:
                raise RuntimeError(f"runtime failed on {p!r}: {output.error}")
            clip = np.concatenate(chunks, axis=0)
            if output is not None and "video" in output.artifacts:
                whole = np.asarray(output.artifacts["video"].frames.cpu(), dtype=np.uint8)
                if not np.array_equal(whole, clip):
                    raise RuntimeError(f"streamed chunks of {p!r} differ from the final video")
            self.timings.append({"first_chunk_s": round(first or 0.0, 4), "total_s": round(time.perf_counter() - t0, 4)})
            out.append(clip)
        return out


_WORKER: dict[str, Any] = {}


def _stream_worker_init(model: str, device: str, options: dict[str, Any] | None, threads: int,
                        size: dict[str, int]) -> None:
    import torch

    torch.set_num_threads(threads)
    _WORKER["gen"] = StreamingRuntimeGenerator(model, device=device, options=options, **size)


def _stream_worker_run(prompts: list[str], seeds: list[int], steps: int,
                       guidance_scale: float) -> tuple[list[np.ndarray], list[dict[str, float]]]:
    gen = _WORKER["gen"]
    start = len(gen.timings)
    clips = gen(prompts, seeds, steps=steps, guidance_scale=guidance_scale)
    return clips, gen.timings[start:]


class ParallelStreamingGenerator:
    """:class:`StreamingRuntimeGenerator` in ``workers`` processes (each its own runtime with
    ``threads`` torch threads): the pairs are split into slices of ``per_task`` and the clips come
    back in order, so a report equals the one-process one's (each clip is generated by the same
    runtime code; float results may differ with the thread count). ``self.timings`` as there."""

    name = "runtime-stream"

    def __init__(self, model: str = "wan-demo-causal", *, workers: int, threads: int = 1, device: str = "cpu",
                 options: dict[str, Any] | None = None, per_task: int = 4, frames: int = 17, height: int = 64,
                 width: int = 64):
        import concurrent.futures
        import multiprocessing

        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers: must be a positive integer, got {workers!r}")
        self.per_task = max(1, int(per_task))
        self.pool = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=_stream_worker_init,
            initargs=(model, device, dict(options) if options else None, int(threads),
                      {"frames": frames, "height": height, "width": width}))
        self.timings: list[dict[str, float]] = []

    def __call__(self, prompts: Sequence[str], seeds: Sequence[int], *, steps: int, guidance_scale: float) -> list[np.ndarray]:
        pairs = list(zip(prompts, seeds, strict=True))
        k = self.per_task
        futs = [self.pool.submit(_stream_worker_run, [p for p, _ in pairs[i:i + k]], [int(s) for _, s in pairs[i:i + k]],
                                 int(steps), float(guidance_scale)) for i in range(0, len(pairs), k)]
        out: list[np.ndarray] = []
        for f in futs:
            clips, timings = f.result()
            out.extend(clips)
            self.timings.extend(timings)
        return out

    def close(self) -> None:
        self.pool.shutdown()


class CausalRolloutGenerator:
    """Causal chunk rollouts of modules in memory (``omniloop_wan.causal.CausalWan``, no runtime):
    what ``train_causal`` checks on the training machine. ``components`` holds ``transformer``,
    ``vae``, ``text_encoder``, ``tokenizer``; ``options`` are ``rollout_options`` (their ``steps``
    and ``guidance_scale`` are replaced by the evaluator's per call)."""

    name = "causal-rollout"

    def __init__(self, components: dict[str, Any], *, device: Any = "cpu", options: dict[str, Any] | None = None,
                 frames: int = 17, height: int = 64, width: int = 64):
        import torch

        from omniloop_wan.causal import CausalOptions, CausalWan

        self.device = torch.device(device)
        self.components = components
        self.options = dict(options or {})
        known = {a.name for a in CausalOptions.__attrs_attrs__}  # type: ignore[attr-defined]
        self.engine = CausalWan(components["transformer"], components["vae"],
                                options=CausalOptions(**{k: v for k, v in self.options.items() if k in known}),
                                height=height, width=width)
        latent = (frames - 1) // int(components["vae"].config.scale_factor_temporal) + 1
        if latent % self.engine.options.chunk_frames:
            raise ValueError(f"{frames} frames are {latent} latent frames: not whole chunks of {self.engine.options.chunk_frames}")
        self.chunks = latent // self.engine.options.chunk_frames

    def _text(self, prompt: str) -> Any:
        from omniloop_wan.stages import encode_text

        c = self.components
        dtype = next(c["transformer"].parameters()).dtype
        return encode_text(c["tokenizer"], c["text_encoder"], prompt, self.device, dtype)[0]

    def __call__(self, prompts: Sequence[str], seeds: Sequence[int], *, steps: int, guidance_scale: float) -> list[np.ndarray]:
        import torch

        from omniloop_wan.stages import to_uint8_frames

        out = []
        cfg = float(guidance_scale) != 1.0
        with torch.no_grad():
            uncond = self._text("") if cfg else None
            for p, s in zip(prompts, seeds, strict=True):
                stream = self.engine.open_stream(int(s), reserve_chunks=self.chunks, cfg=cfg)
                try:
                    chunks = [to_uint8_frames(o.video.float()).cpu() for o in self.engine.run(
                        stream, self._text(p), self.chunks, steps=int(steps), uncond=uncond, guidance=float(guidance_scale))]
                finally:
                    stream.free()
                out.append(np.asarray(torch.cat(chunks, dim=0), dtype=np.uint8))
        return out


def make_generator(backend: str = "auto", *, model: str = "wan-demo", device: str = "cpu", dtype: str = "float32",
                   batch_size: int = 48, kind: str = "video",
                   deploy: dict[str, Any] | None = None) -> tuple[Generate, str, str | None]:
    """``(generate, backend_name, note)``. ``auto`` uses the runtime when it can load ``model``
    and falls back to diffusers' WanPipeline on the shipped checkpoint (the note says why).
    ``kind="image"``: the runtime's ``t2i`` (:class:`ImageRuntimeGenerator`), no fallback.
    ``deploy``: other DeployConfig fields of the runtime's deployment (``{"linear_precision": "fp8"}``);
    only the runtime takes them (no diffusers fallback then)."""
    if deploy and backend == "diffusers":
        raise ValueError(f"deploy settings {sorted(deploy)} apply to the runtime, not --backend diffusers")
    if kind == "image":
        if backend == "diffusers":
            raise ValueError("--backend diffusers generates video only; image models run through the runtime")
        return ImageRuntimeGenerator(model, device=device, dtype=dtype, deploy=deploy), "runtime", None
    from pathlib import Path

    from .checkpoint_path import checkpoint_dir

    # diffusers' WanPipeline can stand in only for a folder or the shipped wan-demo checkpoint
    fallback = Path(model) if Path(model).is_dir() else (checkpoint_dir() if model == "wan-demo" else None)
    note = None
    if backend in ("auto", "runtime"):
        try:
            return RuntimeGenerator(model, device=device, dtype=dtype, deploy=deploy), "runtime", None
        except Exception as e:  # the runtime or the Wan family may not exist yet
            if backend == "runtime" or fallback is None or deploy:
                raise
            note = f"runtime unavailable ({type(e).__name__}: {e}); used diffusers WanPipeline"
    if fallback is None:
        raise ValueError(f"--backend diffusers needs a checkpoint folder or wan-demo, got {model!r}")
    path = fallback
    return DiffusersGenerator(path, device=device, dtype=dtype, batch_size=batch_size), "diffusers", note


def table_columns(kind: str) -> tuple[str, ...]:
    """The per-sample table's columns (:func:`format_table`)."""
    if kind == "image":
        return ("prompt", "seed", "color", "shape", "position", "centroid")
    return ("prompt", "seed", "color", "direction", "shape", "travel px")


def format_table(report: AdherenceReport, *, limit: int | None = None) -> list[list[str]]:
    rows = []
    if report.kind == "image":
        for c in report.clips[: limit or None]:
            cen = c.detected.get("centroid")
            rows.append([
                c.prompt,
                str(c.seed),
                *(f"{c.detected[k]}{'' if c.ok[k] else ' ✗'}" for k in IMAGE_ATTRIBUTES),
                f"{cen[0]:.2f},{cen[1]:.2f}" if cen else "-",
            ])
        return rows
    for c in report.clips[: limit or None]:
        rows.append([
            c.prompt,
            str(c.seed),
            f"{c.detected['color']}{'' if c.ok['color'] else ' ✗'}",
            f"{c.detected['direction']}{'' if c.ok['direction'] else ' ✗'}",
            f"{c.detected['shape']}{'' if c.ok['shape'] else ' ✗'}",
            f"{c.detected['travel']:.1f}",
        ])
    return rows


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson interval of a proportion (for honest small-n reporting)."""
    if n == 0:
        return (0.0, 1.0)
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))
