"""omniloop_offload (omniloop-offload): the move / stream schedule of ``offload: model | sequential``, recorded.

The toy family (its transformer has a ``blocks`` ModuleList) opts in through a subclass declaring
``offload_components``. On CPU storage and execution device are both ``cpu``; a recording mover
counts every copy and poisons evicted weights with NaN, so a weight computed with while it is not
loaded would show in the output (which must stay ``torch.equal`` to the unoffloaded run). The CUDA
tests (skipped without a GPU) run the pinned-memory / side-stream path for real.
"""

from __future__ import annotations

import contextlib
from typing import Any

import attrs
import pytest
import torch
from torch import nn

import omniloop_offload.plugin as offload_plugin
from omniloop.capabilities import FamilyCapabilities, OffloadSupport
from omniloop.deploy import load_deploy
from omniloop.errors import DeployError
from omniloop.hookspecs import hookimpl
from omniloop.loop import is_batched, is_loop_stage
from omniloop.runtime import Deployment, Runtime
from omniloop.testing import build_toy_checkpoint, make_manager, toy_request
from omniloop.testing.toy import ToyFamily
from omniloop_offload import Mover, OffloadedStage, Offloader, PoisonMover, check_offload, install, wrap_pipeline

Trace = list[tuple[str, str, tuple[str, ...]]]


class OffloadToyFamily(ToyFamily):
    capabilities = attrs.evolve(ToyFamily.capabilities, offload=OffloadSupport(
        components={"text_encoder": None, "transformer": "blocks", "decoder": None}))


class _Plugin:
    OMNILOOP_HOOK_API = ">=1.0,<2"

    @hookimpl
    def omniloop_register_families(self, register: Any) -> None:
        register(OffloadToyFamily())


def manager() -> Any:
    return make_manager(("toy-offload", _Plugin()), ("offload", offload_plugin), toy=False)


