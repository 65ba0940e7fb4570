"""Component offload for a GPU smaller than the model: deploy ``offload: model | sequential``
(omniloop-offload; the core's ``omniloop.offload`` until omniloop 0.2, issue 34).

Weights live in host memory (the *storage*: CPU, pinned when the execution device is CUDA) and
are copied to the execution device only while they compute:

``model``
    A pipeline node moves the components it ``uses`` (``Node.uses``) onto the device before any
    of its calls (``forward``, a loop's ``init`` / ``step`` / ``finalize``) and every other
    resident component back to storage — lazily: a denoise loop keeps its transformer resident
    across steps, and the transformer leaves when the VAE decode needs the room. At most one
    node's components are on the device at a time.
``sequential``
    As ``model``, but a component whose family declares a block stack (Wan's transformer:
    ``blocks``; the UMT5 text encoder: ``encoder.block``) moves only its *shell* (embeddings,
    norms, projections) with the node; the blocks are streamed one by one by forward hooks on
    each block: entering block ``i`` waits for its copy, starts copying block ``i+1`` (wrapping to
    block 0 for the next forward) on a side CUDA stream from pinned memory, and leaving block
    ``i`` drops it — so at most two blocks of a stack are on the device, and the next block's
    copy overlaps the current block's compute.

"Back to storage" copies nothing: weights are read-only at inference, so each tensor keeps one
host *master* copy and an evicted parameter simply points at it again; a load is one host-to-device
copy of the master. LoRA adapters, compiled blocks, parallel worker pools and role pools are
refused with offload at load, as is whatever the family vetoes (``offload_refusal``; Wan: sequential
with a causal rollout) — :func:`check_offload`. Through the mechanism this package registers
(``omniloop_offload.plugin``), the Runtime loads the family into host memory, installs the offloader
(:func:`install`), and wraps every pipeline it builds with :func:`wrap_pipeline`.

A family opts in with ``capabilities.offload = OffloadSupport(components)``: ``{component name: its block list(s) or None}`` —
a dotted path of a ModuleList, ``a|b`` for alternatives (the first present wins: library versions
differ), or a tuple of such paths streamed as one stack in that order (Flux: the double-stream then
the single-stream blocks) — the components that may move (tokenizers, schedulers are not modules and
stay), and for sequential mode which of them stream blocks. A component it does not list never
moves (and a node using it under offload fails with a device mismatch, so families list every
module they compute with).

On a CPU deployment storage and execution device are both ``cpu``: the machinery (hooks, the
schedule) runs and nothing is copied — what the CPU tests exercise, with :class:`PoisonMover`
(evicted weights are NaN, so a weight used while not loaded shows in the output).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch

from omniloop.capabilities import capabilities_of
from omniloop.deploy import DeployConfig
from omniloop.errors import DeployError
from omniloop.family import Mechanism

#: the deploy's ``offload`` values
MODES = ("none", "model", "sequential")


class Mover:
    """How a tensor moves between storage and the execution device (the default: real copies).

    ``store(t)`` makes the host master of a tensor; ``fetch(master)`` the device copy
    (asynchronous when called under a side stream); ``park(master)`` what an evicted parameter
    holds (the master itself: nothing is copied back). Tests subclass it to record or to make an
    unloaded weight unusable.

    For a CUDA device the masters are packed into pinned *slabs* of ``slab_bytes`` (a power of
    two), 256-byte aligned: PyTorch's pinned allocator rounds every allocation up to a power of two,
    which for a 141 MB feed-forward weight would pin 256 MB — one slab per tensor could nearly double
    the host memory a large model pins. A tensor larger than a slab stays in ordinary (pageable)
    memory: its copies are synchronous, correct, and rare (an embedding table in a shell)."""

    def __init__(self, device: torch.device, *, pin: bool | None = None, slab_bytes: int = 1 << 30) -> None:
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda" if pin is None else pin
        if slab_bytes <= 0 or slab_bytes & (slab_bytes - 1):
            raise ValueError(f"slab_bytes must be a power of two, not {slab_bytes}")
        self.slab_bytes = slab_bytes
        self._slab: torch.Tensor | None = None
        self._used = 0
        #: host bytes pinned (whole slabs) and kept pageable (tensors larger than a slab)
        self.pinned_bytes = 0
        self.pageable_bytes = 0

    def store(self, t: torch.Tensor) -> torch.Tensor:
        src = t.detach()
        n = src.numel() * src.element_size()
        if self.pin and src.device.type == "cpu" and src.is_pinned():  # already a master (offload installed again)
            return src
        if not self.pin or n > self.slab_bytes:
            host = src.to("cpu")
            if self.pin:
                self.pageable_bytes += n
            return host
        off = (self._used + 255) & ~255
        if self._slab is None or off + n > self.slab_bytes:
            self._slab = self._new_slab()
            self.pinned_bytes += self.slab_bytes
            off = 0
        host = self._slab[off:off + n].view(src.dtype).view(src.shape)
        host.copy_(src)
        self._used = off + n
        return host

    def _new_slab(self) -> torch.Tensor:
        return torch.empty(self.slab_bytes, dtype=torch.uint8, pin_memory=True)

    def fetch(self, master: torch.Tensor) -> torch.Tensor:
        return master.to(self.device, non_blocking=self.pin)

    def park(self, master: torch.Tensor) -> torch.Tensor:
        return master


class CudaStreams:
    """The side stream block prefetches copy on (sequential mode on CUDA). Tests substitute an
    object with the same three methods to record the stream schedule on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def copying(self) -> Any:
        """A context: allocations and copies inside it go on the side stream."""
        return torch.cuda.stream(self.side)

    def record(self) -> Any:
        """An event marking the copies issued so far on the side stream."""
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.side)
        return event

    def wait(self, event: Any, tensors: Sequence[torch.Tensor]) -> None:
        """The compute stream waits for ``event``; ``tensors`` (made on the side stream) are tied to
        the compute stream too, so the allocator does not reuse them while a kernel may read them."""
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for t in tensors:
            if t.numel():  # an empty tensor has no memory to keep
                t.record_stream(current)


