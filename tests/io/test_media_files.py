"""Media files: leftovers of killed writes are cleaned, images by suffix (issue 14)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from omniloop_io import media

pytest.importorskip("av")


def frames(t: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (t, 16, 16, 3), dtype=torch.uint8, generator=g)


def _age(p: Path, seconds: float) -> None:
    past = time.time() - seconds
    os.utime(p, (past, past))


def test_stale_temp_files_of_our_naming_are_removed_on_the_next_write(tmp_path: Path) -> None:
    stale = tmp_path / ".x.mp4.0123456789ab.tmp.mp4"
    fresh = tmp_path / ".y.mp4.ba9876543210.tmp.mp4"  # another writer's, in progress
    stale_png = tmp_path / ".p.png.00000000000a.tmp.png"
    lookalikes = [
        tmp_path / ".x.mp4.0123456789AB.tmp.mp4",  # not our hex
        tmp_path / ".x.mp4.0123456789a.tmp.mp4",  # 11 digits
        tmp_path / "x.mp4.0123456789ab.tmp.mp4",  # not hidden
        tmp_path / ".x.mp4.0123456789ab.tmp.mov",  # not our suffix
        tmp_path / "clip.mp4",
    ]
    for p in (stale, fresh, stale_png, *lookalikes):
        p.write_bytes(b"partial")
    for p in (stale, stale_png, *lookalikes):
        _age(p, 2 * media.STALE_TEMP_SECONDS)
    folder = tmp_path / ".z.mp4.0123456789ab.tmp.mp4.d"
    folder.mkdir()
    link = tmp_path / ".l.mp4.0123456789ab.tmp.mp4"
    link.symlink_to(tmp_path / "clip.mp4")

    media.write_mp4(frames(), 8.0, tmp_path / "new.mp4")

    assert not stale.exists() and not stale_png.exists()
    assert fresh.exists() and folder.exists() and link.is_symlink()
    assert all(p.exists() for p in lookalikes)
    assert (tmp_path / "new.mp4").stat().st_size > 0


def test_a_killed_write_leaves_a_temp_file_that_a_later_write_cleans(tmp_path: Path) -> None:
    """SIGKILL a real process in the middle of an mp4 write, then write again."""
    script = (
        "import sys, torch; from omniloop_io import media\n"
        "import av\n"
        "orig, calls = av.VideoFrame.from_ndarray, []\n"
        "def slow(*a, **k):\n"  # past x264's look-ahead, packets (and the file) exist: stop there
        "    calls.append(1)\n"
        "    if len(calls) == 60:\n"
        "        print('writing', flush=True); import time; time.sleep(60)\n"
        "    return orig(*a, **k)\n"
        "av.VideoFrame.from_ndarray = slow\n"
        "media.write_mp4(torch.zeros(80, 16, 16, 3, dtype=torch.uint8), 8.0, sys.argv[1])\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "x.mp4")], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".x.mp4.")]
    assert len(left) == 1 and left[0].name.endswith(".tmp.mp4")
    assert not (tmp_path / "x.mp4").exists()

    media.write_mp4(frames(), 8.0, tmp_path / "x.mp4")
    assert left[0].exists(), "a young temp file may be another writer's: kept"
    _age(left[0], media.STALE_TEMP_SECONDS + 60)
    media.write_mp4(frames(), 8.0, tmp_path / "x.mp4")
    assert not left[0].exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.mp4"]


@pytest.mark.parametrize("suffix, fmt", [(".png", "PNG"), (".webp", "WEBP"), (".WEBP", "WEBP")])
def test_write_image_by_suffix_is_lossless(tmp_path: Path, suffix: str, fmt: str) -> None:
    import numpy as np
    from PIL import Image

    pixels = frames(1)[0]
    out = media.write_image(pixels, tmp_path / f"a{suffix}")
    with Image.open(out) as img:
        assert img.format == fmt
        assert torch.equal(torch.from_numpy(np.asarray(img.convert("RGB")).copy()), pixels)
    assert [p.name for p in tmp_path.iterdir()] == [f"a{suffix}"]


def test_write_image_refuses_other_suffixes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unsupported image type"):
        media.write_image(frames(1)[0], tmp_path / "a.gif")
