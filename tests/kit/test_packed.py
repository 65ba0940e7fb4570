"""omniloop_kit.packed: a packed MoT sequence's typed layout (segments, pathways, indexes)."""

from __future__ import annotations

import pytest
import torch

from omniloop_kit.packed import GEN, UND, PackedLayout, Segment, pack


def _layout() -> PackedLayout:
    text = torch.arange(5).expand(3, -1)
    vision = torch.zeros(3, 2 * 2 * 3, dtype=torch.long)
    sound = torch.zeros(3, 4, dtype=torch.long)
    return pack([("text", UND, (5, 1, 1), (), None), ("vision", GEN, (2, 2, 3), (1,), None),
                 ("sound", GEN, (4, 1, 1), range(4), None)], [text, vision, sound])


def test_indexes_of_a_packed_layout():
    lay = _layout()
    assert (lay.length, lay.und_len, lay.gen_len) == (5 + 12 + 4, 5, 16)
    v = lay["vision"]
    assert (v.start, v.end, v.frame_tokens) == (5, 17, 6)
    assert v.noisy_indexes().tolist() == list(range(11, 17))  # the second frame only
    assert lay.gen_indexes("vision").tolist() == list(range(0, 12))
    assert lay.gen_indexes("vision", noisy=True).tolist() == list(range(6, 12))
    assert lay.gen_indexes("sound").tolist() == list(range(12, 16))
    assert lay.get("action") is None
    d = lay.describe()
    assert [s["modality"] for s in d["segments"]] == ["text", "vision", "sound"] and d["und_len"] == 5


def test_layout_rules():
    pos = torch.zeros(3, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="after a gen segment"):
        pack([("vision", GEN, (1, 1, 2), (0,), None), ("text", UND, (1, 1, 1), (), None)], [pos])
    with pytest.raises(ValueError, match="position ids"):
        pack([("text", UND, (4, 1, 1), (), None)], [pos])
    with pytest.raises(ValueError, match="contiguous"):
        PackedLayout(segments=(Segment(modality="text", pathway=UND, start=1, grid=(2, 1, 1)),), position_ids=pos)
    with pytest.raises(ValueError, match="pathway"):
        Segment(modality="text", pathway="both", start=0, grid=(2, 1, 1))
    with pytest.raises(ValueError, match="grid"):
        Segment(modality="text", pathway=UND, start=0, grid=(2, 0, 1))
    with pytest.raises(KeyError, match="action"):
        _layout()["action"]
