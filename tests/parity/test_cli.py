"""``omniloop parity record|compare|replay|show`` through click's CliRunner."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import omniloop_parity as op
from omniloop.testing import make_manager
from omniloop_parity import plugin
from omniloop_parity.cli import parity_group


@pytest.fixture
def cli(ckpt):
    runner = CliRunner()

    def invoke(*args: str, manager=None):
        return runner.invoke(parity_group, [str(a) for a in args], obj=manager or make_manager(("parity", plugin)))

    return invoke


def test_record_then_show(cli, ckpt, tmp_path):
    out = tmp_path / "a.safetensors"
    res = cli(
        "record",
        "a red cube",
        "--model",
        ckpt,
        "--out",
        out,
        "--seed",
        "3",
        "--steps",
        "3",
        "--blocks",
        r"blocks\.0$",
        "--no-progress",
    )
    assert res.exit_code == 0, res.output
    assert "recorded" in res.output and out.is_file()
    rec = op.Recording.load(out)
    assert rec.seed == 3 and rec.manifest["steps"] == {"denoise": 3}
    assert "step002/uncond/blocks.0" in rec
    res = cli("show", out)
    assert res.exit_code == 0, res.output
    for text in ("a red cube", "seed 3", "toy", "float32", "blocks[cond]", "noise_pred[uncond]", "final/video"):
        assert text in res.output, text
    res = cli("show", out, "--all")
    assert "step000/cond/blocks.0" in res.output and "absmax" in res.output
    res = cli("show", out, "--json")
    assert json.loads(res.output)["seed"] == 3


def test_compare_exit_codes_and_table(cli, ckpt, tmp_path):
    a, b, c = (tmp_path / f"{n}.safetensors" for n in "abc")
    for path, seed in ((a, 1), (b, 1), (c, 2)):
        assert cli("record", "x", "-m", ckpt, "-o", path, "--seed", seed, "--no-progress").exit_code == 0
    res = cli("compare", a, b)
    assert res.exit_code == 0, res.output
    assert "parity PASS" in res.output and "noise_pred[cond]" in res.output
    res = cli("compare", a, c)
    assert res.exit_code == 1
    assert "parity FAIL" in res.output and "step000/cond/noise_pred" in res.output and "seed differs" in res.output
    res = cli("compare", a, c, "--atol", "100")
    assert res.exit_code == 1  # the video differs by more than 100 levels somewhere
    tol = tmp_path / "tol.toml"
    tol.write_text('atol = 100\n[[override]]\nmatch = "final/video"\natol = 255\n')
    assert cli("compare", a, c, "--tolerances", tol).exit_code == 0
    res = cli("compare", a, c, "--json")
    assert res.exit_code == 1 and json.loads(res.output)["first_divergence"]["step"] == 0


def test_replay_matches_its_recording(cli, ckpt, tmp_path):
    a = tmp_path / "a.safetensors"
    assert cli("record", "x", "-m", ckpt, "-o", a, "--no-progress").exit_code == 0
    res = cli("replay", a)  # the deploy stored in the recording names the checkpoint
    assert res.exit_code == 0, res.output
    assert "parity PASS" in res.output
    new = tmp_path / "new.safetensors"
    res = cli("replay", a, "--model", ckpt, "--out", new, "--json")
    assert res.exit_code == 0 and json.loads(res.output)["passed"] is True and new.is_file()


def test_replay_on_another_model_fails(cli, ckpt, tmp_path):
    from omniloop.testing import build_toy_checkpoint

    other = build_toy_checkpoint(tmp_path / "other", seed=1)
    a = tmp_path / "a.safetensors"
    assert cli("record", "x", "-m", ckpt, "-o", a, "--no-progress").exit_code == 0
    res = cli("replay", a, "--model", other, "--no-progress")
    assert res.exit_code == 1 and "parity FAIL" in res.output


def test_bad_inputs_exit_2_with_one_line(cli, ckpt, tmp_path):
    res = cli("compare", tmp_path / "missing.safetensors", tmp_path / "b.safetensors")
    assert res.exit_code == 2 and "recording not found" in res.output
    res = cli("record", "x", "-o", tmp_path / "o.safetensors")
    assert res.exit_code == 2 and "--model or --deploy" in res.output
    res = cli("record", "x", "-m", tmp_path / "nope", "-o", tmp_path / "o.safetensors")
    assert res.exit_code == 2 and "does not exist" in res.output
    bad_tol = tmp_path / "t.toml"
    bad_tol.write_text("atol = 'a'")
    a = tmp_path / "a.safetensors"
    assert cli("record", "x", "-m", ckpt, "-o", a, "--no-progress").exit_code == 0
    res = cli("compare", a, a, "--tolerances", bad_tol)
    assert res.exit_code == 2 and "expected a number" in res.output


def test_record_with_a_deploy_file(cli, ckpt, tmp_path):
    deploy = tmp_path / "deploy.json"
    deploy.write_text(json.dumps({"model": {"path": str(ckpt)}, "device": "cpu"}))
    out = tmp_path / "d.safetensors"
    res = cli("record", "x", "--deploy", deploy, "-o", out, "--no-progress")
    assert res.exit_code == 0, res.output
    assert op.Recording.load(out).manifest["deploy"]["model"]["path"] == str(ckpt)


def test_the_hook_adds_the_parity_group_to_a_cli():
    import click

    @click.group()
    def top() -> None:
        pass

    plugin.omniloop_register_commands(top)
    assert set(top.commands["parity"].commands) == {"record", "compare", "replay", "show"}


# -- issue 14: non-finite numbers, checks before loading --------------------------------------------


@pytest.mark.parametrize("args", [
    ["--atol", "nan"], ["--atol", "inf"], ["--rtol", "Infinity"], ["--cos", "nan"],
])
def test_non_finite_tolerances_are_refused(cli, tmp_path, args):
    res = cli("compare", tmp_path / "a.safetensors", tmp_path / "b.safetensors", *args)
    assert res.exit_code == 2 and "finite" in res.output


@pytest.mark.parametrize("text", ["atol = inf", "rtol = nan", "cos = 2.0", "[[override]]\nmatch = '*'\natol = -inf"])
def test_non_finite_tolerance_files_are_refused(tmp_path, text):
    f = tmp_path / "t.toml"
    f.write_text(text)
    with pytest.raises(op.ParityError):
        op.Tolerances.from_toml(f)


@pytest.mark.parametrize("args, words", [
    (["--guidance-scale", "nan"], "finite"),
    (["--fps", "inf"], "finite"),
    (["--steps", "100000"], "diffusion.steps"),
    (["--height", "7"], "diffusion.height"),
    (["-o", "/proc/nope/x.safetensors"], "cannot write"),
])
def test_record_checks_before_loading(cli, ckpt, tmp_path, monkeypatch, args, words):
    from omniloop.testing import ToyFamily

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(ToyFamily, "load", no_load)
    out = ["-o", tmp_path / "r.safetensors"] if "-o" not in args else []
    res = cli("record", "x", "-m", ckpt, *out, *args, "--no-progress")
    assert res.exit_code == 2, res.output
    assert words in res.output and "loaded" not in res.output
