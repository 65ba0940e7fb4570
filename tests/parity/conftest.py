"""Fixtures for the parity tests: a deterministic toy checkpoint and runtimes that record."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from omniloop.testing import PassThroughBlocks, build_toy_checkpoint, component_plugin, toy_runtime
from omniloop_parity import plugin as parity_plugin

REQUEST = {"task": "t2v", "prompt": "a red cube rolling", "negative_prompt": "blurry", "diffusion": {"seed": 7}}


class PerturbBlock(PassThroughBlocks):
    """Block interceptor: scales block ``k``'s output by ``1 + eps`` at step ``step`` only.

    The scaling happens through a forward hook on that block while it runs, so the block's
    returned value (which the block taps see) is the perturbed one.
    """

    name = "perturb"
    graph_safe = False
    distribution_altering = True
    needs_eager = True

    def __init__(self, k: int, step: int, eps: float = 1e-3) -> None:
        self.k, self.step, self.eps = k, step, eps

    def run(self, blocks: Any, hidden: torch.Tensor, ctx: Any, call: Any) -> torch.Tensor:
        for i, blk in enumerate(blocks):
            if i == self.k and ctx.step.step_index == self.step:
                handle = blk.register_forward_hook(lambda _m, _inp, out: out * (1 + self.eps))
                try:
                    hidden = call(blk, hidden)
                finally:
                    handle.remove()
            else:
                hidden = call(blk, hidden)
        return hidden


class FailAtStep(PerturbBlock):
    """Block interceptor that raises at a given step (to fail a request mid-loop)."""

    name = "fail-at"

    def run(self, blocks: Any, hidden: torch.Tensor, ctx: Any, call: Any) -> torch.Tensor:
        if ctx.step.step_index == self.step:
            raise RuntimeError(f"boom at step {self.step}")
        return super().run(blocks, hidden, ctx, call)


def interceptor_plugin(obj: Any) -> Any:
    """A plugin registering the block interceptor ``obj`` under ``obj.name`` (distribution-altering)."""
    return component_plugin(obj.name, "block_interceptor", lambda: obj, distribution_altering=True)


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy checkpoint the toy golden was recorded from (seed 0, default config)."""
    return build_toy_checkpoint(tmp_path_factory.mktemp("parity") / "toy", seed=0)


@pytest.fixture
def recording_runtime(ckpt: Path) -> Any:
    """``recording_runtime(blocks=None, out=None, extra=(("name", plugin), ...), **plugins_cfg)``."""

    def make(*extra: tuple[str, Any], plugins: dict[str, Any] | None = None, **parity: Any) -> Any:
        return toy_runtime(ckpt, ("parity", parity_plugin), *extra, plugins={"parity": parity, **(plugins or {})})

    return make


@pytest.fixture
def h() -> Any:
    """Helpers shared by the parity tests (importlib mode: tests cannot import conftest)."""
    import types

    return types.SimpleNamespace(
        REQUEST=dict(REQUEST), PerturbBlock=PerturbBlock, FailAtStep=FailAtStep, InterceptorPlugin=interceptor_plugin
    )
