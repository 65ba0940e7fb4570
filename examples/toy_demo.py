"""Run ``omniloop generate`` on the core's toy family (what ``make demo`` does until wan-demo lands).

The toy family (``omniloop.testing.toy``) is deliberately not an installed entry point, so this
script builds a toy checkpoint and runs the real CLI over the installed plugins *plus* the toy
family added in-process — the same ``cli.main(obj=manager)`` seam the CLI tests use::

    python examples/toy_demo.py "a blue square moving right" --out out/demo.mp4 [generate flags...]
"""

from __future__ import annotations

import sys
from pathlib import Path

from omniloop.plugins import PluginManager
from omniloop.testing import build_toy_checkpoint
from omniloop.testing.toy import ToyPlugin
from omniloop_cli import main


def run(argv: list[str]) -> None:
    ckpt = Path("out") / "toy-checkpoint"
    if not (ckpt / "toy.pt").is_file():
        build_toy_checkpoint(ckpt)
    manager = PluginManager()  # the installed plugins, discovered as usual ...
    manager.add("toy", ToyPlugin())  # ... plus the toy family
    defaults = ["--steps", "8", "--frames", "16", "--height", "64", "--width", "64", "--seed", "0"]
    main(["generate", *argv[:1], "--model", str(ckpt), *defaults, *argv[1:]], obj=manager)


if __name__ == "__main__":
    run(sys.argv[1:])
