"""The deploy's ``linear_precision_options`` for omniloop-quant's FP8 modes (no torch here: the plugin's
entry point hands :class:`FP8Options` to the core as the modes' ``options_schema``, and loading the
plugin must not import torch)."""

from __future__ import annotations

import fnmatch
import re
from typing import Any

from attrs import define, field

from omniloop.errors import DeployError
from omniloop.schema import structure_params

#: what a ``keep`` pattern may hold: module-path characters and fnmatch's ``* ? [ ] !``
_KEEP_PATTERN = re.compile(r"[A-Za-z0-9_.*?\[\]!-]{1,200}")
#: ``keep`` patterns at most (a deploy lists layer kinds, not layers)
MAX_KEEP = 64


def _check_keep(patterns: list[str]) -> str | None:
    if len(patterns) > MAX_KEEP:
        return f"at most {MAX_KEEP} patterns, got {len(patterns)}"
    for i, p in enumerate(patterns):
        if not _KEEP_PATTERN.fullmatch(p):
            return (f"pattern {i} must be 1-200 characters of a module path (letters, digits, _ . -) and "
                    "fnmatch's * ? [ ] !, e.g. '*.to_v'")
    return None


@define(frozen=True)
class FP8Options:
    """The deploy's ``linear_precision_options`` for the FP8 modes (``fp8``, ``fp8-fast``,
    ``fp8-fast-except-down``)::

        linear_precision: fp8
        linear_precision_options:
          keep: ["*.to_v", "*.add_v_proj"]   # the attention value projections stay in the deploy dtype
    """

    #: glob patterns (``fnmatch``, case-sensitive: ``*`` matches any run of characters, dots
    #: included) over the dotted path of a module inside each transformer block (``attn.to_v``,
    #: ``attn1.to_out.0``, ``ff``); a module that matches stays in the deploy's dtype, with everything
    #: under it. A pattern that matches nothing in any block is refused at load (a typo, or a layer
    #: the family fused away, e.g. Wan's ``to_qkv``)
    keep: list[str] = field(factory=list, metadata={"check": _check_keep})


def fp8_options(deploy: Any) -> FP8Options:
    """The deploy's ``linear_precision_options`` as :class:`FP8Options` (the core checked them at load)."""
    try:
        return structure_params(FP8Options, getattr(deploy, "linear_precision_options", None) or {},
                                "linear_precision_options")
    except Exception as exc:  # a caller that skipped the core's check (tests, bench scripts)
        raise DeployError(f"deploy config: {exc}") from None


def keep_matcher(patterns: list[str]) -> tuple[Any, dict[str, list[str]]]:
    """``(exclude, hits)``: ``exclude(path)`` is True for a block path one of ``patterns`` matches;
    ``hits`` maps each pattern to the paths it matched, in order, without repeats."""
    hits: dict[str, list[str]] = {p: [] for p in patterns}

    def exclude(path: str) -> bool:
        kept = False
        for p in patterns:
            if fnmatch.fnmatchcase(path, p):
                kept = True
                if path not in hits[p]:
                    hits[p].append(path)
        return kept

    return exclude, hits


__all__ = ["MAX_KEEP", "FP8Options", "fp8_options", "keep_matcher"]
