"""The conformance kit: one call checks a plugin against omniloop's contracts.

    from omniloop.testing import conformance
    conformance.check_block_interceptor(lambda: MyCache({"threshold": 0.1}))
    conformance.check_step_interceptor(lambda: MySkipper())
    conformance.check_observer(lambda: MyObserver())
    conformance.check_family(lambda: Runtime.from_model(path), {"task": "t2v", "prompt": "x"})
    outs, alone = conformance.check_row_raises_alone(runtime, normal, poison, Denoise, "context")

Interceptors and observers are exercised on the toy family (a real tiny torch model). Each check
raises ``AssertionError`` naming the contract that failed. What is checked:

* declared capabilities (``name``, ``graph_safe``, ``distribution_altering``, ``needs_eager``);
* determinism: the same request twice gives the same output;
* interleaving: two requests advanced step by step give exactly each one's output alone;
* lifecycle: every ``open`` is matched by one ``close`` — at finalize, at cancel and at failure;
* baseline / enabled / disabled-after-enabled: after a run with the plugin, the same loaded
  model without it gives the baseline exactly (nothing was left patched);
* observers are read-only: outputs equal the baseline with the observer enabled;
* a family that declares ``step_batch_retry_alone``: a request whose row breaks every forward it
  is in fails alone in a batched step, its batch-mates complete (``check_row_raises_alone``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..family import PluginComponentSpec
from ..hookspecs import hookimpl
from ..interceptors import open_interceptor
from ..request import Status
from . import advance_in_lockstep, forward_rows, make_manager, raising_rows, run_interleaved
from .toy import build_toy_checkpoint


class _Tracked:
    """A proxy that counts open/close calls of an interceptor."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.opened: list[Any] = []
        self.closed: list[Any] = []

    def __getattr__(self, item: str) -> Any:
        return getattr(self._inner, item)

    def open(self, step: Any, loop: Any, params: Any = None) -> Any:
        """The wrapped interceptor's ``open`` with the request's validated params, as the runtime calls it
        (one written against the 1.0 ``open(step, loop)`` still runs, with its deprecation warning)."""
        st = open_interceptor(self._inner, step, loop, params)
        self.opened.append(st)
        return st

    def close(self, state: Any) -> None:
        self.closed.append(state)
        self._inner.close(state)


def _component_plugin(name: str, kind: str, factory: Callable[[], Any], holder: list[Any]) -> Any:
    class _Plugin:
        OMNILOOP_HOOK_API = ">=1.0,<2"

        @hookimpl
        def omniloop_register_interceptors(self, register: Any) -> None:
            if kind != "observer":
                register(PluginComponentSpec(name=name, kind=kind, factory=self._make))

        @hookimpl
        def omniloop_register_observers(self, register: Any) -> None:
            if kind == "observer":
                register(PluginComponentSpec(name=name, kind=kind, factory=self._make))

        def _make(self, _config: Any) -> Any:
            obj = factory()
            if kind != "observer":
                obj = _Tracked(obj)
            holder.append(obj)
            return obj

    return _Plugin()


def _request(seed: int, steps: int = 8, **extra: Any) -> dict[str, Any]:
    return {"task": "t2v", "prompt": "a red circle moving left", "diffusion": {"seed": seed, "steps": steps}, **extra}


def _latents(out: Any) -> torch.Tensor:
    t: torch.Tensor = out.artifacts["latents"].tensor
    return t


def _check_capabilities(obj: Any, kind: str) -> str:
    name = getattr(obj, "name", None)
    assert isinstance(name, str) and name, f"{kind}: needs a non-empty str `name`"
    for flag in ("graph_safe", "distribution_altering", "needs_eager"):
        assert isinstance(getattr(obj, flag, None), bool), f"{kind} {name!r}: `{flag}` must be declared as a bool"
    for method in ("open", "close", "run" if kind == "block_interceptor" else "forward"):
        assert callable(getattr(obj, method, None)), f"{kind} {name!r}: missing method {method}()"
    return name


def _check_interceptor(kind: str, factory: Callable[[], Any], steps: int) -> None:
    probe = factory()
    name = _check_capabilities(probe, kind)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build_toy_checkpoint(Path(tmp) / "toy")
        from ..runtime import Runtime

        base_rt = Runtime.from_model(ckpt, manager=make_manager())
        holder: list[Any] = []
        rt = Runtime.from_model(
            ckpt, manager=make_manager((name, _component_plugin(name, kind, factory, holder))), plugins={name: {}}
        )
        tracked: _Tracked = holder[0]

        baseline = base_rt.generate(_request(1, steps))
        first = rt.generate(_request(1, steps))
        again = rt.generate(_request(1, steps))
        assert first.status is Status.COMPLETED, f"{name}: enabled run did not complete: {first.error}"
        assert torch.equal(_latents(first), _latents(again)), f"{name}: the same request twice gave different outputs"
        assert torch.isfinite(_latents(first)).all(), f"{name}: produced non-finite latents"

        alone = [rt.generate(_request(s, steps)) for s in (2, 3)]
        interleaved = run_interleaved(rt, [_request(s, steps) for s in (2, 3)])
        for a, out in zip(alone, interleaved, strict=True):
            assert torch.equal(_latents(a), _latents(out)), (
                f"{name}: two requests interleaved step by step differ from each run alone "
                "(per-request state must live in LoopState.plugin_state)"
            )

        cancelled = rt.prepare(_request(4, steps))
        for _ in range(3):
            cancelled.advance()
        cancelled.cancel()
        cancelled.run()
        assert cancelled.output.status is Status.CANCELLED

        assert len(tracked.opened) == len(tracked.closed), (
            f"{name}: {len(tracked.opened)} open() calls but {len(tracked.closed)} close() calls"
        )
        assert [id(s) for s in tracked.opened] == [id(s) for s in tracked.closed] or sorted(
            map(id, tracked.opened)
        ) == sorted(map(id, tracked.closed)), f"{name}: close() received states open() did not return"

        # disabled after enabled: the same loaded model without the plugin gives the baseline
        plain = Runtime.from_model(ckpt, manager=make_manager())
        plain.model = rt.model
        plain._pipelines.clear()
        after = plain.generate(_request(1, steps))
        assert torch.equal(_latents(after), _latents(baseline)), (
            f"{name}: after an enabled run, the model without the plugin no longer gives the baseline "
            "(something was left patched on the shared modules)"
        )


