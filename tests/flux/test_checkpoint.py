"""Loading FLUX.1 checkpoints: detection, the variants, and one clear ``CheckpointError`` naming the
file for every bad or inconsistent file — found before any weight is read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from omniloop.errors import CheckpointError
from omniloop_flux import checkpoint as ck
from omniloop_flux.family import FluxFamily, describe_checkpoint

CPU = torch.device("cpu")


def load(path: Path):
    return FluxFamily().load(path, device=CPU, dtype=torch.float32, options={})


@pytest.fixture
def broken(flux_ckpt, tmp_path, monkeypatch):
    """A private copy of the tiny dev checkpoint to break; loading any weight fails the test."""
    dst = tmp_path / "copy"
    shutil.copytree(flux_ckpt("dev"), dst)

    def no_load(*a, **k):
        raise AssertionError("a weight was loaded before the checkpoint was checked")

    monkeypatch.setattr(ck, "load_component", no_load)
    return dst


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_detect_and_describe(flux_ckpt, tmp_path):
    fam = FluxFamily()
    assert fam.detect(flux_ckpt("dev")) and fam.detect(flux_ckpt("schnell"))
    assert not fam.detect(tmp_path)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    assert not fam.detect(tmp_path)
    fill = tmp_path / "fill"
    shutil.copytree(flux_ckpt("dev"), fill)
    _edit_json(fill / "model_index.json", _class_name="FluxFillPipeline")
    assert not fam.detect(fill)  # another input layout: not this family's
    _edit_json(fill / "model_index.json", _class_name="DiffusionPipeline")
    assert fam.detect(fill)  # judged by the transformer
    d = describe_checkpoint(flux_ckpt("schnell"))
    assert d["variant"] == "flux.1-schnell" and d["tasks"] == ["i2i", "t2i"]
    assert d["components"]["tokenizer_2"] == "T5TokenizerFast"
    assert describe_checkpoint(flux_ckpt("dev"))["variant"] == "flux.1-dev"


def test_components_are_the_classes_model_index_names(flux_runtime):
    import transformers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    comps = flux_runtime("dev").model.components
    assert isinstance(comps["transformer"], FluxTransformer2DModel)
    assert isinstance(comps["vae"], AutoencoderKL)
    assert isinstance(comps["scheduler"], FlowMatchEulerDiscreteScheduler)
    assert isinstance(comps["text_encoder"], transformers.CLIPTextModel)
    assert isinstance(comps["text_encoder_2"], transformers.T5EncoderModel)
    assert isinstance(comps["tokenizer"], transformers.CLIPTokenizer)
    assert isinstance(comps["tokenizer_2"], transformers.T5TokenizerFast)


BREAKS = {
    "missing component": (lambda p: _edit_json(p / "model_index.json", text_encoder_2=[None, None]),
                          "model_index.json: component 'text_encoder_2' is not declared"),
    "unknown class": (lambda p: _edit_json(p / "model_index.json", tokenizer=["transformers", "NoSuchTokenizer"]),
                      "transformers has no class 'NoSuchTokenizer'"),
    "wrong library": (lambda p: _edit_json(p / "model_index.json", vae=["transformers", "AutoencoderKL"]),
                      "component 'vae' must come from diffusers"),
    "missing folder": (lambda p: shutil.rmtree(p / "tokenizer_2"), "tokenizer_2: folder of component 'tokenizer_2' is missing"),
    "no tokenizer files": (lambda p: [f.unlink() for f in (p / "tokenizer").iterdir()], "tokenizer: tokenizer has none of"),
    "bad json": (lambda p: (p / "vae" / "config.json").write_text("{oops"), "vae/config.json: vae config is not valid JSON"),
    "no weights": (lambda p: (p / "text_encoder" / "model.safetensors").unlink(), "text_encoder: no weights"),
    "truncated weights": (
        lambda p: (p / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(
            (p / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()[:-100]),
        "diffusion_pytorch_model.safetensors: weight file is truncated"),
    "latent channels": (lambda p: _edit_json(p / "vae" / "config.json", latent_channels=8),
                        "transformer/config.json: in_channels=16 does not fit the VAE's latent_channels=8"),
    "t5 width": (lambda p: _edit_json(p / "text_encoder_2" / "config.json", d_model=64),
                 "joint_attention_dim=32 but the T5 encoder"),
    "clip width": (lambda p: _edit_json(p / "text_encoder" / "config.json", hidden_size=48),
                   "pooled_projection_dim=32 but the CLIP text encoder"),
    "not flux": (lambda p: _edit_json(p / "transformer" / "config.json", _class_name="SD3Transformer2DModel"),
                 "expected a FluxTransformer2DModel"),
}


@pytest.mark.parametrize("case", list(BREAKS))
def test_bad_checkpoint_is_one_error_naming_the_file_before_any_load(broken, case):
    breaker, message = BREAKS[case]
    breaker(broken)
    with pytest.raises(CheckpointError) as err:
        load(broken)
    assert message in str(err.value)
    assert str(broken) in str(err.value)


def test_missing_folder_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint folder does not exist"):
        load(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"model_index\.json is missing"):
        load(tmp_path)


def test_weights_that_disagree_with_their_config_name_the_folder(flux_ckpt, tmp_path):
    """Past the checks: a transformer config whose layer count the weights do not have."""
    dst = tmp_path / "copy"
    shutil.copytree(flux_ckpt("dev"), dst)
    _edit_json(dst / "transformer" / "config.json", num_single_layers=3)
    with pytest.raises(CheckpointError, match=r"transformer: cannot load FluxTransformer2DModel"):
        load(dst)


def test_a_generic_fast_tokenizer_named_in_model_index(flux_ckpt, flux_runtime, tmp_path, make_t2i, make_manager_flux):
    """``PreTrainedTokenizerFast`` over the same ``tokenizer.json``: loaded as diffusers loads it,
    same tokens, same image."""
    from diffusers import FluxPipeline

    from omniloop import Runtime

    dst = tmp_path / "generic"
    shutil.copytree(flux_ckpt("dev"), dst)
    _edit_json(dst / "model_index.json", tokenizer_2=["transformers", "PreTrainedTokenizerFast"])
    rt = Runtime.from_model(dst, manager=make_manager_flux())
    theirs = FluxPipeline.from_pretrained(dst).tokenizer_2
    assert type(rt.model.components["tokenizer_2"]) is type(theirs)
    req = make_t2i(steps=2, prompt="a red fox xyz")
    assert torch.equal(rt.generate(req).artifacts["latents"].tensor,
                       flux_runtime("dev").generate(req).artifacts["latents"].tensor)
