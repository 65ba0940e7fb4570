"""Where the shipped checkpoint lives (package data)."""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def checkpoint_dir() -> Path:
    """The diffusers-format WanPipeline folder shipped with this package."""
    return PACKAGE_DIR / "checkpoint"


def tokenizer_dir() -> Path:
    """The tokenizer over the demo vocabulary (also copied into ``checkpoint/tokenizer``)."""
    return PACKAGE_DIR / "tokenizer"
