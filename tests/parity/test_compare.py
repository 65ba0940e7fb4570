"""Compare: pass on identical runs, localize a perturbation, tolerances from flags and TOML."""

from __future__ import annotations

import pytest
import torch

import omniloop_parity as op
from omniloop_parity.compare import compare_tensors
from omniloop_parity.recording import TapEntry

K, STEP = 2, 3


def test_identical_runs_pass(h, recording_runtime):
    rt = recording_runtime(blocks=r"blocks\.\d+$")
    a, b = op.record(rt, h.REQUEST), op.record(rt, h.REQUEST)
    result = op.compare(a, b)
    assert result.passed and bool(result) and result.first is None
    assert all(c.max_abs == 0 for c in result.comparisons)
    assert result.summary().startswith("parity PASS")


def test_a_perturbed_block_is_localized_to_its_step_and_block(h, recording_runtime):
    ref = op.record(recording_runtime(blocks=r"blocks\.\d+$"), h.REQUEST)
    perturbed_rt = recording_runtime(
        ("perturb", h.InterceptorPlugin(h.PerturbBlock(k=K, step=STEP))),
        plugins={"perturb": {}},
        blocks=r"blocks\.\d+$",
    )
    bad = op.record(perturbed_rt, h.REQUEST)
    result = op.compare(ref, bad)
    assert not result.passed
    first = result.first
    assert (first.entry.step, first.entry.branch, first.entry.kind, first.entry.block) == (STEP, "cond", "block", K)
    assert first.key == f"step{STEP:03d}/cond/blocks.{K}"
    # the relative size of the perturbation is what we put in
    assert first.max_rel == pytest.approx(1e-3, rel=1e-2)
    assert f"step {STEP}" in result.summary() and f"blocks.{K}" in result.summary()
    # everything before that step matches exactly; the per-step table says so
    _columns, rows = result.table()
    for label, cells in rows:
        if label.isdigit() and int(label) < STEP:
            assert all(c.passed and c.max_abs == 0 for c in cells.values()), label
    step_cells = dict(rows)[str(STEP)]
    assert not step_cells["blocks[cond]"].passed and step_cells["blocks[cond]"].entry.block >= K
    assert not step_cells["latents"].passed


def test_a_loose_tolerance_accepts_the_perturbation_but_not_a_tighter_cosine(h, recording_runtime):
    ref = op.record(recording_runtime(), h.REQUEST)
    bad = op.record(
        recording_runtime(("perturb", h.InterceptorPlugin(h.PerturbBlock(k=K, step=STEP))), plugins={"perturb": {}}),
        h.REQUEST,
    )
    assert not op.compare(ref, bad).passed
    video_ok = op.Tolerances.from_dict({"atol": 0.1, "rtol": 0.1, "override": [{"match": "final/video", "atol": 255}]})
    assert op.compare(ref, bad, video_ok).passed
    strict_cos = video_ok.with_default(cos=1.0 - 1e-12)
    result = op.compare(ref, bad, strict_cos)
    assert not result.passed and result.first.reason == "cosine"


def test_tolerances_from_toml_with_overrides(tmp_path):
    f = tmp_path / "tol.toml"
    f.write_text(
        'atol = 1e-6\nrtol = 1e-5\n\n[[override]]\nmatch = "*/blocks.*"\natol = 1e-3\n\n'
        '[[override]]\nmatch = "final/video"\natol = 1\ncos = 0.99\n'
    )
    tols = op.Tolerances.from_toml(f)
    assert tols.for_key("step003/latents") == op.TapTolerance(atol=1e-6, rtol=1e-5)
    assert tols.for_key("step003/cond/blocks.2") == op.TapTolerance(atol=1e-3, rtol=1e-5)
    assert tols.for_key("final/video") == op.TapTolerance(atol=1, rtol=1e-5, cos=0.99)
    # flags override the file's defaults, never its overrides
    flagged = tols.with_default(atol=0.5)
    assert flagged.for_key("step000/guided").atol == 0.5 and flagged.for_key("final/video").atol == 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("atol = 'x'", "expected a number"),
        ("atoll = 1", "unknown key 'atoll'"),
        ("[[override]]\natol = 1", "needs a 'match'"),
        ("[[override]]\nmatch = 'x'", "sets no tolerance"),
        ("rtol = -1", "must be >= 0"),
        ("atol = ", "cannot parse TOML"),
    ],
)
def test_bad_tolerance_files_say_what_is_wrong(tmp_path, text, message):
    f = tmp_path / "t.toml"
    f.write_text(text)
    with pytest.raises(op.ParityError, match=message):
        op.Tolerances.from_toml(f)


def _entry() -> TapEntry:
    return TapEntry(key="k", node="n", name="x", kind="tap")


def test_elementwise_rule_and_nan_inf_handling():
    a = torch.tensor([1.0, float("nan"), float("inf"), 0.0, 100.0])
    assert compare_tensors(_entry(), a, a.clone(), op.TapTolerance()).passed
    b = a.clone()
    b[4] = 100.5
    c = compare_tensors(_entry(), a, b, op.TapTolerance(atol=0.0, rtol=0.01))
    assert c.passed and c.max_abs == 0.5 and c.max_rel == pytest.approx(0.005)
    c = compare_tensors(_entry(), a, b, op.TapTolerance(atol=0.4))
    assert not c.passed and c.n_bad == 1 and c.worst_index == (4,)
    b = a.clone()
    b[1] = 0.0  # NaN in the reference, a number in the candidate
    assert not compare_tensors(_entry(), a, b, op.TapTolerance(atol=1e9)).passed
    b = a.clone()
    b[3] = 1e-3  # reference 0: infinite relative error, judged by atol
    c = compare_tensors(_entry(), a, b, op.TapTolerance(atol=1e-2))
    assert c.passed and c.max_rel == float("inf")


def test_shape_mismatch_and_missing_taps_fail(h, recording_runtime):
    a = op.record(recording_runtime(), h.REQUEST)
    b = op.record(recording_runtime(taps="^(noise_pred|guided)$"), {**h.REQUEST, "diffusion": {"seed": 7}})
    result = op.compare(a, b)
    assert not result.passed and result.first.key == "step000/latents" and result.first.reason == "missing in B"
    # extra taps in B are notes, not failures
    back = op.compare(b, a)
    assert back.passed and any("only in" in n for n in back.notes)
    small = op.record(recording_runtime(), {**h.REQUEST, "diffusion": {"seed": 7, "height": 8, "width": 8}})
    shape = op.compare(a, small)
    assert shape.first.reason == "shape"


def test_result_serializes_to_json(h, recording_runtime):
    import json

    a = op.record(recording_runtime(), h.REQUEST)
    b = op.record(recording_runtime(), {**h.REQUEST, "diffusion": {"seed": 8}})
    d = op.compare(a, b).to_dict()
    json.dumps(d)
    assert d["passed"] is False and d["first_divergence"]["key"] == "step000/cond/noise_pred"
    assert any("seed differs" in n for n in d["notes"])
