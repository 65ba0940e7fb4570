"""Issue 43, finding 8: a script that builds a ``parallel:`` runtime at its top level (no
``if __name__ == "__main__":``) makes every spawned worker re-run it; the error now says what to do
instead of only "worker rank 0 died while loading the model"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .conftest import MANAGER

SCRIPT = """
from omniloop_parallel import ParallelRuntime

pool = ParallelRuntime({{"model": {{"path": {ckpt!r}}}, "parallel": {{"cfg": 2}}}}, manager={manager!r},
                       timeout_s=10, load_timeout_s=120)
pool.close()
"""


def test_a_script_without_a_main_guard_is_told_to_add_one(wan_ckpt: Path, tmp_path: Path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT.format(ckpt=str(wan_ckpt), manager=MANAGER))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "died" in last and 'if __name__ == "__main__":' in last, proc.stderr[-2000:]
