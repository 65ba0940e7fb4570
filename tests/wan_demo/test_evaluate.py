"""The adherence detector must be right on real data clips; the evaluator and its CLI."""

import json

import numpy as np
import torch
from click.testing import CliRunner

from omniloop_wan_demo import evaluate as ev
from omniloop_wan_demo.data import COLORS, make_clips, parse_prompt, render, sample_params, to_uint8_frames

torch.set_num_threads(1)


def _gt_generator(prompts, seeds, *, steps, guidance_scale):
    """A perfect 'model': renders the clip the prompt describes."""
    out = []
    for p, s in zip(prompts, seeds, strict=True):
        c, sh, d = parse_prompt(p)
        v = render(sample_params(1, seed=1000 + s, color=c, shape=sh, direction=d))
        out.append(to_uint8_frames(v[0]))
    return out


def test_detector_is_exact_on_data_clips():
    v, prompts, labels = make_clips(120, seed=7)
    for i in range(len(prompts)):
        d = ev.detect(to_uint8_frames(v[i]))
        assert (d.color, d.direction, d.shape) == (labels[i]["color"], labels[i]["direction"], labels[i]["shape"]), prompts[i]
        assert d.travel >= 30


def test_detector_tolerates_blur_and_noise():
    v, prompts, labels = make_clips(48, seed=8)
    k = torch.ones(3, 1, 3, 3) / 9.0
    g = torch.Generator().manual_seed(0)
    for i in range(len(prompts)):
        x = v[i].permute(1, 0, 2, 3)  # [T, 3, H, W]
        x = torch.nn.functional.conv2d(torch.nn.functional.pad(x, (1, 1, 1, 1), mode="replicate"), k, groups=3)
        x = (x + 0.03 * torch.randn(x.shape, generator=g)).clamp(0, 1)
        d = ev.detect(to_uint8_frames(x.permute(1, 0, 2, 3)))
        assert d.color == labels[i]["color"] and d.direction == labels[i]["direction"], prompts[i]


def test_reversed_clip_reverses_direction():
    opposite = {"left": "right", "right": "left", "up": "down", "down": "up"}
    v, _, labels = make_clips(8, seed=9)
    for i in range(8):
        f = to_uint8_frames(v[i])[::-1]
        assert ev.detect(f).direction == opposite[labels[i]["direction"]]


def test_static_or_empty_clips():
    v, _, _ = make_clips(1, seed=10)
    f = to_uint8_frames(v[0])
    still = np.repeat(f[:1], f.shape[0], axis=0)
    assert ev.detect(still).direction == "none"
    blank = np.full_like(f, 90)
    d = ev.detect(blank)
    assert d.direction == "none" and d.color is None


def test_color_naming():
    for name, rgb in COLORS.items():
        assert ev.name_color(rgb) == name
        assert ev.name_color([c * 0.8 + 0.1 for c in rgb]) == name  # washed out


def test_evaluate_scores_a_perfect_and_a_wrong_model():
    rep = ev.evaluate(_gt_generator, seeds=(0,), steps=1)
    assert rep.n == 24 and rep.accuracy["color"] == 1.0 and rep.accuracy["direction"] == 1.0 and rep.accuracy["shape"] == 1.0

    def backwards(prompts, seeds, **kw):
        return [f[::-1] for f in _gt_generator(prompts, seeds, **kw)]

    rep = ev.evaluate(backwards, seeds=(0,), steps=1)
    assert rep.accuracy["color"] == 1.0 and rep.accuracy["direction"] == 0.0
    d = rep.to_dict()
    assert len(d["clips"]) == 24 and json.dumps(d)


def test_prompt_sets():
    assert len(ev.default_prompts()) == 24 and len(set(ev.default_prompts())) == 24
    assert len(ev.full_prompts()) == 72
    shapes = [parse_prompt(p)[1] for p in ev.default_prompts()]
    assert all(shapes.count(s) == 8 for s in set(shapes))


def test_cli_adherence(monkeypatch, tmp_path):
    from omniloop_wan_demo import cli

    monkeypatch.setattr(ev, "make_generator", lambda *a, **k: (_gt_generator, "fake", "fake backend for the test"))
    out = tmp_path / "r.json"
    res = CliRunner().invoke(cli.main, ["eval", "adherence", "--steps", "4,2", "--seeds", "0", "--json", str(out), "--no-table"])
    assert res.exit_code == 0, res.output
    assert "100.0%" in res.output
    data = json.loads(out.read_text())
    assert [r["steps"] for r in data["reports"]] == [4, 2]
    assert data["reports"][0]["accuracy"]["direction"] == 1.0


def test_wilson():
    lo, hi = ev.wilson(0.9, 100)
    assert 0.82 < lo < 0.9 < hi < 0.95
