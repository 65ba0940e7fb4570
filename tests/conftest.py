"""Fixtures shared by every test folder.

``scratch_venv`` makes a throw-away virtual environment that sees everything installed in the
environment running the tests, plus packages a test installs into it (a deliberately broken
plugin, the tutorial plugin). Installs are offline and fast: ``--no-deps --no-build-isolation``.

Why not ``python -m venv --system-site-packages``: the tests usually run inside a venv already
(``.venv`` made by ``make``), and a nested venv's "system" site-packages are the *base*
interpreter's, not that venv's. A ``.pth`` line calling ``site.addsitedir`` on the running
environment's site-packages mirrors it exactly (editable installs included).
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest


class ScratchVenv:
    def __init__(self, root: Path) -> None:
        self.root = root
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
        bindir = "Scripts" if os.name == "nt" else "bin"
        self.python = root / bindir / ("python.exe" if os.name == "nt" else "python")
        purelib = Path(sysconfig.get_path("purelib", vars={"base": str(root), "platbase": str(root)}))
        parents = [p for p in site.getsitepackages() if Path(p).is_dir()]
        lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in parents)
        (purelib / "_omniloop_parent_env.pth").write_text(lines)

    def install(self, *projects: Path, editable: bool = True) -> None:
        """``pip install --no-deps --no-build-isolation [-e] PROJECT...`` into this venv, offline."""
        args: list[str] = []
        for p in projects:
            args += ["-e", str(p)] if editable else [str(p)]
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "--python", str(self.python), "install", "-q", "--no-deps",
             "--no-build-isolation", "--no-index", *args],
            capture_output=True, text=True,
        )
        assert proc.returncode == 0, f"pip install failed:\n{proc.stdout}\n{proc.stderr}"

    def omniloop(self, *args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """Run the ``omniloop`` CLI with this venv's interpreter (``python -m omniloop_cli``)."""
        env = {k: v for k, v in os.environ.items() if k not in ("OMNILOOP_DEBUG", "OMNILOOP_TRACE_HOOKS")}
        env.update(COLUMNS="200", NO_COLOR="1", PYTHONDONTWRITEBYTECODE="1")
        return subprocess.run(
            [str(self.python), "-m", "omniloop_cli", *args], capture_output=True, text=True,
            cwd=cwd or self.root, env=env, timeout=timeout,
        )


def write_package(
    root: Path, dist: str, module: str, entry_points: dict[str, str], files: dict[str, str]
) -> Path:
    """Write a minimal setuptools project declaring ``omniloop.plugins`` entry points."""
    root.mkdir(parents=True, exist_ok=True)
    eps = "\n".join(f'"{name}" = "{target}"' for name, target in entry_points.items())
    (root / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [build-system]
        requires = ["setuptools>=64"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{dist}"
        version = "0.0.1"
        dependencies = []

        [project.entry-points."omniloop.plugins"]
        """) + eps + textwrap.dedent(f"""

        [tool.setuptools]
        packages = ["{module}"]
        """))
    pkg = root / module
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    for name, text in files.items():
        (pkg / name).write_text(textwrap.dedent(text))
    return root


TOY_ENTRY_POINT_PLUGIN = '''
    """The core's toy family behind a real entry point, for end-to-end CLI tests."""
    from omniloop.hookspecs import hookimpl
    from omniloop.testing.toy import ToyFamily

    OMNILOOP_HOOK_API = ">=1.0,<2"


    @hookimpl
    def omniloop_register_families(register):
        register(ToyFamily())
'''


@pytest.fixture(scope="session")
def packaging(tmp_path_factory: pytest.TempPathFactory) -> types.SimpleNamespace:
    """Helpers for tests that install real packages (session-scoped, so a module can share a venv).

    * ``packaging.venv(name)`` → a fresh :class:`ScratchVenv` that sees the test environment;
    * ``packaging.package(dist, module, {ep_name: target}, {file: source})`` → a project folder;
    * ``packaging.toy_package()`` → a project registering the toy family as entry point ``toy``.
    """
    src = tmp_path_factory.mktemp("src")

    def venv(name: str = "venv") -> ScratchVenv:
        return ScratchVenv(tmp_path_factory.mktemp(name) / "venv")

    def package(dist: str, module: str, entry_points: dict[str, str], files: dict[str, str]) -> Path:
        return write_package(src / dist, dist, module, entry_points, files)

    def toy_package() -> Path:
        return package("omniloop-test-toy", "omniloop_test_toy", {"toy": "omniloop_test_toy.plugin"},
                       {"plugin.py": TOY_ENTRY_POINT_PLUGIN})

    return types.SimpleNamespace(venv=venv, package=package, toy_package=toy_package)


@pytest.fixture(scope="session")
def noise_png_40x48(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 40x48 RGB noise png (``np.random.RandomState(0)``), for image-conditioned tasks: not any
    output size, so the pipelines resize it as diffusers does (sd3 i2i, Wan i2v)."""
    import numpy as np
    from PIL import Image

    path = tmp_path_factory.mktemp("noise-png") / "noise-40x48.png"
    pixels = (np.random.RandomState(0).rand(40, 48, 3) * 255).astype(np.uint8)
    Image.fromarray(pixels).save(path)
    return path


@pytest.fixture
def compile_for_sm90() -> Any:
    """``compile(kernel, signature, constexprs, num_warps)``: a ``triton.jit`` kernel compiled for Hopper
    (sm_90) down to a cubin on this machine, no GPU needed (Triton's compiler and its bundled ptxas) --
    a kernel variant that would fail to build on the GPU fails here; returns the compiled kernel's asm
    dict. Skips where Triton (or its NVIDIA backend) is missing."""
    pytest.importorskip("triton")
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:  # an older/newer Triton without these entry points
        pytest.skip(f"this Triton cannot compile ahead of time here: {exc}")

    def compile_(kernel: Any, signature: dict[str, str], constexprs: dict[str, Any], num_warps: int = 4) -> dict:
        src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm

    return compile_


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """``gpu`` tests skip cleanly where CUDA is not available."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config: Any) -> None:
    """One intra-op torch thread: the suite's models are tiny, and on a 2-core CI machine torch's
    default thread pool makes them 5-10x slower (threads fight the test's own subprocesses)."""
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
