"""omniloop-kit's ``DenoiseLoop.forward`` default: a family that declares only ``model_forward``
(FLUX.1, SD3) gets its outer forward called on the ``transformer`` component with the request's
block context and the eager blocks (no deploy compile, no CUDA graphs asked for); a loop with
neither is one clear ``NotImplementedError``. The graph replay itself is tests/kit/test_graphs.py's
(CUDA only)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omniloop_kit.denoise import DenoiseLoop

calls: list[dict[str, Any]] = []


def outer_forward(model: Any, **kw: Any) -> torch.Tensor:
    calls.append({"model": model, **kw})
    return kw["hidden_states"] * 2


class Declared(DenoiseLoop):
    model_forward = staticmethod(outer_forward)


def test_the_default_forward_runs_the_declared_model_forward() -> None:
    calls.clear()
    model = torch.nn.Linear(2, 2)
    ctx = SimpleNamespace(components={"transformer": model}, options={}, eager=False)
    x = torch.ones(1, 3)
    bctx = SimpleNamespace(interceptor=object(), block_tap=None)
    out = Declared(menu=None).forward(ctx, "transformer", {"hidden_states": x}, bctx)  # type: ignore[arg-type]
    assert torch.equal(out, x * 2)
    assert calls == [{"model": model, "block_ctx": bctx, "blocks": None, "hidden_states": x}]


def test_a_loop_without_a_forward_says_so() -> None:
    ctx = SimpleNamespace(components={"transformer": None}, options={}, eager=False)
    with pytest.raises(NotImplementedError, match=r"^DenoiseLoop declares no model_forward and writes no forward$"):
        DenoiseLoop(menu=None).forward(ctx, "transformer", {}, None)  # type: ignore[arg-type]
