"""The shipped checkpoint's compact form: the linear VAE stored as its two projections, the complete
diffusers folder built once into the cache (reused, rebuilt when damaged), and one clear error
when the cache cannot be written."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

CONFIG = {"encoder_hidden_size": 16, "downsampling_ratios": [2, 4], "channel_multiples": [1, 1], "decoder_channels": 8,
          "decoder_input_channels": 8, "audio_channels": 1, "sampling_rate": 8000}


def _projections(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"encoder": torch.randn(8, 8, generator=g), "decoder": torch.randn(8, 8, generator=g)}


def test_build_computes_the_linear_map_of_its_projections():
    from omniloop_tone_demo.linear_vae import build, projections

    proj = _projections()
    vae = build(CONFIG, proj)
    x = torch.randn(2, 1, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mode()
        y = vae.decode(z).sample
    blocks = x.view(2, 8, 8).transpose(1, 2)  # [batch, hop, frames]: frame n holds samples n*8 .. n*8+7
    torch.testing.assert_close(z, proj["encoder"] @ blocks, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.view(2, 8, 8).transpose(1, 2), proj["decoder"] @ z, rtol=1e-5, atol=1e-5)
    got = projections(vae)
    torch.testing.assert_close(got["encoder"], proj["encoder"])
    torch.testing.assert_close(got["decoder"], proj["decoder"])


def test_build_refuses_widths_that_cannot_hold_the_polyphase_split():
    from omniloop_tone_demo.linear_vae import build

    with pytest.raises(ValueError, match="a linear Oobleck needs"):
        build({**CONFIG, "decoder_channels": 4}, _projections())
    with pytest.raises(ValueError, match=r"projections of shape encoder \[8, 8\]"):
        build(CONFIG, {"encoder": torch.zeros(8, 4), "decoder": torch.zeros(4, 8)})


@pytest.fixture()
def compact_folder(tmp_path):
    """A folder with the shipped layout's VAE part (the compact VAE) and stand-ins for the rest."""
    from omniloop_tone_demo.checkpoint_path import REQUIRED, VAE_WEIGHTS
    from omniloop_tone_demo.linear_vae import build, save_compact

    folder = tmp_path / "checkpoint"
    for name in REQUIRED:
        if name.startswith("vae/"):
            continue
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps({"stand-in": name}))
    save_compact(build(CONFIG, _projections()), folder / "vae")
    assert not (folder / VAE_WEIGHTS).exists()
    return folder


def test_materialize_builds_the_complete_folder_once(compact_folder, tmp_path):
    from diffusers import AutoencoderOobleck

    from omniloop_tone_demo.checkpoint_path import VAE_COMPACT, VAE_WEIGHTS, checkpoint_missing, materialize
    from omniloop_tone_demo.linear_vae import load_compact

    assert checkpoint_missing(compact_folder) is None  # the compact VAE counts
    full = materialize(compact_folder, tmp_path / "cache")
    assert full.parent == tmp_path / "cache" and checkpoint_missing(full) is None
    assert (full / VAE_WEIGHTS).is_file() and not (full / VAE_COMPACT).exists()
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".building-")]
    loaded = AutoencoderOobleck.from_pretrained(str(full / "vae"))
    z = torch.randn(1, 8, 4, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(loaded.decode(z).sample, load_compact(compact_folder / "vae").decode(z).sample)
    stamp = (full / VAE_WEIGHTS).stat().st_mtime_ns
    assert materialize(compact_folder, tmp_path / "cache") == full  # reused, not rebuilt
    assert (full / VAE_WEIGHTS).stat().st_mtime_ns == stamp
    (full / VAE_WEIGHTS).unlink()  # damaged by hand: built again
    assert materialize(compact_folder, tmp_path / "cache") == full and (full / VAE_WEIGHTS).is_file()
    (compact_folder / "omniloop.json").write_text("{}")  # other shipped files: another folder
    assert materialize(compact_folder, tmp_path / "cache") != full


def test_a_folder_with_full_weights_is_used_as_it_is(compact_folder, tmp_path):
    from omniloop_tone_demo.checkpoint_path import VAE_WEIGHTS, materialize

    shutil.copy(compact_folder / "vae" / "config.json", compact_folder / VAE_WEIGHTS)
    assert materialize(compact_folder, tmp_path / "cache") == compact_folder


def test_an_unwritable_cache_is_one_clear_error(compact_folder, tmp_path, monkeypatch):
    from omniloop.errors import DeployError
    from omniloop_tone_demo import checkpoint_path, plugin

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("OMNILOOP_TONE_DEMO_CACHE", str(blocker / "cache"))
    monkeypatch.setattr(checkpoint_path, "shipped_dir", lambda: compact_folder)
    with pytest.raises(DeployError, match=r"preset 'tone-demo': cannot write the tone-demo cache folder .*OMNILOOP_TONE_DEMO_CACHE"):
        plugin.preset_path()
