"""Transports are the core's transport plugin kind: registered by omniloop-parallel, picked by the
deploy's ``transport``, unknown or misplaced ones refused at load (one line)."""

from __future__ import annotations

import pytest
import torch

from omniloop.artifacts import Latents
from omniloop.errors import DeployError
from omniloop.plugins import default_manager
from omniloop.request import OmniOutput, Status
from omniloop.runtime import Deployment
from omniloop_parallel.transports import map_tensors, transport_for


def test_registered_through_the_plugin_kind():
    assert {"inproc", "shm", "torch.distributed"} <= set(default_manager().registry().transports)


def test_unknown_transport_refused_at_load(wan_ckpt):
    with pytest.raises(DeployError) as info:
        Deployment({"model": {"path": str(wan_ckpt)}, "transport": "carrier-pigeon", "parallel": {"cfg": 2}})
    assert str(info.value).startswith("transport: 'carrier-pigeon' is not implemented yet: no installed transport")
    assert "shm" in str(info.value)


def test_cross_process_transport_needs_a_pool(wan_ckpt):
    with pytest.raises(DeployError, match=r"^transport: 'shm' carries artifacts between worker processes"):
        Deployment({"model": {"path": str(wan_ckpt)}, "transport": "shm"})
    assert Deployment({"model": {"path": str(wan_ckpt)}, "transport": "shm", "parallel": {"cfg": 2}})


def test_encode_decode_round_trip():
    t = torch.arange(6.0).reshape(2, 3)
    out = OmniOutput(request_id="r", status=Status.COMPLETED, artifacts={"latents": Latents(tensor=t)},
                     metrics={"x": [t]})
    for name in ("inproc", "shm", "torch.distributed"):
        tr = transport_for(name)
        back = tr.decode(tr.encode(out))
        assert torch.equal(back.artifacts["latents"].tensor, t) and torch.equal(back.metrics["x"][0], t)
    shared = transport_for("shm").encode(out)
    assert shared.artifacts["latents"].tensor.is_shared()
    assert map_tensors({"a": (1, "s")}, lambda x: x) == {"a": (1, "s")}
