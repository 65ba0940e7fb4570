"""``omniloop generate --deploy`` on a composed deploy (``pipeline: prompt-upsample``): tiny Qwen2
upsampler + tiny Wan2.1 T2V; the video is written, the expanded prompt shown (and in --json), and
it equals the Python API's (``Runtime.from_deploy``) expansion; --model with a composed deploy is
refused with one message."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

import omniloop_compose.plugin as compose_plugin
import omniloop_qwen.plugin as qwen_plugin
import omniloop_wan.plugin as wan_plugin
from omniloop.testing import make_manager
from omniloop_cli import cli


def _manager() -> Any:
    return make_manager(("qwen", qwen_plugin), ("wan", wan_plugin), ("compose", compose_plugin), toy=False)


@pytest.fixture(scope="module")
def deploy_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omniloop_qwen.tiny import build_tiny_checkpoint as build_qwen
    from omniloop_wan.tiny import build_tiny_checkpoint as build_wan

    root = tmp_path_factory.mktemp("composed")
    deploy = {"pipeline": "prompt-upsample",
              "models": {"upsampler": {"path": str(build_qwen(root / "qwen", arch="qwen2"))},
                         "video": {"path": str(build_wan(root / "wan", variant="t2v"))}},
              "pipeline_options": {"upsample": {"instruction": "expand this prompt", "max_tokens": 8}}}
    path = root / "deploy.json"
    path.write_text(json.dumps(deploy))
    return path


def test_generate_runs_a_composed_deploy_and_shows_the_expanded_prompt(deploy_file: Path, tmp_path: Path) -> None:
    from omniloop.runtime import Runtime

    args = ["generate", "a red fox", "--deploy", str(deploy_file), "--frames", "5", "--steps", "1", "--seed", "3"]
    res = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "fox.mp4"), "--json"], obj=_manager())
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["status"] == "completed" and Path(doc["output_path"]).is_file()
    want = Runtime.from_deploy(str(deploy_file), manager=_manager()).generate(
        {"task": "t2v", "prompt": "a red fox", "diffusion": {"frames": 5, "steps": 1, "seed": 3}})
    assert doc["expanded_prompt"] == want.artifacts["expanded_prompt"].text

    res = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "fox2.mp4")], obj=_manager())
    assert res.exit_code == 0, res.output
    assert (tmp_path / "fox2.mp4").is_file()
    assert "expanded_prompt: " + want.artifacts["expanded_prompt"].text in res.stderr.replace("\n", "")


def test_model_flag_with_a_composed_deploy_is_refused(deploy_file: Path, tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["generate", "a fox", "--deploy", str(deploy_file), "--model", "wan-demo",
                                   "--out", str(tmp_path / "a.mp4")], obj=_manager())
    assert res.exit_code != 0 and "--model: a composed deploy" in res.output


def test_an_audio_out_with_a_composed_video_deploy_is_refused_before_load(deploy_file: Path, tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["generate", "a fox", "--deploy", str(deploy_file), "--out", str(tmp_path / "a.wav")],
                             obj=_manager())
    assert res.exit_code == 2 and "--out: a .wav holds audio; a composed deploy's t2v pipeline" in res.stderr
    assert list(tmp_path.iterdir()) == []
