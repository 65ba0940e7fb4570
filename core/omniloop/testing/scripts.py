"""Smoke tests of the repository's scripts (``bench/*.py``): each has ``main(argv) -> int`` and writes
one JSON record into ``--out``. :func:`load_script` imports a script file as a module (it is not on
``sys.path``); :func:`run_script` runs its ``main`` into a folder and loads the record it wrote.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["load_script", "run_script"]


def load_script(path: Path) -> ModuleType:
    """``path`` (``bench/NAME.py``) imported as the module ``NAME_bench``."""
    spec = importlib.util.spec_from_file_location(f"{path.stem}_bench", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_script(script: Path | ModuleType, argv: Sequence[str], out: Path, pattern: str) -> dict[str, Any]:
    """Run ``script``'s ``main([*argv, "--out", out])`` (a path is loaded first), which must return
    0 and leave exactly one file matching ``pattern`` in ``out``; that file's JSON."""
    mod = load_script(script) if isinstance(script, Path) else script
    assert mod.main([*argv, "--out", str(out)]) == 0
    (path,) = out.glob(pattern)
    record: dict[str, Any] = json.loads(path.read_text())
    return record
