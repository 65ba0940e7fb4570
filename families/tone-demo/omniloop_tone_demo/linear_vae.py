"""tone-demo's VAE: a linear ``AutoencoderOobleck``, stored as its two projections.

The Oobleck architecture is kept as diffusers defines it; its weights make it compute a linear map:
every Snake activation is the identity (``alpha = exp(-20)``: ``sin^2(alpha x)`` is below float32
round-off), every residual unit adds zero (``weight_g = 0``), the strided convolutions rearrange
samples into channels (space-to-depth: after the blocks, channel ``j * c + i`` of latent frame
``n`` holds polyphase sample ``n * hop + ...``) and the transposed ones undo it. What is learned is
two matrices: the encoder's last convolution maps each ``hop``-sample block to the latent
(``encoder [latent, hop]``), the decoder's first convolution maps a latent back to a block
(``decoder [hop, latent]``). The posterior's std channels are constant (``softplus(-12)``).

So the checkpoint ships :data:`COMPACT_FILE` (the two projections, 16 KB) instead of the Oobleck's
858 k parameters (mostly the zero residual units and the 0/1 polyphase kernels, 3.4 MB in float32);
:func:`materialize` writes the full diffusers folder from it (:func:`build` then ``save_pretrained``).
The fitting (principal components of the training clips) is in ``omniloop_tone_demo_training.linear_vae``.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import torch

SNAKE_OFF = -20.0
#: the compact VAE file in a shipped checkpoint's ``vae/`` (instead of ``diffusion_pytorch_model.safetensors``)
COMPACT_FILE = "linear_oobleck.safetensors"
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"

#: the linear VAE's config for tone-demo's clips: hop 64, 32 latent channels (half the block's
#: dimensions: the principal components keep ~97 % of the blocks' energy)
LINEAR_VAE_CONFIG: dict[str, Any] = {"encoder_hidden_size": 64, "downsampling_ratios": [2, 4, 8],
                                     "channel_multiples": [1, 1, 1], "decoder_channels": 64,
                                     "decoder_input_channels": 32, "audio_channels": 1, "sampling_rate": 8000}


def _set_wn(conv, weight: torch.Tensor) -> None:
    """Give an old-style weight-normed conv (dim 0) the effective ``weight``."""
    norm = weight.flatten(1).norm(dim=1)
    v = weight.clone()
    v[norm == 0] = 1.0
    conv.weight_v.data.copy_(v)
    conv.weight_g.data.copy_(norm.view(-1, *([1] * (weight.dim() - 1))))


def wn_weight(conv) -> torch.Tensor:
    """The effective weight of an old-style weight-normed conv (``weight_g`` * ``weight_v`` / norm)."""
    v, g = conv.weight_v, conv.weight_g
    return g * v / v.flatten(1).norm(dim=1).view(-1, *([1] * (v.dim() - 1)))


def hop_of(vae) -> int:
    return int(math.prod(vae.config.downsampling_ratios))


@torch.no_grad()
def make_structure(vae) -> None:
    """Everything but the two projections: identity snakes, zero residual units, the polyphase
    (space-to-depth) strided convolutions and their transposes; checks that the widths allow it."""
    from diffusers.models.autoencoders.autoencoder_oobleck import OobleckResidualUnit, Snake1d

    hop, latent = hop_of(vae), vae.config.decoder_input_channels
    width = vae.encoder.conv2.weight_v.shape[1]
    if width < hop or vae.decoder.conv1.weight_v.shape[0] < hop or vae.config.encoder_hidden_size != 2 * latent:
        raise ValueError(f"a linear Oobleck needs >= {hop} channels (the hop) after the encoder blocks and before the "
                         f"decoder blocks, and encoder_hidden_size = 2 x {latent} latent channels")
    for m in vae.modules():
        if isinstance(m, Snake1d):
            m.alpha.data.fill_(SNAKE_OFF)
            m.beta.data.zero_()
        elif isinstance(m, OobleckResidualUnit):
            for conv in (m.conv1, m.conv2):
                _set_wn(conv, torch.zeros_like(conv.weight_v))
                conv.bias.data.zero_()
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
def set_projections(vae, encoder: torch.Tensor, decoder: torch.Tensor) -> None:
    """The encoder's last conv: latent ``= encoder @ block``; the decoder's first: block ``= decoder @ latent``."""
    hop, latent = hop_of(vae), vae.config.decoder_input_channels
    if tuple(encoder.shape) != (latent, hop) or tuple(decoder.shape) != (hop, latent):
        raise ValueError(f"projections of shape encoder [{latent}, {hop}], decoder [{hop}, {latent}] expected, got "
                         f"{list(encoder.shape)} and {list(decoder.shape)}")
    enc_w = torch.zeros_like(vae.encoder.conv2.weight_v)  # [2 * latent, width, 3]
    enc_w[:latent, :hop, 1] = encoder.float()
    _set_wn(vae.encoder.conv2, enc_w)
    vae.encoder.conv2.bias.data.zero_()
    vae.encoder.conv2.bias.data[latent:] = -12.0
    dec_w = torch.zeros_like(vae.decoder.conv1.weight_v)  # [width, latent, 7]
    dec_w[:hop, :, 3] = decoder.float()
    _set_wn(vae.decoder.conv1, dec_w)
    vae.decoder.conv1.bias.data.zero_()


@torch.no_grad()
def projections(vae) -> dict[str, torch.Tensor]:
    """The two projections of a linear Oobleck (float32, contiguous): ``encoder [latent, hop]``,
    ``decoder [hop, latent]``."""
    hop, latent = hop_of(vae), vae.config.decoder_input_channels
    return {"encoder": wn_weight(vae.encoder.conv2)[:latent, :hop, 1].float().contiguous().clone(),
            "decoder": wn_weight(vae.decoder.conv1)[:hop, :, 3].float().contiguous().clone()}


def build(config: dict[str, Any], proj: dict[str, torch.Tensor]):
    """The ``AutoencoderOobleck`` of ``config`` computing the linear map of ``proj``."""
    from diffusers import AutoencoderOobleck

    cfg = {k: v for k, v in config.items() if not k.startswith("_")}
    with warnings.catch_warnings():
        # diffusers builds the Oobleck convolutions with the deprecated torch.nn.utils.weight_norm:
        # its FutureWarning is nothing a tone-demo user can act on
        warnings.filterwarnings("ignore", message=r"`torch\.nn\.utils\.weight_norm` is deprecated",
                                category=FutureWarning)
        vae = AutoencoderOobleck(**cfg).eval().requires_grad_(False)
    make_structure(vae)
    set_projections(vae, proj["encoder"], proj["decoder"])
    return vae


def save_compact(vae, folder: str | Path) -> Path:
    """Write ``folder/config.json`` and ``folder/`` :data:`COMPACT_FILE` (no full weights)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vae.save_config(str(folder))
    path = folder / COMPACT_FILE
    save_file(projections(vae), str(path), metadata={"format": "pt", "kind": "tone-demo linear Oobleck projections"})
    return path


def load_compact(folder: str | Path):
    """The ``AutoencoderOobleck`` of a ``vae/`` folder holding ``config.json`` and :data:`COMPACT_FILE`."""
    import json

    from safetensors.torch import load_file

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return build(config, load_file(str(folder / COMPACT_FILE)))


__all__ = ["COMPACT_FILE", "LINEAR_VAE_CONFIG", "WEIGHTS_FILE", "build", "hop_of", "load_compact", "make_structure",
           "projections", "save_compact", "set_projections", "wn_weight"]
