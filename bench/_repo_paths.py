"""Make the repository's packages importable from a bare checkout (the GPU machine has no editable installs).

The standalone ``bench/*.py`` scripts call :func:`add_repo_packages` before importing omniloop: every
package folder of the repo (a folder holding ``pyproject.toml``) whose top-level module is not
importable already is put on ``sys.path``. Installed packages always win, so on a machine set up
with ``make`` nothing changes. Entry points are not registered this way: scripts that need plugin
discovery must run from an installed environment.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def add_repo_packages(root: Path = ROOT) -> list[str]:
    """Put the repo's not-installed package folders on ``sys.path``; returns the modules added."""
    added: list[str] = []
    for pyproject in sorted(root.glob("**/pyproject.toml")):
        folder = pyproject.parent
        if folder == root or any(part.startswith(".") or part in ("build", "tests") for part in folder.relative_to(root).parts):
            continue
        for init in sorted(folder.glob("*/__init__.py")):
            name = init.parent.name
            if importlib.util.find_spec(name) is None:
                sys.path.insert(0, str(folder))
                added.append(name)
    return added
