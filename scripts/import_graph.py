"""The core's import graph, imports inside functions included: ``python scripts/import_graph.py [--json] [ROOT]``.

Every ``import`` / ``from ... import`` statement anywhere in a module of ``core/omniloop`` (module
level, inside functions, under ``if TYPE_CHECKING``) is an edge. ``from pkg import name`` is an
edge to ``pkg.name`` when that is a module of the core, else to ``pkg`` (the package's
``__init__``); the implicit import of a parent package is not counted. Reported: the import
cycles (strongly connected components of more than one module), the imports of plugin packages
(``omniloop_*``, including ``importlib.import_module("omniloop_...")``), and the imports from a
module to a module of a higher layer (:data:`LAYERS`, also described in CONTRIBUTING.md).

``ROOT`` defaults to the checkout this script lives in; point it at another tree (``git archive
main | tar -x -C /tmp/base``) to measure a baseline. ``tests/core/test_import_layers.py`` runs it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report

#: the core's layers, lowest first: a module imports only modules of its own layer or below
#: (``omniloop`` is the package's ``__init__``; ``testing`` every module of ``omniloop.testing``)
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("types", frozenset({"errors", "artifacts", "request", "scheduling", "lazy"})),
    ("schema", frozenset({"schema", "resolved", "streams", "deploy", "limits", "cancel", "checkpoints", "weights"})),
    ("contracts", frozenset({"loop", "interceptors", "graph", "capabilities", "rl", "family", "hookspecs",
                             "builtin"})),
    ("plugin machinery", frozenset({"plugins", "observers"})),
    ("execution", frozenset({"context", "execution", "placement", "linears"})),
    ("runtime", frozenset({"runtime"})),
    ("api", frozenset({"omniloop", "testing",  # and the shims of moved modules (ImportError naming the new home)
                       "compose", "kvcache", "compile", "adapters", "offload", "media", "jsonschema"})),
)


def core_modules(root: Path) -> dict[str, Path]:
    base = root / "core"
    mods: dict[str, Path] = {}
    for path in sorted((base / "omniloop").rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(module: str, path: Path, mods: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(core modules ``module`` imports, plugin packages it imports)."""
    is_pkg = path.name == "__init__.py"
    core: set[str] = set()
    plugins: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                pkg = ".".join(base + ([node.module] if node.module else []))
            else:
                pkg = node.module or ""
            targets = [f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in mods else pkg for a in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__")):
            targets = [node.args[0].value]
        for t in targets:
            if t in mods and t != module:
                core.add(t)
            elif t.split(".")[0].startswith("omniloop_"):
                plugins.add(t)
    return core, plugins


def graph(root: Path) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    mods = core_modules(root)
    edges: dict[str, set[str]] = {}
    plugins: dict[str, set[str]] = {}
    for m, p in mods.items():
        edges[m], found = _imports(m, p, mods)
        if found:
            plugins[m] = found
    return edges, plugins


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    short = "omniloop" if len(parts) == 1 else parts[1]
    for i, (_, names) in enumerate(LAYERS):
        if short in names:
            return i
    return None


def upward(edges: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for every import from a module to a module of a higher layer."""
    bad = []
    for a, targets in sorted(edges.items()):
        la = layer_of(a)
        for b in sorted(targets):
            lb = layer_of(b)
            if la is not None and lb is not None and lb > la:
                bad.append(f"{a} ({LAYERS[la][0]}) -> {b} ({LAYERS[lb][0]})")
    return bad


def measure(root: Path) -> dict[str, object]:
    edges, plugins = graph(root)
    return {
        "modules": len(edges),
        "cycles": cycles(edges),
        "plugin_imports": {m: sorted(p) for m, p in sorted(plugins.items())},
        "unlayered": sorted(m for m in edges if layer_of(m) is None),
        "upward_imports": upward(edges),
    }


def report(m: dict[str, Any]) -> None:
    cyc = m["cycles"]
    print(f"{m['modules']} modules in core/omniloop; {len(cyc)} import cycle(s)")  # type: ignore[arg-type]
    for c in cyc:  # type: ignore[attr-defined]
        print("  cycle: " + ", ".join(c))
    print(f"plugin imports: {m['plugin_imports'] or 'none'}")
    print(f"modules in no layer: {', '.join(m['unlayered']) or 'none'}")  # type: ignore[arg-type]
    for u in m["upward_imports"]:  # type: ignore[attr-defined]
        print(f"  upward: {u}")


def main(argv: list[str]) -> int:
    return _report.run(argv, measure, report)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