class PoisonMover(Mover):
    """For tests (and a family checking its offload declaration): an evicted weight holds NaN
    (an integer buffer: an empty tensor), so computing with a weight that is not loaded shows in the
    output; a load hands back the master itself (on a CPU a copy at another address may round
    differently in GEMM kernels, which would hide what this checks)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device, pin=False)

    def fetch(self, master: torch.Tensor) -> torch.Tensor:
        return master

    def park(self, master: torch.Tensor) -> torch.Tensor:
        if master.is_floating_point() or master.is_complex():
            return torch.full_like(master, float("nan"))
        return master.new_empty(0)


@attrs.define(eq=False)
class _Unit:
    """A group of tensors that moves together: a component (its shell in sequential mode) or a block."""

    name: str
    #: (module, attribute name, is a parameter)
    slots: list[tuple[torch.nn.Module, str, bool]]
    masters: list[torch.Tensor]
    on_device: bool = False
    #: the side-stream copy event of a prefetched block (CUDA only)
    event: Any = None
    nbytes: int = 0


@attrs.define(eq=False)
class _Stack:
    """One component's streamed block list (sequential mode)."""

    component: str
    units: list[_Unit]


class Offloader(Mechanism):
    """Moves a loaded model's components (and, sequentially, their blocks) as its nodes run.

    Build it with :func:`install`; :func:`wrap_pipeline` makes a pipeline's nodes call
    :meth:`activate`. ``trace`` (a list, when given) receives ``(event, name, resident names)``
    tuples — ``load``, ``prefetch``, ``wait`` (the compute stream waits for a prefetch), ``evict``,
    ``run`` (a block about to compute), ``stage`` — the schedule the tests check."""

    def __init__(self, components: Mapping[str, Any], blocks: Mapping[str, str | Sequence[str] | None], mode: str,
                 device: torch.device, *, mover: Mover | None = None, trace: list[tuple[str, str, tuple[str, ...]]] | None = None,
                 overlap: bool = True, streams: Any = None) -> None:
        if mode not in ("model", "sequential"):
            raise DeployError(f"offload: {mode!r} is not an offload mode (model, sequential)")
        self.mode = mode
        self.device = torch.device(device)
        self.mover = mover or Mover(self.device)
        self.trace = trace
        #: sequential: prefetch the next block while the current one runs (False: each block is copied
        #: when it is entered, on the compute stream — what the overlap saves, for benchmarks)
        self.overlap = overlap
        #: the side stream of prefetches (CUDA with pinned masters; ``streams`` replaces it in tests);
        #: None: a prefetch is a plain load
        self.streams: Any = streams if streams is not None else (
            CudaStreams(self.device) if overlap and self.device.type == "cuda" and self.mover.pin else None
        )
        self._hooks: list[Any] = []
        self.shells: dict[str, _Unit] = {}
        self.stacks: dict[str, _Stack] = {}
        self._block_of: dict[int, tuple[_Stack, int]] = {}
        for name, module in components.items():
            if not isinstance(module, torch.nn.Module):
                continue
            decl = blocks.get(name) if mode == "sequential" else None
            named: list[tuple[str, torch.nn.Module]] = []  # (unit name, block), in stack order
            for spec in (() if not decl else (decl,) if isinstance(decl, str) else tuple(decl)):
                path, seq = _submodule(module, spec, name)
                named += [(f"{name}.{path}.{i}", b) for i, b in enumerate(seq)]
            block_mods = [b for _, b in named]
            skip = {id(m) for b in block_mods for m in b.modules()}
            self.shells[name] = self._parked(self._unit(name, module, skip))
            if block_mods:
                stack = _Stack(name, [self._parked(self._unit(n, b, set())) for n, b in named])
                self.stacks[name] = stack
                for i, b in enumerate(block_mods):
                    self._block_of[id(b)] = (stack, i)
                    self._hooks.append(b.register_forward_pre_hook(self._enter_block))
                    self._hooks.append(b.register_forward_hook(self._leave_block))

    # -- what is where ---------------------------------------------------------------------------
    def resident(self) -> tuple[str, ...]:
        """Names of the units on the execution device now (shells and blocks)."""
        return tuple(u.name for u in self._all_units() if u.on_device)

    def resident_bytes(self) -> int:
        return sum(u.nbytes for u in self._all_units() if u.on_device)

    def describe(self) -> dict[str, Any]:
        return {
            "mode": self.mode, "device": str(self.device), "pinned": self.mover.pin, "overlap": self.overlap,
            #: the weights' host masters, and what this offloader's mover newly pinned (whole slabs; 0 when
            #: it reused masters an earlier offloader pinned) or kept pageable (tensors above a slab)
            "host_bytes": sum(u.nbytes for u in self._all_units()),
            "host_pinned_bytes": getattr(self.mover, "pinned_bytes", None),
            "host_pageable_bytes": getattr(self.mover, "pageable_bytes", None),
            "side_stream": self.streams is not None,
            "components": {n: {"bytes": u.nbytes, "blocks": len(self.stacks[n].units) if n in self.stacks else 0,
                               "block_bytes": sum(b.nbytes for b in self.stacks[n].units) if n in self.stacks else 0}
                           for n, u in self.shells.items()},
        }

    def wrap_pipeline(self, spec: Any) -> Any:
        return wrap_pipeline(spec, self)

    # -- node-level moves ------------------------------------------------------------------------
    def activate(self, uses: Iterable[str], node: str = "") -> None:
        """Make the components in ``uses`` (those this offloader moves) resident, every other one
        parked. A node using none of them moves nothing."""
        want = [n for n in uses if n in self.shells]
        if not want:
            return
        for name in self.shells:
            if name not in want:
                self._evict_component(name)
        for name in want:
            self._load(self.shells[name])
        self._note("stage", node)

    def evict_all(self) -> None:
        """Every component back to storage (e.g. before handing the device to something else)."""
        for name in self.shells:
            self._evict_component(name)

    def remove(self) -> None:
        """Remove the hooks; every tensor is left in storage: its host master (the module works
        there again, e.g. to ``.to()`` it somewhere else)."""
        self.evict_all()
        for unit in self._all_units():
            self._set(unit, unit.masters)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # -- block streaming (sequential) ------------------------------------------------------------
    def _enter_block(self, module: torch.nn.Module, args: Any) -> None:
        stack, i = self._block_of[id(module)]
        self._load(self.shells[stack.component])  # the shell normally is already (its node loaded it)
        unit = stack.units[i]
        for j, other in enumerate(stack.units):  # a block skipped (cache interceptors) or a stale prefetch
            if j != i and other.on_device:
                self._park(other)
        if unit.on_device:
            self._wait(unit)
        else:
            self._load(unit)
        nxt = stack.units[(i + 1) % len(stack.units)]
        if nxt is not unit and self.overlap:
            self._prefetch(nxt)
        self._note("run", unit.name)

    def _leave_block(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        stack, i = self._block_of[id(module)]
        self._park(stack.units[i])

    # -- internals -------------------------------------------------------------------------------
    def _all_units(self) -> list[_Unit]:
        return [*self.shells.values(), *(u for s in self.stacks.values() for u in s.units)]

    def _unit(self, name: str, module: torch.nn.Module, skip: set[int]) -> _Unit:
        slots: list[tuple[torch.nn.Module, str, bool]] = []
        masters: list[torch.Tensor] = []
        seen: set[int] = set()
        for mod in module.modules():
            if id(mod) in skip:
                continue
            for attr, p in list(mod._parameters.items()):
                if p is None or id(p) in seen:  # a tied parameter moves once
                    continue
                seen.add(id(p))
                slots.append((mod, attr, True))
                masters.append(self.mover.store(p))
            for attr, t in list(mod._buffers.items()):
                if t is None:
                    continue
                slots.append((mod, attr, False))
                masters.append(self.mover.store(t))
        nbytes = sum(m.numel() * m.element_size() for m in masters)
        return _Unit(name, slots, masters, nbytes=nbytes)

    def _set(self, unit: _Unit, tensors: Sequence[torch.Tensor]) -> None:
        for (mod, attr, is_param), t in zip(unit.slots, tensors, strict=True):
            if is_param:
                mod._parameters[attr].data = t  # type: ignore[union-attr]
            else:
                mod._buffers[attr] = t

    def _load(self, unit: _Unit) -> None:
        if unit.on_device:
            return
        self._set(unit, [self.mover.fetch(m) for m in unit.masters])
        unit.on_device = True
        unit.event = None
        self._note("load", unit.name)

    def _prefetch(self, unit: _Unit) -> None:
        if unit.on_device:
            return
        if self.streams is None:  # a plain load (CPU, or no pinned masters)
            self._load(unit)
        else:
            with self.streams.copying():
                tensors = [self.mover.fetch(m) for m in unit.masters]
                unit.event = self.streams.record()
            self._set(unit, tensors)
            unit.on_device = True
        self._note("prefetch", unit.name)

    def _wait(self, unit: _Unit) -> None:
        """The compute stream waits for ``unit``'s side-stream copy (:meth:`CudaStreams.wait`)."""
        if unit.event is None:
            return
        tensors = [mod._parameters[attr] if is_param else mod._buffers[attr] for mod, attr, is_param in unit.slots]
        self.streams.wait(unit.event, [t.data for t in tensors if t is not None])
        unit.event = None
        self._note("wait", unit.name)

    def _parked(self, unit: _Unit) -> _Unit:
        """``unit`` in storage from the start (its tensors on the load device are freed now, one unit
        at a time, so installing never holds two copies of the whole model)."""
        self._park(unit)
        return unit

    def _park(self, unit: _Unit) -> None:
        self._set(unit, [self.mover.park(m) for m in unit.masters])
        was = unit.on_device
        unit.on_device = False
        unit.event = None
        if was:
            self._note("evict", unit.name)

    def _evict_component(self, name: str) -> None:
        stack = self.stacks.get(name)
        if stack is not None:
            for u in stack.units:
                if u.on_device:
                    self._park(u)
        if self.shells[name].on_device:
            self._park(self.shells[name])

    def _note(self, event: str, name: str) -> None:
        if self.trace is not None:
            self.trace.append((event, name, self.resident()))


def _submodule(module: torch.nn.Module, spec: str, component: str) -> tuple[str, Sequence[torch.nn.Module]]:
    """The block list ``spec`` names in ``module``: a dotted path, or alternatives ``a|b`` (library
    versions differ) of which the first present wins."""
    for path in spec.split("|"):
        try:
            seq = module.get_submodule(path)
        except AttributeError:
            continue
        if not isinstance(seq, (torch.nn.ModuleList, torch.nn.Sequential)) or len(seq) == 0:
            raise DeployError(f"offload: {component}.{path} is not a non-empty ModuleList (the family's capabilities.offload)")
        return path, list(seq)
    raise DeployError(f"offload: component {component!r} has no block list {spec!r} (the family's capabilities.offload)")


def family_blocks(family: Any) -> dict[str, str | Sequence[str] | None] | None:
    """The family's ``capabilities.offload.components``, or None when it declares no offload."""
    decl = capabilities_of(family).offload
    return None if decl is None else dict(decl.components)


def storage_device(mode: str, device: torch.device) -> torch.device:
    """Where a family loads its weights: host memory when offloading, else ``device``."""
    return torch.device("cpu") if mode != "none" else device


def install(model: Any, family: Any, mode: str, device: torch.device, *, mover: Mover | None = None,
            trace: list[tuple[str, str, tuple[str, ...]]] | None = None, overlap: bool = True,
            streams: Any = None) -> Offloader | None:
    """Put ``model``'s declared components under ``mode`` offload to ``device`` (None for ``none``).

    Every declared module present in ``model.components`` goes to storage; :func:`wrap_pipeline`
    then makes the pipeline's nodes bring them back as they run."""
    if mode == "none":
        return None
    decl = family_blocks(family)
    if decl is None:
        raise DeployError(f"offload: family {family.name!r} declares no offload support (capabilities.offload)")
    comps = {n: model.components[n] for n in decl if n in model.components}
    return Offloader(comps, decl, mode, device, mover=mover, trace=trace, overlap=overlap, streams=streams)


class OffloadedStage:
    """A node's stage behind an :class:`Offloader`: every call first makes the node's components
    resident. Other attributes pass through (``batch_key``, a family's own methods)."""

    _CALLS = frozenset({"forward", "init", "step", "finalize", "step_batch"})

    def __init__(self, stage: Any, offloader: Offloader, uses: tuple[str, ...], node: str) -> None:
        self._stage = stage
        self._offloader = offloader
        self._uses = uses
        self._node = node

    @property
    def inner(self) -> Any:
        return self._stage

    def __getattr__(self, name: str) -> Any:
        stage = self.__dict__.get("_stage")
        if stage is None:  # not initialised (copy, unpickling): no recursion through __getattr__
            raise AttributeError(name)
        attr = getattr(stage, name)
        if name in OffloadedStage._CALLS and callable(attr):
            return self._wrap(attr)
        return attr

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self._offloader.activate(self._uses, self._node)
            return fn(*args, **kwargs)

        return call


def wrap_pipeline(spec: Any, offloader: Offloader | None) -> Any:
    """``spec`` with each node that uses a moved component behind :class:`OffloadedStage`."""
    if offloader is None:
        return spec
    nodes = []
    for node in spec.nodes:
        if any(u in offloader.shells for u in node.uses) and not isinstance(node.stage, OffloadedStage):
            node = attrs.evolve(node, stage=OffloadedStage(node.stage, offloader, tuple(node.uses), node.name))
        nodes.append(node)
    return attrs.evolve(spec, nodes=nodes)


def _axes(deploy: DeployConfig) -> str:
    p = deploy.parallel
    return "{" + f"sp: {p.sp}, cfg: {p.cfg}" + "}"


def check_offload(deploy: DeployConfig, family: Any, device: torch.device,
                  options: dict[str, Any] | None = None) -> None:
    """``deploy.offload`` (``model`` / ``sequential``, this module) can run: the family
    declares what moves (``capabilities.offload``), the device is ``cuda`` (or ``cpu``, where
    storage and device are the same and only the machinery runs), and nothing the offloader cannot
    follow is enabled — LoRA adapters (their weights sit on the load device), ``compile`` (the
    compiled blocks would see weights change device), a parallel world above 1, role pools
    (``placement``) — and the family's
    own ``capabilities.offload.refusal(mode, options)`` (a reason string or None; Wan: a causal rollout calls
    its blocks functionally, so it cannot stream them) has no objection to the family ``options``.
    One :class:`DeployError` line, before any weight loads."""
    mode = deploy.offload
    if mode == "none":
        return
    decl = capabilities_of(family).offload
    if decl is None:
        raise DeployError(
            f"offload: family {family.name!r} does not support offload (it declares no capabilities.offload); "
            "remove the field or set it to 'none'"
        )
    if device.type not in ("cuda", "cpu"):
        raise DeployError(f"offload: {mode!r} moves weights between host memory and a CUDA device, not {device.type!r}")
    if deploy.parallel.world_size > 1:
        raise DeployError(f"offload: {mode!r} runs in one process; it does not combine with parallel: {_axes(deploy)} yet")
    if deploy.adapters:
        raise DeployError(f"offload: {mode!r} does not combine with LoRA adapters yet (adapters: {', '.join(sorted(deploy.adapters))})")
    if getattr(deploy, "placement", None):
        raise DeployError(f"offload: {mode!r} does not combine with placement (role pools) yet")
    if deploy.compile:
        raise DeployError(f"offload: {mode!r} does not combine with compile: true yet (compiled blocks would see their weights move)")
    refusal = decl.refusal
    why = refusal(mode, dict(options if options is not None else deploy.options)) if refusal is not None else None
    if why:
        raise DeployError(f"offload: {mode!r} {why}")
