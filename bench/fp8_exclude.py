"""An experiment for issue 40: omniloop-quant's FP8 linears with some layers kept as they were, by regular expression.
The deploy now does the same by glob (``linear_precision_options: {keep: [...]}``, omniloop-quant's README); this
prelude stays for the commands recorded in bench/results (session 27).

Run before an adherence evaluation in the same process (``gpu_fp8lin_flux_demo.sh``'s ``PRELUDE``, or
``python -c``), with ``FP8_EXCLUDE`` a regular expression over each linear's dotted path under its transformer
block (``norm1.linear``, ``attn.to_q``, ``ff``: the deploy installs block by block)::

    FP8_EXCLUDE='(^|\\.)norm\\w*\\.linear$' python -c 'import runpy; runpy.run_path("bench/fp8_exclude.py"); \\
        import sys; from omniloop_wan_demo.cli import adherence; adherence(sys.argv[1:])' \\
        --model flux-demo --linear-precision fp8 --json fp8-no-mod.json

``linear_precision: fp8`` then swaps every block linear except those the expression matches (``fp8.install``'s
``exclude``); with ``omniloop eval compare --features`` against the bf16 run it shows which layers carry FP8's
systematic effect on the images (flux-demo: objects ~1 % smaller, ``bench/README.md``, "Session 27").
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Any

from torch import nn

import omniloop_quant.blocks as _blocks
import omniloop_quant.fp8 as _fp8

PATTERN = os.environ.get("FP8_EXCLUDE", "")
if not PATTERN:
    raise SystemExit("FP8_EXCLUDE: a regular expression over the linears' paths in a block, e.g. 'norm1\\.linear$'")
try:
    _RX = re.compile(PATTERN)
except re.error as exc:
    raise SystemExit(f"FP8_EXCLUDE={PATTERN!r}: {exc}") from None
_install = _fp8.install
EXCLUDED: dict[str, None] = {}  # the paths (within a block) kept, in order; install may ask twice


def _exclude(path: str) -> bool:
    hit = bool(_RX.search(path))
    if hit:
        EXCLUDED[path] = None
    return hit


def install(roots: Iterable[nn.Module], exclude: Any = None, **kwargs: Any) -> dict[str, Any]:
    """``fp8.install`` keeping what ``FP8_EXCLUDE`` matches, besides the deploy's own ``keep`` (``exclude``)."""
    report = _install(roots, exclude=lambda path: _exclude(path) or bool(exclude and exclude(path)), **kwargs)
    print(f"fp8_exclude: kept the layers at {len(EXCLUDED)} path(s) in the blocks matching {PATTERN!r} as they were: "
          f"{', '.join(list(EXCLUDED)[:6])}", flush=True)
    return report


_blocks.install = install
