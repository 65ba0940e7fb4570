"""A new user's first hour (issue 42), findings 3-5 on the shipped demo models, through the CLI:
``schema --model`` lists every task the model supports; image edits are steered with
``--strength`` / ``--node-param``; a flag or option the run would ignore is refused with one line
before anything loads or computes; the shipped cache-dit example caches on wan-demo."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOYS = REPO / "examples" / "deploys"


# -- finding 3: schema --model ------------------------------------------------------------------

@pytest.mark.parametrize(("preset", "tasks", "loop_node"), [
    ("wan-demo", ["t2v"], "denoise"),
    ("wan-demo-fast", ["t2v"], "denoise"),
    ("wan-demo-causal", ["t2v"], "rollout"),
    ("flux-demo", ["i2i", "t2i"], "denoise"),
])
def test_schema_lists_every_task_the_model_supports(cli_run: Any, preset: str, tasks: list[str], loop_node: str) -> None:
    res = cli_run(["schema", "--model", preset])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert sorted(doc["node_params"]) == tasks
    assert loop_node in doc["node_params"][tasks[0]]


# -- finding 4: --strength and --node-param -------------------------------------------------------

@pytest.fixture(scope="module")
def star(tmp_path_factory: Any, demo_manager: Any) -> Path:
    from click.testing import CliRunner

    from omniloop_cli import cli

    out = tmp_path_factory.mktemp("star") / "star.png"
    res = CliRunner().invoke(cli, ["generate", "a red star at the top left", "--model", "flux-demo", "--seed", "0",
                                   "--out", str(out)], obj=demo_manager)
    assert res.exit_code == 0, res.output
    return out


def _pixels(path: Path) -> np.ndarray:
    from omniloop_io.media import read_image

    return read_image(str(path)).numpy().astype(np.float32)


def test_strength_steers_an_image_edit(cli_run: Any, star: Path, tmp_path: Path) -> None:
    outs = {}
    for s in ("0.3", "0.9"):
        res = cli_run(["generate", "a blue star at the top left", "--model", "flux-demo", "--task", "i2i",
                       "--image", str(star), "--strength", s, "--seed", "1", "--out", f"edit-{s}.png", "--json"])
        assert res.exit_code == 0, res.output
        doc = json.loads(res.stdout)
        outs[s] = (doc["metrics"]["steps"], _pixels(tmp_path / f"edit-{s}.png"))
    assert outs["0.3"][0] < outs["0.9"][0]  # the strength cuts the schedule: fewer steps at 0.3
    base = _pixels(star)
    assert np.abs(outs["0.9"][1] - base).mean() > np.abs(outs["0.3"][1] - base).mean()  # further from the input
    # --node-param is the generic form of the same knob: the same run
    res = cli_run(["generate", "a blue star at the top left", "--model", "flux-demo", "--task", "i2i",
                   "--image", str(star), "--node-param", "denoise.strength=0.9", "--seed", "1", "--out", "np.png"])
    assert res.exit_code == 0, res.output
    assert np.array_equal(_pixels(tmp_path / "np.png"), outs["0.9"][1])


@pytest.mark.parametrize(("extra", "expect"), [
    (["--task", "i2i", "--strength", "2"], "error: node_params.denoise.strength: must be <= 1.0"),
    (["--strength", "0.5"], "error: node_params.denoise.strength: strength applies to i2i requests only"),
    (["--node-param", "denoise.bogus=1"], "error: node_params.denoise.bogus: unknown key"),
    (["--node-param", "nonode.x=1"], "error: node_params.nonode: no node named 'nonode'"),
    (["--node-param", "denoise"], "expected NAME.KEY=VALUE"),
    (["--task", "i2i", "--strength", "0.5", "--node-param", "denoise.strength=0.7"], "disagree"),
])
def test_node_params_are_validated_like_a_requests(cli_run: Any, error_line: Any, star: Path, extra: list[str], expect: str) -> None:
    args = ["generate", "a blue star", "--model", "flux-demo", "--out", "x.png", *extra]
    if "i2i" in extra:
        args += ["--image", str(star)]
    line = error_line(cli_run(args))
    assert expect in line, line


# -- finding 5: nothing silently ignored ----------------------------------------------------------

def test_pipeline_options_in_a_single_model_deploy_is_refused(cli_run: Any, error_line: Any, tmp_path: Path) -> None:
    (tmp_path / "d.yaml").write_text("model: {preset: wan-demo}\npipeline_options: {nonode: {bogus: 1}}\n")
    line = error_line(cli_run(["generate", "a red circle moving up", "--deploy", "d.yaml"]))
    assert line.startswith("error: pipeline_options: a single-model deploy") and "nonode" in line


@pytest.mark.parametrize(("extra", "expect"), [
    (["--max-tokens", "5"], "error: sampling.max_tokens: a t2v request does not read sampling parameters"),
    (["--temperature", "0.5"], "error: sampling.temperature: a t2v request"),
    (["--stream"], "error: --stream: the t2v pipeline of model 'wan-demo' emits no frames"),
    (["--image", "IMAGE"], "error: --image: a t2v request takes no input image"),
])
def test_flags_a_video_run_would_ignore_are_refused(cli_run: Any, error_line: Any, star: Path, tmp_path: Path,
                                                     extra: list[str], expect: str) -> None:
    extra = [str(star) if a == "IMAGE" else a for a in extra]
    line = error_line(cli_run(["generate", "a red circle moving up", "--model", "wan-demo", "--steps", "2", *extra]))
    assert line.startswith(expect), line
    assert not (tmp_path / "out").exists()


def test_stream_on_the_streaming_preset_writes_frames(cli_run: Any, tmp_path: Path) -> None:
    res = cli_run(["generate", "a red circle moving up", "--model", "wan-demo-causal", "--stream", "--seed", "0",
                   "--out", "c.mp4"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "c.mp4").is_file() and len(list((tmp_path / "c.frames").glob("frame_*.png"))) == 17


def test_the_shipped_cache_dit_example_caches_on_wan_demo(cli_run: Any) -> None:
    """examples/deploys/wan-demo-cache-dit.yaml with the README's per-request threshold: a non-zero
    cache ratio (cache-dit's defaults, Fn 8 of 10 blocks with 8 warmup steps, and the default
    stochastic sampler, which re-noises every step, cached nothing)."""
    res = cli_run(["generate", "a yellow triangle moving right", "--deploy", str(DEPLOYS / "wan-demo-cache-dit.yaml"),
                   "--plugin-param", "cache-dit.residual_diff_threshold=0.12", "--seed", "0", "--json"])
    assert res.exit_code == 0, res.output
    ratios = {b: m["cache_ratio"] for b, m in json.loads(res.stdout)["metrics"]["plugins"]["cache-dit"].items()}
    assert set(ratios) == {"cond", "uncond"} and min(ratios.values()) > 0.2, ratios


def test_schema_of_an_undeclared_t2v_checkpoint_lists_t2v_only(cli_run: Any, tmp_path: Path) -> None:
    """A real-format Wan T2V folder without an omniloop.json: the family also does I2V, the
    checkpoint does not; ``schema`` asks the loaded model instead of failing on i2v."""
    from omniloop_wan.tiny import build_tiny_checkpoint

    ck = build_tiny_checkpoint(tmp_path / "tiny-t2v", variant="t2v")
    assert not (ck / "omniloop.json").exists() or "tasks" not in json.loads((ck / "omniloop.json").read_text())
    res = cli_run(["schema", "--model", str(ck)])
    assert res.exit_code == 0, res.output
    assert sorted(json.loads(res.stdout)["node_params"]) == ["t2v"]


# -- finding 7: omniloop models -------------------------------------------------------------------

def test_models_lists_presets_and_families(cli_run: Any) -> None:
    res = cli_run(["models", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    presets = {p["name"]: p for p in doc["presets"]}
    assert set(presets) == {"wan-demo", "wan-demo-fast", "wan-demo-causal", "flux-demo"}
    assert presets["wan-demo"]["tasks"] == ["t2v"] and presets["flux-demo"]["tasks"] == ["i2i", "t2i"]
    assert presets["flux-demo"]["limits"]["height"] == "64" and presets["wan-demo"]["limits"]["frames"] == "<=17"
    families = {f["name"]: f for f in doc["families"]}
    assert {"wan", "flux"} <= set(families) and "Wan-AI/" in families["wan"]["weights"]
    assert families["wan"]["how"] == "docs/using-real-weights.md" and (REPO / families["wan"]["how"]).is_file()
    table = cli_run(["models"])
    assert table.exit_code == 0 and "wan-demo-causal" in table.stdout and "families" in table.stdout


@pytest.mark.parametrize(("model", "hint"), [
    ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", True),  # a Hugging Face repo id: how to get the folder
    ("./nope/x", False),  # typed as a relative path: no hint
    ("nope/x/y", False),
])
def test_a_hugging_face_repo_id_as_model_says_how_to_get_the_weights(cli_run: Any, error_line: Any, model: str,
                                                                     hint: bool) -> None:
    line = error_line(cli_run(["generate", "a red circle moving up", "--model", model]))
    assert line.startswith("error: model.path: ") and "does not exist" in line, line
    assert (f"huggingface-cli download {model} --local-dir" in line and "docs/using-real-weights.md" in line) is hint, line


class _GhostPresetPlugin:
    """A preset whose weights are not installed (as tone-demo's before it is trained)."""

    OMNILOOP_HOOK_API = ">=1.0,<2"

    @staticmethod
    def _path() -> Path:
        from omniloop.errors import DeployError

        raise DeployError("model: preset 'ghost-demo': the ghost-demo weights are not installed (checkpoint/"
                          "model_index.json is missing and 11 more); train them with bash demos/ghost/train.sh "
                          "and copy DIR/checkpoint to omniloop_ghost/checkpoint")

    from omniloop.hookspecs import hookimpl

    @hookimpl
    def omniloop_register_model_presets(self, register: Any) -> None:
        from omniloop.family import ModelPreset

        register(ModelPreset(name="ghost-demo", family="toy", path=self._path, description="not installed"))


def test_models_shows_an_unavailable_preset_briefly_and_json_in_full() -> None:
    from click.testing import CliRunner

    from omniloop.testing import make_manager
    from omniloop_cli import cli

    manager = make_manager(("ghost", _GhostPresetPlugin()))
    res = CliRunner().invoke(cli, ["models"], obj=manager, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    row = next(ln for ln in res.stdout.splitlines() if "ghost-demo" in ln)
    assert "unavailable: the ghost-demo weights are not installed (omniloop generate --model ghost-demo says how" in row
    assert "train them" not in res.stdout  # the whole message: --json, and the command itself
    doc = json.loads(CliRunner().invoke(cli, ["models", "--json"], obj=manager).stdout)
    (ghost,) = [p for p in doc["presets"] if p["name"] == "ghost-demo"]
    assert ghost["available"] is False and "train them with bash demos/ghost/train.sh" in ghost["problem"]
