"""The denoise node's parameter schema: the policy knobs a request may set.

A request sets them under ``node_params.<node>`` (usually ``denoise``)::

    {"node_params": {"denoise": {"sampler": "unipc", "guidance_scale": 4.0, "cfg_window": [0.1, 0.8]}}}

:func:`parse_denoise_params` validates a mapping into :class:`DenoiseParams` and raises
``omniloop.errors.RequestError`` with the dotted path (``node_params.denoise.sampler``) and a
message naming the node and the policy. Field constraints also live in attrs metadata
(``ge``/``gt``/``le``), the convention ``omniloop.schema.structure_params`` reads.

Knobs that belong to one policy (``cfg_window`` → ``interval`` / ``adaptive-gate``;
``gate_every`` / ``gate_threshold`` → ``adaptive-gate``; ``timesteps`` → ``few-step``;
``modality_scales`` → ``per-modality``) are rejected when the request's (or the node's default)
policy does not read them, so a typo'd setup never silently does nothing.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

import attrs
from attrs import define, field

from omniloop.errors import RequestError


def _c(**constraints: Any) -> dict[str, Any]:
    return dict(constraints)


@define(frozen=True, kw_only=True)
class DenoiseParams:
    """Per-request knobs of a denoise loop. ``None`` means the node's default."""

    #: sampler name (``flow-euler``, ``unipc``, ``dpmpp``, ``few-step``)
    sampler: str | None = None
    #: CFG policy name (``classic``, ``batched``, ``interval``, ``adaptive-gate``, ...)
    cfg: str | None = None
    guidance_scale: float | None = field(default=None, metadata=_c(ge=0.0))
    #: scale while the second (low-noise) expert runs — Wan2.2's ``guidance_scale_2``
    guidance_scale_2: float | None = field(default=None, metadata=_c(ge=0.0))
    shift: float | None = field(default=None, metadata=_c(gt=0.0))
    steps: int | None = field(default=None, metadata=_c(ge=1))
    #: guidance window ``[start, end)`` as fractions of the steps
    cfg_window: tuple[float, float] | None = None
    #: adaptive gate: recompute the guidance delta at least every N steps
    gate_every: int | None = field(default=None, metadata=_c(ge=1))
    #: adaptive gate: recompute while the delta changes by more than this (relative)
    gate_threshold: float | None = field(default=None, metadata=_c(ge=0.0))
    #: few-step sampler: the distilled timesteps (strictly decreasing)
    timesteps: tuple[int, ...] | None = None
    #: per-modality CFG: scale per output modality
    modality_scales: dict[str, float] | None = None
    #: image-to-image: the fraction of the schedule run, from the input noised to its first
    #: timestep (diffusers' img2img ``strength``; 1.0 runs every step). Families say which tasks take it.
    strength: float | None = field(default=None, metadata=_c(gt=0.0, le=1.0))


#: which policy reads each policy-specific knob (``None``: every policy)
KNOB_OWNERS: dict[str, tuple[str, frozenset[str]]] = {
    "cfg_window": ("cfg", frozenset({"interval", "adaptive-gate"})),
    "gate_every": ("cfg", frozenset({"adaptive-gate"})),
    "gate_threshold": ("cfg", frozenset({"adaptive-gate"})),
    "timesteps": ("sampler", frozenset({"few-step"})),
    "modality_scales": ("cfg", frozenset({"per-modality"})),
    "strength": ("sampler", frozenset({"flow-euler", "unipc", "dpmpp"})),
}

