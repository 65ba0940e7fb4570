"""``omniloop eval compare``: two adherence reports matched clip by clip, verdicts lost and gained,
McNemar's exact p; bad report files get one clear message naming the file."""

import json
import math

import pytest
from click.testing import CliRunner

from omniloop_wan_demo import cli
from omniloop_wan_demo.compare import compare, feature_shifts, load_report, mcnemar_p, merge_reports, student_t_p


def _report(verdicts, *, kind="video", steps=20, seeds=(0,)):
    """An ``eval adherence --json`` document: ``verdicts`` is a list of (color, direction, shape) per clip."""
    clips = []
    for i, (c, d, s) in enumerate(verdicts):
        clips.append({"prompt": f"prompt {i // len(seeds)}", "seed": seeds[i % len(seeds)], "expected": {},
                      "detected": {}, "ok": {"color": c, "direction": d, "shape": s}})
    return {"model": "m", "kind": kind, "reports": [{"steps": steps, "n": len(clips), "accuracy": {}, "clips": clips}]}


def test_mcnemar_p_is_the_exact_binomial_test():
    assert mcnemar_p(0, 0) == 1.0
    assert mcnemar_p(4, 3) == 1.0
    assert mcnemar_p(8, 0) == pytest.approx(2 / 2**8)
    assert mcnemar_p(10, 3) == pytest.approx(2 * sum(math.comb(13, i) for i in range(4)) / 2**13)
    assert mcnemar_p(3, 10) == mcnemar_p(10, 3)
    assert mcnemar_p(24, 8) < 0.01  # issue 40's e4m3 attention on wan-demo, 144 clips
    with pytest.raises(ValueError):
        mcnemar_p(-1, 2)


def test_compare_counts_lost_and_gained_on_shared_clips_only():
    base = _report([(True, True, True)] * 10 + [(True, True, False)] * 10)
    # the other run: 8 of base's good shapes lost, 1 bad shape gained, one colour lost
    other = _report([(True, True, False)] * 8 + [(True, True, True)] * 2 + [(True, True, True)] + [(True, True, False)] * 8
                    + [(False, True, False)])
    other["reports"][0]["clips"].append({"prompt": "extra", "seed": 5, "ok": {"color": True, "direction": True, "shape": True}})
    out = compare(base, other)
    assert out["clips"] == 20 and out["only_in_base"] == 0 and out["only_in_other"] == 1
    rows = {r["check"]: r for r in out["checks"]}
    assert (rows["shape"]["lost"], rows["shape"]["gained"]) == (8, 1)
    assert rows["shape"]["p"] == pytest.approx(mcnemar_p(8, 1)) and rows["shape"]["reading"] == "loses"
    assert rows["shape"]["base"] == 0.5 and rows["shape"]["other"] == pytest.approx(3 / 20)
    assert (rows["color"]["lost"], rows["color"]["gained"], rows["color"]["reading"]) == (1, 0, "no effect seen")
    assert (rows["direction"]["lost"], rows["direction"]["gained"], rows["direction"]["p"]) == (0, 0, 1.0)


def test_compare_refuses_different_kinds_and_disjoint_runs():
    with pytest.raises(ValueError, match="different kinds"):
        compare(_report([(True, True, True)]), _report([(True, True, True)], kind="image"))
    with pytest.raises(ValueError, match="share no clip"):
        compare(_report([(True, True, True)], seeds=(0,)), _report([(True, True, True)], seeds=(1,)))
    with pytest.raises(ValueError, match="share no clip"):
        compare(_report([(True, True, True)], steps=20), _report([(True, True, True)], steps=4))


