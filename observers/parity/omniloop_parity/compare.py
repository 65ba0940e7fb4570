"""Compare two recordings tap by tap, in execution order, and find the first divergence.

``A`` is the reference (a golden), ``B`` the candidate. An element of a tap diverges when
``|a - b| > atol + rtol * |a|`` (NaN equals NaN, equal infinities are equal); a tap also
diverges when its cosine similarity to the reference is below ``cos``, when its shape differs,
or when ``B`` lacks it. Taps only ``B`` has are reported as notes, not failures.
"""

from __future__ import annotations

import fnmatch
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
from attrs import define

from .config import ParityError
from .recording import Recording, TapEntry, as_recording

if TYPE_CHECKING:
    import torch

_TOL_FIELDS = ("atol", "rtol", "cos")


@define(frozen=True)
class TapTolerance:
    """Per-tap tolerance: absolute, relative (to the reference) and minimum cosine similarity."""

    atol: float = 0.0
    rtol: float = 0.0
    cos: float | None = None

    def describe(self) -> str:
        s = f"atol {self.atol:g}, rtol {self.rtol:g}"
        return s + (f", cos >= {self.cos:g}" if self.cos is not None else "")


@define(frozen=True)
class Tolerances:
    """Default tolerance plus ordered per-key glob overrides (later overrides win).

    ``overrides`` is a tuple of ``(pattern, {field: value})``; patterns are shell globs over tap
    keys (``final/video``, ``*/blocks.*``, ``step00[0-4]/*``).
    """

    default: TapTolerance = attrs.Factory(TapTolerance)
    overrides: tuple[tuple[str, Mapping[str, float | None]], ...] = ()

    @classmethod
    def exact(cls) -> Tolerances:
        return cls()

    def for_key(self, key: str) -> TapTolerance:
        tol = self.default
        for pattern, fields in self.overrides:
            if fnmatch.fnmatchcase(key, pattern):
                tol = attrs.evolve(tol, **fields)
        return tol

    def with_default(self, **fields: float | None) -> Tolerances:
        """A copy whose default takes the given fields (those that are not None)."""
        given = {k: v for k, v in fields.items() if v is not None}
        return attrs.evolve(self, default=attrs.evolve(self.default, **given)) if given else self

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "tolerances") -> Tolerances:
        """From a mapping like the TOML file: top-level atol/rtol/cos, ``[[override]]`` tables."""
        unknown = sorted(set(data) - {*_TOL_FIELDS, "override"})
        if unknown:
            raise ParityError(f"{source}: unknown key {unknown[0]!r} (expected atol, rtol, cos, [[override]])")
        default = TapTolerance(**{k: _num(data[k], f"{source}: {k}") for k in _TOL_FIELDS if k in data})
        overrides = []
        raw = data.get("override", [])
        if not isinstance(raw, list):
            raise ParityError(f"{source}: 'override' must be an array of tables ([[override]])")
        for i, o in enumerate(raw):
            where = f"{source}: override {i + 1}"
            if not isinstance(o, Mapping) or not isinstance(o.get("match"), str):
                raise ParityError(f"{where}: needs a 'match' glob string")
            bad = sorted(set(o) - {*_TOL_FIELDS, "match"})
            if bad:
                raise ParityError(f"{where}: unknown key {bad[0]!r} (expected match, atol, rtol, cos)")
            fields = {k: _num(o[k], f"{where}: {k}") for k in _TOL_FIELDS if k in o}
            if not fields:
                raise ParityError(f"{where}: sets no tolerance (give atol, rtol or cos)")
            overrides.append((o["match"], fields))
        return cls(default=default, overrides=tuple(overrides))

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> Tolerances:
        try:
            import tomllib
        except ImportError:  # python 3.10
            import tomli as tomllib  # type: ignore[no-redef]
        p = Path(path)
        if not p.is_file():
            raise ParityError(f"{p}: tolerance file not found")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except Exception as exc:
            raise ParityError(f"{p}: cannot parse TOML: {exc}") from None
        return cls.from_dict(data, source=str(p))

    def to_dict(self) -> dict[str, Any]:
        return {
            **{k: v for k, v in attrs.asdict(self.default).items() if v is not None},
            "override": [{"match": p, **f} for p, f in self.overrides],
        }


