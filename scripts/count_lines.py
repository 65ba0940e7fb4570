"""The sizes issue 34 measures, reproducibly: ``python scripts/count_lines.py [--json] [ROOT]``.

* **lines**: non-blank lines of Python that are not comments (a line whose first non-space
  character is ``#``); docstrings count (they are code a reader reads). Per family package
  (``families/<name>/omniloop_<name>``) without its tiny-checkpoint builders (``tiny.py``), the
  kit (``families/kit``) the same way, and the core outside ``testing/``.
* **limit checks**: for each deploy limit (``max_steps``, ``max_frames``, ``max_height``,
  ``max_width``), the functions in the package sources (core, cli, plugins, families, observers,
  interceptors; demo training code excluded) that check a request value against it: a function
  that raises and contains a ``<``/``>``/``<=``/``>=`` comparison naming the limit
  (``steps > max_steps``), or reads the limit (``lim.max_steps``, ``f"max_{name}"`` over height
  and width, the core's ``LIMITS[...]`` table) next to such a comparison.

``ROOT`` defaults to the checkout this script lives in; point it at another tree (``git archive
main | tar -x -C /tmp/base``) to measure a baseline.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report

LIMITS = ("max_steps", "max_frames", "max_height", "max_width")
PACKAGE_GLOBS = ("core/omniloop/**/*.py", "cli/*/**/*.py", "plugins/*/omniloop_*/**/*.py", "plugins/*/*/omniloop_*/**/*.py",
                 "families/*/omniloop_*/**/*.py", "observers/*/omniloop_*/**/*.py",
                 "interceptors/*/omniloop_*/**/*.py")


def code_lines(path: Path) -> int:
    return sum(1 for line in path.read_text(encoding="utf-8").splitlines()
               if line.strip() and not line.strip().startswith("#"))


def tree_lines(folder: Path, exclude: tuple[str, ...] = ()) -> int:
    return sum(code_lines(p) for p in sorted(folder.rglob("*.py"))
               if not any(part in exclude for part in p.relative_to(folder).parts))


def _reads_limit(func: ast.AST, name: str) -> bool:
    """Whether ``func`` compares a value with the deploy limit ``name``: a comparison that names
    it (``steps > max_steps``), or a ``<``/``>`` comparison in a function that reads it as an
    attribute (``lim.max_steps``), builds its name (``f"max_{name}"``) or indexes the core's table
    (``LIMITS[...]``)."""
    if not any(isinstance(n, ast.Raise) for n in ast.walk(func)):
        return False  # a check refuses; computing a limit (min of two) is not checking a request
    compares = [c for c in ast.walk(func) if isinstance(c, ast.Compare)
                and any(isinstance(op, (ast.Gt, ast.Lt, ast.GtE, ast.LtE)) for op in c.ops)]
    if not compares:
        return False
    if any(name in ast.unparse(c) for c in compares):
        return True
    for node in ast.walk(func):
        if isinstance(node, ast.Attribute) and node.attr == name:
            return True
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "LIMITS":
            return True
        if (isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant)
                and node.values[0].value == "max_" and name in ("max_height", "max_width")):
            return True  # f"max_{name}" over height and width
    return False


def limit_checks(root: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {name: [] for name in LIMITS}
    files = sorted({p for g in PACKAGE_GLOBS for p in root.glob(g)})
    for path in files:
        rel = path.relative_to(root).as_posix()
        if "/training/" in rel:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = {id(n) for child in node.body for n in ast.walk(child)
                         if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
                if inner:  # nested functions are measured on their own
                    continue
                for name in LIMITS:
                    if _reads_limit(node, name):
                        found[name].append(f"{rel}:{node.lineno} {node.name}")
    return found


def measure(root: Path) -> dict[str, object]:
    families = {}
    for name in ("flux", "sd3", "wan", "qwen", "stable-audio", "ltx2", "cosmos3"):
        pkg = root / "families" / name / f"omniloop_{name.replace('-', '_')}"
        if pkg.is_dir():
            families[name] = tree_lines(pkg, exclude=("tiny.py",))
    kit = root / "families" / "kit"
    out: dict[str, object] = {
        "family_lines_without_tiny": families,
        "core_lines_outside_testing": tree_lines(root / "core" / "omniloop", exclude=("testing",)),
        "limit_checks": {k: len(v) for k, v in limit_checks(root).items()},
        "limit_check_places": limit_checks(root),
    }
    if kit.is_dir():
        out["kit_lines_without_tiny"] = tree_lines(kit, exclude=("tiny.py",))
    return out


def report(m: dict[str, Any]) -> None:
    for name, n in m["family_lines_without_tiny"].items():  # type: ignore[attr-defined]
        print(f"families/{name}: {n} lines (tiny.py excluded)")
    if "kit_lines_without_tiny" in m:
        print(f"families/kit: {m['kit_lines_without_tiny']} lines (tiny.py excluded)")
    print(f"core/omniloop outside testing/: {m['core_lines_outside_testing']} lines")
    for name, places in m["limit_check_places"].items():  # type: ignore[attr-defined]
        print(f"{name} checked in {len(places)} place(s): {', '.join(places)}")


def main(argv: list[str]) -> int:
    return _report.run(argv, measure, report)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
