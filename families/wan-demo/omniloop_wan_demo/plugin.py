"""omniloop hooks of omniloop-wan-demo: the ``wan-demo``, ``wan-demo-causal`` and ``wan-demo-fast``
model presets and ``omniloop eval adherence``."""

from __future__ import annotations

import json
from typing import Any

from omniloop.family import ModelPreset
from omniloop.hookspecs import hookimpl, registering
from omniloop_kit.presets import preset_folder

from .checkpoint_path import (
    CAUSAL_ROLLOUT_OPTIONS,
    causal_checkpoint_dir,
    causal_checkpoint_missing,
    checkpoint_dir,
    fast_checkpoint_dir,
    fast_checkpoint_missing,
    fast_lora_path,
)

OMNILOOP_HOOK_API = ">=1.0,<2"

PRESET = ModelPreset(
    name="wan-demo",
    family="wan",
    path=checkpoint_dir,
    description="~3.5 M-param Wan2.1-architecture t2v model trained on synthetic shapes (17x64x64), shipped with omniloop-wan-demo",
    # the demo runs on CPUs: oneDNN VAE convolutions decode ~5x faster there (no clip's color or
    # direction verdict changes; bench/results/cache_demo-*.json); CUDA runs the reference kernels
    options={"vae_cpu_kernels": "fast"},
    # wan-demo-fast's student as a LoRA of this model: --adapter fast (with the few-step sampler,
    # 4 steps, guidance 1) serves 4-step requests from the same loaded model
    adapters={"fast": fast_lora_path},
)


#: the ``wan-demo-causal`` folder; one clear :class:`~omniloop.errors.DeployError` until its weights are installed
causal_path = preset_folder("wan-demo-causal", lambda: causal_checkpoint_dir(), lambda: causal_checkpoint_missing())


def causal_rollout_options() -> dict[str, Any]:
    """The checkpoint's own ``omniloop.json`` ``rollout_options`` (written by ``train_causal``),
    else :data:`CAUSAL_ROLLOUT_OPTIONS`; a deployment's ``options.rollout_options`` replaces them."""
    f = causal_checkpoint_dir() / "omniloop.json"
    try:
        got = json.loads(f.read_text(encoding="utf-8")).get("rollout_options")
    except (OSError, ValueError, AttributeError):
        got = None
    return dict(got) if isinstance(got, dict) else dict(CAUSAL_ROLLOUT_OPTIONS)


CAUSAL_PRESET = ModelPreset(
    name="wan-demo-causal",
    family="wan",
    path=causal_path,
    description="wan-demo v2 distilled block-causally, Self-Forcing DMD2 (rollout: causal, 1-latent-frame chunks, "
    "4 steps each, no CFG, streamed); same VAE / text encoder as wan-demo",
    options={"vae_cpu_kernels": "fast", "rollout": "causal", "rollout_options": causal_rollout_options()},
)


#: the ``wan-demo-fast`` folder; one clear :class:`~omniloop.errors.DeployError` until its weights are installed
fast_path = preset_folder("wan-demo-fast", lambda: fast_checkpoint_dir(), lambda: fast_checkpoint_missing())


def fast_schedule() -> dict[str, Any]:
    """The distilled schedule from ``checkpoint_fast/omniloop.json`` (its ``defaults``' ``sampler``
    — ``few-step`` — and ``sampler_options``, which the Wan family applies), ``{}`` before it is
    installed."""
    try:
        got = json.loads((fast_checkpoint_dir() / "omniloop.json").read_text(encoding="utf-8")).get("defaults")
    except (OSError, ValueError, AttributeError):
        got = None
    got = got if isinstance(got, dict) else {}
    return {k: got[k] for k in ("sampler", "sampler_options", "steps", "guidance_scale") if k in got}


FAST_PRESET = ModelPreset(
    name="wan-demo-fast",
    family="wan",
    path=fast_path,
    description="wan-demo v2 distilled to 4 steps by DMD2 (few-step sampler, guidance 1.0: one forward per step): "
    "wan-demo with its 'fast' LoRA fused at load",
    options={"vae_cpu_kernels": "fast"},
    adapters={"fast": fast_lora_path},
    adapter_fuse={"fast": 1.0},
)


omniloop_register_model_presets = registering(PRESET, CAUSAL_PRESET, FAST_PRESET)


@hookimpl
def omniloop_register_commands(cli: Any) -> None:
    from .cli import add_to

    add_to(cli)
