"""Deterministic synthetic clips: a colored shape crossing the frame in a named direction.

A clip is ``FRAMES`` frames of ``SIZE``x``SIZE`` RGB: one shape (circle, square, triangle) in one
named color moving left/right/up/down at 2.0-2.5 px/frame over a plain or lightly textured,
static, low-saturation background. The prompt is ``"a {color} {shape} moving {direction}"``.

Objects *cross* the frame: a shape moving left starts near the right edge (with jitter), so the
16-frame travel (32-40 px) is always inside the frame and motion is large. Perpendicular
position, size, speed, background tone and texture are random.

Everything is a pure function of ``(seed, index)``: :func:`sample_params` draws parameters with
numpy's PCG64 and :func:`render` draws them with torch on any device (batched), so the same
seed gives the same clips on CPU and GPU (up to float rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

FRAMES = 17
SIZE = 64

#: name -> RGB in [0, 1]. Saturated and far apart, so that color is easy to name back.
COLORS: dict[str, tuple[float, float, float]] = {
    "red": (0.92, 0.12, 0.10),
    "green": (0.10, 0.78, 0.20),
    "blue": (0.12, 0.28, 0.95),
    "yellow": (0.95, 0.88, 0.10),
    "cyan": (0.10, 0.85, 0.90),
    "magenta": (0.90, 0.15, 0.85),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
DIRECTIONS: tuple[str, ...] = ("left", "right", "up", "down")
#: unit motion per direction in image coordinates (x right, y down)
DIRECTION_VECTORS: dict[str, tuple[float, float]] = {
    "left": (-1.0, 0.0),
    "right": (1.0, 0.0),
    "up": (0.0, -1.0),
    "down": (0.0, 1.0),
}
COLOR_NAMES: tuple[str, ...] = tuple(COLORS)

RADIUS_RANGE = (8.0, 10.0)
SPEED_RANGE = (2.0, 2.5)  # px / frame


def prompt_for(color: str, shape: str, direction: str) -> str:
    return f"a {color} {shape} moving {direction}"


def parse_prompt(prompt: str) -> tuple[str, str, str]:
    """``"a red circle moving left"`` -> ``("red", "circle", "left")``."""
    words = prompt.lower().replace(",", " ").split()
    color = next((w for w in words if w in COLORS), None)
    shape = next((w for w in words if w in SHAPES), None)
    direction = next((w for w in words if w in DIRECTIONS), None)
    if color is None or shape is None or direction is None:
        raise ValueError(f"not a demo prompt (color shape direction): {prompt!r}")
    return color, shape, direction


def all_prompts() -> list[str]:
    return [prompt_for(c, s, d) for c in COLORS for s in SHAPES for d in DIRECTIONS]


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
    margin = radius + 1.5
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
    # low-saturation background: gray in [0.22, 0.55] with a slight tint
    gray = rng.uniform(0.22, 0.55, n)
    tint = rng.uniform(-0.04, 0.04, (n, 3))
    bg = np.clip(gray[:, None] + tint, 0, 1)
    textured = rng.uniform(0, 1, n) < 0.5
    texture = np.where(textured, rng.uniform(0.02, 0.05, n), 0.0)
    tex_freq = rng.uniform(0.05, 0.3, (n, 2))
    tex_phase = rng.uniform(0, 2 * np.pi, (n, 2))
    noise_seed = rng.integers(0, 2**31 - 1, n)
    return ClipParams(ci, si, di, radius, speed, x0, y0, bg, texture, tex_freq, tex_phase, noise_seed)


def _shape_alpha(shape: torch.Tensor, dx: torch.Tensor, dy: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Anti-aliased coverage in [0, 1]; dx, dy: [B, T, H, W] offsets from the center."""
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
    return (0.5 - d).clamp(0.0, 1.0)


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
    alpha = _shape_alpha(shape, dx, dy, r)  # [B, T, H, W]

    # background [B, 3, H, W]: base + optional low-frequency texture + faint static noise
    bg = col(params.bg)[:, :, None, None].expand(n, 3, size, size)
    fx, fy = col(params.tex_freq[:, 0]), col(params.tex_freq[:, 1])
    px, py = col(params.tex_phase[:, 0]), col(params.tex_phase[:, 1])
    pattern = torch.sin(fx[:, None, None] * xx[None] + px[:, None, None]) * torch.sin(
        fy[:, None, None] * yy[None] + py[:, None, None]
    )
    bg = bg + col(params.texture)[:, None, None, None] * pattern[:, None]
    noise = torch.stack(
        [
            torch.randn(3, size, size, generator=torch.Generator().manual_seed(int(s)))
            for s in params.noise_seed
        ]
    ).to(device)
    bg = bg + noise * (col(params.texture)[:, None, None, None] > 0) * 0.012

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


def to_uint8_frames(video: torch.Tensor) -> np.ndarray:
    """``[3, T, H, W]`` float in [0, 1] -> ``[T, H, W, 3]`` uint8."""
    v = (video.clamp(0, 1) * 255).round().to(torch.uint8)
    return v.permute(1, 2, 3, 0).cpu().numpy()