FIELDS = tuple(a.name for a in attrs.fields(DenoiseParams))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def parse_denoise_params(
    data: Mapping[str, Any] | DenoiseParams | None,
    *,
    node: str = "denoise",
    samplers: Collection[str] | None = None,
    cfgs: Collection[str] | None = None,
    default_sampler: str | None = None,
    default_cfg: str | None = None,
    unavailable: Mapping[str, str] | None = None,
    prefix: str = "node_params",
) -> DenoiseParams:
    """Validate a request's ``node_params[node]`` into :class:`DenoiseParams`.

    ``samplers`` / ``cfgs`` are the names available on this node (unknown names are rejected,
    listing them); ``unavailable`` maps names that exist but cannot run on this checkpoint to the
    reason. Raises ``RequestError(path, message)``.
    """
    base = f"{prefix}.{node}" if prefix else node

    def err(key: str, msg: str) -> RequestError:
        return RequestError(f"{base}.{key}", f"node {node!r}: {msg}")

    if data is None:
        values: dict[str, Any] = {}
    elif isinstance(data, DenoiseParams):
        values = {k: v for k, v in attrs.asdict(data, recurse=False).items() if v is not None}
    elif isinstance(data, Mapping):
        values = dict(data)
    else:
        raise RequestError(base, f"node {node!r}: params must be an object, got {type(data).__name__}")

    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise err(unknown[0], f"unknown parameter {unknown[0]!r}; known: {', '.join(FIELDS)}")

    out: dict[str, Any] = {}
    for key in ("sampler", "cfg"):
        v = values.get(key)
        if v is None:
            continue
        if not isinstance(v, str):
            raise err(key, f"{key} must be a name (string), got {v!r}")
        names = samplers if key == "sampler" else cfgs
        if unavailable and v in unavailable:
            raise err(key, f"{key} {v!r} cannot run on this model: {unavailable[v]}")
        if names is not None and v not in names:
            raise err(key, f"unknown {key} {v!r}; available: {', '.join(sorted(names))}")
        out[key] = v

    for key, lo, strict_lo in (
        ("guidance_scale", 0.0, False),
        ("guidance_scale_2", 0.0, False),
        ("shift", 0.0, True),
        ("gate_threshold", 0.0, False),
    ):
        v = values.get(key)
        if v is None:
            continue
        if not _is_number(v) or (v <= lo if strict_lo else v < lo):
            raise err(key, f"{key} must be a finite number {'>' if strict_lo else '>='} {lo:g}, got {v!r}")
        out[key] = float(v)

    v = values.get("strength")
    if v is not None:
        if not _is_number(v) or not 0.0 < v <= 1.0:
            raise err("strength", f"strength must be a number in (0, 1], got {v!r}")
        out["strength"] = float(v)

    for key in ("steps", "gate_every"):
        v = values.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise err(key, f"{key} must be an integer >= 1, got {v!r}")
        out[key] = v

    if values.get("cfg_window") is not None:
        w = values["cfg_window"]
        if (
            not isinstance(w, (list, tuple))
            or len(w) != 2
            or not all(_is_number(x) for x in w)
            or not (0.0 <= w[0] < w[1] <= 1.0)
        ):
            raise err("cfg_window", f"cfg_window must be [start, end) with 0 <= start < end <= 1, got {w!r}")
        out["cfg_window"] = (float(w[0]), float(w[1]))

    if values.get("timesteps") is not None:
        ts = values["timesteps"]
        if (
            not isinstance(ts, (list, tuple))
            or not ts
            or not all(isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in ts)
            or any(b >= a for a, b in itertools.pairwise(ts))
        ):
            raise err("timesteps", f"timesteps must be a strictly decreasing list of positive integers, got {ts!r}")
        out["timesteps"] = tuple(ts)

    if values.get("modality_scales") is not None:
        ms = values["modality_scales"]
        if not isinstance(ms, Mapping) or not all(
            isinstance(k, str) and _is_number(v) and v >= 0 for k, v in ms.items()
        ):
            raise err("modality_scales", f"modality_scales must map modality names to numbers >= 0, got {ms!r}")
        out["modality_scales"] = {k: float(v) for k, v in ms.items()}

    chosen = {"sampler": out.get("sampler", default_sampler), "cfg": out.get("cfg", default_cfg)}
    for key, (role, owners) in KNOB_OWNERS.items():
        if key in out:
            policy = chosen[role]
            if policy is not None and policy not in owners:
                raise err(
                    key,
                    f"{key} is read by the {' / '.join(sorted(owners))} {role} policy, but this request uses "
                    f"{role} {policy!r}; set {role}={sorted(owners)[0]!r} or drop {key}",
                )

    return DenoiseParams(**out)


def params_error_adapter(node: str = "denoise", prefix: str = "node_params") -> Callable[[str, str], RequestError]:
    """A ``(key, message) -> RequestError`` for errors found after parsing (e.g. by a sampler)."""

    def make(key: str, msg: str) -> RequestError:
        base = f"{prefix}.{node}" if prefix else node
        return RequestError(f"{base}.{key}", f"node {node!r}: {msg}")

    return make
