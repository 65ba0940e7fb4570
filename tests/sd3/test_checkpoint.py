"""Bad checkpoints: one ``CheckpointError`` naming the file, raised before any weight is loaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from omniloop.errors import CheckpointError
from omniloop_sd3 import checkpoint as ck
from omniloop_sd3.family import SD3Family, describe_checkpoint


@pytest.fixture
def broken(tiny_ckpt, tmp_path: Path):
    """A writable copy of the tiny checkpoint to break."""
    def copy(variant: str = "sd35-medium") -> Path:
        dst = tmp_path / "ckpt"
        shutil.copytree(tiny_ckpt(variant), dst)
        return dst

    return copy


def _edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _load(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_weights(*a: Any, **k: Any) -> None:
        raise AssertionError("weights were loaded before the checkpoint was validated")

    monkeypatch.setattr(ck, "load_model", no_weights)
    import torch

    SD3Family().load(path, device=torch.device("cpu"), dtype=torch.float32, options={})


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


CASES = {
    "no model_index": (lambda r: (r / "model_index.json").unlink(), "model_index.json", "missing"),
    "undeclared text_encoder_2": (
        lambda r: _edit_json(r / "model_index.json", text_encoder_2=[None, None]), "model_index.json", "text_encoder_2"),
    "T5 without its tokenizer": (
        lambda r: _edit_json(r / "model_index.json", tokenizer_3=[None, None]), "model_index.json", "tokenizer_3"),
    "missing vae folder": (lambda r: shutil.rmtree(r / "vae"), "vae", "missing"),
    "truncated transformer weights": (
        lambda r: _truncate(r / "transformer" / "diffusion_pytorch_model.safetensors"),
        "diffusion_pytorch_model.safetensors", "truncated"),
    "text encoder config not JSON": (
        lambda r: (r / "text_encoder" / "config.json").write_text("{oops"), "text_encoder/config.json", "not valid JSON"),
    "tokenizer without files": (lambda r: (r / "tokenizer_2" / "tokenizer.json").unlink(), "tokenizer_2", "tokenizer"),
    "pooled dim mismatch": (
        lambda r: _edit_json(r / "transformer" / "config.json", pooled_projection_dim=48),
        "transformer/config.json", "pooled_projection_dim=48"),
    "T5 width mismatch": (
        lambda r: _edit_json(r / "text_encoder_3" / "config.json", d_model=24),
        "text_encoder_3/config.json", "joint_attention_dim"),
    "VAE channels mismatch": (
        lambda r: _edit_json(r / "vae" / "config.json", latent_channels=4), "vae/config.json", "latent_channels=4"),
    "unknown class": (
        lambda r: _edit_json(r / "model_index.json", tokenizer=["transformers", "NoSuchTokenizer"]),
        "model_index.json", "NoSuchTokenizer"),
    "foreign library": (
        lambda r: _edit_json(r / "model_index.json", vae=["os", "system"]), "model_index.json", "'os'"),
    "wrong transformer class": (
        lambda r: _edit_json(r / "transformer" / "config.json", _class_name="FluxTransformer2DModel"),
        "transformer/config.json", "SD3Transformer2DModel"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_checkpoint_is_one_error_naming_the_file(broken, monkeypatch, case):
    root = broken()
    breaker, where, what = CASES[case]
    breaker(root)
    with pytest.raises(CheckpointError) as err:
        _load(root, monkeypatch)
    msg = str(err.value)
    assert where in msg and what in msg, msg


def test_detect_and_describe(tiny_ckpt, tmp_path):
    fam = SD3Family()
    assert fam.detect(tiny_ckpt()) and not fam.detect(tmp_path)
    d = describe_checkpoint(tiny_ckpt("sd35-medium"))
    assert d["qk_norm"] == "rms_norm" and d["dual_attention_layers"] == [0, 1]
    assert "text_encoder_3" in d["components"]
    assert "text_encoder_3" not in describe_checkpoint(tiny_ckpt("sd35-medium", t5=False))["components"]


def test_components_load_by_the_class_model_index_names(sd3_runtime):
    comps = sd3_runtime().model.components
    # the tiny checkpoint declares generic fast tokenizers (tokenizer.json) for CLIP and T5TokenizerFast for T5
    assert type(comps["tokenizer"]).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
    assert "T5" in type(comps["tokenizer_3"]).__name__
    assert type(comps["text_encoder"]).__name__ == "CLIPTextModelWithProjection"
    assert type(comps["transformer"]).__name__ == "SD3Transformer2DModel"