def check_block_interceptor(factory: Callable[[], Any], *, steps: int = 8) -> None:
    """Check a block interceptor made by ``factory()`` on the toy family."""
    _check_interceptor("block_interceptor", factory, steps)


def check_step_interceptor(factory: Callable[[], Any], *, steps: int = 8) -> None:
    """Check a step interceptor made by ``factory()`` on the toy family."""
    _check_interceptor("step_interceptor", factory, steps)


def check_observer(factory: Callable[[], Any], *, steps: int = 4) -> None:
    """Check an observer made by ``factory()``: read-only, and every event it implements fires."""
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build_toy_checkpoint(Path(tmp) / "toy")
        from ..runtime import Runtime

        holder: list[Any] = []
        probe = factory()
        name = getattr(probe, "name", None) or type(probe).__name__.lower()
        base = Runtime.from_model(ckpt, manager=make_manager()).generate(_request(1, steps))
        rt = Runtime.from_model(
            ckpt, manager=make_manager((name, _component_plugin(name, "observer", factory, holder))), plugins={name: {}}
        )
        out = rt.generate(_request(1, steps))
        assert out.status is Status.COMPLETED, f"observer {name!r}: run failed: {out.error}"
        assert torch.equal(_latents(out), _latents(base)), f"observer {name!r}: changed the output (observers are read-only)"
        assert torch.equal(out.artifacts["video"].frames, base.artifacts["video"].frames)


def check_family(
    runtime_factory: Callable[[], Any], request: Mapping[str, Any], *, output: str = "video"
) -> None:
    """Check a family through a runtime: determinism, interleaving, cancel, stream shape, output type."""
    rt = runtime_factory()
    req = dict(request)
    req.setdefault("diffusion", {})
    req["diffusion"] = {**req["diffusion"], "seed": req["diffusion"].get("seed", 0)}
    events = list(rt.stream(req))
    assert events and events[-1].kind.value == "final", "stream must end with a final event"
    first = events[-1].output
    assert first.status is Status.COMPLETED, f"run failed: {first.error}"
    art = first.artifacts.get(output)
    assert art is not None, f"output has no {output!r} artifact (has {sorted(first.artifacts)})"
    if output == "video":
        f = art.frames
        assert f.dtype == torch.uint8 and f.ndim == 4 and f.shape[-1] == 3, "video frames must be uint8 [T, H, W, 3]"
    again = rt.generate(req)
    assert _same(first.artifacts[output], again.artifacts[output]), "the same request twice gave different outputs"
    reqs = [dict(req, diffusion={**req["diffusion"], "seed": s}) for s in (11, 12)]
    alone = [rt.generate(r) for r in reqs]
    for a, out in zip(alone, run_interleaved(rt, reqs), strict=True):
        assert _same(a.artifacts[output], out.artifacts[output]), "interleaved requests differ from each alone"
    c = rt.prepare(req)
    c.advance()
    c.cancel()
    c.run()
    assert c.output.status is Status.CANCELLED, "cancel() must end the request as cancelled"
    assert all(not lp.plugin_state for lp in c.state.loops.values()), "cancel() must release plugin state"


def check_row_raises_alone(
    runtime: Any, normal: list[Any], poison: Any, stage_cls: type, key: str, *, position: int = 1
) -> tuple[list[Any], list[Any]]:
    """A family that declares ``step_batch_retry_alone`` for its denoise loop: a raising batched
    forward is re-run one request at a time. ``poison`` gets a row of ``batch[key]`` (what
    ``stage_cls.forward`` receives) that ``normal[0]`` does not have; that row then breaks every
    forward it is in after its first step, and the requests step in lockstep with the poison at
    ``position``. Checks the poison fails with the injected error and at least one step ran
    batched; returns ``(the batch-mates' outputs, each one's output alone)`` for the family's own
    closeness check (its tolerance)."""
    with forward_rows(stage_cls, key) as shared:
        runtime.generate(normal[0])
    with forward_rows(stage_cls, key) as mine:
        runtime.generate(poison)
    rows = [r for r in mine if not any(torch.equal(r, s) for s in shared)]
    assert rows, f"the poison request has no {key!r} row of its own"
    alone = [runtime.generate(r) for r in normal]
    with raising_rows(stage_cls, key, rows, after=1):
        outs, batched = advance_in_lockstep(runtime, [*normal[:position], poison, *normal[position:]])
    bad = outs.pop(position)
    assert bad.status is Status.FAILED and "injected" in bad.error.message, bad.error
    assert batched >= 1, "no step ran batched"
    return outs, alone


def _same(a: Any, b: Any) -> bool:
    for attr in ("frames", "pixels", "tensor", "samples"):
        if hasattr(a, attr):
            return torch.equal(getattr(a, attr), getattr(b, attr))
    return bool(a == b)
