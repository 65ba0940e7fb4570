"""An SD3 checkpoint's default request parameters: diffusers' pipeline defaults.

=======================  ====================================  ===================================
parameter                t2i (``StableDiffusion3Pipeline``)    i2i (``StableDiffusion3Img2ImgPipeline``)
=======================  ====================================  ===================================
steps                    28                                    50
guidance_scale           7.0                                   7.0
strength                 —                                     0.6
height, width            ``transformer.sample_size * vae scale`` (1024 for the released models)
max_sequence_length      256 (T5 tokens)                       256
negative_prompt          ``""``                                ``""``
shift                    the scheduler config's (3.0 for SD3 / SD3.5)
=======================  ====================================  ===================================

A checkpoint may override any of them with an ``omniloop.json`` next to ``model_index.json``
(``{"defaults": {"steps": 2}}`` — the tiny test checkpoints do); per-task overrides go under
``{"defaults": {"i2i": {...}}}``.
"""

from __future__ import annotations

from typing import Any

from omniloop.request import TaskType

T2I: dict[str, Any] = {"steps": 28, "guidance_scale": 7.0, "max_sequence_length": 256, "negative_prompt": ""}
I2I: dict[str, Any] = {**T2I, "steps": 50, "strength": 0.6}


def defaults_for(sample_size: int, vae_scale: int, overrides: dict[str, Any] | None = None) -> dict[TaskType, dict[str, Any]]:
    """Resolved defaults per task (sizes from the transformer's ``sample_size``)."""
    size = {"height": sample_size * vae_scale, "width": sample_size * vae_scale}
    overrides = dict(overrides or {})
    per_task = {t: overrides.pop(t.value, None) or {} for t in (TaskType.T2I, TaskType.I2I)}
    out = {}
    for task, base in ((TaskType.T2I, T2I), (TaskType.I2I, I2I)):
        out[task] = {**base, **size, **overrides, **per_task[task]}
    return out
