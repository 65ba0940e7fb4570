"""A fast start (issue 42): ``omniloop --help``, ``omniloop generate --help``, a refused
``generate`` (a bad flag or value, a flag the model's task would ignore) and loading every installed
plugin's entry point import no torch (nor diffusers, transformers, starlette). Checked in fresh interpreters through
``sys.modules``, not by timing (the seconds are measured by ``bench/fast_start.py``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "diffusers", "transformers", "starlette", "uvicorn", "av", "numpy")


def _heavy_after(code: str) -> list[str]:
    probe = code + f"\nimport json, sys\nprint('HEAVY=' + json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("HEAVY=")][-1]
    return json.loads(line[len("HEAVY="):])


def test_omniloop_help_imports_no_torch():
    code = (
        "import sys\nfrom omniloop_cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n"
    )
    assert _heavy_after(code) == []


def _cli_heavy(args: list[str]) -> tuple[int, str, list[str]]:
    """Run ``omniloop ARGS`` in a fresh interpreter: (exit code, last stderr line, heavy modules imported)."""
    code = (
        "import contextlib, io, sys\nfrom omniloop_cli import main\nerr = io.StringIO()\ncode = 0\n"
        "with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):\n"
        f"    try:\n        main({args!r})\n    except SystemExit as e:\n        code = e.code or 0\n"
        "lines = err.getvalue().strip().splitlines()\n"
        "print('RESULT=' + json.dumps([code, lines[-1] if lines else '']))\n"
    )
    probe = "import json\n" + code + f"print('HEAVY=' + json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    got = {ln.split("=", 1)[0]: json.loads(ln.split("=", 1)[1]) for ln in res.stdout.splitlines() if "=" in ln}
    return got["RESULT"][0], got["RESULT"][1], got["HEAVY"]


def test_generate_help_imports_no_torch_and_lists_plugin_flags():
    """The plugin flags (``--profile``) come from the run-option hook alone, not from every family."""
    assert _cli_heavy(["generate", "--help"])[::2] == (0, [])
    res = subprocess.run([sys.executable, "-m", "omniloop_cli", "generate", "--help"], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and "--profile" in res.stdout, res.stdout[-2000:]


@pytest.mark.parametrize("args, expect", [
    (["--bogus"], "No such option '--bogus'"),
    (["--model", "wan-demo", "--steps", "-1"], "diffusion.steps: must be >= 1, got -1"),
    (["--model", "wan-demo", "--steps", "abc"], "diffusion.steps: expected an integer"),
    (["--model", "wan-demo", "--guidance", "nan"], "diffusion.guidance_scale"),
    (["--model", "wan-demo", "--node-param", "denoise"], "expected NAME.KEY=VALUE"),
    (["--model", "wan-demo", "--out", "clip.xyz"], "--out: unsupported file type '.xyz'"),
    # the task is the model's default (t2v): read from the checkpoint's omniloop.json, not its family
    (["--model", "wan-demo", "--image", __file__], "--image: a t2v request takes no input image"),
    (["--model", "wan-demo", "--task", "reason", "--stream"], "--stream: writes video frames"),
    # finding 1's mistake: the size range the checkpoint's omniloop.json declares, before its family loads
    (["--model", "wan-demo-fast", "--height", "2048", "--width", "2048"],
     "diffusion.height: 2048 is outside what model 'wan-demo-fast' supports: height 64..64"),
    (["--model", "wan-demo", "--frames", "33"], "diffusion.frames: 33 is outside what model 'wan-demo' supports"),
])
def test_a_refused_generate_imports_no_torch(args: list[str], expect: str):
    """Validation comes before heavy imports: a mistake is one line and exit 2 in a fraction of a
    second, not after torch's import (issue 42: "validation before heavy imports")."""
    pytest.importorskip("omniloop_wan_demo")
    code, line, heavy = _cli_heavy(["generate", "a red circle", *args])
    assert code == 2 and expect in line, line
    assert heavy == []


