"""Fixtures for omniloop-comfyui: ComfyUI's published workflow templates (the
``comfyui-workflow-templates-json`` package from PyPI, a test dependency in the Makefile) and tiny
checkpoints of the Wan, FLUX.1 and SD3 families behind the templates' model names (aliases)."""

from __future__ import annotations

import copy
import importlib.resources
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("transformers")


def template(name: str) -> dict[str, Any]:
    """A template of ComfyUI's package (editor format), as published."""
    pkg = pytest.importorskip("comfyui_workflow_templates_json")
    root = importlib.resources.files(pkg) / "templates"
    return json.loads((root / f"{name}.json").read_text(encoding="utf-8"))


def set_widgets(workflow: dict[str, Any], node_id: int, *, subgraph: int | None = None, **values: Any) -> dict[str, Any]:
    """A copy of an editor workflow with some widget values of one node changed (by input name);
    ``subgraph``: the node is inside the workflow's ``definitions.subgraphs[subgraph]``."""
    from omniloop_comfyui.nodes import SPECS

    wf = copy.deepcopy(workflow)
    nodes = wf["nodes"] if subgraph is None else wf["definitions"]["subgraphs"][subgraph]["nodes"]
    node = next(n for n in nodes if n["id"] == node_id)
    spec = SPECS[node["type"]]
    k = 0
    for i in spec.inputs:
        if not i.widget:
            continue
        if i.name in values:
            node["widgets_values"][k] = values.pop(i.name)
        k += 2 if i.control_after_generate else 1
    assert not values, f"no widgets {sorted(values)} on {node['type']}"
    return wf


def manager(*names: str) -> Any:
    from omniloop.testing import make_manager

    plugins = []
    for n in names:
        mod = __import__(f"omniloop_{n}.plugin", fromlist=["plugin"])
        plugins.append((n, mod))
    return make_manager(*plugins, toy=False)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    """``tiny(family, variant)`` → a tiny checkpoint path, built once per session."""
    cache: dict[tuple[str, str], Path] = {}

    def get(family: str, variant: str) -> Path:
        key = (family, variant)
        if key not in cache:
            mod = __import__(f"omniloop_{family}.tiny", fromlist=["tiny"])
            kw = {"scheduler": "flow_euler"} if family == "wan" else {}
            cache[key] = mod.build_tiny_checkpoint(tmp_path_factory.mktemp(f"{family}-{variant}"), variant=variant, **kw)
        return cache[key]

    return get


@pytest.fixture
def templates():
    return template


@pytest.fixture
def widgets():
    return set_widgets


@pytest.fixture
def family_manager():
    return manager
