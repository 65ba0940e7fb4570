"""What kind of Wan checkpoint this is, and its default request parameters.

The kind is read from the configs (never from the folder name):

==================  ===============================================================  ===========
kind                how it is recognised                                             tasks
==================  ===============================================================  ===========
wan2.1-t2v          one transformer, ``in_channels == out_channels``                 t2v
wan2.1-i2v          ``in_channels == 2 * z_dim + 4``, CLIP ``image_dim`` set          i2v
wan2.2-t2v-a14b     ``transformer_2`` + ``boundary_ratio``, ``in == out``             t2v
wan2.2-i2v-a14b     ``transformer_2`` + ``boundary_ratio``, ``in == 2 * z_dim + 4``    i2v
wan2.2-ti2v-5b      ``expand_timesteps`` (per-token timesteps, 48-channel VAE)         t2v, i2v
==================  ===============================================================  ===========

Defaults follow the Wan-AI model cards. A checkpoint may override them with an ``omniloop.json``
file (``{"defaults": {"steps": 2, ...}}``) — the tiny test checkpoints do.
"""

from __future__ import annotations

from typing import Any

from omniloop.request import TaskType

#: the text encoder's context: Wan pads every prompt to 512 tokens, and the I2V attention
#: processor in diffusers hard-codes it (it splits image tokens from text tokens at len - 512)
TEXT_LEN = 512

DEFAULTS: dict[str, dict[str, Any]] = {
    "wan2.1-t2v": {"steps": 50, "guidance_scale": 5.0, "height": 480, "width": 832, "frames": 81, "fps": 16.0},
    "wan2.1-i2v": {"steps": 40, "guidance_scale": 5.0, "height": 480, "width": 832, "frames": 81, "fps": 16.0},
    "wan2.2-t2v-a14b": {
        "steps": 40, "guidance_scale": 4.0, "guidance_scale_2": 3.0,
        "height": 720, "width": 1280, "frames": 81, "fps": 16.0,
    },
    "wan2.2-i2v-a14b": {
        "steps": 40, "guidance_scale": 3.5, "guidance_scale_2": 3.5,
        "height": 480, "width": 832, "frames": 81, "fps": 16.0,
    },
    "wan2.2-ti2v-5b": {"steps": 50, "guidance_scale": 5.0, "height": 704, "width": 1280, "frames": 121, "fps": 24.0},
}

#: the negative prompt used when a request gives none (diffusers' default: empty)
DEFAULT_NEGATIVE_PROMPT = ""


def model_kind(index: dict[str, Any], transformer_config: dict[str, Any], vae_config: dict[str, Any]) -> str:
    """The checkpoint kind (see the module table) from its parsed configs."""
    z = int(vae_config.get("z_dim", 16))
    cin = int(transformer_config.get("in_channels", 16))
    if index.get("expand_timesteps"):
        return "wan2.2-ti2v-5b"
    image_latent = cin != int(transformer_config.get("out_channels") or cin)
    two = index.get("boundary_ratio") is not None
    if two:
        return "wan2.2-i2v-a14b" if image_latent else "wan2.2-t2v-a14b"
    if image_latent:
        if cin != 2 * z + 4:
            return "unknown"
        return "wan2.1-i2v"
    return "wan2.1-t2v"


def tasks_of(kind: str) -> frozenset[TaskType]:
    if kind == "wan2.2-ti2v-5b":
        return frozenset({TaskType.T2V, TaskType.I2V})
    if kind.endswith("i2v") or kind == "wan2.2-i2v-a14b":
        return frozenset({TaskType.I2V})
    return frozenset({TaskType.T2V})


def defaults_for(kind: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    out = dict(DEFAULTS.get(kind, DEFAULTS["wan2.1-t2v"]))
    out.setdefault("negative_prompt", DEFAULT_NEGATIVE_PROMPT)
    out.update(overrides or {})
    return out
