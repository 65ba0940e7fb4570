"""Reflow pairs with re-rendered endpoints (omniloop_wan_demo_training.reflow): reading a generated
clip back into the renderer's parameters, on rendered clips (whose parameters are known) and on a
clip with a duplicate object (the case the pairs are for)."""

import numpy as np
import pytest
import torch

from omniloop_wan_demo.evaluate import detect
from omniloop_wan_demo_training import reflow
from omniloop_wan_demo_training.render import DIRECTIONS, SHAPES, ClipParams, render, sample_params, to_uint8_frames

torch.set_num_threads(2)


def _clips(p: ClipParams) -> list[np.ndarray]:
    return [to_uint8_frames(v) for v in render(p)]


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_fit_recovers_a_rendered_clips_parameters(direction):
    p = sample_params(len(SHAPES) * 2, seed=7, direction=direction)
    for i, (clip, prompt) in enumerate(zip(_clips(p), p.prompts(), strict=True)):
        got = reflow.fit_params(clip, prompt)
        assert got is not None and got["ghost_frames"] == 0
        assert (got["color"], got["shape"], got["direction"]) == (p.color[i], p.shape[i], p.direction[i])
        assert abs(got["x0"] - p.x0[i]) < 1.0 and abs(got["y0"] - p.y0[i]) < 1.0, (prompt, got, p.x0[i], p.y0[i])
        assert abs(got["speed"] - p.speed[i]) < 0.1 and abs(got["radius"] - p.radius[i]) < 0.8, (prompt, got)


def test_a_duplicate_object_is_re_rendered_as_the_one_the_middle_frame_holds():
    p = sample_params(2, seed=3, color="blue", shape="circle", direction="down")
    p.x0[:] = (16.0, 48.0)  # same clip twice, side by side
    p.radius[1] = p.radius[0] - 1.0  # the second one a bit smaller: the first is the object
    p.speed[1], p.y0[1] = p.speed[0], p.y0[0]
    p.bg[1], p.texture[1], p.noise_seed[1] = p.bg[0], p.texture[0], p.noise_seed[0]
    b = render(p, return_mask=True)[1][1]  # the second object's coverage [1, T, H, W]
    video = render(ClipParams(*(getattr(p, f)[:1] for f in ClipParams.__dataclass_fields__)))[0]
    second = render(ClipParams(*(getattr(p, f)[1:] for f in ClipParams.__dataclass_fields__)))[0]
    video = torch.where(b > 0.5, second, video)  # paste the second object in
    clip = to_uint8_frames(video)
    assert detect(clip).ghost_frames >= 8  # what the evaluator calls a duplicate
    got = reflow.fit_params(clip, "a blue circle moving down")
    assert got["ghost_frames"] >= 8 and abs(got["x0"] - 16.0) < 1.0 and abs(got["radius"] - p.radius[0]) < 0.8
    clean = _clips(reflow.params_batch([got]))[0]
    d = detect(clean)
    assert (d.color, d.shape, d.direction, d.ghost_frames) == ("blue", "circle", "down", 0)


def test_no_object_gives_no_parameters():
    blank = np.full((17, 64, 64, 3), 110, dtype=np.uint8)
    assert reflow.fit_params(blank, "a red star moving left") is None


def test_area_per_r2_is_each_shapes_rendered_area():
    assert reflow.AREA_PER_R2["circle"] == pytest.approx(np.pi, rel=0.01)
    assert reflow.AREA_PER_R2["square"] == pytest.approx((2 * 0.86) ** 2, rel=0.01)