class RecordingMover(PoisonMover):
    """Counts fetches; evicted weights are NaN (omniloop_offload.PoisonMover)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.fetches = 0

    def fetch(self, master: torch.Tensor) -> torch.Tensor:
        self.fetches += 1
        return super().fetch(master)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_toy_checkpoint(tmp_path_factory.mktemp("toy-offload"), layers=5)


def _strict(rt: Runtime, mode: str) -> tuple[Trace, RecordingMover]:
    trace: Trace = []
    mover = RecordingMover(rt.device)
    rt.offload.remove()
    rt.offload = install(rt.model, rt.family, mode, rt.device, mover=mover, trace=trace)
    rt._pipelines.clear()
    return trace, mover


def _latents(out: Any) -> torch.Tensor:
    assert out.status.value == "completed", out.error
    return out.artifacts["latents"].tensor


@pytest.fixture(scope="module")
def reference(ckpt: Any) -> tuple[torch.Tensor, torch.Tensor]:
    out = Runtime.from_model(ckpt, manager=manager()).generate(toy_request(steps=3))
    return _latents(out), out.artifacts["video"].frames


@pytest.mark.parametrize("mode", ["model", "sequential"])
def test_runtime_offload_equals_no_offload(ckpt: Any, reference: Any, mode: str) -> None:
    rt = Runtime.from_model(ckpt, manager=manager(), offload=mode)
    out = rt.generate(toy_request(steps=3))
    assert torch.equal(_latents(out), reference[0]) and torch.equal(out.artifacts["video"].frames, reference[1])


def test_model_mode_schedule(ckpt: Any, reference: Any) -> None:
    """One node's components on the device at a time; the transformer loads once for the whole
    denoise loop (lazy eviction), not once per step."""
    rt = Runtime.from_model(ckpt, manager=manager(), offload="model")
    trace, mover = _strict(rt, "model")
    assert rt.offload.resident() == ()
    assert torch.equal(_latents(rt.generate(toy_request(steps=3))), reference[0])
    moves = [(ev, name) for ev, name, _ in trace if ev in ("load", "evict")]
    assert moves == [("load", "text_encoder"), ("evict", "text_encoder"), ("load", "transformer"),
                     ("evict", "transformer"), ("load", "decoder")]
    for ev, name, res in trace:
        if ev == "stage":
            assert res == ({"text_encode": "text_encoder", "denoise": "transformer", "decode": "decoder"}[name],)
    n_tensors = sum(len(u.masters) for u in rt.offload.shells.values())
    assert mover.fetches == n_tensors  # every tensor copied exactly once for the request


def test_sequential_schedule(ckpt: Any, reference: Any) -> None:
    """Each block loads when it runs, the next one is prefetched as it starts (wrapping to block 0),
    it leaves when it is done: at most two blocks resident, never a block while the decoder runs."""
    rt = Runtime.from_model(ckpt, manager=manager(), offload="sequential")
    trace, mover = _strict(rt, "sequential")
    assert torch.equal(_latents(rt.generate(toy_request(steps=3))), reference[0])
    n = len(rt.model.components["transformer"].blocks)
    runs = [(name, res) for ev, name, res in trace if ev == "run"]
    forwards = len(runs) // n
    assert forwards >= 3 and [r for r, _ in runs] == [f"transformer.blocks.{i}" for i in range(n)] * forwards
    for name, res in runs:
        blocks = [r for r in res if r.startswith("transformer.blocks.")]
        assert name in res and len(blocks) <= 2 and "transformer" in res
        assert "decoder" not in res and "text_encoder" not in res
    # block i runs after block i+1's prefetch was started and before block i was evicted
    for k, (ev, name, _) in enumerate(trace):
        if ev == "run":
            i = int(name.rsplit(".", 1)[1])
            assert trace[k - 1][:2] == ("prefetch", f"transformer.blocks.{(i + 1) % n}")
            assert ("evict", name) == next(t[:2] for t in trace[k + 1:] if t[1] == name)
    stages = {name: res for ev, name, res in trace if ev == "stage"}
    assert stages["decode"] == ("decoder",)
    # the shell moves once for the loop; each block once per forward, plus the wrapped-around prefetch
    shell = len(rt.offload.shells["transformer"].masters)
    per_block = len(rt.offload.stacks["transformer"].units[0].masters)
    enc, dec = len(rt.offload.shells["text_encoder"].masters), len(rt.offload.shells["decoder"].masters)
    assert mover.fetches == enc + shell + per_block * (n * forwards + 1) + dec


def test_skipped_blocks_keep_the_bound() -> None:
    """A caller that runs only some blocks (a cache interceptor) leaves a stale prefetch behind:
    the next block entered drops it, so no more than two blocks are ever resident."""
    blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(6))
    trace: Trace = []
    off = Offloader({"net": nn.ModuleDict({"blocks": blocks})}, {"net": "blocks"}, "sequential", torch.device("cpu"),
                    mover=RecordingMover(torch.device("cpu")), trace=trace)
    off.activate(["net"])
    x = torch.randn(2, 4)
    ref = x
    with torch.no_grad():
        for i in (0, 1, 4, 5, 0, 3):
            x = blocks[i](x)
    off.remove()
    with torch.no_grad():
        for i in (0, 1, 4, 5, 0, 3):
            ref = blocks[i](ref)
    assert torch.equal(x, ref)
    for ev, name, res in trace:
        if ev == "run":
            assert name in res and len([r for r in res if ".blocks." in r]) <= 2


def test_model_mode_keeps_what_the_node_uses_and_ignores_the_rest() -> None:
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    off = Offloader({"a": a, "b": b, "tokenizer": object()}, {}, "model", torch.device("cpu"),
                    mover=RecordingMover(torch.device("cpu")))
    assert "tokenizer" not in off.shells and off.resident() == ()
    assert torch.isnan(a.weight).all()  # parked: poisoned by the recording mover
    off.activate(["a", "tokenizer"])
    assert off.resident() == ("a",) and not torch.isnan(a.weight).any()
    off.activate(["tokenizer"])  # a node using nothing that moves moves nothing
    assert off.resident() == ("a",)
    off.activate(["b"])
    assert off.resident() == ("b",) and torch.isnan(a.weight).all()
    off.remove()
    assert off.resident() == () and not torch.isnan(a.weight).any()  # removed: the masters again


def test_tied_parameters_move_once() -> None:
    enc = nn.Module()
    enc.embed = nn.Embedding(5, 3)
    enc.head = nn.Linear(3, 5, bias=False)
    enc.head.weight = enc.embed.weight
    off = Offloader({"enc": enc}, {}, "model", torch.device("cpu"))
    assert len(off.shells["enc"].masters) == 1


def test_wrapped_stage_keeps_its_shape(ckpt: Any) -> None:
    """The wrapped denoise is still a (batched) loop stage; each call activates its components."""
    from omniloop.request import TaskType

    rt = Runtime.from_model(ckpt, manager=manager(), offload="model")
    spec = rt.pipeline(TaskType.T2V).spec
    den = spec.node("denoise")
    assert isinstance(den.stage, OffloadedStage) and is_loop_stage(den.stage) and is_batched(den.stage)
    assert not isinstance(den.stage.inner, OffloadedStage)
    assert wrap_pipeline(spec, rt.offload).node("denoise").stage is den.stage  # never wrapped twice
    assert wrap_pipeline(spec, None) is spec


def _run_batched(rt: Runtime) -> list[torch.Tensor]:
    from omniloop.execution import advance_batch

    execs = [rt.prepare(toy_request(steps=3, seed=1)), rt.prepare(toy_request(steps=3, seed=2))]
    batched = 0
    while not all(e.done for e in execs):
        keys = {e.batch_key() for e in execs}
        if len(keys) == 1 and None not in keys:
            advance_batch(execs)
            batched += 1
        else:
            for e in execs:
                e.advance()
    assert batched >= 2
    return [_latents(e.output) for e in execs]


def test_step_batch_of_two_requests_equal(ckpt: Any) -> None:
    """Two requests co-batched (``advance_batch``, the step scheduler's path) through the wrapped
    stage equal the same batched run without offload (a batch of two rounds differently from two
    requests alone, so the reference is batched too)."""
    ref = _run_batched(Runtime.from_model(ckpt, manager=manager()))
    rt = Runtime.from_model(ckpt, manager=manager(), offload="sequential")
    _strict(rt, "sequential")
    got = _run_batched(rt)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))


def test_host_masters_packed_into_slabs() -> None:
    """With pinning on, masters are 256-byte-aligned views into power-of-two slabs (not one rounded
    pinned allocation each); a tensor larger than a slab stays pageable. (Slabs are plain CPU
    memory here: pinning needs CUDA.)"""

    class Unpinned(Mover):
        def _new_slab(self) -> torch.Tensor:
            return torch.empty(self.slab_bytes, dtype=torch.uint8)

    mover = Unpinned(torch.device("cpu"), pin=True, slab_bytes=1024)
    xs = [torch.randn(10), torch.randn(3, 5).to(torch.bfloat16), torch.tensor(7), torch.randn(100), torch.randn(300)]
    hosts = [mover.store(x) for x in xs]
    assert all(torch.equal(x, h) and x.shape == h.shape and x.dtype == h.dtype for x, h in zip(xs, hosts, strict=True))
    slab0 = hosts[0].untyped_storage().data_ptr()
    assert [h.untyped_storage().data_ptr() == slab0 for h in hosts[:3]] == [True] * 3  # packed together
    assert all((h.data_ptr() - slab0) % 256 == 0 for h in hosts[:3])
    assert hosts[3].untyped_storage().data_ptr() != slab0  # 400 bytes did not fit after the first three
    assert mover.pinned_bytes == 2 * 1024 and mover.pageable_bytes == 300 * 4  # the 1200-byte one: pageable
    with pytest.raises(ValueError, match="power of two"):
        Mover(torch.device("cpu"), slab_bytes=1000)


class FakeStreams:
    """Stands in for :class:`omniloop_offload.CudaStreams` on a CPU: records which copies were
    issued on the side stream, the events, and the compute stream's waits."""

    def __init__(self, log: list[tuple[str, Any]]) -> None:
        self.log = log
        self.on_side = False
        self.events = 0

    @contextlib.contextmanager
    def copying(self) -> Any:
        self.on_side = True
        try:
            yield
        finally:
            self.on_side = False

    def record(self) -> int:
        assert self.on_side
        self.events += 1
        self.log.append(("record", self.events))
        return self.events

    def wait(self, event: int, tensors: list[torch.Tensor]) -> None:
        assert not self.on_side and tensors
        self.log.append(("wait", event))


def test_side_stream_schedule_recorded() -> None:
    """With a side stream: block i+1's copies are issued inside the side-stream context and an
    event recorded after them; the compute stream waits on exactly that event before block i+1
    runs (and ties its tensors to the compute stream); block 0's first load is a plain load."""
    log: list[tuple[str, Any]] = []
    streams = FakeStreams(log)

    class SideMover(PoisonMover):
        def fetch(self, master: torch.Tensor) -> torch.Tensor:
            log.append(("copy", "side" if streams.on_side else "compute"))
            return super().fetch(master)

    net = nn.ModuleDict({"blocks": nn.ModuleList(nn.Linear(4, 4) for _ in range(3))})
    trace: Trace = []
    off = Offloader({"net": net}, {"net": "blocks"}, "sequential", torch.device("cpu"),
                    mover=SideMover(torch.device("cpu")), trace=trace, streams=streams)
    assert off.describe()["side_stream"]
    off.activate(["net"])
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(2):
            for b in net["blocks"]:
                x = b(x)
    assert not torch.isnan(x).any()
    events = [(ev, name) for ev, name, _ in trace if ev in ("load", "prefetch", "wait", "run") and ".blocks." in name]
    assert events[:4] == [("load", "net.blocks.0"), ("prefetch", "net.blocks.1"), ("run", "net.blocks.0"),
                          ("wait", "net.blocks.1")]
    # every run after the first is preceded by the wait for its own prefetch
    for k, (ev, name) in enumerate(events):
        if ev == "run" and k > 2:
            assert ("wait", name) in events[:k] and events[k - 2] == ("wait", name)
    copies = [c for c in log if c[0] == "copy"]
    assert copies[:2] == [("copy", "compute")] * 2  # block 0's weight and bias, loaded on the compute stream
    assert all(c == ("copy", "side") for c in copies[2:])
    waits = [e for tag, e in log if tag == "wait"]
    assert waits == list(range(1, streams.events + 1))[: len(waits)] and len(waits) == 5  # 2 forwards x 3 blocks - 1


def test_no_overlap_streams_without_prefetch() -> None:
    blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
    trace: Trace = []
    off = Offloader({"net": nn.ModuleDict({"blocks": blocks})}, {"net": "blocks"}, "sequential", torch.device("cpu"),
                    mover=RecordingMover(torch.device("cpu")), trace=trace, overlap=False)
    off.activate(["net"])
    with torch.no_grad():
        x = torch.randn(2, 4)
        for b in blocks:
            x = b(x)
    assert not any(ev == "prefetch" for ev, *_ in trace)
    assert all(len([r for r in res if ".blocks." in r]) == 1 for ev, _, res in trace if ev == "run")
    assert not torch.isnan(x).any()


# -- refused at load, one line ------------------------------------------------------------------
@attrs.define
class _Fam:
    name: str = "fam"
    offload_components: dict[str, Any] | None = attrs.Factory(lambda: {"x": None})

    @property
    def capabilities(self) -> FamilyCapabilities:
        comps = self.offload_components
        return FamilyCapabilities(offload=OffloadSupport(components=comps) if comps else None)


@pytest.mark.parametrize("deploy,family,device,match", [
    ({"offload": "model"}, _Fam(offload_components=None), "cpu", r"^offload: family 'fam' does not support offload"),
    ({"offload": "sequential"}, _Fam(), "meta", r"^offload: 'sequential' moves weights between host memory and a CUDA device, not 'meta'$"),
    ({"offload": "model", "parallel": {"sp": 2}}, _Fam(), "cpu", r"^offload: 'model' runs in one process"),
    ({"offload": "model", "adapters": {"x": "/a"}}, _Fam(), "cpu", r"^offload: 'model' does not combine with LoRA adapters yet \(adapters: x\)$"),
    ({"offload": "sequential", "compile": True}, _Fam(), "cpu", r"^offload: 'sequential' does not combine with compile: true"),
    ({"offload": "model", "placement": {"vae": {"devices": ["cpu"]}}}, _Fam(), "cpu",
     r"^offload: 'model' does not combine with placement \(role pools\) yet$"),
])
def test_check_offload_refusals(deploy: dict[str, Any], family: Any, device: str, match: str) -> None:
    with pytest.raises(DeployError, match=match) as info:
        check_offload(load_deploy(deploy), family, torch.device(device))
    assert "\n" not in str(info.value)
    check_offload(load_deploy({}), family, torch.device(device))  # offload: none always passes


def test_family_without_declaration_refused_before_weights(ckpt: Any) -> None:
    with pytest.raises(DeployError, match=r"^offload: family 'toy' does not support offload"):
        Deployment({"model": {"path": str(ckpt)}, "offload": "model"}, manager=make_manager(("offload", offload_plugin)))


@pytest.mark.parametrize("value", ["Model", "all", "1"])
def test_bad_offload_value_is_one_line(ckpt: Any, value: str) -> None:
    with pytest.raises(DeployError, match=r"offload") as info:
        Deployment({"model": {"path": str(ckpt)}, "offload": value}, manager=manager())
    assert "\n" not in str(info.value)


def test_bad_block_path_declared() -> None:
    net = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(DeployError, match=r"^offload: component 'net' has no block list 'layers'"):
        Offloader({"net": net}, {"net": "layers"}, "sequential", torch.device("cpu"))
    holder = nn.Module()
    holder.layers = nn.ModuleList()
    with pytest.raises(DeployError, match=r"^offload: net.layers is not a non-empty ModuleList"):
        Offloader({"net": holder}, {"net": "layers"}, "sequential", torch.device("cpu"))
    Offloader({"net": net}, {"net": "layers"}, "model", torch.device("cpu"))  # model mode ignores block lists
    with pytest.raises(DeployError, match=r"^offload: component 'net' has no block list 'a\|b'"):
        Offloader({"net": net}, {"net": "a|b"}, "sequential", torch.device("cpu"))


def test_alternatives_and_several_lists_as_one_stack() -> None:
    """``a|b``: the first present; a tuple: one stack in order (the prefetch after the last block
    of the first list is the first block of the second)."""
    net = nn.Module()
    net.doubles = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
    net.singles = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
    trace: Trace = []
    off = Offloader({"net": net}, {"net": ("missing|doubles", "singles")}, "sequential", torch.device("cpu"),
                    mover=RecordingMover(torch.device("cpu")), trace=trace)
    assert [u.name for u in off.stacks["net"].units] == [
        "net.doubles.0", "net.doubles.1", "net.singles.0", "net.singles.1", "net.singles.2"]
    off.activate(["net"])
    x = torch.randn(1, 2)
    with torch.no_grad():
        for b in [*net.doubles, *net.singles]:
            x = b(x)
    k = next(i for i, t in enumerate(trace) if t[:2] == ("run", "net.doubles.1"))
    assert trace[k - 1][:2] == ("prefetch", "net.singles.0")
    assert not torch.isnan(x).any()


# -- CUDA: pinned host masters, a side stream, the memory bound (marked gpu: skipped without CUDA) --
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["model", "sequential"])
def test_cuda_runtime_offload_equals_resident(ckpt: Any, mode: str) -> None:
    ref = Runtime.from_model(ckpt, device="cuda", manager=manager()).generate(toy_request(steps=3))
    rt = Runtime.from_model(ckpt, device="cuda", manager=manager(), offload=mode)
    out = rt.generate(toy_request(steps=3))
    assert torch.equal(_latents(out).cpu(), _latents(ref).cpu())
    info = rt.offload.describe()
    assert info["pinned"] and info["host_pinned_bytes"] >= sum(u.nbytes for u in rt.offload.shells.values())
    assert info["side_stream"]
    assert all(p.device.type == "cpu" for p in rt.model.components["transformer"].parameters())  # decode ran last


