"""The same frames always encode to the same mp4 bytes (one encoder thread)."""

import hashlib

import pytest
import torch

av = pytest.importorskip("av")


def test_mp4_bytes_are_reproducible(tmp_path):
    from omniloop_io.media import write_mp4

    g = torch.Generator().manual_seed(0)
    frames = torch.randint(0, 255, (9, 48, 48, 3), dtype=torch.uint8, generator=g)
    digests = set()
    for i in range(3):
        p = tmp_path / f"{i}.mp4"
        write_mp4(frames, 16, p)
        digests.add(hashlib.sha256(p.read_bytes()).hexdigest())
    assert len(digests) == 1
