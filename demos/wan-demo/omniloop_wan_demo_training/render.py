"""Deterministic synthetic data: a colored shape crossing the frame (clips) or placed at one of 9
positions (images).

A clip is ``FRAMES`` frames of ``SIZE``x``SIZE`` RGB: one shape (circle, square, triangle, star)
in one named color moving left/right/up/down at 2.0-2.5 px/frame over a plain or lightly
textured, static, low-saturation background. The prompt is ``"a {color} {shape} moving {direction}"``.

An image (:func:`render_images`) is one ``size``x``size`` RGB frame with the same background and
anti-aliasing: one shape in one color centred on one of the 9 :data:`POSITIONS` (a 3x3 grid at
0.25/0.5/0.75 of the frame) up to a small jitter. The prompt is
``"a {color} {shape} at the {position}"`` (:func:`image_prompt_for`).

Objects *cross* the frame: a shape moving left starts near the right edge (with jitter), so the
16-frame travel (32-40 px) is always inside the frame and motion is large. Perpendicular
position, size, speed, background tone and texture are random.

Everything is a pure function of ``(seed, index)``: :func:`sample_params` draws parameters with
numpy's PCG64 and :func:`render` draws them with torch on any device (batched), so the same
seed gives the same clips on CPU and GPU (up to float rounding).

The prompt grammar (colours, shapes, directions, positions and the prompt forms) is the runtime
package's, :mod:`omniloop_wan_demo.prompts`; its names are re-exported here. Until the demos moved
to ``demos/`` (issue 34) this module was ``omniloop_wan_demo.data``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from omniloop_wan_demo.prompts import (  # re-exported: the renderer's callers name them from here too
    COLOR_NAMES,
    COLORS,
    DIRECTION_VECTORS,
    DIRECTIONS,
    POSITION_NAMES,
    POSITIONS,
    SHAPES,
    all_image_prompts,
    all_prompts,
    image_prompt_for,
    parse_image_prompt,
    parse_prompt,
    prompt_for,
    vocabulary_words,
)

#: the grammar's names (re-exported) and the renderer's own
__all__ = [
    "COLORS",
    "COLOR_NAMES",
    "DIRECTIONS",
    "DIRECTION_VECTORS",
    "FRAMES",
    "IMAGE_JITTER",
    "IMAGE_RADIUS_RANGE",
    "POSITIONS",
    "POSITION_NAMES",
    "RADIUS_RANGE",
    "SHAPES",
    "SHAPE_EXTENT",
    "SIZE",
    "SPEED_RANGE",
    "STAR_INNER",
    "STAR_OUTER",
    "ClipParams",
    "ImageParams",
    "all_image_prompts",
    "all_prompts",
    "image_prompt_for",
    "make_clips",
    "parse_image_prompt",
    "parse_prompt",
    "prompt_for",
    "render",
    "render_image_params",
    "render_images",
    "sample_image_params",
    "sample_params",
    "shape_alpha",
    "to_uint8_frames",
    "vocabulary_words",
]


FRAMES = 17
SIZE = 64

RADIUS_RANGE = (8.0, 10.0)
SPEED_RANGE = (2.0, 2.5)  # px / frame
#: images: smaller objects, so that the largest one (+ jitter) stays inside its position's zone
IMAGE_RADIUS_RANGE = (7.0, 10.0)
IMAGE_JITTER = 2.5  # px, uniform in [-jitter, jitter] on each axis

#: star geometry: outer (tip) radius and inner (notch) radius as multiples of ``r``
STAR_OUTER = 1.3
STAR_INNER = 0.65
#: how far each shape reaches from its centre, in multiples of ``r`` (square: its corner)
SHAPE_EXTENT: dict[str, float] = {"circle": 1.0, "square": 0.86 * 2**0.5, "triangle": 1.25, "star": STAR_OUTER}


@dataclass
class ClipParams:
    """Parameters of a batch of clips (numpy arrays of length B)."""

    color: np.ndarray  # int index into COLOR_NAMES
    shape: np.ndarray  # int index into SHAPES
    direction: np.ndarray  # int index into DIRECTIONS
    radius: np.ndarray
    speed: np.ndarray
    x0: np.ndarray  # center at frame 0 (pixels, x right)
    y0: np.ndarray  # (pixels, y down)
    bg: np.ndarray  # [B, 3] background base color
    texture: np.ndarray  # [B] texture amplitude (0 = plain)
    tex_freq: np.ndarray  # [B, 2] spatial frequencies (radians / px)
    tex_phase: np.ndarray  # [B, 2]
    noise_seed: np.ndarray  # [B] int seeds of the static pixel noise

    def __len__(self) -> int:
        return len(self.color)

    def prompts(self) -> list[str]:
        return [
            prompt_for(COLOR_NAMES[c], SHAPES[s], DIRECTIONS[d])
            for c, s, d in zip(self.color, self.shape, self.direction, strict=True)
        ]

    def labels(self) -> list[dict[str, str]]:
        return [
            {"color": COLOR_NAMES[c], "shape": SHAPES[s], "direction": DIRECTIONS[d]}
            for c, s, d in zip(self.color, self.shape, self.direction, strict=True)
        ]


def sample_params(
    n: int,
    seed: int,
    *,
    color: str | None = None,
    shape: str | None = None,
    direction: str | None = None,
    frames: int = FRAMES,
    size: int = SIZE,
) -> ClipParams:
    """Draw ``n`` clips' parameters from ``seed``; fixing color/shape/direction is optional."""
    rng = np.random.Generator(np.random.PCG64(seed))
    ci = np.full(n, COLOR_NAMES.index(color)) if color else rng.integers(0, len(COLORS), n)
    si = np.full(n, SHAPES.index(shape)) if shape else rng.integers(0, len(SHAPES), n)
    di = np.full(n, DIRECTIONS.index(direction)) if direction else rng.integers(0, len(DIRECTIONS), n)
    radius = rng.uniform(*RADIUS_RANGE, n)
    speed = rng.uniform(*SPEED_RANGE, n)
    travel = speed * (frames - 1)
    # the star reaches past r (its tips): keep its margin so the whole object stays in the frame
    reach = np.where(si == SHAPES.index("star"), STAR_OUTER, 1.0)
    margin = radius * reach + 1.5
    # position along the motion axis: start on the side the object comes from
    lo = margin
    hi = size - margin - travel
    along = lo + rng.uniform(0, 1, n) * np.maximum(hi - lo, 0.0)
    perp = margin + rng.uniform(0, 1, n) * (size - 2 * margin)
    x0 = np.empty(n)
    y0 = np.empty(n)
    for i in range(n):
        dx, dy = DIRECTION_VECTORS[DIRECTIONS[di[i]]]
        if dx != 0:
            x0[i] = along[i] if dx > 0 else size - along[i]
            y0[i] = perp[i]
        else:
            y0[i] = along[i] if dy > 0 else size - along[i]
            x0[i] = perp[i]
    bg, texture, tex_freq, tex_phase, noise_seed = _sample_backgrounds(rng, n)
    return ClipParams(ci, si, di, radius, speed, x0, y0, bg, texture, tex_freq, tex_phase, noise_seed)


