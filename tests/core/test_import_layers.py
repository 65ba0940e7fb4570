"""The core's imports, read from the source (imports inside functions included): no import cycle,
no plugin package imported, no import from a lower layer to a higher one (issue 34).

The layers are ``scripts/import_graph.py``'s ``LAYERS`` (described in CONTRIBUTING.md, "The core's
layers"); a new core module must be placed in one.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _graph_module():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("import_graph", mod)
    spec.loader.exec_module(mod)
    return mod


G = _graph_module()


def test_the_core_has_no_import_cycle_counting_imports_inside_functions():
    edges, _ = G.graph(ROOT)
    assert len(edges) > 20  # the core was found
    assert G.cycles(edges) == []


def test_the_core_imports_no_plugin_package():
    _, plugins = G.graph(ROOT)
    assert plugins == {}


def test_every_core_module_has_a_layer_and_no_import_goes_up():
    edges, _ = G.graph(ROOT)
    assert [m for m in edges if G.layer_of(m) is None] == []
    assert G.upward(edges) == []


def test_the_checker_sees_function_level_imports_cycles_and_plugins(tmp_path):
    """The analysis itself: a cycle closed by an import inside a function, a plugin imported lazily
    (also through importlib) and an upward import are all reported."""
    pkg = tmp_path / "core" / "omniloop"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("def f():\n    from . import runtime\n")
    (pkg / "runtime.py").write_text("from .errors import f\nimport importlib\n"
                                    "def g():\n    import omniloop_parallel\n    importlib.import_module('omniloop_compose')\n")
    edges, plugins = G.graph(tmp_path)
    assert G.cycles(edges) == [["omniloop.errors", "omniloop.runtime"]]
    assert plugins == {"omniloop.runtime": {"omniloop_parallel", "omniloop_compose"}}
    assert G.upward(edges) == ["omniloop.errors (types) -> omniloop.runtime (runtime)"]
