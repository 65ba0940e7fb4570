"""One-line parity assertions for plugin and family authors.

::

    from omniloop_parity.testing import assert_matches_golden

    def test_my_family_is_pinned(runtime):
        assert_matches_golden(runtime, {"task": "t2v", "prompt": "a cat", "diffusion": {"seed": 0}},
                              Path(__file__).parent / "golden" / "my-family.safetensors")

Rewrite goldens with ``OMNILOOP_PARITY_REGEN=1`` or ``pytest --parity-regen``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .compare import ParityResult, Tolerances, compare
from .recording import Recording
from .run import record, runtime_with_parity

REGEN_ENV = "OMNILOOP_PARITY_REGEN"


def regen_requested() -> bool:
    return os.environ.get(REGEN_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def assert_matches_golden(
    runtime: Any,
    request: Any,
    golden_path: str | os.PathLike[str],
    tolerances: Tolerances | Mapping[str, Any] | None = None,
    *,
    blocks: str | None = None,
    taps: str | None = None,
    regen: bool | None = None,
) -> ParityResult:
    """Run ``request`` on ``runtime`` and assert it matches the golden recording, bit for bit by default.

    ``runtime`` need not have the parity observer enabled: a runtime with it is built from the
    same deploy and plugin manager. ``tolerances`` is a :class:`Tolerances` or a mapping in the
    TOML file's shape (``{"atol": 1e-6, "override": [{"match": "final/video", "atol": 1}]}``).
    With ``regen`` (default: ``$OMNILOOP_PARITY_REGEN``) the golden is (re)written instead.
    """
    from omniloop.schema import request_from_dict

    req = request_from_dict(request) if isinstance(request, Mapping) else request
    if req.diffusion.seed is None:
        raise ValueError("assert_matches_golden: the request needs diffusion.seed (a golden run must be reproducible)")
    golden = Path(golden_path)
    tols = Tolerances.from_dict(tolerances, "tolerances") if isinstance(tolerances, Mapping) else tolerances
    rt = runtime_with_parity(runtime, taps=taps, blocks=blocks)
    new = record(rt, req)
    if regen if regen is not None else regen_requested():
        new.save(golden)
        result = compare(new, new)
        result.regenerated = True
        return result
    if not golden.is_file():
        raise AssertionError(
            f"golden recording {golden} does not exist; write it with {REGEN_ENV}=1 (or pytest --parity-regen)"
        )
    result = compare(Recording.load(golden), new, tols)
    result.b_label = "this run"
    if not result.passed:
        raise AssertionError(result.explain())
    return result
