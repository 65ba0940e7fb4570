"""omniloop.testing's declaration helpers: ``tiny_checkpoints`` (a checkpoint per argument set, in
its own folder) and ``plugin_of`` / ``component_plugin`` (an in-process plugin from specs, each kind
through its own registration hook), with ``PassThroughSteps`` changing nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from omniloop.family import PluginComponentSpec
from omniloop.testing import (
    PassThroughBlocks,
    PassThroughSteps,
    ToyFamily,
    completed_latents,
    component_plugin,
    make_manager,
    plugin_of,
    tiny_checkpoints,
    toy_request,
    toy_runtime,
)


def test_tiny_checkpoints_builds_once_per_argument_set(tmp_path_factory: pytest.TempPathFactory) -> None:
    calls: list[tuple[Path, dict[str, Any]]] = []

    def build(folder: Path, **args: Any) -> Path:
        calls.append((folder, args))
        return folder

    get = tiny_checkpoints(tmp_path_factory, build, "fam", variant="a", scheduler="unipc")
    assert get() == get("a") == get(variant="a", scheduler="unipc")
    assert get("b") != get() and get("b", "euler") != get("b")
    assert [a for _, a in calls] == [{"variant": "a", "scheduler": "unipc"}, {"variant": "b", "scheduler": "unipc"},
                                     {"variant": "b", "scheduler": "euler"}]
    assert [f.name for f, _ in calls] == ["fam-a-unipc0", "fam-b-unipc0", "fam-b-euler0"]
    with pytest.raises(TypeError, match="at most 2 positional arguments"):
        get("a", "unipc", "extra")


def test_plugin_of_registers_each_kind_through_its_hook() -> None:
    specs = [PluginComponentSpec(name="s", kind="step_interceptor", factory=lambda cfg: PassThroughSteps()),
             PluginComponentSpec(name="b", kind="block_interceptor", factory=lambda cfg: PassThroughBlocks()),
             PluginComponentSpec(name="o", kind="observer", factory=lambda cfg: object())]
    fam = ToyFamily()
    pm = make_manager(("declared", plugin_of(*specs, families=[fam])), toy=False)
    reg = pm.registry()
    assert pm.records["declared"].ok, pm.records["declared"].error
    assert reg.families["toy"] is fam
    assert set(reg.interceptors) == {"s", "b"} and set(reg.observers) == {"o"}
    assert [reg.component(n).kind for n in ("s", "b", "o")] == ["step_interceptor", "block_interceptor", "observer"]
    assert plugin_of(hook_api=">=1.1,<2").OMNILOOP_HOOK_API == ">=1.1,<2"


def test_pass_through_interceptors_change_nothing(toy_checkpoint: Path) -> None:
    plain = completed_latents(toy_runtime(toy_checkpoint).generate(toy_request(steps=3)))
    for name, kind, cls in (("s", "step_interceptor", PassThroughSteps), ("b", "block_interceptor", PassThroughBlocks)):
        rt = toy_runtime(toy_checkpoint, (name, component_plugin(name, kind, cls)), plugins={name: {}})
        out = rt.generate(toy_request(steps=3))
        assert torch.equal(completed_latents(out), plain), kind
        assert "plugins" not in out.metrics  # no state, no metrics
