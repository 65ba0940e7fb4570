"""Where the shipped checkpoint lives (package data)."""

from __future__ import annotations

from pathlib import Path

from omniloop_kit.presets import weights_missing

PACKAGE_DIR = Path(__file__).resolve().parent


def checkpoint_dir() -> Path:
    """The diffusers-format WanPipeline folder shipped with this package."""
    return PACKAGE_DIR / "checkpoint"


def tokenizer_dir() -> Path:
    """The tokenizer over the demo vocabulary (also copied into ``checkpoint/tokenizer``)."""
    return PACKAGE_DIR / "tokenizer"


#: the ``rollout_options`` ``wan-demo-causal`` runs with unless its ``omniloop.json`` names others:
#: chunks of one latent frame (a 17-frame clip is 5 latent frames: 1 + 4 + 4 + 4 + 4 video frames),
#: 4 flow-Euler steps per chunk at wan-demo's flow shift 3.0, CFG 5.0 (wan-demo's default scale)
CAUSAL_ROLLOUT_OPTIONS: dict[str, object] = {"chunk_frames": 1, "steps": 4, "shift": 3.0, "guidance_scale": 5.0}

#: the files a trained student checkpoint (causal, fast) has of its own
TRANSFORMER_FILES = ("transformer/config.json", "transformer/diffusion_pytorch_model.safetensors")

#: what ``checkpoint_causal/`` shares with ``checkpoint/`` (relative links, not copies) — except
#: ``vae``, a copy of the decoder the causal student was measured with since wan-demo's decoder was
#: replaced (``decoder_specks --ship``, 2026-12-05); a causal student shipped later links it again
CAUSAL_SHARED = ("vae", "text_encoder", "tokenizer", "scheduler", "model_index.json")


def causal_checkpoint_dir() -> Path:
    """The ``wan-demo-causal`` folder: its own ``transformer/``, ``omniloop.json`` and ``vae/`` (the
    decoder before 2026-12-05's); the rest are links to wan-demo's (:data:`CAUSAL_SHARED`)."""
    return PACKAGE_DIR / "checkpoint_causal"


def causal_checkpoint_missing(folder: Path | None = None) -> str | None:
    """Why the trained causal checkpoint cannot be used yet (``None`` when it can)."""
    return weights_missing(
        "wan-demo-causal", folder or causal_checkpoint_dir(), (*TRANSFORMER_FILES, *CAUSAL_SHARED),
        "train them with python -m omniloop_wan_demo_training.train_causal --out DIR, then install them with "
        "python -m omniloop_wan_demo_training.train_causal --ship DIR (package omniloop-wan-demo-training, demos/wan-demo)",
        present=Path.exists,
    )


#: what ``checkpoint_fast/`` shares with ``checkpoint/`` (relative links): the student was distilled
#: from wan-demo v2 with its VAE, text encoder and tokenizer frozen
FAST_SHARED = ("vae", "text_encoder", "tokenizer", "scheduler", "model_index.json")


def fast_lora_path() -> Path:
    """wan-demo-fast's student as a LoRA adapter of wan-demo (``--model wan-demo --adapter fast``;
    diffusers' Wan LoRA keys, alpha = rank): the file the ``wan-demo`` preset offers as ``fast``."""
    return PACKAGE_DIR / "adapters" / "fast.safetensors"


def fast_checkpoint_dir() -> Path:
    """The ``wan-demo-fast`` folder: its own ``transformer/`` and ``omniloop.json`` (the few-step
    schedule, guidance 1.0); the rest are links to wan-demo's (:data:`FAST_SHARED`)."""
    return PACKAGE_DIR / "checkpoint_fast"


def fast_checkpoint_missing(folder: Path | None = None) -> str | None:
    """Why the distilled checkpoint cannot be used yet (``None`` when it can)."""
    return weights_missing(
        "wan-demo-fast", folder or fast_checkpoint_dir(), (*TRANSFORMER_FILES, "omniloop.json", *FAST_SHARED),
        "train its LoRA with python -m omniloop_wan_demo_training.dmd_fast --out OUT on a GPU, then install it with "
        "python -m omniloop_wan_demo_training.v2 --ship OUT (package omniloop-wan-demo-training, demos/wan-demo)",
        present=Path.exists,
    )
