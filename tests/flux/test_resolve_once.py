"""Issue 15 on FLUX.1: the request is resolved once (``FluxFamily.resolve``), the nodes read it,
and the scheduler's workload is the steps the loop runs."""

from __future__ import annotations

from typing import Any

import pytest

from omniloop import Resolved
from omniloop.errors import RequestError
from omniloop_flux import resolve as flux_resolve
from omniloop_flux.resolve import FluxParams

from .conftest import i2i, t2i


def test_one_resolution_per_request(flux_runtime: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = flux_resolve.resolve

    def counting(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(*args, **kw)

    for module in ("omniloop_flux.family", "omniloop_flux.stages"):
        monkeypatch.setattr(f"{module}.resolve", counting)
    ex = flux_runtime("dev").prepare(t2i(steps=2, height=32, width=32))
    assert len(calls) == 1 and isinstance(ex.resolved, FluxParams) and isinstance(ex.resolved, Resolved)
    assert ex.run().ok and len(calls) == 1
    w = ex.resolved.workload()
    assert (w.steps, w.branches, w.frames, w.height, w.width) == (2, 1, 1, 32, 32) and ex.steps_done == 2


def test_i2i_workload_counts_the_strength_share(flux_runtime: Any, input_png: Any) -> None:
    ex = flux_runtime("dev").prepare(i2i(input_png, steps=4))
    w = ex.resolved.workload()
    assert ex.run().ok and w.steps == ex.steps_done < 4


def test_text_encode_params_checked_by_the_converter(flux_runtime: Any) -> None:
    with pytest.raises(RequestError) as err:
        flux_runtime("dev").prepare({**t2i(), "node_params": {"text_encode": {"max_sequence_length": 0}}})
    assert err.value.path == "node_params.text_encode.max_sequence_length"