def test_cli_prints_the_table_and_writes_json(tmp_path):
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "cmp.json"
    a.write_text(json.dumps(_report([(True, True, True)] * 6)))
    b.write_text(json.dumps(_report([(True, True, False)] * 6)))
    res = CliRunner().invoke(cli.main, ["eval", "compare", str(a), str(b), "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "McNemar p" in res.output and "loses" in res.output
    got = json.loads(out.read_text())
    assert got["clips"] == 6 and {r["check"]: r["lost"] for r in got["checks"]}["shape"] == 6


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("{not json", "not a JSON report"),
    (json.dumps({"model": "m"}), "no 'reports' list"),
    (json.dumps({"reports": [{"steps": 4, "n": 2, "accuracy": {}}]}), "no per-clip verdicts"),
    (json.dumps({"reports": [{"clips": [{"prompt": "p", "seed": "0", "ok": {"shape": True}}]}]}), "integer seed"),
    (json.dumps({"reports": [{"clips": [{"prompt": "p", "seed": 0, "ok": {"shape": 1}}]}]}), "boolean 'ok'"),
])
def test_bad_report_files_are_one_usage_error_naming_the_file(tmp_path, content, message):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(_report([(True, True, True)])))
    if content is not None:
        bad.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_report(bad)
    res = CliRunner().invoke(cli.main, ["eval", "compare", str(good), str(bad)])
    assert res.exit_code == 2 and "bad.json" in res.output and message in res.output
    assert "Traceback" not in res.output


def test_cli_disjoint_runs_are_a_usage_error(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_report([(True, True, True)], seeds=(0,))))
    b.write_text(json.dumps(_report([(True, True, True)], seeds=(1,))))
    res = CliRunner().invoke(cli.main, ["eval", "compare", str(a), str(b)])
    assert res.exit_code == 2 and "share no clip" in res.output


def test_sweeps_are_compared_per_step_count_too(tmp_path):
    base = _report([(True, True, True)] * 4, steps=20)
    base["reports"].append(_report([(True, True, True)] * 4, steps=4)["reports"][0])
    other = _report([(True, True, True)] * 4, steps=20)
    other["reports"].append(_report([(True, True, False)] * 4, steps=4)["reports"][0])
    out = compare(base, other)
    assert out["clips"] == 8 and [g["steps"] for g in out["by_steps"]] == [20, 4]
    shape = {g["steps"]: {r["check"]: r for r in g["checks"]}["shape"] for g in out["by_steps"]}
    assert (shape[20]["lost"], shape[4]["lost"]) == (0, 4)
    assert "by_steps" not in compare(_report([(True, True, True)]), _report([(True, True, True)]))
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(base))
    b.write_text(json.dumps(other))
    res = CliRunner().invoke(cli.main, ["eval", "compare", str(a), str(b)])
    assert res.exit_code == 0 and "all step counts" in res.output and "4 steps: 4 clips" in res.output


def _image_report(areas, *, shapes=("square", "circle"), centroid_x=None):
    """An image report whose clip i measured ``areas[i]`` (expected shape alternating over ``shapes``)."""
    clips = []
    for i, area in enumerate(areas):
        detected = {"color": "red", "shape": "square", "area": area, "fill": 0.9, "flag": True, "label": "x",
                    "centroid": [0.5 if centroid_x is None else centroid_x[i], 0.25], "bad": float("nan")}
        clips.append({"prompt": f"p{i}", "seed": 0, "expected": {"shape": shapes[i % len(shapes)]},
                      "detected": detected, "ok": {"color": True, "shape": True, "position": True}})
    return {"model": "m", "kind": "image", "reports": [{"steps": 20, "n": len(clips), "accuracy": {}, "clips": clips}]}


