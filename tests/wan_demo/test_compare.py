"""``omniloop eval compare``: two adherence reports matched clip by clip, verdicts lost and gained,
McNemar's exact p; bad report files get one clear message naming the file."""

import json
import math

import pytest
from click.testing import CliRunner

from omniloop_wan_demo import cli
from omniloop_wan_demo.compare import compare, load_report, mcnemar_p


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
