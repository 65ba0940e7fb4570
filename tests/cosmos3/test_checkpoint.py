"""A Cosmos 3 checkpoint is detected from its index, checked file by file before any weight is read
(one ``CheckpointError`` naming the file), and ``python -m omniloop_cosmos3.tiny`` writes one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from omniloop.errors import CheckpointError
from omniloop_cosmos3.checkpoint import check_checkpoint
from omniloop_cosmos3.family import Cosmos3Family


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_detect_and_check(tiny_ckpt):
    fam = Cosmos3Family()
    assert fam.detect(tiny_ckpt("qwen")) and fam.detect(tiny_ckpt("nemotron"))
    _, present = check_checkpoint(tiny_ckpt("qwen"))
    assert "sound_tokenizer" in present
    _, present = check_checkpoint(tiny_ckpt("nemotron"))
    assert "sound_tokenizer" not in present


def test_vae_channels_must_fit(tiny_ckpt, tmp_path):
    root = _copy(tiny_ckpt("nemotron"), tmp_path / "c")
    cfg_path = root / "transformer" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(latent_channel=48, patch_latent_dim=192)
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="latent_channel=48 but the VAE's z_dim is 16"):
        check_checkpoint(root)


def test_missing_component_named(tiny_ckpt, tmp_path):
    root = _copy(tiny_ckpt("nemotron"), tmp_path / "c")
    shutil.rmtree(root / "text_tokenizer")
    with pytest.raises(CheckpointError, match="text_tokenizer"):
        check_checkpoint(root)


def test_tiny_main(tmp_path, capsys):
    from omniloop_cosmos3.tiny import main

    assert main([str(tmp_path / "t"), "--variant", "nemotron"]) == 0
    assert "Cosmos 3 omni" in capsys.readouterr().out
    assert Cosmos3Family().detect(tmp_path / "t")
