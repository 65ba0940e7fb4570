"""Tiny checkpoints (builder, script entry, tokenizer) and the plugin registration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from omniloop_wan.tiny import VARIANTS, build_tiny_checkpoint


def test_tiny_checkpoint_is_small_fast_and_diffusers_format(tmp_path):
    t0 = time.perf_counter()
    path = build_tiny_checkpoint(tmp_path / "t", variant="wan22", seed=1)
    assert time.perf_counter() - t0 < 5.0
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert size < 1_000_000
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline" and index["boundary_ratio"] == 0.875
    for comp in ("transformer", "transformer_2", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert (path / comp).is_dir()
    assert (path / "transformer" / "diffusion_pytorch_model.safetensors").is_file()


def test_tiny_builder_is_deterministic_and_leaves_the_global_rng(tmp_path):
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_tiny_checkpoint(tmp_path / "a", seed=5)
    after = torch.rand(1)
    b = build_tiny_checkpoint(tmp_path / "b", seed=5)
    assert torch.equal(before, after)
    f = "transformer/diffusion_pytorch_model.safetensors"
    assert (a / f).read_bytes() == (b / f).read_bytes()


def test_tiny_builder_rejects_unknown_variant(tmp_path):
    with pytest.raises(ValueError, match="variant must be one of"):
        build_tiny_checkpoint(tmp_path, variant="t2i")
    assert set(VARIANTS) == {"t2v", "wan22", "i2v", "wan22_i2v", "ti2v"}


def test_tokenizer_is_a_real_tokenizer_file(tiny_ckpt):
    from transformers import AutoTokenizer, T5TokenizerFast

    folder = tiny_ckpt("t2v") / "tokenizer"
    for cls in (AutoTokenizer, T5TokenizerFast):
        tok = cls.from_pretrained(str(folder), local_files_only=True)
        enc = tok(["a red fox jumps"], padding="max_length", max_length=16, truncation=True)
        ids = enc["input_ids"][0]
        assert len(ids) == 16 and ids[4] == tok.eos_token_id and ids[5:] == [tok.pad_token_id] * 11
        assert tok.convert_ids_to_tokens(ids[:4]) == ["\u2581a", "\u2581red", "\u2581fox", "\u2581jumps"]
    assert tok.model_max_length == 512


def test_script_entry(tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, "-m", "omniloop_wan.tiny", str(out), "--variant", "i2v"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "wrote tiny Wan checkpoint (i2v" in proc.stdout
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == "WanImageToVideoPipeline"
    assert (out / "image_encoder" / "model.safetensors").is_file()


def test_entry_point_registers_the_wan_family():
    from importlib.metadata import entry_points

    eps = {ep.name: ep for ep in entry_points(group="omniloop.plugins")}
    assert eps["wan"].value == "omniloop_wan.plugin"
    module = eps["wan"].load()
    assert module.OMNILOOP_HOOK_API == ">=1.0,<2"


def test_registry_has_the_family_through_discovery():
    from omniloop.plugins import PluginManager

    registry = PluginManager().registry()
    fam = registry.families["wan"]
    assert fam.name == "wan" and fam.capabilities.block_interceptors
    assert {t.value for t in fam.tasks} == {"t2v", "i2v"}


def test_runtime_from_model_with_installed_plugins(tiny_ckpt, t2v_request):
    """End to end through entry-point discovery (needs a scheduler plugin installed)."""
    from omniloop.plugins import PluginManager
    from omniloop.runtime import Runtime

    if "serial" not in PluginManager().registry().schedulers:
        pytest.skip("no 'serial' scheduler plugin installed")
    rt = Runtime.from_model(tiny_ckpt("t2v"))
    assert rt.family.name == "wan"
    out = rt.generate(t2v_request(steps=1))
    assert out.ok, out.error
    assert tuple(out.artifacts["video"].frames.shape) == (9, 32, 32, 3)