def test_feature_shifts_are_paired_means_with_standard_errors():
    base = _image_report([100.0, 200.0, 300.0, 400.0, 150.0, 250.0])
    # squares (even clips) shrink by 2, 3, 4 px; circles do not move
    other = _image_report([98.0, 200.0, 297.0, 400.0, 146.0, 250.0])
    rows = {(r["group"], r["feature"]): r for r in feature_shifts(base, other, by="shape")}
    sq = rows[("shape=square", "area")]
    assert sq["n"] == 3 and sq["shift"] == pytest.approx(-3.0) and sq["se"] == pytest.approx(1 / math.sqrt(3))
    assert sq["z"] == pytest.approx(-3 * math.sqrt(3)) and sq["base_mean"] == pytest.approx(550 / 3)
    t = 3 * math.sqrt(3)  # the paired t-test with 2 degrees of freedom: p = 1 - |t| / sqrt(t^2 + 2)
    assert sq["p"] == pytest.approx(1 - t / math.sqrt(t * t + 2), rel=1e-9)
    circle = rows[("shape=circle", "area")]
    assert (circle["shift"], circle["se"], circle["z"], circle["p"], circle["reading"]) == (0.0, 0.0, 0.0, 1.0, "no shift seen")
    everything = rows[("all", "area")]
    assert everything["n"] == 6 and everything["shift"] == pytest.approx(-1.5)
    # numbers only: booleans, labels and non-finite values are not measurements; lists are split by index
    assert {f for _, f in rows} == {"area", "fill", "centroid[0]", "centroid[1]"}
    # without `by`, all clips only; the groups come first "all", then the expected values in order
    assert {g for g, _ in ((r["group"], r["feature"]) for r in feature_shifts(base, other))} == {"all"}
    assert [r["group"] for r in feature_shifts(base, other, by="shape")][::4] == ["all", "shape=circle", "shape=square"]


def test_student_t_p_against_closed_forms_and_the_normal_limit():
    for t in (0.0, 0.5, 1.0, 3.0, 12.706, -4.0):
        assert student_t_p(t, 1) == pytest.approx(1 - 2 / math.pi * math.atan(abs(t)), rel=1e-9, abs=1e-12)  # Cauchy
        assert student_t_p(t, 2) == pytest.approx(1 - abs(t) / math.sqrt(t * t + 2), rel=1e-9, abs=1e-12)
    assert student_t_p(2.228, 10) == pytest.approx(0.05, abs=2e-5)  # the table's 5 % point
    assert student_t_p(1.96, 10**6) == pytest.approx(math.erfc(1.96 / math.sqrt(2)), rel=1e-4)
    assert student_t_p(math.inf, 5) == 0.0 and student_t_p(0.0, 5) == 1.0
    with pytest.raises(ValueError):
        student_t_p(1.0, 0)


def test_a_systematic_shift_reads_as_shifts_after_bonferroni():
    n = 40
    base = _image_report([200.0] * n, centroid_x=[0.5] * n)
    # every clip's centroid moves right by about 0.01 (with a little spread): unmistakable
    other = _image_report([200.0 + (-1) ** i for i in range(n)], centroid_x=[0.51 + 0.001 * ((i % 3) - 1) for i in range(n)])
    rows = {(r["group"], r["feature"]): r for r in feature_shifts(base, other, by="shape")}
    assert rows[("all", "centroid[0]")]["reading"] == "shifts" and rows[("all", "centroid[0]")]["z"] > 10
    assert rows[("all", "area")]["reading"] == "no shift seen"
    with pytest.raises(ValueError, match="different kinds"):
        feature_shifts(base, _report([(True, True, True)]))


