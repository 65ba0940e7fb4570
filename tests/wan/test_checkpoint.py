"""Loading diffusers-format checkpoints: detection, HF cache layout, and one clear error per bad file."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omniloop.errors import CheckpointError
from omniloop.request import TaskType
from omniloop_wan.family import WanFamily, describe_checkpoint

CPU = torch.device("cpu")
TF_WEIGHTS = Path("transformer") / "diffusion_pytorch_model.safetensors"


def load(path: Path, dtype: torch.dtype = torch.float32):
    return WanFamily().load(path, device=CPU, dtype=dtype, options={})


@pytest.fixture
def ckpt_copy(tiny_ckpt, tmp_path):
    """A private copy of a tiny checkpoint to break."""

    def get(variant: str = "t2v") -> Path:
        dst = tmp_path / f"copy-{variant}"
        shutil.copytree(tiny_ckpt(variant), dst)
        return dst

    return get


# -- detection --------------------------------------------------------------------------------


def test_detect_accepts_every_tiny_variant(tiny_ckpt):
    fam = WanFamily()
    for variant in ("t2v", "wan22", "i2v", "wan22_i2v", "ti2v"):
        assert fam.detect(tiny_ckpt(variant))


def test_detect_rejects_other_folders(tmp_path):
    fam = WanFamily()
    assert not fam.detect(tmp_path)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    assert not fam.detect(tmp_path)
    (tmp_path / "model_index.json").write_text("{not json")
    assert not fam.detect(tmp_path)


def test_detect_is_cheap_it_reads_no_weights(ckpt_copy):
    path = ckpt_copy()
    (path / TF_WEIGHTS).write_bytes(b"garbage")
    assert WanFamily().detect(path)


def test_kinds_and_tasks_from_configs(tiny_ckpt):
    expect = {
        "t2v": ("wan2.1-t2v", ["t2v"]),
        "wan22": ("wan2.2-t2v-a14b", ["t2v"]),
        "i2v": ("wan2.1-i2v", ["i2v"]),
        "wan22_i2v": ("wan2.2-i2v-a14b", ["i2v"]),
        "ti2v": ("wan2.2-ti2v-5b", ["i2v", "t2v"]),
    }
    for variant, (kind, tasks) in expect.items():
        info = describe_checkpoint(tiny_ckpt(variant))
        assert (info["kind"], info["tasks"]) == (kind, tasks), variant


# -- loading ----------------------------------------------------------------------------------


def test_load_t2v_components(tiny_ckpt):
    model = load(tiny_ckpt("t2v"))
    assert set(model.components) == {"transformer", "vae", "text_encoder", "tokenizer", "scheduler"}
    assert model.config["kind"] == "wan2.1-t2v"
    assert model.config["tasks"] == frozenset({TaskType.T2V})
    assert model.config["size_multiple"] == 16 and model.config["vae_scale_temporal"] == 4
    assert model.weight_version
    assert not any(p.requires_grad for p in model.components["transformer"].parameters())


def test_loaded_weights_equal_the_files(tiny_ckpt):
    path = tiny_ckpt("wan22")
    model = load(path)
    for name in ("transformer", "transformer_2", "vae"):
        state = load_file(str(path / name / "diffusion_pytorch_model.safetensors"))
        ours = model.components[name].state_dict()
        assert set(state) == set(ours)
        assert all(torch.equal(state[k], ours[k]) for k in state), name
    assert not torch.equal(
        model.components["transformer"].proj_out.weight, model.components["transformer_2"].proj_out.weight
    )


def test_bf16_load_keeps_diffusers_fp32_modules(tiny_ckpt):
    # diffusers' from_pretrained(torch_dtype=bf16) keeps WanTransformer3DModel._keep_in_fp32_modules in fp32
    model = load(tiny_ckpt("t2v"), dtype=torch.bfloat16)
    tf = model.components["transformer"]
    keep = tf._keep_in_fp32_modules
    for name, p in tf.named_parameters():
        fp32 = any(m in name.split(".") for m in keep)
        assert p.dtype == (torch.float32 if fp32 else torch.bfloat16), name
    # rotary tables are computed in __init__ (float32, as diffusers builds them), never loaded or cast
    assert tf.rope.freqs_cos.dtype == torch.float32
    assert model.components["vae"].dtype == torch.float32  # the VAE stays fp32 by default


def test_hf_cache_layout_loads_from_repo_folder_and_snapshot(tiny_ckpt, tmp_path):
    """``models--Org--Name/{blobs,refs/main,snapshots/<hash>/...}`` with files linked to blobs."""
    src = tiny_ckpt("t2v")
    repo = tmp_path / "hub" / "models--Wan-AI--Tiny-T2V-Diffusers"
    snap = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    for i, f in enumerate(sorted(p for p in src.rglob("*") if p.is_file())):
        blob = repo / "blobs" / f"blob{i:03d}"
        shutil.copy(f, blob)
        link = snap / f.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    fam = WanFamily()
    for path in (repo, snap):
        assert fam.detect(path)
        model = load(path)
        assert model.path == snap
        assert model.config["kind"] == "wan2.1-t2v"


def test_hf_cache_partial_download_names_the_missing_blob(tiny_ckpt, tmp_path):
    src = tiny_ckpt("t2v")
    snap = tmp_path / "models--x--y" / "snapshots" / "abc"
    shutil.copytree(src, snap)
    target = snap / TF_WEIGHTS
    target.unlink()
    os.symlink("../../../blobs/deadbeef", target)
    with pytest.raises(CheckpointError, match=r"diffusion_pytorch_model\.safetensors.*missing blob"):
        load(snap)


# -- one clear error per bad checkpoint ---------------------------------------------------------


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load(tmp_path / "nope")


def test_missing_model_index(ckpt_copy):
    path = ckpt_copy()
    (path / "model_index.json").unlink()
    with pytest.raises(CheckpointError, match=r"model_index\.json: model_index\.json is missing"):
        load(path)


def test_malformed_model_index(ckpt_copy):
    path = ckpt_copy()
    (path / "model_index.json").write_text('{"_class_name": "WanPipeline",')
    with pytest.raises(CheckpointError, match=r"model_index\.json: .*not valid JSON"):
        load(path)


def test_missing_component_folder(ckpt_copy):
    path = ckpt_copy()
    shutil.rmtree(path / "vae")
    with pytest.raises(CheckpointError, match=r"vae: folder of component 'vae' is missing"):
        load(path)


def test_component_not_declared(ckpt_copy):
    path = ckpt_copy()
    index = json.loads((path / "model_index.json").read_text())
    del index["text_encoder"]
    (path / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="component 'text_encoder' is not declared"):
        load(path)


def test_truncated_weights(ckpt_copy):
    path = ckpt_copy()
    f = path / TF_WEIGHTS
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"transformer/diffusion_pytorch_model\.safetensors: weight file is truncated"):
        load(path)


def test_weights_that_are_not_safetensors(ckpt_copy):
    path = ckpt_copy()
    (path / TF_WEIGHTS).write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=r"diffusion_pytorch_model\.safetensors: not a safetensors file"):
        load(path)


def test_missing_weight_file(ckpt_copy):
    path = ckpt_copy()
    (path / TF_WEIGHTS).unlink()
    with pytest.raises(CheckpointError, match=r"transformer: no weights"):
        load(path)


def test_missing_tensors(ckpt_copy):
    path = ckpt_copy()
    f = path / TF_WEIGHTS
    state = load_file(str(f))
    del state["proj_out.weight"]
    save_file(state, str(f))
    with pytest.raises(CheckpointError, match=r"safetensors: 1 weight\(s\) of WanTransformer3DModel missing, e\.g\. proj_out\.weight"):
        load(path)


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("ffn_dim", 48, r"weight 'blocks\.0\.ffn\..*' has shape"),  # config and weights disagree in shape
        ("num_layers", 3, r"weight\(s\) of WanTransformer3DModel missing, e\.g\. blocks\.2\."),  # more layers than weights
    ],
)
def test_transformer_config_that_disagrees_with_the_weights(ckpt_copy, key, value, message):
    path = ckpt_copy()
    cfg_file = path / "transformer" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg[key] = value
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=message):
        load(path)


def test_malformed_transformer_config(ckpt_copy):
    path = ckpt_copy()
    (path / "transformer" / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"transformer/config\.json: transformer config must be a JSON object"):
        load(path)


def test_missing_tokenizer_files(ckpt_copy):
    path = ckpt_copy()
    (path / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer has neither tokenizer\.json nor spiece\.model"):
        load(path)


def test_missing_scheduler_config(ckpt_copy):
    path = ckpt_copy()
    (path / "scheduler" / "scheduler_config.json").unlink()
    with pytest.raises(CheckpointError, match=r"scheduler_config\.json: scheduler config is missing"):
        load(path)


def test_unknown_scheduler_class(ckpt_copy):
    path = ckpt_copy()
    f = path / "scheduler" / "scheduler_config.json"
    cfg = json.loads(f.read_text())
    cfg["_class_name"] = "NoSuchScheduler"
    f.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unknown scheduler class 'NoSuchScheduler'"):
        load(path)


def test_boundary_ratio_without_second_expert(ckpt_copy):
    path = ckpt_copy()
    index = json.loads((path / "model_index.json").read_text())
    index["boundary_ratio"] = 0.875
    (path / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="boundary_ratio is set but no transformer_2 is declared"):
        load(path)


def test_text_encoder_weights_broken(ckpt_copy):
    path = ckpt_copy()
    f = path / "text_encoder" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"text_encoder/model\.safetensors: weight file is truncated"):
        load(path)


def test_runtime_surfaces_the_checkpoint_error(ckpt_copy):
    from omniloop.runtime import Runtime

    from .conftest import wan_manager

    path = ckpt_copy()
    (path / "vae" / "config.json").write_text("oops")
    with pytest.raises(CheckpointError, match=r"vae/config\.json"):
        Runtime.from_model(path, manager=wan_manager())


# -- sharing --------------------------------------------------------------------------------------


def test_components_are_loaded_once_and_shared_between_pipelines(wan_runtime):
    rt = wan_runtime("ti2v")
    t2v, i2v = rt.pipeline(TaskType.T2V), rt.pipeline(TaskType.I2V)
    assert t2v.components is i2v.components is rt.model.components
    assert t2v.spec.node("denoise").stage is not i2v.spec.node("denoise").stage
