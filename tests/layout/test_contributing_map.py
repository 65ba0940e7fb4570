"""CONTRIBUTING.md's layout table is the map of the tree (issue 34): every folder it names exists,
and every package of the repository (a folder with a pyproject.toml) is on it, by name or under a
``<name>`` row of its parent folder."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _map_rows() -> list[str]:
    text = (REPO / "CONTRIBUTING.md").read_text(encoding="utf-8")
    start = text.index("| folder | distribution / import |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        m = re.match(r"\|\s*`([^`]+)`", line)
        assert m, f"a layout row without a folder: {line[:80]}"
        rows.append(m.group(1).rstrip("/"))
    return rows


def _packages() -> list[str]:
    tracked = subprocess.run(["git", "ls-files", "*pyproject.toml"], cwd=REPO, check=True,
                             capture_output=True, text=True).stdout.split()
    return sorted(str(Path(p).parent) for p in tracked if p != "pyproject.toml")


def _covers(row: str, package: str) -> bool:
    pattern = "/".join("[^/]+" if re.fullmatch(r"<[^>]+>", part) else re.escape(part) for part in row.split("/"))
    return re.fullmatch(pattern, package) is not None


def test_every_folder_on_the_map_exists() -> None:
    for row in _map_rows():
        concrete = row.split("/<")[0]
        assert (REPO / concrete).is_dir(), f"CONTRIBUTING.md names {row}/, which is not in the tree"


def test_every_package_is_on_the_map() -> None:
    rows = _map_rows()
    missing = [p for p in _packages() if not any(_covers(r, p) for r in rows)]
    assert not missing, f"packages missing from CONTRIBUTING.md's layout table: {missing}"
