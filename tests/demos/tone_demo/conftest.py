"""A toy-size tone-demo checkpoint trained once per session (one VAE and one DiT iteration on the
CPU, ``omniloop_tone_demo_training.train.run``): the recipe's smoke test and the folder the
evaluator / family tests load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(scope="session")
def toy_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    pytest.importorskip("torchsde")
    from omniloop_tone_demo_training.train import run

    out = tmp_path_factory.mktemp("tone")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = run(out, device="cpu", toy=True, vae_seconds=1e9, dit_seconds=1e9, vae_steps=1, dit_steps=1,
                     n_clips=4, vae_batch=2, dit_batch=2, sweeps=[], eval_seeds=[0], bf16=False, eval_prompts=4)
    finally:
        torch.set_num_threads(threads)
    return out, report
