"""``omniloop eval adherence`` on an image model: a tiny RANDOM FLUX.1 checkpoint whose
``omniloop.json`` says ``"adherence": {"kind": "image"}``. Scores are ~chance (random weights);
what is asserted is the pipeline: image prompts go through the runtime as t2i requests, the
report carries color / shape / position (with Wilson intervals in the table) and the JSON
output keeps its layout."""

import json

import pytest
import torch
from click.testing import CliRunner

from omniloop_wan_demo import cli
from omniloop_wan_demo import evaluate as ev
from omniloop_wan_demo.prompts import parse_image_prompt

pytest.importorskip("omniloop_flux")
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def image_ckpt(tmp_path_factory):
    from omniloop_flux.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-flux-demo") / "ckpt", variant="dev", seed=0)
    meta = json.loads((path / "omniloop.json").read_text())
    meta["adherence"] = {"kind": "image"}
    (path / "omniloop.json").write_text(json.dumps(meta))
    return path


def test_image_generator_runs_t2i_through_the_runtime(image_ckpt):
    gen = ev.ImageRuntimeGenerator(str(image_ckpt))
    req = gen.request("a red star at the top left", 3, 1, None)
    assert req["task"] == "t2i" and req["diffusion"] == {"steps": 1, "seed": 3, "height": 64, "width": 64}
    a = gen(["a red star at the top left", "a blue circle at the center"], [0, 1], steps=1, guidance_scale=3.5)
    b = gen(["a red star at the top left"], [0], steps=1, guidance_scale=3.5)
    assert len(a) == 2 and a[0].shape == (64, 64, 3) and a[0].dtype.name == "uint8"
    assert (a[0] == b[0]).all()  # seeded: the same prompt and seed give the same image


