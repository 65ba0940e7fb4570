"""Deploy ``offload: model | sequential`` on the tiny SD3.5 checkpoint (with T5) (omniloop-offload).

CPU: storage and execution device are both ``cpu``; :func:`omniloop_offload.testing.offload_run`
runs under :class:`omniloop_offload.PoisonMover` (an evicted weight is NaN), so an output
``torch.equal`` to the unoffloaded runtime's means every weight was loaded when it computed.
Sequential streams the joint blocks and the three text encoders' layers.
"""

from __future__ import annotations

import pytest
import torch

import omniloop_offload.plugin as offload_plugin
from omniloop.runtime import Runtime
from omniloop_offload.testing import offload_run

from .conftest import sd3_manager, t2i


@pytest.mark.parametrize("mode", ["model", "sequential"])
def test_sd3_offload_equals_no_offload(tiny_ckpt, mode: str) -> None:
    rt, out, ref, trace = offload_run(lambda **kw: Runtime.from_model(tiny_ckpt(), manager=sd3_manager(("offload", offload_plugin)), **kw), t2i, mode)
    assert torch.equal(out.artifacts["latents"].tensor, ref.artifacts["latents"].tensor)
    assert torch.equal(out.artifacts["image"].pixels, ref.artifacts["image"].pixels)
    runs = [(name, res) for ev, name, res in trace if ev == "run" and name.startswith("transformer.")]
    if mode == "sequential":
        tf = rt.model.components["transformer"]
        assert len(runs) >= len(tf.transformer_blocks)
        assert all(len([r for r in res if r.startswith("transformer.")]) <= 2 for _, res in runs)
        encoders = {name.split(".")[0] for ev, name, _ in trace if ev == "run" and name.startswith("text_encoder")}
        assert encoders == {"text_encoder", "text_encoder_2", "text_encoder_3"}
    else:
        assert runs == []
