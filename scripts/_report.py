"""The command line the measuring scripts share (``count_lines.py``, ``import_graph.py``):
``python scripts/<name>.py [--json] [ROOT]``. ROOT defaults to the repository holding ``scripts/``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def run(argv: list[str], measure: Callable[[Path], dict[str, Any]], report: Callable[[dict[str, Any]], None]) -> int:
    """``measure(ROOT)``, printed as JSON with ``--json``, else by ``report``; returns 0."""
    args = [a for a in argv if a != "--json"]
    m = measure(Path(args[0]) if args else Path(__file__).resolve().parents[1])
    if "--json" in argv:
        print(json.dumps(m, indent=2))
    else:
        report(m)
    return 0