def test_cli_features_prints_the_measurements_and_writes_them(tmp_path):
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "cmp.json"
    n = 40
    a.write_text(json.dumps(_image_report([200.0] * n, centroid_x=[0.5] * n)))
    b.write_text(json.dumps(_image_report([200.0] * n, centroid_x=[0.51 + 0.001 * ((i % 3) - 1) for i in range(n)])))
    res = CliRunner().invoke(cli.main, ["eval", "compare", str(a), str(b), "--features", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "centroid[0]" in res.output and "square" in res.output and "Bonferroni" in res.output
    got = json.loads(out.read_text())
    assert {(r["group"], r["feature"]) for r in got["features"]} >= {("all", "centroid[0]"), ("shape=square", "area")}
    plain = CliRunner().invoke(cli.main, ["eval", "compare", str(a), str(b), "--features", "--by", ""])
    assert plain.exit_code == 0 and "square" not in plain.output.split("Bonferroni")[0].split("measurements")[-1]
    # reports without measurements (the verdicts only) say so instead of printing an empty table
    c, d = tmp_path / "c.json", tmp_path / "d.json"
    c.write_text(json.dumps(_report([(True, True, True)] * 3)))
    d.write_text(json.dumps(_report([(True, True, True)] * 3)))
    res = CliRunner().invoke(cli.main, ["eval", "compare", str(c), str(d), "--features"])
    assert res.exit_code == 0 and "no measurement shared" in res.output


def _seeded(seeds, verdicts, **kw):
    """A report of two prompts at ``seeds``; ``verdicts`` one shape verdict per clip, with a measured area."""
    doc = _report([(True, True, v) for v in verdicts], seeds=seeds, **kw)
    for i, c in enumerate(doc["reports"][0]["clips"]):
        c["detected"] = {"area": 100.0 + i}
    rep = doc["reports"][0]
    rep["accuracy"] = {"shape": sum(verdicts) / len(verdicts)}
    rep["seconds"] = 2.0
    return doc


def test_merge_joins_runs_over_seeds_into_one_report(tmp_path):
    """An evaluation split over runs (seeds 0,1 then 2,3) merges into the report one run would have written: the
    comparison of the merged reports is the comparison over all clips, accuracy is recomputed over them."""
    base = [_seeded((0, 1), [True, True, True, False]), _seeded((2, 3), [True, True, True, True])]
    other = [_seeded((0, 1), [False, True, True, True]), _seeded((2, 3), [True, False, True, True])]
    names = ["a.json", "b.json"]
    mb, mo = merge_reports(base, names), merge_reports(other, names)
    (rep,) = mb["reports"]
    assert rep["n"] == 8 and rep["accuracy"] == {"shape": 7 / 8} and rep["seconds"] == 4.0
    assert mb["merged_from"] == names and [c["seed"] for c in rep["clips"]] == [0, 1, 0, 1, 2, 3, 2, 3]
    shape = {r["check"]: r for r in compare(mb, mo)["checks"]}["shape"]
    assert (shape["lost"], shape["gained"]) == (2, 1)
    for i, doc in enumerate([*base, *other]):
        (tmp_path / f"{i}.json").write_text(json.dumps(doc))
    res = CliRunner().invoke(cli.main, ["eval", "merge", str(tmp_path / "m.json"), str(tmp_path / "0.json"), str(tmp_path / "1.json")])
    assert res.exit_code == 0, res.output
    assert load_report(tmp_path / "m.json")["reports"][0]["n"] == 8


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(kind="image"), "kind"),
    (lambda d: d["reports"][0].update(steps=4), "steps 4 (not 20)"),
    (lambda d: d["reports"][0].update(extra={"deploy": {"linear_precision": "fp8"}}), "deploy"),
    (lambda d: [c.update(seed=0) for c in d["reports"][0]["clips"]], "seed 0 (20 steps) is also in a.json"),
])
def test_merge_refuses_runs_of_different_evaluations(change, message):
    second = _seeded((2, 3), [True] * 4)
    change(second)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        merge_reports([_seeded((0, 1), [True] * 4), second], ["a.json", "b.json"])


def test_merge_cli_writes_nothing_on_refusal_and_never_over_an_input(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_seeded((0, 1), [True] * 4)))
    b.write_text(json.dumps(_seeded((0, 1), [True] * 4)))  # the same clips again
    out = tmp_path / "m.json"
    res = CliRunner().invoke(cli.main, ["eval", "merge", str(out), str(a), str(b)])
    assert res.exit_code == 2 and "is also in" in res.output and not out.exists()
    assert not list(tmp_path.glob(".*.part"))
    res = CliRunner().invoke(cli.main, ["eval", "merge", str(a), str(a), str(b)])
    assert res.exit_code == 2 and "one of the REPORTS" in res.output
    res = CliRunner().invoke(cli.main, ["eval", "merge", str(out), str(a)])
    assert res.exit_code == 2 and "at least two" in res.output