def test_the_help_still_lists_plugin_commands():
    res = subprocess.run([sys.executable, "-m", "omniloop_cli", "--help"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "serve" in res.stdout and "generate" in res.stdout  # a plugin's command and a built-in one


def test_importing_the_core_package_and_request_types_imports_no_torch():
    assert _heavy_after("import omniloop\nfrom omniloop.request import OmniRequest\nfrom omniloop import TaskType") == []


def test_loading_every_installed_plugin_entry_point_imports_no_torch():
    """Registration must be cheap (CONTRIBUTING, "Writing a plugin"): each plugin module defers its
    heavy imports to the hooks that need them."""
    code = (
        "import importlib.metadata as md\n"
        "for ep in md.entry_points(group='omniloop.plugins'):\n"
        "    ep.load()\n"
    )
    assert _heavy_after(code) == []


def test_the_lazy_package_exports_still_resolve():
    pytest.importorskip("torch")
    import omniloop

    missing = [n for n in omniloop.__all__ if getattr(omniloop, n, None) is None]
    assert missing == []
    assert omniloop.runtime.Runtime is omniloop.Runtime  # a submodule as an attribute, as before
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        omniloop.nope  # noqa: B018


def test_no_two_request_fields_share_a_flag() -> None:
    """Every flag derived from the request schema names one field: ``--guidance`` stays
    ``diffusion.guidance_scale``'s alias after the audio group gained a ``guidance`` knob (LTX-2's
    audio branch), whose flag is qualified (``--audio-guidance``), as are the other audio knobs."""
    from omniloop_cli.generate import request_flags

    flags = [(f"{g}.{n}", flag) for g, n, _, names in request_flags() for flag in names]
    names = [flag for _, flag in flags]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    owner = dict((flag, path) for path, flag in flags)
    assert owner["--guidance"] == "diffusion.guidance_scale"
    assert owner["--audio-guidance"] == "audio.guidance"
    assert owner["--seconds"] == "audio.seconds"


#: what a text-to-video demo run has no use for: the server's libraries (plugin discovery loads the
#: server's and other front ends' registration modules, which import none of them), torchvision,
#: and the CLIP image encoder / processor (Wan2.1 I2V only; importing transformers'
#: CLIPImageProcessor also printed a torchvision warning on every wan-demo run)
NOT_IN_A_T2V_DEMO_RUN = ("starlette", "uvicorn", "fastapi", "openai", "httpx", "torchvision",
                         "transformers.models.clip")


def test_a_wan_demo_run_imports_no_image_encoder_nor_server(tmp_path):
    """A t2v demo run imports the libraries it runs (torch, diffusers' model modules, transformers'
    UMT5, av) and none of the above; the remaining import floor is measured by
    ``bench/fast_start.py`` (docs/first-hour.md, finding 6)."""
    pytest.importorskip("omniloop_wan_demo")
    out = tmp_path / "clip.mp4"
    args = ["generate", "a red circle moving up", "--model", "wan-demo", "--steps", "1", "--seed", "0",
            "--out", str(out)]
    code = (
        "import json, sys\nfrom omniloop_cli import main\ncode = 0\n"
        f"try:\n    main({args!r})\nexcept SystemExit as e:\n    code = e.code or 0\n"
        "print('RESULT=' + json.dumps([code, sorted(sys.modules)]))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT=")][-1]
    exit_code, modules = json.loads(line[len("RESULT="):])
    assert exit_code == 0 and out.is_file(), res.stderr[-2000:]
    assert "torch" in modules and "omniloop_wan" in modules  # it did run the model
    loaded = [m for m in modules if any(m == n or m.startswith(n + ".") for n in NOT_IN_A_T2V_DEMO_RUN)]
    assert loaded == []
    assert "torchvision" not in res.stderr, res.stderr[-2000:]