def _stack(dim: int = 1024, n: int = 12) -> nn.ModuleDict:
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim)) for _ in range(n))
    return nn.ModuleDict({"blocks": blocks}).eval()


def _run(net: nn.ModuleDict, x: torch.Tensor, forwards: int = 2) -> torch.Tensor:
    for _ in range(forwards):
        y = x
        for b in net["blocks"]:
            y = b(y)
    return y


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [True, False])
def test_cuda_sequential_memory_bound_and_equal(overlap: bool) -> None:
    """12 blocks of 8 MiB streamed (side-stream prefetch, or none): when a block starts at most two
    blocks are allocated, and the output is ``torch.equal`` to the same stack resident on the GPU."""
    dev = torch.device("cuda")
    net = _stack()
    x = torch.randn(64, 1024, device=dev)
    with torch.no_grad():
        ref = _run(net.to(dev), x).cpu()
        net.to("cpu")
        torch.cuda.empty_cache()
        off = Offloader({"net": net}, {"net": "blocks"}, "sequential", dev, overlap=overlap)
        off.activate(["net"])
        block_bytes = off.stacks["net"].units[0].nbytes
        peaks: list[int] = []
        probes = [b.register_forward_pre_hook(lambda m, a: peaks.append(torch.cuda.memory_allocated()))
                  for b in net["blocks"]]  # after the offloader's hook: block i loaded, i+1 on its way
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        y = _run(net, x)
        torch.cuda.synchronize()
        for p in probes:
            p.remove()
        off.remove()
    assert torch.equal(y.cpu(), ref)
    assert max(peaks) - base <= (2 if overlap else 1) * block_bytes + 4 * 64 * 1024 * 4
    assert all(p.device.type == "cpu" for p in net.parameters())


def test_offload_without_its_plugin_is_refused_naming_the_package(ckpt: Any) -> None:
    """The core keeps the deploy field; with no mechanism serving it the deploy is one line."""
    with pytest.raises(DeployError, match=r"^offload: no installed plugin serves this field: pip install omniloop-offload$"):
        Deployment({"model": {"path": str(ckpt)}, "offload": "model"}, manager=make_manager())
