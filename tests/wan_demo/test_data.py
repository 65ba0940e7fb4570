"""The synthetic data generator: deterministic, labelled, with clearly visible motion."""

import numpy as np
import pytest
import torch

from omniloop_wan_demo.data import (
    COLORS,
    DIRECTIONS,
    FRAMES,
    SHAPES,
    SIZE,
    all_prompts,
    make_clips,
    parse_prompt,
    prompt_for,
    render,
    sample_params,
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


def test_vocabulary():
    assert len(all_prompts()) == len(COLORS) * len(SHAPES) * len(DIRECTIONS) == 72
    with pytest.raises(ValueError):
        parse_prompt("a dog running")


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
