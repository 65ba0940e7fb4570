"""omniloop-kit's checkpoint reading: a family's ``Layout`` checked file by file (one
``CheckpointError`` naming the file), and a real checkpoint's trained size from its configs
(issue 42, finding 1: warned and bounded by the deploy's limits, not refused)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("diffusers")

from omniloop.errors import CheckpointError, DeployError
from omniloop.runtime import Deployment
from omniloop.testing import make_manager
from omniloop_kit import checkpoint as kit
from omniloop_kit.options import choice_option

LAYOUT = kit.Layout(what="a test checkpoint", pipelines=("TestPipeline",), transformer_class="FluxTransformer2DModel",
                    required=("transformer", "tokenizer", "scheduler"), tokenizer_files=("tokenizer.json", "spiece.model"))


@pytest.fixture(scope="module")
def flux_dev(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omniloop_flux.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("flux"), variant="dev")


@pytest.fixture(scope="module")
def sd3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omniloop_sd3.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("sd3"), variant="sd3")


def _real(src: Path, dst: Path) -> Path:
    """A copy without the omniloop.json a tiny checkpoint writes: what a downloaded model looks like."""
    shutil.copytree(src, dst)
    (dst / "omniloop.json").unlink()
    return dst


def _edit(path: Path, **changes: Any) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_layout_checks_name_the_file(flux_dev: Path, tmp_path: Path) -> None:
    root = tmp_path / "ck"
    shutil.copytree(flux_dev, root)
    _, present, configs = kit.check_checkpoint(root, LAYOUT)
    assert present == ["transformer", "tokenizer", "scheduler"] and "transformer" in configs
    _edit(root / "model_index.json", scheduler=["transformers", "FlowMatchEulerDiscreteScheduler"])
    with pytest.raises(CheckpointError, match=r"model_index\.json: component 'scheduler' must come from diffusers"):
        kit.check_checkpoint(root, LAYOUT)
    _edit(root / "model_index.json", scheduler=["diffusers", "FlowMatchEulerDiscreteScheduler"], tokenizer=None)
    with pytest.raises(CheckpointError, match="'tokenizer' is not declared \\(a test checkpoint needs"):
        kit.check_checkpoint(root, LAYOUT)
    _edit(root / "model_index.json", tokenizer=["transformers", "CLIPTokenizer"])
    (root / "tokenizer" / "tokenizer.json").unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match=r"tokenizer: tokenizer has neither tokenizer\.json nor spiece\.model"):
        kit.check_checkpoint(root, LAYOUT)
    consistency: list[str] = []
    kit.check_checkpoint(root, kit.Layout(what="x", pipelines=(), transformer_class="FluxTransformer2DModel",
                                          required=("transformer",)),
                         lambda r, i, c: consistency.append(c["transformer"]["_class_name"]))
    assert consistency == ["FluxTransformer2DModel"]
    other = kit.Layout(what="x", pipelines=(), transformer_class="SD3Transformer2DModel", required=("transformer",))
    with pytest.raises(CheckpointError, match=r"transformer/config\.json: expected an SD3Transformer2DModel"):
        kit.check_checkpoint(root, other)


def test_a_real_checkpoints_trained_size_warns_and_is_bounded_by_the_deploy(flux_dev: Path, sd3: Path,
                                                                            tmp_path: Path) -> None:
    import omniloop_flux.plugin as flux_plugin
    import omniloop_sd3.plugin as sd3_plugin

    flux_real = _real(flux_dev, tmp_path / "flux")
    dep = Deployment({"model": {"path": str(flux_real)}}, manager=make_manager(("flux", flux_plugin), toy=False))
    lim = dep.model_limits
    assert (lim.enforce, lim.max_height, lim.max_width) == ("warn", 64, 64)  # the tiny VAE's sample_size
    assert "vae/config.json sample_size" in (lim.note or "")
    assert dep.limits.max_height == dep.deploy_limits.max_height == 2048  # a warn declaration bounds nothing
    req = {"task": "t2i", "prompt": "a red fox", "diffusion": {"steps": 2, "height": 128, "width": 64}}
    dep.check(req)  # runs: not refused
    (warning,) = dep.limit_warnings(dep.check(req))
    assert warning.startswith("diffusion.height: 128 is outside") and "height up to 64" in warning
    with pytest.raises(Exception, match=r"diffusion\.height"):  # the deploy's limits still bound it
        Deployment({"model": {"path": str(flux_real)}, "limits": {"max_height": 96}},
                   manager=make_manager(("flux", flux_plugin), toy=False)).check(req)

    assert Deployment({"model": {"path": str(flux_dev)}},  # a checkpoint with an omniloop.json: none
                      manager=make_manager(("flux", flux_plugin), toy=False)).model_limits is None

    sd3_real = _real(sd3, tmp_path / "sd3")
    lim = Deployment({"model": {"path": str(sd3_real)}}, manager=make_manager(("sd3", sd3_plugin), toy=False)).model_limits
    assert (lim.enforce, lim.max_height) == ("warn", 32)  # transformer sample_size 4 x VAE scale 8


def test_wan_real_checkpoint_limits_come_from_its_kind(tmp_path: Path) -> None:
    from omniloop_wan.checkpoint import limits
    from omniloop_wan.tiny import build_tiny_checkpoint

    root = _real(build_tiny_checkpoint(tmp_path / "tiny", variant="t2v"), tmp_path / "wan")
    lim = limits(root)
    assert (lim.enforce, lim.max_height, lim.max_width, lim.max_frames) == ("warn", 832, 832, 81)


def test_choice_option() -> None:
    assert choice_option({}, "qkv", ("separate", "fused")) == "separate"
    assert choice_option({"qkv": "fused"}, "qkv", ("separate", "fused")) == "fused"
    with pytest.raises(DeployError, match=r"^options\.qkv: must be one of separate, fused, not 'x'$"):
        choice_option({"qkv": "x"}, "qkv", ("separate", "fused"))
