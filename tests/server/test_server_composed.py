"""A composed deploy (``pipeline`` + ``models`` by role) is refused by ``omniloop serve`` and by
``create_app`` with one message naming ``pipeline``, before any weights load: the async engine's
step/serial scheduler drives one runtime's execution (``Runtime.prepare``), which a composed
runtime does not have (it runs one runtime per role)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from omniloop.deploy import load_deploy
from omniloop.errors import DeployError

DEPLOY = {"pipeline": "prompt-upsample",
          "models": {"upsampler": {"path": "/nonexistent/qwen"}, "video": {"path": "/nonexistent/wan"}}}


def test_serve_refuses_a_composed_deploy_before_loading(tmp_path: Path) -> None:
    from omniloop_server.cli import make_serve_command

    path = tmp_path / "deploy.json"
    path.write_text(json.dumps(DEPLOY))
    res = CliRunner().invoke(make_serve_command(), ["--deploy", str(path), "--port", "0"])
    assert res.exit_code != 0
    assert "pipeline: omniloop serve cannot serve a composed deploy (pipeline 'prompt-upsample')" in res.output
    assert "omniloop generate --deploy" in res.output


def test_create_app_refuses_a_composed_runtime() -> None:
    from omniloop_server import create_app

    with pytest.raises(DeployError, match=r"^pipeline: omniloop serve cannot serve a composed deploy"):
        create_app(SimpleNamespace(deploy=load_deploy(DEPLOY)))
