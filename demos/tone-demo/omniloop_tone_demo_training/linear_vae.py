"""A linear ``AutoencoderOobleck`` fitted in closed form (principal components).

The Oobleck architecture is kept as diffusers defines it; its weights are set so that it computes a
linear map: every Snake activation is the identity (``alpha = exp(-20)``: ``sin^2(alpha x)`` is
below float32 round-off), every residual unit adds zero (``weight_g = 0``), the strided
convolutions rearrange samples into channels (space-to-depth: after the blocks, channel
``j * c + i`` of latent frame ``n`` holds polyphase sample ``n * hop + ...``) and the transposed ones
undo it. The encoder's last convolution projects each ``hop``-sample block onto the top
``latent_channels`` principal components of the training clips' blocks (scaled to unit variance),
the decoder's first convolution maps them back: the least-squares linear autoencoder of the data.
The posterior's std channels are constant (``softplus(-12)``, about 6e-6).
"""

from __future__ import annotations

import math

import torch

SNAKE_OFF = -20.0


def _set_wn(conv, weight: torch.Tensor) -> None:
    """Give an old-style weight-normed conv (dim 0) the effective ``weight``."""
    norm = weight.flatten(1).norm(dim=1)
    v = weight.clone()
    v[norm == 0] = 1.0
    conv.weight_v.data.copy_(v)
    conv.weight_g.data.copy_(norm.view(-1, *([1] * (weight.dim() - 1))))


def _identity_snakes_and_residuals(module) -> None:
    from diffusers.models.autoencoders.autoencoder_oobleck import OobleckResidualUnit, Snake1d

    for m in module.modules():
        if isinstance(m, Snake1d):
            m.alpha.data.fill_(SNAKE_OFF)
            m.beta.data.zero_()
        elif isinstance(m, OobleckResidualUnit):
            for conv in (m.conv1, m.conv2):
                _set_wn(conv, torch.zeros_like(conv.weight_v))
                conv.bias.data.zero_()


def _polyphase(vae) -> None:
    """Encoder: conv1 passes the waveform in channel 0, each strided conv is space-to-depth;
    decoder: each transposed conv is depth-to-space, conv2 reads channel 0."""
    enc, dec = vae.encoder, vae.decoder
    w = torch.zeros_like(enc.conv1.weight_v)
    w[0, 0, 3] = 1.0
    _set_wn(enc.conv1, w)
    enc.conv1.bias.data.zero_()
    c = 1
    for block, s in zip(enc.block, vae.config.downsampling_ratios, strict=True):
        conv = block.conv1
        w = torch.zeros_like(conv.weight_v)
        pad = math.ceil(s / 2)
        for j in range(s):
            for i in range(c):
                w[j * c + i, i, j + pad] = 1.0
        _set_wn(conv, w)
        conv.bias.data.zero_()
        c *= s
    # decoder blocks run the strides in reverse: undo them in reverse order
    c_out = c
    for block, s in zip(dec.block, vae.config.downsampling_ratios[::-1], strict=True):
        conv = block.conv_t1  # weight [in, out, k]
        w = torch.zeros_like(conv.weight_v)
        pad = math.ceil(s / 2)
        c_out = c_out // s
        for j in range(s):
            for i in range(c_out):
                w[j * c_out + i, i, j + pad] = 1.0
        _set_wn(conv, w)
        conv.bias.data.zero_()
    w = torch.zeros_like(dec.conv2.weight_v)
    w[0, 0, 3] = 1.0
    _set_wn(dec.conv2, w)


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
    width = vae.encoder.conv2.weight_v.shape[1]
    if width < hop:
        raise ValueError(f"the encoder has {width} channels before conv2; a lossless polyphase split needs {hop}")
    _identity_snakes_and_residuals(vae)
    _polyphase(vae)
    f = features(vae, clips)[:, :hop]  # [N, hop, frames]
    x = f.transpose(1, 2).reshape(-1, hop).double()
    cov = x.T @ x / x.shape[0]
    evals, evecs = torch.linalg.eigh(cov)
    order = torch.argsort(evals, descending=True)
    evals, evecs = evals[order].clamp_min(1e-12), evecs[:, order]
    p = evecs[:, :latent].T  # [latent, hop]
    std = evals[:latent].sqrt()
    enc_w = torch.zeros_like(vae.encoder.conv2.weight_v)  # [2 * latent, width, 3]
    enc_w[:latent, :hop, 1] = (p / std[:, None]).float()
    _set_wn(vae.encoder.conv2, enc_w)
    vae.encoder.conv2.bias.data.zero_()
    vae.encoder.conv2.bias.data[latent:] = -12.0
    dec_w = torch.zeros_like(vae.decoder.conv1.weight_v)  # [width, latent, 7]
    dec_w[:hop, :, 3] = (p.T * std[None, :]).float()
    _set_wn(vae.decoder.conv1, dec_w)
    vae.decoder.conv1.bias.data.zero_()
    return {"kept_energy": float(evals[:latent].sum() / evals.sum()), "hop": hop, "latent_channels": latent}


#: the linear VAE's config for tone-demo's clips: hop 64, 32 latent channels (half the block's
#: dimensions: the principal components keep ~97 % of the blocks' energy)
LINEAR_VAE_CONFIG = {"encoder_hidden_size": 64, "downsampling_ratios": [2, 4, 8], "channel_multiples": [1, 1, 1],
                     "decoder_channels": 64, "decoder_input_channels": 32, "audio_channels": 1, "sampling_rate": 8000}


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
