"""scripts/relayout.py (issue 34: plugins/ grouped by role) on a scratch git repository: it moves
the plugin folders, fixes the moved files' relative links and root-finding paths, rewrites the
references everywhere but bench/results, keeps both package globs, writes the group docs, and a
second run (and --check) finds nothing to do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "relayout.py"

FILES = {
    "Makefile": "PYPROJECTS := $(wildcard core/pyproject.toml plugins/*/pyproject.toml \\\n    families/*/pyproject.toml)\n",
    "CONTRIBUTING.md": ("`make` finds packages by glob (`core`, `cli`, `plugins/*`, `families/*`)\n\n"
                        "| folder | distribution / import | depends on | holds |\n|---|---|---|---|\n"
                        "| `plugins/server/` | `omniloop-server` | omniloop | see [plugins/comfyui](plugins/comfyui) |\n"
                        "| `plugins/<other>/` | `omniloop-<other>` | omniloop (+ their stack) | transports, integrations |\n"),
    "plugins/server/pyproject.toml": "[project]\nname = \"omniloop-server\"\n",
    "plugins/server/README.md": ("# server\n[comfy](../comfyui) [core](../../core/README.md) [here](docs/a.md) "
                                 "[web](https://example.com/x) [anchor](#bodies)\nrun plugins/server/bench/x.py\n"),
    "plugins/server/docs/a.md": "a\n",
    "plugins/comfyui/pyproject.toml": "[project]\nname = \"omniloop-comfyui\"\n",
    "plugins/comfyui/README.md": "[server routes](../server/README.md#route-extensions)\n",
    "plugins/dynamo/pyproject.toml": "[project]\nname = \"omniloop-dynamo\"\n",
    "plugins/dynamo/install.sh": 'here="$(cd "$(dirname "$0")" && pwd)"\nrepo="$(cd "$here/../.." && pwd)"\n',
    "plugins/quant/pyproject.toml": "[project]\nname = \"omniloop-quant\"\n",
    "plugins/custom/pyproject.toml": "[project]\nname = \"omniloop-custom\"\n",
    "core/README.md": "see plugins/quant/README.md and plugins/quantum and plugins/server_x\n",
    "families/wan/README.md": "[policies](../../plugins/policies/README.md)\n",
    "tests/dynamo/conftest.py": 'INSTALL = REPO / "plugins" / "dynamo" / "install.sh"\n',
    "tests/core/test_src.py": 'GLOBS = ("core/omniloop/**/*.py", "plugins/*/omniloop_*/**/*.py", "families/*/omniloop_*/**/*.py")\n',
    "bench/results/old.json": '{"command": "bash plugins/quant/scripts/gpu.sh"}\n',
}


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def _run(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), "--root", str(repo), *args], capture_output=True, text=True)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "plugins/server/omniloop_server.egg-info").mkdir()
    (tmp_path / "plugins/server/omniloop_server.egg-info/PKG-INFO").write_text("x")  # untracked leftover
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A", ".")
    _git(tmp_path, "rm", "-q", "--cached", "-r", "plugins/server/omniloop_server.egg-info")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    return tmp_path


def test_moves_rewrites_and_is_idempotent(repo: Path) -> None:
    assert _run(repo, "--check").returncode == 1
    res = _run(repo, "--also", "custom=execution")
    assert res.returncode == 0, res.stderr
    r = lambda p: (repo / p).read_text()  # noqa: E731
    for name, group in (("server", "frontends"), ("comfyui", "frontends"), ("dynamo", "frontends"),
                        ("quant", "compute"), ("custom", "execution")):
        assert (repo / f"plugins/{group}/{name}/pyproject.toml").is_file() and not (repo / f"plugins/{name}").exists()
    # the untracked egg-info moved along, nothing left behind
    assert (repo / "plugins/frontends/server/omniloop_server.egg-info/PKG-INFO").is_file()
    # relative links of moved files, recomputed from their old place; URLs and anchors untouched
    assert r("plugins/frontends/server/README.md").splitlines()[1] == (
        "[comfy](../comfyui) [core](../../../core/README.md) [here](docs/a.md) [web](https://example.com/x) [anchor](#bodies)")
    assert "run plugins/frontends/server/bench/x.py" in r("plugins/frontends/server/README.md")
    assert r("plugins/frontends/comfyui/README.md") == "[server routes](../server/README.md#route-extensions)\n"
    assert '"$here/../../.."' in r("plugins/frontends/dynamo/install.sh")
    # references elsewhere; look-alike names untouched; records untouched
    assert r("core/README.md") == "see plugins/compute/quant/README.md and plugins/quantum and plugins/server_x\n"
    assert r("families/wan/README.md") == "[policies](../../plugins/compute/policies/README.md)\n"
    assert r("tests/dynamo/conftest.py") == 'INSTALL = REPO / "plugins" / "frontends" / "dynamo" / "install.sh"\n'
    assert '"plugins/*/omniloop_*/**/*.py", "plugins/*/*/omniloop_*/**/*.py"' in r("tests/core/test_src.py")
    assert "plugins/*/pyproject.toml plugins/*/*/pyproject.toml" in r("Makefile")
    assert r("bench/results/old.json") == FILES["bench/results/old.json"]
    # the group docs
    contributing = r("CONTRIBUTING.md")
    assert contributing.count("<!-- relayout:") == 1 and "[`server`](plugins/frontends/server)" in contributing
    assert "`plugins/<group>/<other>/`" in contributing and "`plugins/<group>/*` and `plugins/*`" in contributing
    assert "[`custom`](execution/custom)" in r("plugins/README.md")
    # a second run changes nothing
    _git(repo, "add", "-A", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "relayout")
    assert _run(repo, "--also", "custom=execution").returncode == 0
    assert _git(repo, "status", "--porcelain") == ""
    assert _run(repo, "--check", "--also", "custom=execution").returncode == 0


def test_folders_other_work_owns_are_listed_or_skipped(repo: Path) -> None:
    res = _run(repo, "--also", "custom=execution", "--skip-protected")
    assert res.returncode == 0, res.stderr
    assert (repo / "families/wan/README.md").read_text() == FILES["families/wan/README.md"]
    assert "left as is (--skip-protected): families/wan/README.md" in res.stdout
    assert (repo / "core/README.md").read_text() != FILES["core/README.md"]  # core/omniloop/ only is protected


def test_paths_rewritten_in_folders_other_work_owns_are_listed(repo: Path) -> None:
    res = _run(repo, "--also", "custom=execution")
    assert "paths rewritten in a folder other work owns: families/wan/README.md" in res.stdout


def test_a_plugin_in_no_group_is_reported_and_left_in_place(repo: Path) -> None:
    res = _run(repo)
    assert res.returncode == 0 and "plugins/custom is in no group" in res.stderr
    assert (repo / "plugins/custom/pyproject.toml").is_file()
    assert "not grouped: plugins/custom" in _run(repo, "--check").stdout


def test_refuses_a_dirty_tree_and_a_bad_group(repo: Path) -> None:
    (repo / "core/README.md").write_text("changed\n")
    res = _run(repo)
    assert res.returncode == 2 and "uncommitted changes" in res.stderr
    assert (repo / "plugins/server").is_dir()
    res = _run(repo, "--check", "--also", "custom=nowhere")
    assert res.returncode == 2 and "GROUP one of frontends, execution, compute" in res.stderr


def test_files_left_at_the_old_place_after_the_grouping_are_merged_in(repo: Path) -> None:
    """Another branch merged after the grouping adds a file under plugins/server/: a re-run moves it
    into plugins/frontends/server/ and rewrites its references; a clash is refused."""
    assert _run(repo, "--also", "custom=execution").returncode == 0
    _git(repo, "add", "-A", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "relayout")
    (repo / "plugins/server/omniloop_server").mkdir(parents=True)
    (repo / "plugins/server/omniloop_server/new.py").write_text('"""see plugins/quant/README.md"""\n')
    (repo / "docs").mkdir()
    (repo / "docs/new.md").write_text("run plugins/server/bench/x.py\n")
    _git(repo, "add", "-A", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "another branch")
    assert "would move plugins/server -> plugins/frontends/server" in _run(repo, "--check", "--also", "custom=execution").stdout
    res = _run(repo, "--also", "custom=execution")
    assert res.returncode == 0 and "files merged into the grouped folder" in res.stdout, res.stdout + res.stderr
    assert not (repo / "plugins/server").exists()
    assert (repo / "plugins/frontends/server/omniloop_server/new.py").read_text() == '"""see plugins/compute/quant/README.md"""\n'
    assert (repo / "docs/new.md").read_text() == "run plugins/frontends/server/bench/x.py\n"
    assert (repo / "plugins/frontends/server/pyproject.toml").is_file()
    _git(repo, "add", "-A", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "re-run")
    # a file at both places is refused, nothing moved
    (repo / "plugins/server").mkdir()
    (repo / "plugins/server/README.md").write_text("old\n")
    _git(repo, "add", "-A", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "clash")
    res = _run(repo, "--also", "custom=execution")
    assert res.returncode != 0 and "plugins/server/README.md exists at both" in res.stderr
