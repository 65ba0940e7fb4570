"""omniloop_kit.graphs: deploy ``options.cuda_graphs`` — the checks, the graph keys, capture once
per key, the plain-forward fallbacks. The capture itself needs CUDA: on CPU a stand-in capture
(``_capture`` replaced) records what would be captured and "replays" by calling the forward on
the captured buffers; the real graphs are exercised by the GPU test at the end (skipped on CPU)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import attrs
import pytest
import torch

from omniloop.deploy import DeployConfig
from omniloop.errors import DeployError
from omniloop_kit import graphs


@pytest.fixture
def fake_capture(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """``_capture`` replaced: each capture is recorded (its static buffers); a replay recomputes
    ``fn`` on the static buffers into the captured output (what a CUDA graph replay does)."""
    captures: list[dict[str, Any]] = []

    def capture(fn: Any, static: dict[str, Any]) -> tuple[Any, torch.Tensor]:
        captures.append(static)
        out = fn(**static)

        def run() -> None:
            out.copy_(fn(**static))

        return run, out

    monkeypatch.setattr(graphs, "_capture", capture)
    return captures


class Model:
    """A stand-in model (graphs are kept per model, weakly)."""


def forward(x: torch.Tensor, scale: torch.Tensor, rotary: Any = None, guidance: Any = None) -> torch.Tensor:
    out = x * scale
    if rotary is not None:
        out = out + rotary[0] - rotary[1]
    if guidance is not None:
        out = out + guidance
    return out


def test_option_is_checked_before_load() -> None:
    assert graphs.graph_option({}, "cpu") is False
    assert graphs.graph_option({"cuda_graphs": False}, "cpu") is False
    with pytest.raises(DeployError, match=r"^options\.cuda_graphs: expected true or false, got 'yes'$"):
        graphs.graph_option({"cuda_graphs": "yes"}, "cuda")
    with pytest.raises(DeployError, match=r"^options\.cuda_graphs: CUDA graphs need a CUDA device, not cpu$"):
        graphs.graph_option({"cuda_graphs": True}, torch.device("cpu"))
    with pytest.raises(DeployError, match=r"CUDA graphs need a CUDA device, not None"):
        graphs.graph_option({"cuda_graphs": True}, None)
    deploy = DeployConfig(device="cuda", offload="model")
    with pytest.raises(DeployError, match=r"^options\.cuda_graphs: not with offload: model"):
        graphs.graph_option({"cuda_graphs": True, "deploy": deploy}, "cuda")
    assert graphs.graph_option({"cuda_graphs": True, "deploy": DeployConfig(device="cuda")}, "cuda:0") is True


def test_graph_key_names_every_input_shape_dtype_and_device() -> None:
    x = torch.zeros(2, 3)
    key = graphs.graph_key(True, {"x": x, "g": None, "rot": (torch.zeros(4), torch.zeros(4, dtype=torch.float64))})
    assert key == (True, ("g", None), ("rot", (((4,), torch.float32, x.device), ((4,), torch.float64, x.device))),
                   ("x", ((2, 3), torch.float32, x.device)))
    assert graphs.graph_key(True, {"x": x}) != graphs.graph_key(False, {"x": x})  # the family's tag
    assert graphs.graph_key(0, {"x": x}) != graphs.graph_key(0, {"x": x.half()})
    assert graphs.graph_key(0, {"x": x}) == graphs.graph_key(0, {"x": torch.ones(2, 3)})  # values do not count
    with pytest.raises(TypeError, match=r"forward input 's' is a float"):
        graphs.graph_key(0, {"s": 1.5})  # a number would be baked into the graph


def test_one_capture_per_key_inputs_copied_in_output_copied_out(fake_capture: list[dict[str, Any]]) -> None:
    model = Model()
    rot = (torch.ones(3), torch.zeros(3))
    a = {"x": torch.randn(2, 3), "scale": torch.tensor(2.0), "rotary": rot, "guidance": None}
    out_a = graphs.replay(model, "tag", forward, a)
    assert torch.equal(out_a, forward(**a))
    b = {**a, "x": torch.randn(2, 3), "scale": torch.tensor(3.0)}
    out_b = graphs.replay(model, "tag", forward, b)
    assert len(fake_capture) == 1 and graphs.captured(model) == 1  # same shapes: replayed, not captured again
    assert torch.equal(out_b, forward(**b))  # the new inputs were copied into the captured buffers
    assert torch.equal(out_a, forward(**a))  # the first result is a copy, not the graph's output buffer
    assert fake_capture[0]["x"] is not a["x"]  # the captured buffers are the graph's own
    graphs.replay(model, "tag", forward, {**a, "x": torch.randn(4, 3)})  # a new shape: a second graph
    graphs.replay(model, "other", forward, a)  # another tag (compiled vs eager blocks): a third
    assert graphs.captured(model) == 3
    graphs.replay(Model(), "tag", forward, a)  # graphs are per model
    assert graphs.captured(model) == 3 and len(fake_capture) == 4
    graphs.release(model)
    assert graphs.captured(model) == 0


def test_past_max_graphs_new_shapes_run_plainly(fake_capture: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(graphs, "MAX_GRAPHS", 2)
    model = Model()
    for n in (1, 2, 3, 4):
        x = torch.randn(n, 3)
        assert torch.equal(graphs.replay(model, 0, forward, {"x": x, "scale": torch.tensor(2.0)}), x * 2)
    assert graphs.captured(model) == 2 and len(fake_capture) == 2
    assert sum("already keeps 2 graphs" in r.message for r in caplog.records) == 1  # logged once


@attrs.define
class Bound:
    interceptor: Any = None
    block_tap: Any = None


def test_graphed_falls_back_to_the_plain_forward_when_something_is_bound(fake_capture: list[dict[str, Any]]) -> None:
    calls: list[Any] = []

    def run(bctx: Any, x: torch.Tensor) -> torch.Tensor:
        calls.append(bctx)
        return x + 1

    x = torch.zeros(2)
    on = SimpleNamespace(options={"cuda_graphs": True}, eager=False)
    cases = [  # (ctx, block_ctx, graphed?)
        (SimpleNamespace(options={}, eager=False), None, False),  # not asked for
        (SimpleNamespace(options={"cuda_graphs": True}, eager=True), None, False),  # a plugin needs eager blocks
        (on, Bound(interceptor=object()), False),  # a block interceptor (cache-dit) runs between blocks
        (on, Bound(block_tap=print), False),  # block taps
        (on, Bound(), True),  # a block context with nothing bound
        (on, None, True),
    ]
    for ctx, bctx, want in cases:
        model, calls[:] = Model(), []
        assert graphs.graphs_enabled(ctx, bctx) is want
        assert torch.equal(graphs.graphed(ctx, bctx, model, 0, run, {"x": x}), x + 1)
        assert graphs.captured(model) == int(want)
        assert calls[0] is (None if want else bctx)  # a captured forward gets no block context


def test_families_declare_it_and_others_refuse_it_in_one_line() -> None:
    """SD3, FLUX.1 and Stable Audio read ``options.cuda_graphs``; Wan does not: the runtime refuses."""
    from omniloop.capabilities import capabilities_of
    from omniloop_flux.family import FluxFamily
    from omniloop_sd3.family import SD3Family
    from omniloop_stable_audio.family import StableAudioFamily
    from omniloop_wan.family import WanFamily

    for fam in (FluxFamily(), SD3Family(), StableAudioFamily()):
        capabilities_of(fam).check_options(fam.name, {"cuda_graphs": True})
    with pytest.raises(DeployError, match=r"^options\.cuda_graphs: family 'wan' does not read this option"):
        capabilities_of(WanFamily()).check_options("wan", {"cuda_graphs": True})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_a_real_graph_replays_the_forward_on_cuda() -> None:
    model = torch.nn.Linear(8, 8).cuda()
    with torch.no_grad():
        for n in (2, 2, 3):
            x = torch.randn(n, 8, device="cuda")
            assert torch.equal(graphs.replay(model, 0, lambda x: model(x).relu(), {"x": x}), model(x).relu())
    assert graphs.captured(model) == 2