def shape_alpha(shape: torch.Tensor, dx: torch.Tensor, dy: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Anti-aliased coverage in [0, 1] of shape index ``shape`` (into :data:`SHAPES`) of size
    ``r``; ``dx``, ``dy``: pixel-centre offsets from the object's centre (x right, y down). All
    arguments broadcast (clips: ``[B, T, H, W]``, images: ``[B, H, W]``)."""
    d_circle = torch.sqrt(dx * dx + dy * dy) - r
    s = r * 0.86  # half side: similar area to the circle
    d_square = torch.maximum(dx.abs(), dy.abs()) - s
    # equilateral triangle pointing up, circumradius R = 1.25 r, centroid at the center
    R = r * 1.25
    k = 3**0.5 / 2
    # signed distances to the three edges (inradius R/2)
    e1 = dy - R / 2  # bottom edge (y down)
    e2 = -k * dx - 0.5 * dy - R / 2
    e3 = k * dx - 0.5 * dy - R / 2
    d_tri = torch.maximum(e1, torch.maximum(e2, e3))
    d = torch.where(shape == 0, d_circle, torch.where(shape == 1, d_square, d_tri))
    d = torch.where(shape == 3, _star_distance(dx, dy, r), d)
    return (0.5 - d).clamp(0.0, 1.0)


def _star_distance(dx: torch.Tensor, dy: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Signed distance (px, negative inside) to a 5-pointed star pointing up: tips at
    ``STAR_OUTER * r``, notches at ``STAR_INNER * r``. The angle from "up" is folded into one
    half-arm (``[0, pi/5]``), where the boundary is the single edge from the tip to the notch."""
    half = math.pi / 5
    rho = torch.sqrt(dx * dx + dy * dy)
    theta = torch.atan2(dx, -dy)  # 0 = up, clockwise in image coordinates
    theta = torch.remainder(theta, 2 * half)  # one arm: [0, 2pi/5)
    theta = torch.minimum(theta, 2 * half - theta)  # mirror: [0, pi/5]
    px, py = rho * torch.cos(theta), rho * torch.sin(theta)  # tip on +x
    ax, ay = STAR_OUTER * r, torch.zeros_like(r)
    bx, by = STAR_INNER * r * math.cos(half), STAR_INNER * r * math.sin(half)
    ex, ey = bx - ax, by - ay
    t = (((px - ax) * ex + (py - ay) * ey) / (ex * ex + ey * ey)).clamp(0.0, 1.0)
    dist = torch.sqrt((px - ax - t * ex) ** 2 + (py - ay - t * ey) ** 2)
    # inside: on the centre's side of the edge's line (cross product sign)
    outside = (ex * (py - ay) - ey * (px - ax)) < 0
    return torch.where(outside, dist, -dist)


#: the old private name (kept for importers)
_shape_alpha = shape_alpha


def _backgrounds(
    bg: np.ndarray,
    texture: np.ndarray,
    tex_freq: np.ndarray,
    tex_phase: np.ndarray,
    noise_seed: np.ndarray,
    xx: torch.Tensor,
    yy: torch.Tensor,
    device: torch.device,
) -> torch.Tensor:
    """``[B, 3, H, W]``: base color + optional low-frequency texture + faint static noise."""
    n, size = len(bg), xx.shape[0]

    def col(a: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(a, dtype=np.float32), device=device)

    out = col(bg)[:, :, None, None].expand(n, 3, size, size)
    fx, fy = col(tex_freq[:, 0]), col(tex_freq[:, 1])
    px, py = col(tex_phase[:, 0]), col(tex_phase[:, 1])
    pattern = torch.sin(fx[:, None, None] * xx[None] + px[:, None, None]) * torch.sin(
        fy[:, None, None] * yy[None] + py[:, None, None]
    )
    out = out + col(texture)[:, None, None, None] * pattern[:, None]
    noise = torch.stack(
        [torch.randn(3, size, size, generator=torch.Generator().manual_seed(int(s))) for s in noise_seed]
    ).to(device)
    return out + noise * (col(texture)[:, None, None, None] > 0) * 0.012


def _sample_backgrounds(rng: np.random.Generator, n: int) -> tuple[np.ndarray, ...]:
    """``(bg [n,3], texture [n], tex_freq [n,2], tex_phase [n,2], noise_seed [n])``."""
    # low-saturation background: gray in [0.22, 0.55] with a slight tint
    gray = rng.uniform(0.22, 0.55, n)
    tint = rng.uniform(-0.04, 0.04, (n, 3))
    bg = np.clip(gray[:, None] + tint, 0, 1)
    textured = rng.uniform(0, 1, n) < 0.5
    texture = np.where(textured, rng.uniform(0.02, 0.05, n), 0.0)
    tex_freq = rng.uniform(0.05, 0.3, (n, 2))
    tex_phase = rng.uniform(0, 2 * np.pi, (n, 2))
    noise_seed = rng.integers(0, 2**31 - 1, n)
    return bg, texture, tex_freq, tex_phase, noise_seed


def render(
    params: ClipParams,
    *,
    device: torch.device | str = "cpu",
    frames: int = FRAMES,
    size: int = SIZE,
    return_mask: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Clips as float ``[B, 3, T, H, W]`` in ``[0, 1]`` (and object coverage ``[B, 1, T, H, W]``)."""
    device = torch.device(device)
    n = len(params)
    f32 = dict(device=device, dtype=torch.float32)

    def col(a: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(a, dtype=np.float32), device=device)

    t = torch.arange(frames, **f32)
    yy, xx = torch.meshgrid(torch.arange(size, **f32) + 0.5, torch.arange(size, **f32) + 0.5, indexing="ij")
    vec = np.array([DIRECTION_VECTORS[DIRECTIONS[d]] for d in params.direction], dtype=np.float32).reshape(n, 2)
    vx = col(vec[:, 0] * params.speed)
    vy = col(vec[:, 1] * params.speed)
    cx = col(params.x0)[:, None] + vx[:, None] * t[None]  # [B, T]
    cy = col(params.y0)[:, None] + vy[:, None] * t[None]
    dx = xx[None, None] - cx[:, :, None, None]  # [B, T, H, W]
    dy = yy[None, None] - cy[:, :, None, None]
    r = col(params.radius)[:, None, None, None]
    shape = torch.as_tensor(np.asarray(params.shape), device=device)[:, None, None, None]
    alpha = shape_alpha(shape, dx, dy, r)  # [B, T, H, W]
    bg = _backgrounds(params.bg, params.texture, params.tex_freq, params.tex_phase, params.noise_seed, xx, yy, device)

    color = torch.as_tensor(
        np.array([COLORS[COLOR_NAMES[c]] for c in params.color], dtype=np.float32).reshape(n, 3), device=device
    )
    a = alpha[:, None]  # [B, 1, T, H, W]
    video = bg[:, :, None] * (1 - a) + color[:, :, None, None, None] * a
    video = video.clamp(0.0, 1.0)
    if return_mask:
        return video, a
    return video


def make_clips(
    n: int, seed: int, *, device: torch.device | str = "cpu", **fixed: str
) -> tuple[torch.Tensor, list[str], list[dict[str, str]]]:
    """Convenience: ``(video [B,3,T,H,W] in [0,1], prompts, labels)``."""
    p = sample_params(n, seed, **fixed)
    return render(p, device=device), p.prompts(), p.labels()


# ------------------------------------------------------------------------------------------
# Images: one shape at one of 9 positions
# ------------------------------------------------------------------------------------------


@dataclass
class ImageParams:
    """Parameters of a batch of images (numpy arrays of length B)."""

    color: np.ndarray  # int index into COLOR_NAMES
    shape: np.ndarray  # int index into SHAPES
    position: np.ndarray  # int index into POSITION_NAMES
    radius: np.ndarray
    x: np.ndarray  # object centre (pixels, x right)
    y: np.ndarray  # (pixels, y down)
    bg: np.ndarray  # [B, 3]
    texture: np.ndarray  # [B]
    tex_freq: np.ndarray  # [B, 2]
    tex_phase: np.ndarray  # [B, 2]
    noise_seed: np.ndarray  # [B]
    size: int = SIZE

    def __len__(self) -> int:
        return len(self.color)

    def labels(self) -> list[tuple[str, str, str]]:
        """``(color, shape, position)`` per image."""
        return [
            (COLOR_NAMES[c], SHAPES[s], POSITION_NAMES[q])
            for c, s, q in zip(self.color, self.shape, self.position, strict=True)
        ]

    def prompts(self) -> list[str]:
        return [image_prompt_for(*lab) for lab in self.labels()]


def _check_range(name: str, lo: float, hi: float) -> None:
    if not (math.isfinite(lo) and math.isfinite(hi) and 0 < lo <= hi):
        raise ValueError(f"{name} must be finite with 0 < low <= high, got ({lo}, {hi})")


def sample_image_params(
    n: int,
    seed: int,
    *,
    color: str | None = None,
    shape: str | None = None,
    position: str | None = None,
    size: int = SIZE,
    radius_range: tuple[float, float] = IMAGE_RADIUS_RANGE,
    jitter: float = IMAGE_JITTER,
) -> ImageParams:
    """Draw ``n`` images' parameters from ``seed``; fixing color/shape/position is optional.

    The centre is the position's grid point plus a uniform jitter in ``[-jitter, jitter]`` px per
    axis. Refused (ValueError): a jitter that could move an object past the midpoint to the next
    grid point, or an object (its largest shape's reach + jitter) that could leave the frame."""
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 16:
        raise ValueError(f"size must be an int >= 16, got {size!r}")
    lo_r, hi_r = (float(v) for v in radius_range)
    _check_range("radius_range", lo_r, hi_r)
    jitter = float(jitter)
    if not (math.isfinite(jitter) and jitter >= 0):
        raise ValueError(f"jitter must be finite and >= 0, got {jitter}")
    spacing = 0.25 * size
    if jitter >= spacing / 2:
        raise ValueError(f"jitter {jitter} px would blur positions {spacing:g} px apart (must be < {spacing / 2:g})")
    reach = hi_r * max(SHAPE_EXTENT.values()) + jitter
    if reach > spacing:
        raise ValueError(
            f"radius_range {radius_range} with jitter {jitter} reaches {reach:.1f} px from the centre: "
            f"past the frame edge ({spacing:g} px from the outer positions)"
        )
    for name, value, names in (("color", color, COLOR_NAMES), ("shape", shape, SHAPES), ("position", position, POSITION_NAMES)):
        if value is not None and value not in names:
            raise ValueError(f"unknown {name} {value!r} (one of {', '.join(names)})")
    rng = np.random.Generator(np.random.PCG64(seed))
    ci = np.full(n, COLOR_NAMES.index(color)) if color else rng.integers(0, len(COLORS), n)
    si = np.full(n, SHAPES.index(shape)) if shape else rng.integers(0, len(SHAPES), n)
    qi = np.full(n, POSITION_NAMES.index(position)) if position else rng.integers(0, len(POSITIONS), n)
    radius = rng.uniform(lo_r, hi_r, n)
    grid = np.array([POSITIONS[POSITION_NAMES[q]] for q in qi], dtype=np.float64).reshape(n, 2) * size
    offset = rng.uniform(-jitter, jitter, (n, 2))
    bg, texture, tex_freq, tex_phase, noise_seed = _sample_backgrounds(rng, n)
    return ImageParams(ci, si, qi, radius, grid[:, 0] + offset[:, 0], grid[:, 1] + offset[:, 1],
                       bg, texture, tex_freq, tex_phase, noise_seed, int(size))


def render_image_params(
    params: ImageParams, *, device: torch.device | str = "cpu", return_mask: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Images as float ``[B, 3, H, W]`` in ``[0, 1]`` (and object coverage ``[B, 1, H, W]``)."""
    device = torch.device(device)
    n, size = len(params), params.size
    f32 = dict(device=device, dtype=torch.float32)

    def col(a: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(a, dtype=np.float32), device=device)

    yy, xx = torch.meshgrid(torch.arange(size, **f32) + 0.5, torch.arange(size, **f32) + 0.5, indexing="ij")
    dx = xx[None] - col(params.x)[:, None, None]  # [B, H, W]
    dy = yy[None] - col(params.y)[:, None, None]
    r = col(params.radius)[:, None, None]
    shape = torch.as_tensor(np.asarray(params.shape), device=device)[:, None, None]
    a = shape_alpha(shape, dx, dy, r)[:, None]  # [B, 1, H, W]
    bg = _backgrounds(params.bg, params.texture, params.tex_freq, params.tex_phase, params.noise_seed, xx, yy, device)
    color = torch.as_tensor(
        np.array([COLORS[COLOR_NAMES[c]] for c in params.color], dtype=np.float32).reshape(n, 3), device=device
    )
    images = (bg * (1 - a) + color[:, :, None, None] * a).clamp(0.0, 1.0)
    if return_mask:
        return images, a
    return images


def render_images(
    n: int,
    *,
    seed: int | None = None,
    generator: np.random.Generator | torch.Generator | None = None,
    device: torch.device | str = "cpu",
    size: int = SIZE,
    radius_range: tuple[float, float] = IMAGE_RADIUS_RANGE,
    jitter: float = IMAGE_JITTER,
    color: str | None = None,
    shape: str | None = None,
    position: str | None = None,
) -> tuple[torch.Tensor, list[tuple[str, str, str]]]:
    """``(images [n, 3, size, size] float in [0, 1] on device, labels [(color, shape, position)])``.

    Deterministic: give ``seed`` (an int), or ``generator`` (a numpy ``Generator`` or a torch
    ``Generator``; one int is drawn from it, so successive calls give fresh batches and the same
    generator state gives the same batch). Parameters are drawn on the CPU (numpy), pixels are
    drawn with torch on ``device``, so a seed gives the same images on CPU and GPU up to float
    rounding. The prompt of a label is :func:`image_prompt_for` ``(*label)``."""
    if (seed is None) == (generator is None):
        raise ValueError("render_images needs exactly one of seed= or generator=")
    if generator is not None:
        if isinstance(generator, torch.Generator):
            seed = int(torch.randint(0, 2**62, (1,), generator=generator).item())
        elif isinstance(generator, np.random.Generator):
            seed = int(generator.integers(0, 2**62))
        else:
            raise ValueError(f"generator must be a numpy or torch Generator, got {type(generator).__name__}")
    elif not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    p = sample_image_params(n, int(seed), color=color, shape=shape, position=position, size=size,
                            radius_range=radius_range, jitter=jitter)
    images = render_image_params(p, device=device)
    assert isinstance(images, torch.Tensor)
    return images, p.labels()


def to_uint8_frames(video: torch.Tensor) -> np.ndarray:
    """``[3, T, H, W]`` float in [0, 1] -> ``[T, H, W, 3]`` uint8."""
    v = (video.clamp(0, 1) * 255).round().to(torch.uint8)
    return v.permute(1, 2, 3, 0).cpu().numpy()
