"""The synthetic data generator (``omniloop_wan_demo_training.render``, demos/wan-demo): deterministic, labelled, with clearly visible motion (clips) and
unambiguous positions (images)."""

import math

import numpy as np
import pytest
import torch

from omniloop_wan_demo_training.render import (
    COLORS,
    DIRECTIONS,
    FRAMES,
    POSITIONS,
    SHAPES,
    SIZE,
    make_clips,
    parse_prompt,
    prompt_for,
    render,
    render_image_params,
    render_images,
    sample_image_params,
    sample_params,
    shape_alpha,
)

torch.set_num_threads(1)


def test_deterministic():
    a, pa, la = make_clips(6, seed=3)
    b, pb, lb = make_clips(6, seed=3)
    assert torch.equal(a, b) and pa == pb and la == lb
    c, _, _ = make_clips(6, seed=4)
    assert not torch.equal(a, c)


def test_shapes_and_range():
    v, prompts, labels = make_clips(5, seed=0)
    assert v.shape == (5, 3, FRAMES, SIZE, SIZE)
    assert float(v.min()) >= 0.0 and float(v.max()) <= 1.0
    for p, lab in zip(prompts, labels, strict=True):
        assert p == prompt_for(lab["color"], lab["shape"], lab["direction"])
        assert parse_prompt(p) == (lab["color"], lab["shape"], lab["direction"])


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_motion_is_large_and_inside_the_frame(direction):
    p = sample_params(16, seed=11, direction=direction)
    _, cov = render(p, return_mask=True)
    cov = cov[:, 0]  # [B, T, H, W]
    area = cov.sum(dim=(2, 3))
    # the whole object is inside the frame on every frame: constant area
    assert float((area.max(1).values - area.min(1).values).max()) < 0.02 * float(area.min())
    ys, xs = torch.meshgrid(torch.arange(SIZE) + 0.5, torch.arange(SIZE) + 0.5, indexing="ij")
    cx = (cov * xs).sum(dim=(2, 3)) / area
    cy = (cov * ys).sum(dim=(2, 3)) / area
    dx = (cx[:, -1] - cx[:, 0]).numpy()
    dy = (cy[:, -1] - cy[:, 0]).numpy()
    sign = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}[direction]
    along = dx * sign[0] + dy * sign[1]
    across = np.abs(dx * sign[1] + dy * sign[0])
    assert along.min() >= 30.0  # >= 2 px / frame over 16 frames
    assert across.max() < 0.5


def test_fixed_attributes():
    p = sample_params(4, seed=1, color="blue", shape="triangle", direction="up")
    assert set(p.prompts()) == {"a blue triangle moving up"}


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_stars_stay_inside_the_frame(direction):
    """The star reaches 1.3 r: its margin keeps the whole star inside on every frame."""
    p = sample_params(16, seed=5, shape="star", direction=direction)
    _, cov = render(p, return_mask=True)
    area = cov[:, 0].sum(dim=(2, 3))
    assert float((area.max(1).values - area.min(1).values).max()) < 0.02 * float(area.min())


def test_shape_alpha_star_is_a_five_pointed_star():
    """Tips on the outer radius every 72 degrees from up, notches on the inner radius between them;
    area 5 R r sin(36 deg); the old private name still works."""
    from omniloop_wan_demo_training import render as data

    assert data._shape_alpha is shape_alpha
    r = torch.tensor(20.0)
    star = torch.tensor(3)
    outer, inner = data.STAR_OUTER * 20, data.STAR_INNER * 20
    for k in range(5):
        a = math.radians(72 * k)
        tip = (math.sin(a), -math.cos(a))  # up = -y
        inside = shape_alpha(star, torch.tensor(tip[0] * (outer - 1.5)), torch.tensor(tip[1] * (outer - 1.5)), r)
        past = shape_alpha(star, torch.tensor(tip[0] * (outer + 1.0)), torch.tensor(tip[1] * (outer + 1.0)), r)
        b = a + math.radians(36)
        notch = (math.sin(b), -math.cos(b))
        in_notch = shape_alpha(star, torch.tensor(notch[0] * (inner - 1.5)), torch.tensor(notch[1] * (inner - 1.5)), r)
        out_notch = shape_alpha(star, torch.tensor(notch[0] * (inner + 1.5)), torch.tensor(notch[1] * (inner + 1.5)), r)
        assert float(inside) == 1.0 and float(past) == 0.0
        assert float(in_notch) == 1.0 and float(out_notch) == 0.0
    ys, xs = torch.meshgrid(torch.arange(-40, 40) + 0.5, torch.arange(-40, 40) + 0.5, indexing="ij")
    area = float(shape_alpha(star, xs, ys, r).sum())
    expected = 5 * outer * inner * math.sin(math.radians(36))
    assert abs(area - expected) < 0.01 * expected


