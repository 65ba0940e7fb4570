"""The ``parity`` observer: records named taps of each request into a :class:`Recording`.

State is kept per request id, so interleaved requests (the ``step`` scheduler) never mix. Values
are copied to the CPU when tapped (a host sync per tap on GPU: this observer is a debugging
instrument, not something to leave on in production).
"""

from __future__ import annotations

import datetime as _dt
import logging
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from omniloop.hookspecs import hookimpl
from omniloop.observers import TapFilter
from omniloop.request import Status

from .config import ParityConfig, ParityError, out_path
from .recording import FORMAT, Recording, TapEntry, environment, tap_key, tensor_fields

if TYPE_CHECKING:
    import torch

log = logging.getLogger("omniloop.parity")

#: names that look like a block output (``blocks.3``, ``transformer.blocks.12``): only recorded via ``blocks``


@attrs.define
class _Capture:
    family: str
    task: str
    items: list[tuple[str, str, str, int | None, str | None, float | None, torch.Tensor]] = attrs.Factory(list)
    totals: dict[str, int] = attrs.Factory(dict)
    device: str | None = None
    dtype: str | None = None


class ParityRecorder:
    """Observer object created by the ``parity`` plugin factory (one per runtime)."""

    def __init__(self, config: ParityConfig | None = None) -> None:
        self.config = config or ParityConfig()
        #: block taps need the blocks to run eagerly (no compiled block stack)
        self._select = TapFilter(self.config.taps, self.config.blocks, observer="parity", doing="recording")
        self.needs_eager = self._select.needs_eager
        self.deploy: Any = None
        self._live: dict[str, _Capture] = {}
        self.recordings: OrderedDict[str, Recording] = OrderedDict()
        self.written: dict[str, Path] = {}
        self.errors: dict[str, str] = {}

    # -- wiring ------------------------------------------------------------------------------
    def bind(self, runtime: Any) -> None:
        """Let the recorder put the runtime's deploy config into its manifests."""
        self.deploy = runtime.deploy

    def take(self, request_id: str) -> Recording:
        """Remove and return the in-memory recording of ``request_id``."""
        if request_id in self.errors:
            raise ParityError(f"parity: recording of request {request_id} failed: {self.errors.pop(request_id)}")
        if request_id in self.written:
            return Recording.load(self.written.pop(request_id))
        try:
            return self.recordings.pop(request_id)
        except KeyError:
            raise ParityError(f"parity: no recording for request {request_id!r}") from None

    # -- observer events -----------------------------------------------------------------------
    @hookimpl
    def omniloop_request_start(self, request: Any, pipeline: Any, deploy: Any = None) -> None:
        if deploy is not None and self.deploy is None:
            self.deploy = deploy  # enabled from a deploy file: record the deploy that made the run
        task = getattr(pipeline.task, "value", str(pipeline.task))
        self._live[request.request_id] = _Capture(family=pipeline.family, task=task)

    @hookimpl
    def omniloop_wants_block_taps(self, node: str) -> Any:
        return self.config.blocks

    @hookimpl
    def omniloop_loop_init(self, request: Any, node: str, loop: Any) -> None:
        cap = self._live.get(request.request_id)
        if cap is not None:
            cap.totals[node] = int(loop.total)

    @hookimpl
    def omniloop_tap(self, request: Any, node: str, step: Any, name: str, value: Any) -> None:
        import torch
        cap = self._live.get(request.request_id)
        if cap is None or not isinstance(value, torch.Tensor):
            return
        kind = self._select.kind(name)
        if kind is None:
            return
        if cap.device is None and value.is_floating_point():
            cap.device, cap.dtype = str(value.device), str(value.dtype).replace("torch.", "")
        t = value.detach().to("cpu", copy=True)
        if not t.is_contiguous():
            t = t.contiguous()
        if step is None:
            cap.items.append((node, name, kind, None, None, None, t))
        else:
            cap.items.append((node, name, kind, int(step.step_index), step.branch, float(step.timestep), t))

    @hookimpl
    def omniloop_request_end(self, request: Any, output: Any) -> None:
        rid = request.request_id
        cap = self._live.pop(rid, None)
        if cap is None:
            return
        if output.status is not Status.COMPLETED:
            # never leave a recording that looks complete for a run that was not
            log.warning("parity: request %s ended %s; nothing recorded", rid, output.status.value)
            self.errors[rid] = f"the run ended {output.status.value}" + (
                f": {output.error.message}" if output.error is not None else ""
            )
            return
        try:
            rec = self._build(request, output, cap)
            if self.config.out:
                path = out_path(self.config.out, rid)
                rec.save(path)
                self.written[rid] = path
                log.info("parity: wrote %d taps of request %s to %s", len(rec), rid, path)
            else:
                self.recordings[rid] = rec
                while len(self.recordings) > self.config.keep:
                    self.recordings.popitem(last=False)
        except Exception as exc:  # a recording failure must not fail the request itself
            log.error("parity: could not record request %s: %s: %s", rid, type(exc).__name__, exc)
            self.errors[rid] = f"{type(exc).__name__}: {exc}"

    # -- building ------------------------------------------------------------------------------
    def _build(self, request: Any, output: Any, cap: _Capture) -> Recording:
        from omniloop.schema import request_to_dict

        step_nodes = {it[0] for it in cap.items if it[3] is not None}
        prefix = len(step_nodes) > 1
        entries: list[TapEntry] = []
        tensors: dict[str, torch.Tensor] = {}

        def add(
            node: str,
            name: str,
            kind: str,
            step: int | None,
            branch: str | None,
            timestep: float | None,
            t: torch.Tensor,
        ) -> None:
            key = base = tap_key(node, name, kind, step, branch, prefix)
            n = 1
            while key in tensors:  # the same name tapped twice in one place
                key = f"{base}#{n}"
                n += 1
            tensors[key] = t
            entries.append(TapEntry(key=key, node=node, name=name, kind=kind, step=step, branch=branch,
                                    timestep=timestep, shape=tuple(t.shape), dtype=str(t.dtype).replace("torch.", "")))

        for node, name, kind, step, branch, timestep, t in cap.items:
            add(node, name, kind, step, branch, timestep, t)
        if self.config.final:
            for out_name, art in output.artifacts.items():
                fields = list(tensor_fields(art))
                for fname, t in fields:
                    name = out_name if len(fields) == 1 else f"{out_name}.{fname}"
                    add(
                        getattr(art, "producer", None) or "output",
                        name,
                        "final",
                        None,
                        None,
                        None,
                        t.detach().to("cpu", copy=True).contiguous(),
                    )
        device, dtype = self._device_dtype(cap)
        deploy = None
        if self.deploy is not None:
            deploy = attrs.asdict(self.deploy)
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "request_id": request.request_id,
            "request": request_to_dict(request),
            "seed": output.metrics.get("seed", request.diffusion.seed),
            "family": cap.family,
            "task": cap.task,
            "deploy": deploy,
            "device": device,
            "dtype": dtype,
            **environment(),
            "config": {"taps": self.config.taps, "blocks": self.config.blocks, "final": self.config.final},
            "steps": cap.totals,
            "taps": [e.to_dict() for e in entries],
        }
        return Recording(manifest, tensors)

    def _device_dtype(self, cap: _Capture) -> tuple[str, str]:
        if self.deploy is not None:
            return str(self.deploy.device), str(self.deploy.dtype)
        # unbound (enabled from a deploy file): what the first floating-point tap was
        return cap.device or "unknown", cap.dtype or "unknown"