def _num(v: Any, where: str) -> float:
    """A finite tolerance >= 0 (TOML's ``inf`` would make every tap pass, ``nan`` every tap fail)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ParityError(f"{where}: expected a number, got {type(v).__name__} {str(v)[:40]!r}")
    if not math.isfinite(v):
        raise ParityError(f"{where}: must be a finite number, got {v!r}")
    if v < 0:
        raise ParityError(f"{where}: must be >= 0, got {v!r}")
    if where.endswith(": cos") and v > 1:
        raise ParityError(f"{where}: a cosine similarity is at most 1, got {v!r}")
    return float(v)


@define
class TapComparison:
    """How one tap of B compares to the same tap of A."""

    entry: TapEntry
    passed: bool
    reason: str = ""  # "" | "values" | "cosine" | "shape" | "missing in B" | "only in B"
    max_abs: float = 0.0
    max_rel: float = 0.0
    cosine: float | None = None
    n_bad: int = 0
    numel: int = 0
    tol: TapTolerance = attrs.Factory(TapTolerance)
    worst_index: tuple[int, ...] | None = None

    @property
    def key(self) -> str:
        return self.entry.key

    def describe(self) -> str:
        e = self.entry
        where = [f"node {e.node!r}"]
        if e.step is not None:
            where.insert(0, f"step {e.step}")
        if e.branch:
            where.append(f"branch {e.branch!r}")
        if e.kind == "block":
            where.append(f"block {e.name!r}")
        else:
            where.append(f"tap {e.name!r}")
        head = f"{e.key} ({', '.join(where)})"
        if self.reason in ("missing in B", "only in B", "shape"):
            return f"{head}: {self.reason}"
        cos = f", cosine {self.cosine:.9f}" if self.cosine is not None else ""
        at = f" at index {list(self.worst_index)}" if self.worst_index is not None else ""
        return (
            f"{head}: {self.n_bad}/{self.numel} values beyond tolerance ({self.tol.describe()}); "
            f"max abs err {self.max_abs:.3e}{at}, max rel err {self.max_rel:.3e}{cos}"
        )

    def to_dict(self) -> dict[str, Any]:
        d = {
            "key": self.key,
            "node": self.entry.node,
            "step": self.entry.step,
            "branch": self.entry.branch,
            "name": self.entry.name,
            "kind": self.entry.kind,
            "block": self.entry.block,
            "passed": self.passed,
            "reason": self.reason,
            "max_abs": _finite(self.max_abs),
            "max_rel": _finite(self.max_rel),
            "cosine": self.cosine,
            "n_bad": self.n_bad,
            "numel": self.numel,
            "tolerance": attrs.asdict(self.tol),
        }
        return d


def _finite(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


@define
class ParityResult:
    """The outcome of a comparison. ``bool(result)`` is whether it passed."""

    passed: bool
    comparisons: list[TapComparison]
    first: TapComparison | None
    a_label: str = "A"
    b_label: str = "B"
    notes: list[str] = attrs.Factory(list)
    tolerances: Tolerances = attrs.Factory(Tolerances)
    regenerated: bool = False

    def __bool__(self) -> bool:
        return self.passed

    @property
    def failures(self) -> list[TapComparison]:
        return [c for c in self.comparisons if not c.passed]

    def summary(self) -> str:
        n = len([c for c in self.comparisons if c.reason != "only in B"])
        if self.passed:
            return f"parity PASS: {n} taps of {self.b_label} match {self.a_label}"
        assert self.first is not None
        return f"parity FAIL: {len(self.failures)} of {n} taps diverge; first divergence at {self.first.describe()}"

    def explain(self) -> str:
        lines = [self.summary()]
        lines += [f"  note: {n}" for n in self.notes]
        for c in self.failures[:10]:
            lines.append(f"  - {c.describe()}")
        if len(self.failures) > 10:
            lines.append(f"  ... and {len(self.failures) - 10} more")
        return "\n".join(lines)

    def table(self) -> tuple[list[str], list[tuple[str, dict[str, TapComparison]]]]:
        """The per-step table: columns (tap labels) and rows ``(step label, {column: worst tap})``.

        A cell holds the tap with the largest absolute error for that step and column; block taps
        of a branch share one column (``blocks[cond]``), the worst block named in the cell.
        """
        multi = len({c.entry.node for c in self.comparisons if c.entry.step is not None}) > 1
        columns: list[str] = []
        rows: dict[str, dict[str, TapComparison]] = {}
        order: list[str] = []
        for c in self.comparisons:
            e = c.entry
            if e.kind == "final":
                row = "final"
            elif e.step is None:
                row = e.node
            else:
                row = f"{e.node}/{e.step}" if multi else str(e.step)
            base = "blocks" if e.kind == "block" else e.name
            col = f"{base}[{e.branch}]" if e.branch else base
            if col not in columns:
                columns.append(col)
            if row not in rows:
                rows[row] = {}
                order.append(row)
            cur = rows[row].get(col)
            if cur is None or _worse(c, cur):
                rows[row][col] = c
        return columns, [(r, rows[r]) for r in order]

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "a": self.a_label,
            "b": self.b_label,
            "first_divergence": self.first.to_dict() if self.first is not None else None,
            "notes": self.notes,
            "tolerances": self.tolerances.to_dict(),
            "taps": [c.to_dict() for c in self.comparisons],
        }


def _worse(c: TapComparison, other: TapComparison) -> bool:
    if c.passed != other.passed:
        return not c.passed
    return c.max_abs > other.max_abs


def compare(
    a: Recording | str | os.PathLike[str],
    b: Recording | str | os.PathLike[str],
    tolerances: Tolerances | None = None,
) -> ParityResult:
    """Compare recording ``b`` (candidate) against ``a`` (reference)."""
    ra, rb = as_recording(a), as_recording(b)
    tols = tolerances or Tolerances()
    comps: list[TapComparison] = []
    for e in ra.entries:
        tol = tols.for_key(e.key)
        if e.key not in rb:
            comps.append(TapComparison(entry=e, passed=False, reason="missing in B", tol=tol))
            continue
        comps.append(compare_tensors(e, ra[e.key], rb[e.key], tol))
    extra = [e for e in rb.entries if e.key not in ra]
    for e in extra:
        comps.append(TapComparison(entry=e, passed=True, reason="only in B"))
    first = next((c for c in comps if not c.passed), None)
    notes = _environment_notes(ra, rb)
    if extra:
        notes.append(f"{len(extra)} taps only in {rb.label} (not compared), e.g. {extra[0].key}")
    return ParityResult(
        passed=first is None,
        comparisons=comps,
        first=first,
        a_label=ra.label,
        b_label=rb.label,
        notes=notes,
        tolerances=tols,
    )


def compare_tensors(entry: TapEntry, a: torch.Tensor, b: torch.Tensor, tol: TapTolerance) -> TapComparison:
    import torch  # on use: loading the parity plugin imports no torch (issue 42)

    with torch.no_grad():
        return _compare_tensors(entry, a, b, tol)


def _compare_tensors(entry: TapEntry, a: torch.Tensor, b: torch.Tensor, tol: TapTolerance) -> TapComparison:
    import torch

    if tuple(a.shape) != tuple(b.shape):
        return TapComparison(entry=entry, passed=False, reason="shape", tol=tol, numel=a.numel())
    n = a.numel()
    if n == 0:
        return TapComparison(entry=entry, passed=True, tol=tol)
    x = a.detach().to(torch.float64).reshape(-1)
    y = b.detach().to(torch.float64).reshape(-1)
    same = (x == y) | (x.isnan() & y.isnan())
    diff = torch.nan_to_num((x - y).abs(), nan=math.inf, posinf=math.inf)
    diff = torch.where(same, torch.zeros_like(diff), diff)
    # a NaN or an infinity on either side that is not matched exactly on the other is always bad
    finite = torch.isfinite(x) & torch.isfinite(y)
    bad = ~same & (~finite | ~(diff <= tol.atol + tol.rtol * x.abs()))
    # |a - b| relative to |a|; where a == 0 and they differ the relative error is infinite
    rel = torch.where(same, torch.zeros_like(diff), diff / x.abs())
    rel = torch.nan_to_num(rel, nan=math.inf, posinf=math.inf)
    n_bad = int(bad.sum())
    max_abs = float(diff.max())
    worst = None
    if max_abs > 0:
        flat = int(diff.argmax())
        worst = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(a.shape))) if a.dim() else ()
    cosine = _cosine(x, y)
    passed = n_bad == 0
    reason = "" if passed else "values"
    if passed and tol.cos is not None and cosine is not None and cosine < tol.cos:
        passed, reason = False, "cosine"
    return TapComparison(
        entry=entry,
        passed=passed,
        reason=reason,
        max_abs=max_abs,
        max_rel=float(rel.max()),
        cosine=cosine,
        n_bad=n_bad,
        numel=n,
        tol=tol,
        worst_index=worst,
    )


def _cosine(x: torch.Tensor, y: torch.Tensor) -> float | None:
    import torch
    finite = torch.isfinite(x) & torch.isfinite(y)
    if not bool(finite.all()):
        return None
    nx, ny = float(x.norm()), float(y.norm())
    if nx == 0.0 and ny == 0.0:
        return 1.0
    if nx == 0.0 or ny == 0.0:
        return 0.0
    return float(torch.dot(x, y) / (nx * ny))


def _environment_notes(a: Recording, b: Recording) -> list[str]:
    notes = []
    for field in ("device", "dtype", "torch", "family", "task", "seed"):
        va, vb = a.manifest.get(field), b.manifest.get(field)
        if va != vb:
            notes.append(f"{field} differs: {va} vs {vb}")
    pa, pb = a.manifest.get("versions") or {}, b.manifest.get("versions") or {}
    for name in sorted(set(pa) | set(pb)):
        if pa.get(name) != pb.get(name):
            notes.append(f"{name} version differs: {pa.get(name)} vs {pb.get(name)}")
    return notes
