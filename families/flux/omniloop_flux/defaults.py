"""FLUX.1 variants and their default request parameters (diffusers' pipeline defaults).

The variant is read from the transformer config, never from the folder name: ``guidance_embeds``
true is FLUX.1 [dev] (guidance-distilled: the guidance scale is a model input), false is
FLUX.1 [schnell] (timestep-distilled: no guidance input).

Defaults are ``FluxPipeline`` / ``FluxImg2ImgPipeline``'s: 28 steps, guidance 3.5 (text-to-image)
or 7.0 (image-to-image), strength 0.6, ``max_sequence_length`` 512, height and width
``default_sample_size (128) * vae_scale_factor`` (1024 for the FLUX.1 VAE). The schnell model card
recommends 4 steps, guidance 0 and 256 tokens; a deployment sets those through an
``omniloop.json`` next to the checkpoint (``{"defaults": {"steps": 4, "max_sequence_length": 256}}``)
or per request. Tiny checkpoints write their own.
"""

from __future__ import annotations

from typing import Any

from omniloop.request import TaskType

TASKS = frozenset({TaskType.T2I, TaskType.I2I})
DEFAULT_SAMPLE_SIZE = 128
MAX_SEQUENCE_LENGTH = 512

DEFAULTS: dict[str, Any] = {
    "steps": 28,
    "guidance_scale": 3.5,
    "i2i_guidance_scale": 7.0,
    "strength": 0.6,
    "max_sequence_length": MAX_SEQUENCE_LENGTH,
}


def variant_of(transformer_config: Any) -> str:
    return "flux.1-dev" if bool(dict(transformer_config).get("guidance_embeds", False)) else "flux.1-schnell"


def defaults_for(vae_scale_factor: int, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    size = DEFAULT_SAMPLE_SIZE * vae_scale_factor
    out: dict[str, Any] = {**DEFAULTS, "height": size, "width": size}
    out.update(overrides or {})
    return out
