"""Per-model limits (issue 42, finding 1): a checkpoint's ``omniloop.json`` ``limits`` tighten the
deploy's limits, so a request outside the model's range is refused before any compute with one
line naming the field and the model's range; ``enforce: warn`` runs it with a warning; a malformed
declaration is one DeployError naming the file. The shipped demos declare 64x64."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from omniloop.errors import DeployError, RequestError
from omniloop.runtime import Deployment, Runtime
from omniloop.testing import make_manager, toy_request
from omniloop.testing.toy import build_toy_checkpoint


def _with_limits(tmp_path: Path, limits: Any) -> Path:
    ck = build_toy_checkpoint(tmp_path / "ck")
    (ck / "omniloop.json").write_text(json.dumps({"limits": limits}))
    return ck


def _deploy(ck: Path, **extra: Any) -> dict[str, Any]:
    return {"model": {"path": str(ck)}, **extra}


def test_declared_range_refused_before_weights_load(tmp_path: Path) -> None:
    ck = _with_limits(tmp_path, {"min_height": 16, "max_height": 16, "max_width": 32, "max_frames": 3,
                                 "note": "trained at 3x16x16"})
    dep = Deployment(_deploy(ck), manager=make_manager())
    assert dep.deploy.limits.max_height == 16 and dep.deploy.limits.max_frames == 3  # effective limits
    assert dep.deploy_limits.max_height == 2048  # the deploy's own, kept
    with pytest.raises(RequestError) as e:
        dep.check(toy_request(diffusion={"height": 64, "steps": 2}))
    assert e.value.path == "diffusion.height"
    assert "16..16" in e.value.message and "trained at 3x16x16" in e.value.message and str(ck) in e.value.message
    with pytest.raises(RequestError) as e:
        dep.check(toy_request(diffusion={"height": 8, "steps": 2}))  # below the minimum too
    assert e.value.path == "diffusion.height"
    with pytest.raises(RequestError) as e:
        dep.check(toy_request(diffusion={"frames": 5, "steps": 2}))
    assert e.value.path == "diffusion.frames" and "up to 3" in e.value.message
    dep.check(toy_request(diffusion={"height": 16, "width": 16, "frames": 3, "steps": 2}))


def test_deploy_limit_below_the_model_still_wins(tmp_path: Path) -> None:
    ck = _with_limits(tmp_path, {"max_height": 64})
    dep = Deployment(_deploy(ck, limits={"max_height": 32}), manager=make_manager())
    assert dep.deploy.limits.max_height == 32
    with pytest.raises(RequestError, match="above this deployment's limit of 32"):
        dep.check(toy_request(diffusion={"height": 48, "steps": 2}))


def test_in_range_runs_and_the_runtime_sees_effective_limits(tmp_path: Path) -> None:
    ck = _with_limits(tmp_path, {"max_height": 16, "max_width": 16})
    rt = Runtime(_deploy(ck), manager=make_manager())
    assert rt.options["deploy"].limits.max_height == 16  # what families' resolve reads
    assert rt.describe()["model_limits"] == {"max_height": 16, "max_width": 16, "enforce": "refuse"}
    out = rt.generate(toy_request(steps=2))
    assert out.ok
    with pytest.raises(RequestError, match=r"diffusion\.width"):
        rt.prepare(toy_request(steps=2, diffusion={"width": 32, "steps": 2}))


def test_warn_declaration_runs_with_one_warning(tmp_path: Path) -> None:
    ck = _with_limits(tmp_path, {"max_height": 16, "enforce": "warn", "note": "trained at 16"})
    rt = Runtime(_deploy(ck), manager=make_manager())
    assert rt.deploy.limits.max_height == 2048  # bounded by the deploy's limits only
    ex = rt.prepare(toy_request(diffusion={"height": 32, "steps": 2}))
    warnings = ex.state.metrics["warnings"]
    assert any(w.startswith("diffusion.height: 32 is outside") and "may degrade" in w for w in warnings), warnings
    assert ex.run().ok


@pytest.mark.parametrize(("limits", "field"), [
    ({"max_height": 0}, "limits.max_height"),
    ({"max_height": "big"}, "limits.max_height"),
    ({"bogus": 1}, "limits"),
    ({"min_frames": 9, "max_frames": 5}, "limits.min_frames"),
    ({"enforce": "maybe"}, "limits.enforce"),
])
def test_malformed_declaration_is_one_deploy_error(tmp_path: Path, limits: Any, field: str) -> None:
    ck = _with_limits(tmp_path, limits)
    with pytest.raises(DeployError) as e:
        Deployment(_deploy(ck), manager=make_manager())
    assert str(ck / "omniloop.json") in str(e.value) and field in str(e.value)


def test_no_declaration_changes_nothing(tmp_path: Path) -> None:
    ck = build_toy_checkpoint(tmp_path / "ck")
    dep = Deployment(_deploy(ck), manager=make_manager())
    assert dep.model_limits is None and dep.deploy.limits == dep.deploy_limits


# -- the shipped demos --------------------------------------------------------------------------

def _demo_manager() -> Any:
    pytest.importorskip("diffusers")
    import omniloop_adapters.plugin as adapters_plugin
    import omniloop_flux.plugin as flux_plugin
    import omniloop_flux_demo.plugin as flux_demo_plugin
    import omniloop_wan.plugin as wan_plugin
    import omniloop_wan_demo.plugin as wan_demo_plugin

    # wan-demo-fast is wan-demo + its fast LoRA fused at load: it needs the adapters mechanism
    return make_manager(("wan", wan_plugin), ("wan-demo", wan_demo_plugin), ("flux", flux_plugin),
                        ("flux-demo", flux_demo_plugin), ("adapters", adapters_plugin), toy=False)


@pytest.mark.parametrize(("args", "field", "range_"), [
    (["a red star at the top left", "--model", "flux-demo", "--height", "256", "--width", "256"], "diffusion.height", "height 64..64"),
    (["a yellow triangle moving right", "--model", "wan-demo-fast", "--height", "2048", "--width", "2048"], "diffusion.height", "height 64..64"),
    (["a yellow triangle moving right", "--model", "wan-demo", "--width", "1024"], "diffusion.width", "width 64..64"),
    (["a yellow triangle moving right", "--model", "wan-demo", "--frames", "33"], "diffusion.frames", "frames up to 17"),
])
def test_demo_presets_refuse_sizes_they_were_not_trained_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              args: list[str], field: str, range_: str) -> None:
    from omniloop_cli import cli

    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(cli, ["generate", *args], obj=_demo_manager())
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}: ") and range_ in lines[0], res.stderr
    assert "omniloop.json limits" in lines[0]
    assert not (tmp_path / "out").exists()  # nothing written, nothing computed


def test_demo_presets_declare_their_training_size() -> None:
    mgr = _demo_manager()
    for preset in ("wan-demo", "wan-demo-fast", "wan-demo-causal", "flux-demo"):
        dep = Deployment({"model": {"preset": preset}}, manager=mgr)
        lim = dep.deploy.limits
        assert (lim.max_height, lim.max_width) == (64, 64), preset
        assert dep.model_limits is not None and dep.model_limits.min_height == 64


# -- declared tasks -----------------------------------------------------------------------------

def test_declared_tasks_narrow_what_a_checkpoint_advertises(tmp_path: Path) -> None:
    ck = build_toy_checkpoint(tmp_path / "ck")
    (ck / "omniloop.json").write_text(json.dumps({"tasks": ["t2v"]}))
    dep = Deployment(_deploy(ck), manager=make_manager())
    assert dep.declared_tasks == frozenset({"t2v"})
    # the toy family inspects its checkpoints (that view wins); without inspect the declaration is used
    assert {t.value for t in dep.supported_tasks} == {"t2v", "t2i"}
    dep.inspect = lambda: None  # type: ignore[method-assign]
    assert {t.value for t in dep.supported_tasks} == {"t2v"}


@pytest.mark.parametrize("tasks", [[], "t2v", ["t2v", "paint"], [1]])
def test_malformed_declared_tasks_is_one_deploy_error(tmp_path: Path, tasks: Any) -> None:
    ck = build_toy_checkpoint(tmp_path / "ck")
    (ck / "omniloop.json").write_text(json.dumps({"tasks": tasks}))
    with pytest.raises(DeployError, match=r"omniloop.json: tasks: expected a non-empty list"):
        Deployment(_deploy(ck), manager=make_manager())
