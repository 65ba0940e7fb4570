"""The tutorial plugin (examples/tutorial-plugin): its observer and interceptor on the toy family.

In-process tests register the plugin module with an isolated manager (``toy_runtime``); the
installed tests put the package into a scratch venv, as a user would with pip, and go through
entry-point discovery and the ``omniloop`` CLI.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from omniloop.testing import build_toy_checkpoint, toy_runtime
from omniloop.testing.toy import DEFAULT_CONFIG

PROJECT = Path(__file__).resolve().parents[2] / "examples" / "tutorial-plugin"
LAYERS = DEFAULT_CONFIG["layers"]


@pytest.fixture
def tutorial(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The plugin module (``omniloop_tutorial.plugin``), importable without installing it."""
    monkeypatch.syspath_prepend(str(PROJECT))
    return importlib.import_module("omniloop_tutorial.plugin")


def run(ckpt: Path, tutorial: ModuleType | None, request: dict[str, Any], **deploy: Any) -> tuple[Any, Any]:
    plugins = [("tutorial", tutorial)] if tutorial is not None else []
    rt = toy_runtime(ckpt, *plugins, **deploy)
    return rt, rt.generate({"task": "t2v", "prompt": "a blue square moving right", **request})


ENABLED = {"plugins": {"step-timer": {}, "block-counter": {}}}


def test_registers_an_observer_and_an_interceptor(tutorial: ModuleType) -> None:
    from omniloop.testing import make_manager

    pm = make_manager(("tutorial", tutorial))
    reg = pm.registry()
    assert pm.records["tutorial"].ok
    assert pm.records["tutorial"].provides == {"observer": ["step-timer"], "interceptor": ["block-counter"]}
    assert reg.observers["step-timer"].kind == "observer"
    assert reg.interceptors["block-counter"].kind == "block_interceptor"


def test_block_counter_counts_every_block_per_branch(tutorial: ModuleType, toy_checkpoint: Path) -> None:
    _, out = run(toy_checkpoint, tutorial, {"diffusion": {"steps": 3, "seed": 0}}, **ENABLED)
    assert out.ok
    counts = out.metrics["plugins"]["block-counter"]
    assert set(counts) == {"cond", "uncond"}  # guidance > 1: two branches, counted separately
    for branch in ("cond", "uncond"):
        assert counts[branch] == {"forwards": 3, "block_calls": 3 * LAYERS}


def test_block_counter_request_params(tutorial: ModuleType, toy_checkpoint: Path) -> None:
    _, out = run(toy_checkpoint, tutorial, {
        "diffusion": {"steps": 2, "guidance_scale": 1.0},
        "plugin_params": {"block-counter": {"per_block": True}},
    }, **ENABLED)
    assert out.metrics["plugins"]["block-counter"]["cond"]["by_block"] == {i: 2 for i in range(LAYERS)}


def test_step_timer_times_every_step(tutorial: ModuleType, toy_checkpoint: Path) -> None:
    rt, out = run(toy_checkpoint, tutorial, {"diffusion": {"steps": 4}}, **ENABLED)
    timer = rt.components_enabled["step-timer"][1]
    times = timer.finished[out.request_id]
    assert times.status == "completed" and times.steps == 4
    assert list(times.node_steps) == ["denoise"]
    assert not timer.running  # per-request state is dropped at request end


def test_step_timer_prints_a_summary_when_configured(
    tutorial: ModuleType, toy_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, out = run(toy_checkpoint, tutorial, {"diffusion": {"steps": 2}},
                 plugins={"step-timer": {"print_summary": True}})
    err = capsys.readouterr().err
    assert f"[step-timer] {out.request_id} completed" in err and "denoise: 2 steps" in err


def test_baseline_enabled_disabled_give_the_same_video(tutorial: ModuleType, toy_checkpoint: Path) -> None:
    """Neither component alters outputs: baseline == enabled == disabled-after-enabled, bit for bit."""
    req = {"diffusion": {"steps": 3, "seed": 11}}
    _, baseline = run(toy_checkpoint, None, req)
    _, enabled = run(toy_checkpoint, tutorial, req, **ENABLED)
    _, disabled = run(toy_checkpoint, tutorial, req)
    assert torch.equal(baseline.artifacts["video"].frames, enabled.artifacts["video"].frames)
    assert torch.equal(baseline.artifacts["video"].frames, disabled.artifacts["video"].frames)
    assert "plugins" not in disabled.metrics


def test_exact_requests_keep_the_counter(tutorial: ModuleType, toy_checkpoint: Path) -> None:
    _, out = run(toy_checkpoint, tutorial, {"diffusion": {"steps": 2}, "exact": True}, **ENABLED)
    assert "block-counter" in out.metrics["plugins"]  # not distribution-altering


def test_bad_config_and_params_are_rejected_naming_the_field(tutorial: ModuleType, toy_checkpoint: Path) -> None:
    from omniloop.errors import DeployError, RequestError

    with pytest.raises(DeployError, match=r"plugins\.step-timer\.keep"):
        toy_runtime(toy_checkpoint, ("tutorial", tutorial), plugins={"step-timer": {"keep": -1}})
    rt, _ = run(toy_checkpoint, tutorial, {"diffusion": {"steps": 1}}, **ENABLED)
    with pytest.raises(RequestError, match=r"plugin_params\.block-counter\.per_block"):
        rt.prepare({"task": "t2v", "prompt": "x", "plugin_params": {"block-counter": {"per_block": 1}}})


# --------------------------------------------------------------------------------------------
# installed with pip into a scratch venv, driven through the CLI
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def venv_with_tutorial(packaging: Any) -> Any:
    venv = packaging.venv("tutorial")
    venv.install(PROJECT, packaging.toy_package())
    return venv


@pytest.mark.slow
def test_installed_plugin_is_listed_ok(venv_with_tutorial: Any) -> None:
    res = venv_with_tutorial.omniloop("plugins", "--json")
    assert res.returncode == 0, res.stderr
    rec = {p["name"]: p for p in json.loads(res.stdout)["plugins"]}["tutorial"]
    assert rec["status"] == "ok", rec
    assert rec["distribution"] == "omniloop-tutorial-plugin" and rec["version"] == "0.1.0"
    assert rec["hook_api"] == ">=1.0,<2"
    assert rec["provides"] == {"observer": ["step-timer"], "interceptor": ["block-counter"]}


@pytest.mark.slow
def test_installed_plugin_runs_through_the_cli(venv_with_tutorial: Any, tmp_path: Path) -> None:
    ckpt = build_toy_checkpoint(tmp_path / "ckpt")
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(
        f"model: {{path: {ckpt}}}\n"
        "plugins:\n  step-timer: {print_summary: true}\n  block-counter: {}\n"
    )
    res = venv_with_tutorial.omniloop(
        "generate", "a blue square moving right", "--deploy", str(deploy), "--steps", "2",
        "--plugin-param", "block-counter.per_block=true", "--out", str(tmp_path / "clip.mp4"), "--json",
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["status"] == "completed" and (tmp_path / "clip.mp4").is_file()
    cond = doc["metrics"]["plugins"]["block-counter"]["cond"]
    assert cond["forwards"] == 2 and cond["block_calls"] == 2 * LAYERS
    assert cond["by_block"] == {str(i): 2 for i in range(LAYERS)}
    assert "[step-timer]" in res.stderr and "denoise: 2 steps" in res.stderr
