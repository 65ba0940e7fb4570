"""Test helpers for omniloop and its plugin authors.

* :mod:`omniloop.testing.toy` — a toy family on a real tiny torch model.
* :mod:`omniloop.testing.toy_audio` — a toy text-to-audio family (a deterministic sine generator
  under the runtime-owned loop) for the audio front ends.
* :mod:`omniloop.testing.conformance` — checks a family, block/step interceptor or observer
  against the contracts (determinism, interleaving, baseline/enabled/disabled, read-only).
* :func:`make_manager` / :func:`toy_runtime` — an isolated plugin manager and runtime, no
  entry-point discovery, so tests do not depend on what else is installed.
* :func:`toy_request` / :func:`completed_latents` — a t2v request that returns its latents, and
  the latents of a completed output (the usual pair of an interceptor's runtime tests);
  :func:`run_interleaved` — several requests advanced step by step in turn (compare with each
  run alone to show no state leaks between requests).
* :func:`advance_in_lockstep` / :func:`forward_rows` / :func:`raising_rows` — batched-step
  failure isolation: executions stepped together through ``advance_batch``, the text rows a
  family's denoise forward sees, and that forward made to raise on a poison request's rows;
  :func:`stream_together` — requests streamed side by side through a ``step``-scheduler runtime
  (so their steps co-batch), their final outputs by request id; :func:`check_streamed_together`
  — that, checked against each request run alone.
* :func:`check_interleaved_equal_alone` — the per-request-state test of a stateful plugin: two
  requests stepped alternately equal each run alone (latents and the plugin's metrics);
  :func:`check_block_cache` / :func:`check_first_block_cache` — cache-dit / fbcache on a family's blocks;
  :class:`BlockTapPlugin` / :func:`block_taps` — the block taps a family's blocks give an observer.
* :func:`plugin_of` / :func:`component_plugin` — an in-process plugin object from declarations
  (families, interceptor and observer specs) instead of a hand-written class per test; :class:`PassThroughSteps` /
  :class:`PassThroughBlocks` — step / block interceptors that change nothing, to subclass in
  tests (override what the test needs: ``forward``, ``run``, ``open``, ``metrics``).
* :func:`once_per_arguments` — a session fixture's builder (tiny checkpoints) run once per argument set;
  :func:`tiny_checkpoints` — a family's tiny-checkpoint builder so wrapped, each checkpoint in its
  own temporary folder; :func:`~omniloop.testing.pytest_plugin.family_fixtures` — a family test
  folder's ``tiny_ckpt`` / ``runtime`` / ``reference`` session fixtures from declarations.
* pytest fixtures (auto-loaded through the ``pytest11`` entry point): ``omniloop_manager``,
  ``toy_checkpoint``, ``toy_runtime_factory``, ``toy_blocks``, ``check_preset_not_installed``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..execution import Execution, ScheduleDecision
from ..family import SchedulerSpec
from ..hookspecs import hookimpl
from ..plugins import PluginManager
from ..request import OmniEvent, Status
from .toy import ToyFamily, ToyPlugin, build_toy_checkpoint
from .toy_audio import ToyAudioFamily, ToyAudioPlugin, build_toy_audio_checkpoint


class InlineSerialScheduler:
    """A minimal serial scheduler so core tests need no scheduler package."""

    name = "serial"

    def __init__(self, runtime: Any = None, **_: Any) -> None:
        self.runtime = runtime

    def stream(self, execution: Execution) -> Iterator[OmniEvent]:
        bus = execution.bus
        if bus is not None and bus.schedule_decision is not None:
            bus.schedule_decision(decision=ScheduleDecision("serial", "admit", (execution.request_id,)))
        while not execution.done:
            yield from execution.advance()


class _InlineSchedulerPlugin:
    OMNILOOP_HOOK_API = ">=1.0,<2"

    @hookimpl
    def omniloop_register_schedulers(self, register: Any) -> None:
        register(SchedulerSpec(name="serial", factory=InlineSerialScheduler))


def make_manager(*plugins: tuple[str, Any], toy: bool = True, scheduler: bool = True,
                 toy_audio: bool = False) -> PluginManager:
    """A plugin manager with no entry-point discovery: core + toy family (+ the toy-audio family
    with ``toy_audio``) + a serial scheduler + ``plugins``."""
    pm = PluginManager(discover=False)
    if toy:
        pm.add("toy", ToyPlugin())
    if toy_audio:
        pm.add("toy-audio", ToyAudioPlugin())
    if scheduler:
        pm.add("inline-serial", _InlineSchedulerPlugin())
    for name, obj in plugins:
        pm.add(name, obj)
    return pm


def toy_request(seed: int = 1, steps: int = 20, **extra: Any) -> dict[str, Any]:
    """A t2v request dict ("a red fox", ``steps``, ``seed``) that returns its final latents."""
    return {
        "task": "t2v",
        "prompt": "a red fox",
        "diffusion": {"steps": steps, "seed": seed},
        "outputs": {"return_latents": True},
        **extra,
    }


def completed_latents(output: Any) -> Any:
    """The final latents tensor of ``output``, asserting that it completed (its error otherwise)."""
    assert output.status is Status.COMPLETED, output.error
    return output.artifacts["latents"].tensor


def run_interleaved(runtime: Any, requests: list[Any]) -> list[Any]:
    """Prepare every request, advance them one unit each in turn until all are done; their outputs."""
    executions = [runtime.prepare(r) for r in requests]
    while not all(e.done for e in executions):
        for e in executions:
            e.advance()
    return [e.output for e in executions]


def toy_runtime(checkpoint: str | Path, *plugins: tuple[str, Any], **deploy: Any) -> Any:
    """A CPU float32 runtime over the toy family, with in-process ``plugins`` added."""
    from ..runtime import Runtime

    return Runtime.from_model(checkpoint, manager=make_manager(*plugins), **deploy)


def once_per_arguments(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run once per set of arguments, its defaults applied (``get()`` and ``get("dev")`` are
    one call when ``"dev"`` is the default): a session fixture's tiny-checkpoint builder, e.g.
    ``get(variant="dev") -> path`` building into ``tmp_path_factory.mktemp(...)``."""
    sig = inspect.signature(fn)
    done: dict[tuple[tuple[str, Any], ...], Any] = {}

    @functools.wraps(fn)
    def cached(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        key = tuple(bound.arguments.items())
        if key not in done:
            done[key] = fn(*args, **kwargs)
        return done[key]

    return cached


def tiny_checkpoints(tmp_path_factory: Any, build: Callable[..., Path], prefix: str, **defaults: Any) -> Callable[..., Path]:
    """A session fixture's tiny-checkpoint getter: ``get(*values, **overrides)`` → the path
    ``build(folder, **arguments)`` returns, the arguments being ``defaults`` (their order is the
    positional order) overridden by ``values`` and ``overrides``; built once per set of arguments,
    into a fresh ``tmp_path_factory`` folder named ``<prefix>-<value>-...``."""
    names = list(defaults)
    done: dict[tuple[tuple[str, Any], ...], Path] = {}

    def get(*values: Any, **overrides: Any) -> Path:
        if len(values) > len(names):
            raise TypeError(f"{prefix} checkpoints take at most {len(names)} positional arguments ({', '.join(names)})")
        args = {**defaults, **dict(zip(names, values, strict=False)), **overrides}
        key = tuple(args.items())
        if key not in done:
            folder = tmp_path_factory.mktemp("-".join([prefix, *(str(v) for v in args.values())]))
            done[key] = build(folder, **args)
        return done[key]

    return get


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` inside the block, restored after it (tests that
    compare CPU sums whose order depends on the thread count, or that should not contend for
    CI's two cores)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def advance_in_lockstep(runtime: Any, requests: list[Any]) -> tuple[list[Any], int]:
    """Prepare ``requests`` and step them together: each step whose batch keys all agree runs as
    one ``advance_batch`` (a member that failed drops out); the outputs and the batched steps."""
    from ..execution import advance_batch

    exes = [runtime.prepare(r) for r in requests]
    batched = 0
    while not all(e.done for e in exes):
        live = [e for e in exes if not e.done]
        keys = [e.batch_key() for e in live]
        if len(live) > 1 and keys[0] is not None and all(k == keys[0] for k in keys):
            advance_batch(live)
            batched += 1
        else:
            for e in live:
                e.advance()
    return [e.output for e in exes], batched


def stream_together(runtime: Any, requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Stream ``requests`` (each with a ``request_id``) side by side through ``runtime`` — a
    ``step``-scheduler runtime, whose one shared pool co-batches their steps — and return their
    final outputs by request id."""
    streams = [runtime.stream(r) for r in requests]
    finals = {}
    for st in reversed(streams):  # driving one stream advances the others too (one shared pool)
        for ev in st:
            if ev.kind.value == "final":
                finals[ev.request_id] = ev.output
    return finals


def check_streamed_together(alone: Any, step: Any, requests: list[dict[str, Any]], min_batched: int
                            ) -> list[tuple[Any, Any]]:
    """Run each of ``requests`` alone on the runtime ``alone``, then :func:`stream_together` through
    ``step`` (a ``step``-scheduler runtime over the same checkpoint): at least ``min_batched``
    ``batched_step`` decisions stepped all of them at once, and each completed. Returns
    ``(streamed output, output alone)`` per request, for the family's comparison."""
    outs_alone = [alone.generate(r) for r in requests]
    finals = stream_together(step, requests)
    trace = step.scheduler.trace
    batched = [d for d in trace if d.action == "batched_step" and len(d.request_ids) == len(requests)]
    assert len(batched) >= min_batched, [(d.action, d.request_ids) for d in trace]
    pairs = [(finals[r["request_id"]], a) for r, a in zip(requests, outs_alone, strict=True)]
    for out, _ in pairs:
        assert out.status is Status.COMPLETED, out.error
    return pairs


def check_interleaved_equal_alone(runtime: Any, requests: list[Any], plugin: str) -> list[Any]:
    """Per-request state of the plugin deployed as ``plugin``: ``requests`` advanced one unit each
    in turn complete with exactly the latents and the ``metrics["plugins"][plugin]`` of each run
    alone. Returns the interleaved outputs."""
    import torch

    alone = [runtime.generate(r) for r in requests]
    outs = run_interleaved(runtime, requests)
    for a, out in zip(alone, outs, strict=True):
        assert torch.equal(completed_latents(out), completed_latents(a))
        assert out.metrics["plugins"][plugin] == a.metrics["plugins"][plugin]
    return outs


@contextmanager
def forward_rows(stage_cls: type, key: str) -> Iterator[list[Any]]:
    """Inside the block, every row of ``batch[key]`` that ``stage_cls.forward(..., batch,
    block_ctx)`` receives is appended to the yielded list (the family's denoise forward)."""
    real = stage_cls.forward  # type: ignore[attr-defined]
    seen: list[Any] = []

    def spy(self: Any, *args: Any) -> Any:
        rows = args[-2][key]
        seen.extend(rows[j].clone() for j in range(rows.shape[0]))
        return real(self, *args)

    stage_cls.forward = spy  # type: ignore[attr-defined]
    try:
        yield seen
    finally:
        stage_cls.forward = real  # type: ignore[attr-defined]


@contextmanager
def raising_rows(stage_cls: type, key: str, poison: list[Any], after: int = 1) -> Iterator[None]:
    """Inside the block, ``stage_cls.forward`` raises ``RuntimeError("injected ...")`` when its
    ``batch[key]`` holds one of the ``poison`` rows (``torch.equal``), from the ``after``-th such
    forward on: a poison request whose row breaks every forward it is part of, batched or alone."""
    import torch

    real = stage_cls.forward  # type: ignore[attr-defined]
    hits = [0]

    def forward(self: Any, *args: Any) -> Any:
        rows = args[-2][key]
        if any(torch.equal(rows[j], p) for j in range(rows.shape[0]) for p in poison):
            hits[0] += 1
            if hits[0] > after:
                raise RuntimeError("injected: this request's row breaks the forward")
        return real(self, *args)

    stage_cls.forward = forward  # type: ignore[attr-defined]
    try:
        yield
    finally:
        stage_cls.forward = real  # type: ignore[attr-defined]


def check_fails_alone(runtime: Any, stage_cls: type, key: str, poison_rows: list[Any], normal: list[dict[str, Any]],
                      poison: dict[str, Any], atol: float) -> tuple[list[Any], list[Any]]:
    """A family's ``step_batch_retry_alone``: ``poison`` (whose ``batch[key]`` rows ``poison_rows``
    break every forward of ``stage_cls`` they are in, after the first) stepped in lockstep between
    ``normal[0]`` and the other ``normal`` requests fails with the injected error, at least one step
    ran batched, and each normal request completes within ``atol`` of its run alone. Returns
    ``(the normal outputs, their runs alone)``."""
    import torch

    alone = [runtime.generate(r) for r in normal]
    with raising_rows(stage_cls, key, poison_rows, after=1):
        outs, batched = advance_in_lockstep(runtime, [normal[0], poison, *normal[1:]])
    bad = outs.pop(1)
    assert bad.status is Status.FAILED and "injected" in bad.error.message, bad.error
    assert batched >= 1
    for o, a in zip(outs, alone, strict=True):
        assert o.status is Status.COMPLETED, o.error
        torch.testing.assert_close(completed_latents(o), completed_latents(a), atol=atol, rtol=0)
    return outs, alone


def check_block_cache(runtime_for: Any, name: str, plugin: Any, config: dict[str, Any],
                      request: dict[str, Any]) -> Any:
    """A step-caching block interceptor plugin (cache-dit, fbcache) on a family's blocks:
    ``runtime_for(*plugins, **deploy)`` makes a runtime of the family. With the plugin deployed as
    ``name`` (``config``) a request completes with at least one cached step, and the same request
    with ``exact`` equals the plain runtime's latents exactly. Returns the cached output."""
    import torch

    plain = runtime_for()
    rt = runtime_for((name, plugin), plugins={name: config})
    out = rt.generate(request)
    assert out.status is Status.COMPLETED, out.error
    assert sum(m["num_cached_steps"] for m in out.metrics["plugins"][name].values()) > 0
    baseline = completed_latents(plain.generate(request))
    assert torch.equal(completed_latents(rt.generate({**request, "exact": True})), baseline)
    return out


def check_first_block_cache(runtime_for: Any, plugin: Any, request: dict[str, Any]) -> Any:
    """The first-block cache (``plugin``: ``omniloop_fbcache.plugin``) on a family's blocks, baseline
    / enabled / disabled: ``runtime_for(*plugins, **deploy)`` makes a runtime of the family. With
    fbcache deployed (threshold 0.5, one warm-up step) ``request`` caches at least one step and its
    latents differ from the plain runtime's; with threshold 0 (every block computed) they equal them
    exactly, as does the plain runtime run again. Returns the cached output."""
    import torch

    plain = runtime_for()
    cached = runtime_for(("fbcache", plugin), plugins={"fbcache": {"threshold": 0.5, "warmup_steps": 1}})
    baseline = completed_latents(plain.generate(request))
    out = cached.generate(request)
    hits = sum(m["num_cached_steps"] for m in out.metrics["plugins"]["fbcache"].values())
    assert hits > 0 and not torch.equal(completed_latents(out), baseline)
    off = cached.generate({**request, "plugin_params": {"fbcache": {"threshold": 0.0}}})
    assert torch.equal(completed_latents(off), baseline)
    assert torch.equal(completed_latents(plain.generate(request)), baseline)
    return out


class _DeclaredPlugin:
    def __init__(self, families: tuple[Any, ...], components: tuple[Any, ...], hook_api: str) -> None:
        self.OMNILOOP_HOOK_API = hook_api
        self.families = families
        self.components = components

    @hookimpl
    def omniloop_register_families(self, register: Any) -> None:
        for family in self.families:
            register(family)

    @hookimpl
    def omniloop_register_interceptors(self, register: Any) -> None:
        for spec in self.components:
            if spec.kind != "observer":
                register(spec)

    @hookimpl
    def omniloop_register_observers(self, register: Any) -> None:
        for spec in self.components:
            if spec.kind == "observer":
                register(spec)


def plugin_of(*components: Any, families: tuple[Any, ...] = (), hook_api: str = ">=1.0,<2") -> Any:
    """An in-process plugin (for ``make_manager`` / ``toy_runtime``) that registers ``families``
    and the ``PluginComponentSpec``s ``components`` — interceptors through
    ``omniloop_register_interceptors``, observers through ``omniloop_register_observers`` — and
    declares ``OMNILOOP_HOOK_API = hook_api``."""
    return _DeclaredPlugin(tuple(families), components, hook_api)


def component_plugin(name: str, kind: str, make: Callable[[], Any], *, hook_api: str = ">=1.0,<2", **spec: Any) -> Any:
    """:func:`plugin_of` one ``PluginComponentSpec(name, kind)`` (``"step_interceptor"``,
    ``"block_interceptor"`` or ``"observer"``) whose factory returns ``make()`` — a class for a fresh
    object per runtime, or ``lambda: obj`` for one the test keeps to inspect; ``spec``: the spec's
    other fields (``params_schema``, ``distribution_altering``, ...)."""
    from ..family import PluginComponentSpec

    return plugin_of(PluginComponentSpec(name=name, kind=kind, factory=lambda cfg: make(), **spec), hook_api=hook_api)


class PassThroughSteps:
    """A step interceptor that changes nothing (``forward`` returns ``compute()``, no state, no
    metrics): subclass it in a test and override what the test observes or alters."""

    name = "pass-through"
    graph_safe = True
    distribution_altering = False
    needs_eager = False

    def open(self, step: Any, loop: Any, params: Any = None) -> Any:
        return None

    def forward(self, step: Any, state: Any, inputs: Any, compute: Callable[[], Any]) -> Any:
        return compute()

    def close(self, state: Any) -> None:
        pass

    def metrics(self, state: Any) -> dict[str, Any]:
        return {}


class PassThroughBlocks(PassThroughSteps):
    """A block interceptor that runs every block (``run`` is the plain loop): subclass it."""

    def run(self, blocks: Any, hidden: Any, ctx: Any, call: Callable[[Any, Any], Any]) -> Any:
        for block in blocks:
            hidden = call(block, hidden)
        return hidden


class BlockTapPlugin:
    """A plugin registering the observer ``name``: it asks for the block taps whose names match
    ``blocks`` (``needs_eager``) and records every tap it gets as ``(name, shape)`` in ``seen``.
    Deploy it with ``plugins={name: {}}``."""

    OMNILOOP_HOOK_API = ">=1.0,<2"

    def __init__(self, blocks: str = r"transformer_blocks\.\d+$", name: str = "tapper") -> None:
        self.blocks = blocks
        self.name = name
        self.seen: list[tuple[str, tuple[int, ...]]] = []

    @hookimpl
    def omniloop_register_observers(self, register: Any) -> None:
        from ..family import PluginComponentSpec

        register(PluginComponentSpec(name=self.name, kind="observer", factory=self._tapper))

    def _tapper(self, cfg: Any = None) -> _BlockTapper:
        return _BlockTapper(self)


class _BlockTapper:
    needs_eager = True

    def __init__(self, plugin: BlockTapPlugin) -> None:
        from ..observers import TapFilter

        self.plugin = plugin
        self.filter = TapFilter(".*", plugin.blocks, observer=plugin.name, doing="testing")

    @hookimpl
    def omniloop_wants_block_taps(self) -> Any:
        return self.filter.blocks

    @hookimpl
    def omniloop_tap(self, request: Any, node: Any, step: Any, name: str, value: Any) -> None:
        self.plugin.seen.append((name, tuple(value.shape)))


def block_taps(runtime_for: Any, request: dict[str, Any], blocks: str = r"transformer_blocks\.\d+$") -> list[Any]:
    """``request`` run on ``runtime_for(("tapper", plugin), plugins={"tapper": {}})`` with a
    :class:`BlockTapPlugin` asking for the blocks ``blocks``; it completes. Returns the taps it saw,
    ``(name, shape)`` in order."""
    plugin = BlockTapPlugin(blocks)
    out = runtime_for(("tapper", plugin), plugins={"tapper": {}}).generate(request)
    assert out.status is Status.COMPLETED, out.error
    return plugin.seen


__all__ = [
    "BlockTapPlugin",
    "InlineSerialScheduler",
    "PassThroughBlocks",
    "PassThroughSteps",
    "ToyAudioFamily",
    "ToyAudioPlugin",
    "ToyFamily",
    "ToyPlugin",
    "advance_in_lockstep",
    "block_taps",
    "build_toy_audio_checkpoint",
    "build_toy_checkpoint",
    "check_block_cache",
    "check_fails_alone",
    "check_first_block_cache",
    "check_interleaved_equal_alone",
    "check_streamed_together",
    "completed_latents",
    "component_plugin",
    "forward_rows",
    "make_manager",
    "once_per_arguments",
    "plugin_of",
    "raising_rows",
    "run_interleaved",
    "stream_together",
    "tiny_checkpoints",
    "torch_threads",
    "toy_request",
    "toy_runtime",
]
