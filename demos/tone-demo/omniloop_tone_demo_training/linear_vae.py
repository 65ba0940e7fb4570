"""Fitting tone-demo's linear ``AutoencoderOobleck`` in closed form (principal components).

The architecture and its fixed weights (identity snakes, zero residual units, polyphase strided
convolutions) are :mod:`omniloop_tone_demo.linear_vae`'s; :func:`fit` sets the two learned
projections: the encoder's last convolution projects each ``hop``-sample block onto the top
``latent_channels`` principal components of the training clips' blocks (scaled to unit variance),
the decoder's first convolution maps them back: the least-squares linear autoencoder of the data.
"""

from __future__ import annotations

import math

import torch

from omniloop_tone_demo.linear_vae import LINEAR_VAE_CONFIG, make_structure, set_projections


@torch.no_grad()
def features(vae, clips: torch.Tensor) -> torch.Tensor:
    """The encoder's output before its last convolution (the polyphase blocks), ``[N, C, frames]``."""
    enc = vae.encoder
    h = enc.conv1(clips)
    for block in enc.block:
        h = block(h)
    return enc.snake1(h)


@torch.no_grad()
def fit(vae, clips: torch.Tensor) -> dict[str, float]:
    """Make ``vae`` the PCA autoencoder of ``clips`` ``[N, 1, samples]``; returns the kept share of
    the blocks' energy."""
    hop = int(math.prod(vae.config.downsampling_ratios))
    latent = vae.config.decoder_input_channels
    make_structure(vae)  # raises when the widths cannot hold a lossless polyphase split
    f = features(vae, clips)[:, :hop]  # [N, hop, frames]
    x = f.transpose(1, 2).reshape(-1, hop).double()
    cov = x.T @ x / x.shape[0]
    evals, evecs = torch.linalg.eigh(cov)
    order = torch.argsort(evals, descending=True)
    evals, evecs = evals[order].clamp_min(1e-12), evecs[:, order]
    p = evecs[:, :latent].T  # [latent, hop]
    std = evals[:latent].sqrt()
    set_projections(vae, (p / std[:, None]).float(), (p.T * std[None, :]).float())
    return {"kept_energy": float(evals[:latent].sum() / evals.sum()), "hop": hop, "latent_channels": latent}


def main(argv: list[str] | None = None) -> None:
    """Fit the linear VAE on ``--clips`` random clips and score its reconstructions of the 96
    evaluation prompts with the tone-demo evaluator (the VAE gate of the recipe)."""
    import argparse
    import json
    import time

    from diffusers import AutoencoderOobleck

    from omniloop_tone_demo.evaluate import evaluate_clips
    from omniloop_tone_demo.grammar import eval_specs, random_specs, synthesize

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--clips", type=int, default=64)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    vae = AutoencoderOobleck(**LINEAR_VAE_CONFIG).eval()
    g = torch.Generator().manual_seed(0)
    clips = synthesize(random_specs(a.clips, g), gen=g)
    t0 = time.time()
    info = fit(vae, clips)
    info["fit_seconds"] = round(time.time() - t0, 1)
    specs = eval_specs(96)
    gt = synthesize(specs, gen=torch.Generator().manual_seed(5))
    with torch.no_grad():
        z = vae.encode(gt).latent_dist.mode()
        rec = vae.decode(z).sample
    info["latent_std"] = float(z.std())
    info["relative_error"] = float((rec - gt).pow(2).mean() / gt.pow(2).mean())
    info["reconstruction_adherence"] = evaluate_clips([c[0].numpy() for c in rec], specs).accuracy
    info["params"] = sum(p.numel() for p in vae.parameters())
    print(json.dumps(info, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
