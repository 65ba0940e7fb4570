"""Where the tone-demo checkpoint lives (package data) and why it may be missing."""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent

#: the files a usable checkpoint folder has (a diffusers StableAudioPipeline folder + omniloop.json)
REQUIRED = ("model_index.json", "omniloop.json", "scheduler/scheduler_config.json", "tokenizer/tokenizer.json",
            "text_encoder/config.json", "text_encoder/model.safetensors",
            "projection_model/config.json", "projection_model/diffusion_pytorch_model.safetensors",
            "transformer/config.json", "transformer/diffusion_pytorch_model.safetensors",
            "vae/config.json", "vae/diffusion_pytorch_model.safetensors")


def checkpoint_dir() -> Path:
    """The diffusers-format ``StableAudioPipeline`` folder shipped with this package."""
    return PACKAGE_DIR / "checkpoint"


def checkpoint_missing(folder: Path | None = None) -> str | None:
    """Why the tone-demo checkpoint cannot be used (``None`` when it can)."""
    folder = folder or checkpoint_dir()
    missing = [n for n in REQUIRED if not (folder / n).is_file()]
    if not missing:
        return None
    return (f"the tone-demo weights are not installed ({folder.name}/{missing[0]} is missing"
            f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}); train them with "
            "bash demos/tone-demo/scripts/gpu_train.sh (or python -m omniloop_tone_demo_training.train --out DIR) "
            "and copy DIR/checkpoint to omniloop_tone_demo/checkpoint")
