"""Fixtures for composed deployments: a tiny Qwen2 checkpoint (the upsampler) and a tiny Wan2.1
T2V checkpoint (the video model), built once per session, and a plugin manager holding only the
qwen family (which registers ``prompt-upsample``), the wan family, omniloop-compose (the runtime
loader of composed deploys) and the serial scheduler."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

import omniloop_compose.plugin as compose_plugin
import omniloop_qwen.plugin as qwen_plugin
import omniloop_wan.plugin as wan_plugin
from omniloop.testing import make_manager


def _manager() -> Any:
    return make_manager(("qwen", qwen_plugin), ("wan", wan_plugin), ("compose", compose_plugin), toy=False)


@pytest.fixture(scope="session")
def compose_manager() -> Any:
    """``compose_manager()`` → a fresh manager: the qwen and wan families, the inline serial scheduler."""
    return _manager


@pytest.fixture(scope="session")
def tiny_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from omniloop_qwen.tiny import build_tiny_checkpoint as build_qwen
    from omniloop_wan.tiny import build_tiny_checkpoint as build_wan

    return {"qwen": build_qwen(tmp_path_factory.mktemp("qwen"), arch="qwen2"),
            "wan": build_wan(tmp_path_factory.mktemp("wan"), variant="t2v")}


@pytest.fixture(scope="session")
def composed_deploy(tiny_paths: dict[str, Path]) -> dict[str, Any]:
    return {"pipeline": "prompt-upsample",
            "models": {"upsampler": {"path": str(tiny_paths["qwen"])}, "video": {"path": str(tiny_paths["wan"])}},
            "pipeline_options": {"upsample": {"instruction": "expand this prompt into a detailed video description",
                                              "max_tokens": 12}}}
