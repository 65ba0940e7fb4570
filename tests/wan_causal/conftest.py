from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_wan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omniloop_wan.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("wan-causal") / "t2v", variant="t2v", scheduler="flow_euler")


@pytest.fixture(scope="session")
def transformer(tiny_wan: Path):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel.from_pretrained(tiny_wan / "transformer").eval()


@pytest.fixture(scope="session")
def vae(tiny_wan: Path):
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan.from_pretrained(tiny_wan / "vae").eval()


@pytest.fixture()
def text(transformer) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(1, 16, transformer.config.text_dim, generator=g)


def other_text(transformer, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 16, transformer.config.text_dim, generator=g)
