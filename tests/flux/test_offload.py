"""Deploy ``offload: model | sequential`` on the tiny FLUX.1 checkpoint (omniloop-offload).

CPU: storage and execution device are both ``cpu``; :func:`omniloop_offload.testing.offload_run`
runs under :class:`omniloop_offload.PoisonMover` (an evicted weight is NaN), so an output
``torch.equal`` to the unoffloaded runtime's means every weight was loaded when it computed.
Sequential streams the double- then single-stream blocks as one stack.
"""

from __future__ import annotations

import pytest
import torch

import omniloop_flux.plugin as flux_plugin
import omniloop_offload.plugin as offload_plugin
from omniloop.runtime import Runtime
from omniloop.testing import make_manager
from omniloop_offload.testing import offload_run

from .conftest import t2i


@pytest.mark.parametrize("mode", ["model", "sequential"])
def test_flux_offload_equals_no_offload(flux_ckpt, mode: str) -> None:
    rt, out, ref, trace = offload_run(lambda **kw: Runtime.from_model(flux_ckpt(), manager=make_manager(("flux", flux_plugin), ("offload", offload_plugin), toy=False), **kw), t2i, mode)
    assert torch.equal(out.artifacts["latents"].tensor, ref.artifacts["latents"].tensor)
    assert torch.equal(out.artifacts["image"].pixels, ref.artifacts["image"].pixels)
    runs = [(name, res) for ev, name, res in trace if ev == "run" and name.startswith("transformer.")]
    if mode == "sequential":
        tf = rt.model.components["transformer"]
        n = len(tf.transformer_blocks) + len(tf.single_transformer_blocks)
        assert len(runs) >= n and all(len([r for r in res if r.startswith("transformer.")]) <= 2 for _, res in runs)
        # the single-stream stack follows the double-stream one: its first block was prefetched
        last_double = f"transformer.transformer_blocks.{len(tf.transformer_blocks) - 1}"
        k = next(i for i, t in enumerate(trace) if t[:2] == ("run", last_double))
        assert trace[k - 1][:2] == ("prefetch", "transformer.single_transformer_blocks.0")
    else:
        assert runs == []
