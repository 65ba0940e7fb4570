"""The complete minimal family of CONTRIBUTING.md ("Writing a family"): examples/minimal-family, a
tiny diffusers-format text-to-image family on omniloop-kit with its own tiny checkpoint."""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path
from types import ModuleType

import pytest

from omniloop.errors import DeployError
from omniloop.runtime import Runtime, deploy_for_model
from omniloop.testing import make_manager
from omniloop.testing.conformance import check_family

PROJECT = Path(__file__).resolve().parents[2] / "examples" / "minimal-family"


@pytest.fixture
def minimal(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(PROJECT))
    return importlib.import_module("omniloop_minimal.plugin")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(PROJECT))
        tiny = importlib.import_module("omniloop_minimal.tiny")
        return tiny.build_tiny_checkpoint(tmp_path_factory.mktemp("mini") / "ckpt")


def test_it_is_small() -> None:
    lines = [ln for ln in (PROJECT / "omniloop_minimal" / "plugin.py").read_text().splitlines()
             if ln.strip() and not ln.strip().startswith("#")]
    assert len(lines) <= 60


def test_it_registers_its_declaration_without_warnings(minimal: ModuleType) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reg = make_manager(("minimal", minimal), toy=False).registry()
    caps = reg.families["minimal"].capabilities
    # it declares what it serves: the kit's loop returns latents; its forward runs the transformer
    # whole, so it takes no block interceptors, and it reads no deploy options
    assert caps.returns_latents and not caps.block_interceptors and caps.options == frozenset()


def test_it_passes_the_family_conformance_kit(minimal: ModuleType, ckpt: Path) -> None:
    manager = make_manager(("minimal", minimal), toy=False)
    check_family(lambda: Runtime.from_model(ckpt, manager=manager), {"task": "t2i", "prompt": "a red fox"}, output="image")
    rt = Runtime.from_model(ckpt, manager=manager)
    out = rt.generate({"task": "t2i", "prompt": "a red fox", "outputs": {"return_latents": True}})
    assert out.artifacts["image"].pixels.shape == (32, 32, 3) and out.artifacts["latents"].tensor.shape == (1, 4, 16, 16)


def test_it_checks_the_checkpoint_and_the_request(minimal: ModuleType, ckpt: Path, tmp_path: Path) -> None:
    import shutil

    from omniloop.errors import CheckpointError, RequestError

    manager = make_manager(("minimal", minimal), toy=False)
    rt = Runtime.from_model(ckpt, manager=manager)
    with pytest.raises(RequestError, match=r"^diffusion\.height"):
        rt.generate({"task": "t2i", "prompt": "a red fox", "diffusion": {"height": 33}})
    broken = shutil.copytree(ckpt, tmp_path / "broken")
    (broken / "vae" / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match="vae config is not valid JSON"):
        Runtime.from_model(broken, manager=manager)


def test_what_it_does_not_declare_is_refused(minimal: ModuleType, ckpt: Path) -> None:
    import omniloop_offload.plugin as offload_plugin  # the offload mechanism installed: the family refuses it

    manager = make_manager(("minimal", minimal), ("offload", offload_plugin), toy=False)
    with pytest.raises(DeployError, match=r"^options\.vae_tiling: family 'minimal' does not read this option"):
        Runtime(deploy_for_model(ckpt, options={"vae_tiling": True}), manager=manager)
    with pytest.raises(DeployError, match=r"^offload: family 'minimal' does not support offload"):
        Runtime(deploy_for_model(ckpt, offload="model"), manager=manager)
