"""A toy block stack and a steppable denoise loop, for testing block interceptors without a family.

The model is a residual stack (``h + a * tanh(W h + temb)``) driven through
:func:`omniloop.run_blocks`; the loop does classifier-free guidance over two branches and small
Euler steps, so consecutive inputs are close and a residual cache actually hits. It opens and
closes the interceptor per branch exactly as the runtime does, so a test can interleave requests
step by step (:func:`interleave`) and compare with each run alone (:func:`run_alone`).

For end-to-end checks through a real runtime use :mod:`omniloop.testing.conformance`.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..interceptors import BlockContext, open_interceptor, run_blocks
from ..loop import LoopState, StepContext
from ..schema import structure_params

DIM = 16
TOKENS = 12


class ToyBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = h + 0.5 * torch.tanh(self.lin(h) + temb)
        return out


class ToyModel(nn.Module):
    def __init__(self, n_blocks: int = 6, dim: int = DIM, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.proj_in = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(ToyBlock(dim) for _ in range(n_blocks))
        self.proj_out = nn.Linear(dim, dim)
        self.time = nn.Linear(1, dim)
        self.text = nn.Parameter(torch.zeros(2, dim))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 / p.shape[-1] ** 0.5))
            self.text.copy_(torch.randn(2, dim, generator=g) * 0.3)

    def forward(self, x: torch.Tensor, t: float, branch: str, ctx: BlockContext | None) -> torch.Tensor:
        temb = self.time(torch.tensor([[t]], dtype=x.dtype)) + self.text[0 if branch == "cond" else 1]
        h = self.proj_in(x)

        def call(block: Any, hidden: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = block(hidden, temb)
            return out

        h = run_blocks(self.blocks, h, ctx, call)
        y: torch.Tensor = self.proj_out(h)
        return y


class ToyRun:
    """One request through the toy loop, steppable so tests can interleave requests."""

    def __init__(
        self,
        model: ToyModel,
        interceptor: Any = None,
        *,
        request_id: str = "r0",
        seed: int = 0,
        steps: int = 20,
        guidance: float = 3.0,
        branches: tuple[str, ...] = ("cond", "uncond"),
        params: Any = None,
        node: str = "denoise",
    ) -> None:
        self.model = model
        self.interceptor = interceptor
        self.request_id = request_id
        self.node = node
        self.guidance = guidance
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(1, TOKENS, DIM, generator=g)
        schema = getattr(interceptor, "params_schema", None)
        if isinstance(params, Mapping) and schema is not None:  # validated once, as the runtime does
            params = structure_params(schema, params, f"plugin_params.{interceptor.name}")
        self.loop = LoopState(step=0, total=steps, branches=branches)
        self.preds: list[torch.Tensor] = []
        if interceptor is not None:
            for b in branches:
                sc = StepContext(request_id, node, 0, steps, 1.0, branch=b)
                self.loop.plugin_state[(interceptor.name, b)] = open_interceptor(interceptor, sc, self.loop, params)

    @property
    def done(self) -> bool:
        return self.loop.step >= self.loop.total

    def step(self) -> None:
        i, n = self.loop.step, self.loop.total
        t = 1.0 - i / n
        out: dict[str, torch.Tensor] = {}
        for b in self.loop.branches:
            sc = StepContext(self.request_id, self.node, i, n, t, branch=b)
            ctx = BlockContext(step=sc, loop=self.loop, interceptor=self.interceptor) if self.interceptor else None
            with torch.no_grad():
                out[b] = self.model(self.x, t, b, ctx)
        if len(out) == 2:
            pred = out["uncond"] + self.guidance * (out["cond"] - out["uncond"])
        else:
            pred = out[self.loop.branches[0]]
        self.preds.append(pred)
        self.x = self.x - pred / n
        self.loop.step += 1

    def close(self) -> dict[str, Any]:
        metrics: dict[str, Any] = {}
        if self.interceptor is not None:
            for b in self.loop.branches:
                state = self.loop.plugin_state.pop((self.interceptor.name, b))
                metrics[b] = self.interceptor.metrics(state)
                self.interceptor.close(state)
        return metrics

    def run(self) -> torch.Tensor:
        while not self.done:
            self.step()
        self.metrics = self.close()
        return self.x


def run_alone(model: ToyModel, interceptor: Any = None, **kw: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    r = ToyRun(model, interceptor, **kw)
    x = r.run()
    return x, r.metrics


def interleave(runs: list[ToyRun], order: Callable[[int], int] | None = None) -> None:
    """Step runs round-robin until all are done."""
    while not all(r.done for r in runs):
        for r in runs:
            if not r.done:
                r.step()


def blocks_namespace() -> types.SimpleNamespace:
    """Everything above as one namespace (what the ``toy_blocks`` pytest fixture returns)."""
    return types.SimpleNamespace(
        Model=ToyModel, Run=ToyRun, run_alone=run_alone, interleave=interleave, DIM=DIM, TOKENS=TOKENS
    )
