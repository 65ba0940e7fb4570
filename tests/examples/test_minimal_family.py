"""The complete minimal family of CONTRIBUTING.md ("Writing a family"): examples/minimal-family."""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path
from types import ModuleType

import pytest

from omniloop.errors import DeployError
from omniloop.runtime import Runtime, deploy_for_model
from omniloop.testing import build_toy_checkpoint, make_manager
from omniloop.testing.conformance import check_family

PROJECT = Path(__file__).resolve().parents[2] / "examples" / "minimal-family"


@pytest.fixture
def minimal(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(PROJECT))
    return importlib.import_module("omniloop_minimal.plugin")


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return build_toy_checkpoint(tmp_path / "mini", family="minimal")


def test_it_is_small() -> None:
    lines = [ln for ln in (PROJECT / "omniloop_minimal" / "plugin.py").read_text().splitlines()
             if ln.strip() and not ln.strip().startswith("#")]
    assert len(lines) <= 60


def test_it_registers_its_declaration_without_warnings(minimal: ModuleType) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reg = make_manager(("minimal", minimal), toy=False).registry()
    fam = reg.families["minimal"]
    assert fam.capabilities.block_interceptors and fam.capabilities.options == frozenset()


def test_it_passes_the_family_conformance_kit(minimal: ModuleType, ckpt: Path) -> None:
    manager = make_manager(("minimal", minimal), toy=False)
    check_family(lambda: Runtime.from_model(ckpt, manager=manager), {"task": "t2v", "prompt": "a red fox"})
    rt = Runtime.from_model(ckpt, manager=manager)
    out = rt.generate({"task": "t2v", "prompt": "a red fox", "outputs": {"return_latents": True}})
    assert out.artifacts["video"].frames.shape == (3, 16, 16, 3) and "latents" in out.artifacts


def test_what_it_does_not_declare_is_refused(minimal: ModuleType, ckpt: Path) -> None:
    import omniloop_offload.plugin as offload_plugin  # the offload mechanism installed: the family refuses it

    manager = make_manager(("minimal", minimal), ("offload", offload_plugin), toy=False)
    with pytest.raises(DeployError, match=r"^options\.vae_tiling: family 'minimal' does not read this option"):
        Runtime(deploy_for_model(ckpt, options={"vae_tiling": True}), manager=manager)
    with pytest.raises(DeployError, match=r"^offload: family 'minimal' does not support offload"):
        Runtime(deploy_for_model(ckpt, offload="model"), manager=manager)
