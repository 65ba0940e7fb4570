"""omniloop_io.media.read_video: an mp4 decoded to uint8 [T, H, W, 3]; bad files one RequestError naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniloop.errors import RequestError
from omniloop_io.media import read_video, write_mp4


def test_read_video_round_trip(tmp_path):
    frames = torch.from_numpy(np.full((5, 16, 24, 3), 128, dtype=np.uint8))
    write_mp4(frames, 24.0, tmp_path / "a.mp4")
    got = read_video(tmp_path / "a.mp4")
    assert got.dtype == torch.uint8 and tuple(got.shape) == (5, 16, 24, 3)
    assert (got.int() - 128).abs().max() <= 2  # h264 is lossy
    assert read_video(tmp_path / "a.mp4", frame_cap=2).shape[0] == 2


def test_read_video_refusals(tmp_path):
    with pytest.raises(RequestError) as err:
        read_video(tmp_path / "missing.mp4", name="inputs[0].path")
    assert err.value.path == "inputs[0].path" and "does not exist" in err.value.message
    (tmp_path / "bad.mp4").write_bytes(b"not a video")
    with pytest.raises(RequestError, match="could not be decoded"):
        read_video(tmp_path / "bad.mp4")