# ------------------------------------------------------------------------------------------
# images
# ------------------------------------------------------------------------------------------


def test_render_images_deterministic_and_labelled():
    a, la = render_images(12, seed=7)
    b, lb = render_images(12, seed=7)
    assert a.shape == (12, 3, SIZE, SIZE) and a.dtype == torch.float32
    assert torch.equal(a, b) and la == lb
    assert float(a.min()) >= 0.0 and float(a.max()) <= 1.0
    c, _ = render_images(12, seed=8)
    assert not torch.equal(a, c)
    for lab in la:
        assert lab[0] in COLORS and lab[1] in SHAPES and lab[2] in POSITIONS
    # a torch or numpy generator: same state, same batch; the state advances
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    x1, _ = render_images(4, generator=g1)
    x2, _ = render_images(4, generator=g2)
    x3, _ = render_images(4, generator=g1)
    assert torch.equal(x1, x2) and not torch.equal(x1, x3)
    n1, _ = render_images(4, generator=np.random.default_rng(3))
    n2, _ = render_images(4, generator=np.random.default_rng(3))
    assert torch.equal(n1, n2)
    _, labels = render_images(3, seed=0, color="red", shape="star", position="top right")
    assert labels == [("red", "star", "top right")] * 3


def test_render_images_object_in_its_zone():
    """Every object lies wholly inside the frame and its centroid is nearest its position's grid
    point (by a clear margin), for every shape at the largest radius."""
    p = sample_image_params(400, seed=2)
    _, cov = render_image_params(p, return_mask=True)
    cov = cov[:, 0]
    ys, xs = torch.meshgrid(torch.arange(SIZE) + 0.5, torch.arange(SIZE) + 0.5, indexing="ij")
    # nothing touches the border rows/columns
    border = cov[:, 0].sum(-1) + cov[:, -1].sum(-1) + cov[:, :, 0].sum(-1) + cov[:, :, -1].sum(-1)
    assert float(border.max()) == 0.0
    area = cov.sum(dim=(1, 2))
    cx = ((cov * xs).sum(dim=(1, 2)) / area).numpy() / SIZE
    cy = ((cov * ys).sum(dim=(1, 2)) / area).numpy() / SIZE
    centres = np.array(list(POSITIONS.values()))
    d = np.hypot(cx[:, None] - centres[None, :, 0], cy[:, None] - centres[None, :, 1])
    nearest = d.argmin(1)
    assert (nearest == p.position).all()
    own = d[np.arange(len(p)), p.position]
    assert own.max() < 0.07  # jitter 2.5 px plus the triangle/star centroid offset, < 4.5 px of 64


def test_render_images_refuses_bad_arguments():
    with pytest.raises(ValueError, match="exactly one of seed= or generator="):
        render_images(2)
    with pytest.raises(ValueError, match="exactly one of seed= or generator="):
        render_images(2, seed=0, generator=torch.Generator())
    with pytest.raises(ValueError, match="seed must be"):
        render_images(2, seed=-1)
    with pytest.raises(ValueError, match="jitter"):
        render_images(2, seed=0, jitter=9.0)
    with pytest.raises(ValueError, match="jitter"):
        render_images(2, seed=0, jitter=float("nan"))
    with pytest.raises(ValueError, match="past the frame edge"):
        render_images(2, seed=0, radius_range=(8.0, 14.0))
    with pytest.raises(ValueError, match="radius_range"):
        render_images(2, seed=0, radius_range=(float("inf"), 3.0))
    with pytest.raises(ValueError, match="unknown shape"):
        render_images(2, seed=0, shape="hexagon")


def test_render_images_device_agnostic():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    cpu, _ = render_images(4, seed=1)
    gpu, _ = render_images(4, seed=1, device="cuda")
    assert gpu.device.type == "cuda"
    assert torch.allclose(cpu, gpu.cpu(), atol=1e-4)  # float rounding of sin/sqrt on the GPU
