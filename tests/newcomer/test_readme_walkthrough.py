"""A new user's first hour, scripted (issue 42): every command and snippet of the root README,
executed as written, in order, on the demo models, from a scratch folder that sees the repo's
``examples/`` (the README is followed from the repository root); each output checked for being
there and sane.

* ``bash`` blocks: every command (continuation lines joined, comments dropped). ``omniloop ...``
  runs through the CLI in-process over the installed plugins (what a user gets), ``python ...``
  in a subprocess. ``make ...`` / ``source ...`` are the set-up this suite already ran under.
  ``--steps 20`` becomes ``--steps 4`` (CI time; the README's step count is not what is checked).
* ``text`` blocks that show ``$ omniloop ...`` and its output: the command must print exactly that.
* ``python`` blocks: executed (``"steps": 20`` -> 4 likewise).
* ``yaml`` blocks: equal to the shipped ``examples/deploys/wan-demo.yaml``.

A README command that is not recognised below fails the test: a new snippet gets a check.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("peft")

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
SKIP_PREFIXES = ("make ", "source ")

pytestmark = pytest.mark.slow


def blocks(text: str) -> list[tuple[str, str]]:
    return re.findall(r"^```(\w+)\n(.*?)^```", text, re.S | re.M)


def commands(body: str) -> list[str]:
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()  # the README's prompts hold no '#'
        if line and not line.startswith("#") and not line.startswith(SKIP_PREFIXES):
            out.append(line)
    return out


def fewer_steps(cmd: str) -> str:
    return cmd.replace("--steps 20", "--steps 4").replace('"steps": 20', '"steps": 4')


def _video(path: Path) -> tuple[int, int, int]:
    import av

    with av.open(str(path)) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    return len(frames), frames[0].shape[0], frames[0].shape[1]


def _image(path: Path) -> Any:
    from omniloop_io.media import read_image

    return read_image(str(path)).numpy()


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("newcomer")
    (d / "examples").symlink_to(REPO / "examples")
    return d


def run_cli(args: list[str], cwd: Path) -> Any:
    from click.testing import CliRunner

    from omniloop_cli import cli

    before = Path.cwd()
    os.chdir(cwd)
    try:
        return CliRunner().invoke(cli, args)
    finally:
        os.chdir(before)


def check(cmd: str, res: Any, cwd: Path) -> None:
    """What each README command must produce (exit code and output checked for sanity)."""
    assert res.exit_code == 0, f"{cmd}\n{res.output}"
    args = shlex.split(cmd)[1:]
    if args[0] == "models":
        assert "wan-demo" in res.stdout and "flux-demo" in res.stdout
    elif args[0] == "plugins":
        assert "wan-demo" in res.stdout and "ok" in res.stdout
    elif args[0] == "generate" and "--json" in args:
        doc = json.loads(res.stdout)
        assert doc["status"] == "completed" and Path(cwd / doc["output_path"]).is_file()
        if "cache-dit" in cmd:
            ratios = [m["cache_ratio"] for m in doc["metrics"]["plugins"]["cache-dit"].values()]
            assert min(ratios) > 0.2, ratios  # the README's example caches
    elif args[0] == "generate" and "--out" in args:
        out = cwd / args[args.index("--out") + 1]
        assert out.is_file(), cmd
        img = _image(out)
        assert img.ndim == 3 and img.shape[2] == 3 and img.std() > 0, cmd
        if "flux-demo" in args:
            assert img.shape[:2] == (64, 64)
    elif args[0] == "generate" and "--max-tokens" in args:  # a text model: the text on stdout
        assert res.stdout.strip() and "completed" in res.stderr
    elif args[0] == "generate":  # a video to out/<request_id>.mp4, named on stderr
        m = re.search(r"wrote (\S+\.mp4)", res.output)
        assert m, res.output
        assert _video(cwd / m.group(1)) == (17, 64, 64)
    else:
        raise AssertionError(f"the walkthrough has no check for README command: {cmd}")


def test_readme_walkthrough(home: Path) -> None:
    text = README.read_text(encoding="utf-8")
    ran: list[str] = []
    for lang, body in blocks(text):
        if lang == "bash":
            for cmd in commands(body):
                cmd = fewer_steps(cmd)
                if cmd.startswith("omniloop "):
                    check(cmd, run_cli(shlex.split(cmd)[1:], home), home)
                elif cmd.startswith("python "):
                    env = {**os.environ, "OMP_NUM_THREADS": "1"}
                    res = subprocess.run([sys.executable, *shlex.split(cmd)[1:]], cwd=home, env=env,
                                         capture_output=True, text=True, timeout=600)
                    assert res.returncode == 0, f"{cmd}\n{res.stdout[-2000:]}{res.stderr[-2000:]}"
                else:
                    raise AssertionError(f"the walkthrough does not know how to run README command: {cmd}")
                ran.append(cmd)
        elif lang == "text":
            lines = body.strip().splitlines()
            if not lines or not lines[0].startswith("$ omniloop "):
                continue
            res = run_cli(shlex.split(lines[0][2:])[1:], home)
            assert res.exit_code == 2, res.output
            assert res.stderr.strip() == "\n".join(lines[1:]).strip(), res.stderr  # exactly what the README shows
            ran.append(lines[0])
        elif lang == "python":
            before = Path.cwd()
            os.chdir(home)
            try:
                exec(compile(fewer_steps(body), "README.md", "exec"), {"__name__": "readme"})
            finally:
                os.chdir(before)
            assert _video(home / "square.mp4") == (17, 64, 64)
            ran.append("python snippet")
        elif lang == "yaml":
            import yaml

            assert yaml.safe_load(body) == yaml.safe_load((REPO / "examples/deploys/wan-demo.yaml").read_text())
            ran.append("yaml snippet")
    # the tour covered what a newcomer is told to try
    joined = "\n".join(ran)
    for must in ("omniloop models", "--model wan-demo", "cache-dit", "--model flux-demo", "--strength",
                 "omniloop_qwen.tiny", "make_demo_lora.py", "--adapter", "python snippet", "yaml snippet", "$ omniloop"):
        assert must in joined, must
