"""The closed-form linear Oobleck: with as many latent channels as the hop it reconstructs
exactly; with fewer it is the PCA projection (unit-variance latents, the kept energy reported)."""

from __future__ import annotations

import pytest
import torch

from omniloop_tone_demo.grammar import random_specs, synthesize


def _vae(latent: int):
    from diffusers import AutoencoderOobleck

    torch.manual_seed(0)
    return AutoencoderOobleck(encoder_hidden_size=2 * latent, downsampling_ratios=[2, 4], channel_multiples=[1, 1],
                              decoder_channels=8, decoder_input_channels=latent, audio_channels=1,
                              sampling_rate=8000).eval()


@pytest.fixture(scope="module")
def clips():
    g = torch.Generator().manual_seed(0)
    return synthesize(random_specs(6, g), gen=g)[..., :2048]


def test_full_rank_linear_vae_reconstructs_exactly(clips):
    from omniloop_tone_demo_training.linear_vae import fit

    vae = _vae(8)  # hop 8, 8 latent channels
    info = fit(vae, clips)
    assert info["hop"] == 8 and info["kept_energy"] == pytest.approx(1.0)
    with torch.no_grad():
        z = vae.encode(clips).latent_dist.mode()
        y = vae.decode(z).sample
    assert z.shape == (6, 8, 256)
    torch.testing.assert_close(y, clips, rtol=1e-4, atol=1e-5)


def test_fewer_channels_keep_the_principal_components(clips):
    from omniloop_tone_demo_training.linear_vae import fit

    vae = _vae(4)
    info = fit(vae, clips)
    assert 0.5 < info["kept_energy"] < 1.0
    with torch.no_grad():
        post = vae.encode(clips).latent_dist
        z = post.mode()
        y = vae.decode(z).sample
    assert z.transpose(0, 1).flatten(1).pow(2).mean(dim=1).sqrt().sub(1).abs().max() < 1e-3  # unit second moment
    assert float(post.std.max()) < 1e-3
    err = float((y - clips).pow(2).sum() / clips.pow(2).sum())
    assert err == pytest.approx(1 - info["kept_energy"], abs=1e-3)
