"""CONTRIBUTING.md's "Writing a family" shows the complete minimal family: its copy of
examples/minimal-family/omniloop_minimal/plugin.py is the file, byte for byte, and the names it
points to exist."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "minimal-family" / "omniloop_minimal" / "plugin.py"


def _guide() -> str:
    text = (REPO / "CONTRIBUTING.md").read_text(encoding="utf-8")
    start = text.index("**Writing a family.**")
    return text[start:text.index("\n**Writing an interceptor**", start)]


def test_the_guide_shows_the_whole_example_file() -> None:
    blocks = re.findall(r"```python\n(.*?)```", _guide(), flags=re.S)
    assert blocks, "CONTRIBUTING.md 'Writing a family' has no python block"
    assert blocks[0] == EXAMPLE.read_text(encoding="utf-8"), (
        "CONTRIBUTING.md's copy of the minimal family differs from " + str(EXAMPLE.relative_to(REPO)))


def test_the_guide_names_what_exists() -> None:
    guide = _guide()
    for path in ("examples/minimal-family", "tests/examples/test_minimal_family.py", "tests/examples/test_family_guide.py"):
        assert path in guide and (REPO / path).exists(), path
