"""omniloop-nanwatch: stop (``mode: raise``) or flag (``mode: flag``) at the first NaN/Inf.

Enable with ``plugins: {nanwatch: {mode: raise, blocks: 'blocks\\.\\d+$'}}``. In ``raise`` mode the
request fails with a :class:`NonFiniteError` naming node, step, branch and tap or module; in
``flag`` mode findings are kept per request: ``runtime.components_enabled["nanwatch"][1].get_report(rid)``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Literal

import attrs
from attrs import define, field

from omniloop.errors import OmniloopError
from omniloop.hookspecs import hookimpl
from omniloop.observers import TapFilter
from omniloop.schema import check_regex

__version__ = "0.1.0"

log = logging.getLogger("omniloop.nanwatch")



class NonFiniteError(OmniloopError):
    """A watched value held NaN or Inf; ``finding`` says where."""

    def __init__(self, finding: Finding) -> None:
        self.finding = finding
        super().__init__(f"nanwatch: {finding.describe()}")


@define(frozen=True)
class NanWatchConfig:
    """``mode``: ``raise`` stops the request at the first NaN/Inf, ``flag`` records findings.
    ``taps``: regex over tap names to check (block outputs excluded); ``blocks``: regex over block
    names whose outputs to check (forces eager blocks); ``max_findings``: per request, in flag mode;
    ``keep``: reports kept in memory."""

    mode: Literal["raise", "flag"] = "raise"
    taps: str = field(default=".*", validator=check_regex)
    blocks: str | None = field(default=None, validator=check_regex)
    max_findings: int = field(default=100, metadata={"ge": 1})
    keep: int = field(default=32, metadata={"ge": 1})


@define(frozen=True)
class Finding:
    request_id: str
    node: str
    step: int | None
    branch: str | None
    name: str
    kind: str  # "tap" | "block"
    nan: int
    inf: int
    numel: int

    def describe(self) -> str:
        what = f"module {self.name!r}" if self.kind == "block" else f"tap {self.name!r}"
        where = [f"node {self.node!r}"]
        if self.step is not None:
            where.append(f"step {self.step}")
        if self.branch:
            where.append(f"branch {self.branch!r}")
        bad = " and ".join(s for s in ("NaN" if self.nan else "", "Inf" if self.inf else "") if s)
        return (
            f"{bad} in {what} ({', '.join(where)}): {self.nan} NaN, {self.inf} Inf of {self.numel} values "
            f"(request {self.request_id})"
        )

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


class NanWatch:
    """Observer object created by the ``nanwatch`` plugin (one per runtime)."""

    def __init__(self, config: NanWatchConfig | None = None) -> None:
        self.config = config or NanWatchConfig()
        #: block taps need the blocks to run eagerly (no compiled block stack)
        self._select = TapFilter(self.config.taps, self.config.blocks, observer="nanwatch", doing="checking")
        self.needs_eager = self._select.needs_eager
        self._live: dict[str, dict[str, Any]] = {}
        self.reports: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def get_report(self, request_id: str) -> dict[str, Any] | None:
        """``{"request_id", "checked", "findings": [Finding.to_dict(), ...], "first"}`` or None."""
        return self.reports.get(request_id)

    def findings(self, request_id: str) -> list[Finding]:
        st = self._live.get(request_id)
        if st is not None:
            return list(st["findings"])
        rep = self.reports.get(request_id)
        return [Finding(**f) for f in rep["findings"]] if rep else []

    @hookimpl
    def omniloop_request_start(self, request: Any, pipeline: Any) -> None:
        self._live[request.request_id] = {"checked": 0, "findings": []}

    @hookimpl
    def omniloop_wants_block_taps(self, node: str) -> Any:
        return self.config.blocks

    @hookimpl
    def omniloop_tap(self, request: Any, node: str, step: Any, name: str, value: Any) -> None:
        import torch
        if not isinstance(value, torch.Tensor) or not (value.is_floating_point() or value.is_complex()):
            return
        kind = self._select.kind(name)
        if kind is None:
            return
        st = self._live.setdefault(request.request_id, {"checked": 0, "findings": []})
        st["checked"] += 1
        if bool(torch.isfinite(value).all()):  # one reduction; a host sync on GPU
            return
        nan = int(torch.isnan(value).sum())
        finding = Finding(
            request_id=request.request_id,
            node=node,
            step=None if step is None else int(step.step_index),
            branch=None if step is None else step.branch,
            name=name,
            kind=kind,
            nan=nan,
            inf=int(value.numel() - nan - int(torch.isfinite(value).sum())),
            numel=value.numel(),
        )
        if self.config.mode == "raise":
            st["findings"].append(finding)
            raise NonFiniteError(finding)
        if not st["findings"]:
            log.warning("nanwatch: %s", finding.describe())
        if len(st["findings"]) < self.config.max_findings:
            st["findings"].append(finding)

    @hookimpl
    def omniloop_request_end(self, request: Any, output: Any) -> None:
        st = self._live.pop(request.request_id, None)
        if st is None:
            return
        fs = [f.to_dict() for f in st["findings"]]
        self.reports[request.request_id] = {
            "request_id": request.request_id,
            "checked": st["checked"],
            "findings": fs,
            "first": fs[0] if fs else None,
        }
        while len(self.reports) > self.config.keep:
            self.reports.popitem(last=False)


__all__ = ["Finding", "NanWatch", "NanWatchConfig", "NonFiniteError"]