def test_cli_eval_adherence_image_model(image_ckpt, tmp_path):
    out = tmp_path / "report.json"
    res = CliRunner().invoke(cli.main, ["eval", "adherence", "--model", str(image_ckpt), "--steps", "1",
                                        "--seeds", "0", "--json", str(out)], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    assert "image: 54 prompts" in res.output
    for col in ("color", "shape", "position", "all three"):
        assert col in res.output
    assert "direction" not in res.output and "%" in res.output and "[" in res.output  # 95 % Wilson intervals
    data = json.loads(out.read_text())
    assert data["kind"] == "image" and data["model"] == str(image_ckpt)
    (rep,) = data["reports"]
    assert rep["kind"] == "image" and rep["n"] == 54 and rep["steps"] == 1
    assert set(rep["accuracy"]) == {"color", "shape", "position", "all"}
    assert all(0.0 <= v <= 1.0 for v in rep["accuracy"].values())
    clip = rep["clips"][0]
    assert parse_image_prompt(clip["prompt"]) == tuple(clip["expected"][k] for k in ("color", "shape", "position"))
    assert set(clip["ok"]) == {"color", "shape", "position"}


def test_cli_refuses_video_only_options_for_an_image_model(image_ckpt):
    for extra, what in ((["--rollout", "causal"], "--rollout causal"), (["--backend", "diffusers"], "--backend diffusers")):
        res = CliRunner().invoke(cli.main, ["eval", "adherence", "--model", str(image_ckpt), *extra])
        assert res.exit_code == 2 and what in res.output and "image model" in res.output


def test_cli_refuses_a_bad_adherence_block(tmp_path):
    # "audio" is a kind now (tone-demo: handed to omniloop-tone-demo's evaluator); "smell" is not
    (tmp_path / "omniloop.json").write_text(json.dumps({"adherence": {"kind": "smell"}}))
    res = CliRunner().invoke(cli.main, ["eval", "adherence", "--model", str(tmp_path)])
    assert res.exit_code == 2 and "adherence.kind" in res.output


def test_bench_adherence_smoke_on_an_image_model(image_ckpt, capsys):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("adherence_bench", Path(__file__).resolve().parents[2] / "bench" / "adherence.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--model", str(image_ckpt), "--smoke"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["n"] == 2 and set(line["accuracy"]) == {"color", "shape", "position", "all"}


def test_cli_resolves_an_installed_preset_and_names_a_missing_one(image_ckpt, monkeypatch, tmp_path):
    """A preset's own omniloop.json decides the kind; a preset whose weights are not installed is
    one usage error with its reason (never a silent fallback to wan-demo)."""
    from omniloop.errors import DeployError
    from omniloop.family import ModelPreset
    from omniloop.plugins import default_manager

    presets = default_manager().registry().presets

    def missing():
        raise DeployError("model: preset 'img-missing': the weights are not installed")

    monkeypatch.setitem(presets, "img-demo-test", ModelPreset(name="img-demo-test", family="flux", path=lambda: image_ckpt))
    monkeypatch.setitem(presets, "img-missing", ModelPreset(name="img-missing", family="flux", path=missing))
    assert cli._checkpoint_meta("img-demo-test")["adherence"] == {"kind": "image"}
    assert cli._checkpoint_meta("no-such-preset") == {}
    res = CliRunner().invoke(cli.main, ["eval", "adherence", "--model", "img-missing"])
    assert res.exit_code == 2 and "the weights are not installed" in res.output
    with pytest.raises(Exception, match="no-such-preset"):  # the runtime's own error, no diffusers stand-in
        ev.make_generator("auto", model="no-such-preset")


def test_generator_deploys_the_linear_precision_it_is_given(image_ckpt):
    """``eval adherence --linear-precision fp8`` measures a precision's cost: the runtime behind the
    generator is deployed with it (omniloop-quant's FP8 block linears, which also run on the CPU)."""
    pytest.importorskip("omniloop_quant")
    gen, used, note = ev.make_generator("auto", model=str(image_ckpt), kind="image", deploy={"linear_precision": "fp8"})
    assert used == "runtime" and note is None
    assert gen.runtime.deploy.linear_precision == "fp8" and gen.runtime.linears["mode"] == "fp8"
    (img,) = gen(["a red star at the top left"], [0], steps=1, guidance_scale=3.5)
    assert img.shape == (64, 64, 3) and img.dtype.name == "uint8"
    with pytest.raises(ValueError, match="runtime, not --backend diffusers"):
        ev.make_generator("diffusers", model=str(image_ckpt), kind="image", deploy={"linear_precision": "fp8"})


def test_cli_refuses_a_linear_precision_it_cannot_deploy(image_ckpt):
    """One line, before any clip: an unknown precision (the runtime's DeployError), or a precision
    with the diffusers backend (which has no deployment to set it on)."""
    res = CliRunner().invoke(cli.main, ["eval", "adherence", "--model", str(image_ckpt), "--linear-precision", "int3"])
    assert res.exit_code == 1 and "linear_precision: unknown value 'int3'" in res.output
    assert "Traceback" not in res.output and "prompt adherence" not in res.output
    res = CliRunner().invoke(cli.main, ["eval", "adherence", "--model", "wan-demo", "--backend", "diffusers",
                                        "--linear-precision", "fp8"])
    assert res.exit_code == 2 and "--linear-precision" in res.output


def test_cli_deploy_file_sets_the_runtime_under_test(image_ckpt, tmp_path, monkeypatch):
    """``eval adherence --deploy FILE``: what a deployment's settings cost in adherence (e.g. a fast path's
    compile and fused options against the default deployment, then ``eval compare``). The file's settings
    that differ from the defaults reach the runtime and the report; its model/device/dtype give way to the
    flags; ``--linear-precision`` adds to it."""
    seen = {}
    real = ev.make_generator

    def spy(backend, **kw):
        seen.update(kw["deploy"])
        return real(backend, **kw)

    monkeypatch.setattr(ev, "make_generator", spy)
    f = tmp_path / "fast.json"
    f.write_text(json.dumps({"model": {"preset": "wan-demo"}, "dtype": "bfloat16",
                             "options": {"modulation": "per-request", "qkv": "fused"}}))
    out = tmp_path / "r.json"
    res = CliRunner().invoke(cli.main, ["eval", "adherence", "--model", str(image_ckpt), "--steps", "1", "--seeds", "0",
                                        "--prompts", "default", "--deploy", str(f), "--no-table", "--json", str(out)],
                             env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    assert seen == {"options": {"modulation": "per-request", "qkv": "fused"}}
    (rep,) = json.loads(out.read_text())["reports"]
    assert rep["extra"]["deploy"] == {"options": {"modulation": "per-request", "qkv": "fused"}}
    assert 'options {"modulation": "per-request", "qkv": "fused"}' in res.output


def test_cli_prints_a_keep_glob_as_written(image_ckpt, tmp_path):
    """A deploy's strings are printed as text: the summary's title once ate ``[qkv]`` out of a keep glob (rich read
    it as markup), so the table named a deployment that was not the one evaluated."""
    f = tmp_path / "keep.json"
    f.write_text(json.dumps({"linear_precision": "fp8", "linear_precision_options": {"keep": ["attn.to_[qkv]"]}}))
    res = CliRunner().invoke(cli.main, ["eval", "adherence", "--model", str(image_ckpt), "--steps", "1", "--seeds", "0",
                                        "--prompts", "default", "--deploy", str(f)], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    assert '{"keep": ["attn.to_[qkv]"]}' in res.output


def test_cli_refuses_a_bad_deploy_file_before_any_clip(image_ckpt, tmp_path):
    for text, what in (("{", "cannot parse"), ('{"compile": "yes please"}', "compile"),
                       ('{"pipeline": "prompt-upsample"}', "composed pipeline")):
        f = tmp_path / "bad.json"
        f.write_text(text)
        res = CliRunner().invoke(cli.main, ["eval", "adherence", "--model", str(image_ckpt), "--deploy", str(f)])
        assert res.exit_code == 2 and "--deploy" in res.output and what in res.output, (text, res.output)
        assert "Traceback" not in res.output and "prompt adherence" not in res.output
    res = CliRunner().invoke(cli.main, ["eval", "adherence", "--model", str(image_ckpt), "--deploy", str(tmp_path / "none.json")])
    assert res.exit_code == 2 and "deploy file not found" in res.output
    ok = tmp_path / "ok.json"
    ok.write_text('{"compile": true}')
    res = CliRunner().invoke(cli.main, ["eval", "adherence", "--model", "wan-demo", "--backend", "diffusers", "--deploy", str(ok)])
    assert res.exit_code == 2 and "--deploy" in res.output and "diffusers" in res.output
