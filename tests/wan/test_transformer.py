"""``wan_forward`` (omniloop's outer forward) against diffusers' ``WanTransformer3DModel.forward``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omniloop.interceptors import BlockContext
from omniloop.loop import LoopState, StepContext
from omniloop.testing import PassThroughBlocks
from omniloop_wan.transformer import wan_forward


def _inputs(model: Any, *, seed: int = 0, frames: int = 3, size: int = 4, per_token: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    x = torch.randn(1, cfg.in_channels, frames, size, size, generator=g)
    text = torch.randn(1, 512, cfg.text_dim, generator=g)
    if per_token:
        p = cfg.patch_size
        t = torch.full((1, frames * (size // p[1]) * (size // p[2])), 700.0)
        t[:, :4] = 0.0
    else:
        t = torch.tensor([700])
    out = {"hidden_states": x, "timestep": t, "encoder_hidden_states": text}
    if cfg.image_dim is not None:
        out["encoder_hidden_states_image"] = torch.randn(1, 17, cfg.image_dim, generator=g)
    return out


@pytest.mark.parametrize(
    "variant, per_token",
    [("t2v", False), ("i2v", False), ("wan22", False), ("ti2v", True)],
    ids=["wan2.1-t2v", "wan2.1-i2v-clip", "wan2.2-a14b", "wan2.2-ti2v-per-token-timesteps"],
)
def test_outer_forward_equals_diffusers_exactly(wan_runtime, variant, per_token):
    model = wan_runtime(variant).model.components["transformer"]
    inputs = _inputs(model, per_token=per_token)
    with torch.no_grad():
        ref = model(**inputs, return_dict=False)[0]
        ours = wan_forward(model, **inputs)
    assert ours.shape == ref.shape
    assert torch.equal(ours, ref)


class CountingInterceptor(PassThroughBlocks):
    """Runs every block and records which blocks ran for which branch."""

    name = "counting"

    def __init__(self) -> None:
        self.calls: list[tuple[str | None, int]] = []

    def open(self, step: StepContext, loop: LoopState, params: Any = None) -> Any:
        return {"branch": step.branch}

    def run(self, blocks: Any, hidden: torch.Tensor, ctx: BlockContext, call: Any) -> torch.Tensor:
        assert ctx.state == {"branch": ctx.step.branch}
        for i, block in enumerate(blocks):
            self.calls.append((ctx.step.branch, i))
            hidden = call(block, hidden)
        return hidden


def test_blocks_run_through_run_blocks_with_interceptor_and_taps(wan_runtime):
    model = wan_runtime("t2v").model.components["transformer"]
    inputs = _inputs(model)
    icpt = CountingInterceptor()
    loop = LoopState(total=1, branches=("uncond",))
    step = StepContext("r", "denoise", 0, 1, 700.0, branch="uncond")
    loop.plugin_state[("counting", "uncond")] = icpt.open(step, loop)
    taps: list[tuple[str, torch.Size]] = []
    ctx = BlockContext(step=step, loop=loop, interceptor=icpt,
                       block_tap=lambda name, v: taps.append((name, v.shape)), prefix="transformer.blocks")
    with torch.no_grad():
        ref = model(**inputs, return_dict=False)[0]
        ours = wan_forward(model, **inputs, block_ctx=ctx)
    assert torch.equal(ours, ref)  # an interceptor that runs every block changes nothing
    n = len(model.blocks)
    assert icpt.calls == [("uncond", i) for i in range(n)]
    assert [name for name, _ in taps] == [f"transformer.blocks.{i}" for i in range(n)]


class SkipLastBlock(CountingInterceptor):
    name = "skip-last"

    def run(self, blocks: Any, hidden: torch.Tensor, ctx: BlockContext, call: Any) -> torch.Tensor:
        for block in list(blocks)[:-1]:
            hidden = call(block, hidden)
        return hidden


def test_a_block_interceptor_can_skip_blocks(wan_runtime):
    model = wan_runtime("t2v").model.components["transformer"]
    inputs = _inputs(model)
    step = StepContext("r", "denoise", 0, 1, 700.0, branch="cond")
    ctx = BlockContext(step=step, loop=LoopState(), interceptor=SkipLastBlock())
    with torch.no_grad():
        full = wan_forward(model, **inputs)
        skipped = wan_forward(model, **inputs, block_ctx=ctx)
    assert skipped.shape == full.shape
    assert not torch.equal(skipped, full)
