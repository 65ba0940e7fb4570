"""Where the shipped checkpoint lives (package data), and whether it is there yet."""

from __future__ import annotations

from pathlib import Path

from omniloop_kit.presets import weights_missing

PACKAGE_DIR = Path(__file__).resolve().parent

#: what a usable checkpoint folder holds (the FluxPipeline layout + omniloop.json)
REQUIRED_FILES = (
    "model_index.json", "omniloop.json", "scheduler/scheduler_config.json",
    "transformer/config.json", "transformer/diffusion_pytorch_model.safetensors",
    "vae/config.json", "vae/diffusion_pytorch_model.safetensors",
    "text_encoder/config.json", "text_encoder/model.safetensors",
    "text_encoder_2/config.json", "text_encoder_2/model.safetensors",
    "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json",
    "tokenizer_2/tokenizer.json", "tokenizer_2/tokenizer_config.json",
)


def checkpoint_dir() -> Path:
    """The diffusers-format FluxPipeline folder shipped with this package."""
    return PACKAGE_DIR / "checkpoint"


def checkpoint_missing(folder: Path | None = None) -> str | None:
    """Why the trained checkpoint cannot be used yet (``None`` when it can)."""
    return weights_missing(
        "flux-demo", folder or checkpoint_dir(), REQUIRED_FILES,
        "train them with bash demos/flux-demo/scripts/gpu_session.sh (or python -m omniloop_flux_demo_training.gpu_run "
        "--out DIR), then install them with python -m omniloop_flux_demo_training.ship DIR (package "
        "omniloop-flux-demo-training, demos/flux-demo)",
    )
