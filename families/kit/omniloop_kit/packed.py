"""Packed sequences: one token sequence holding several modalities, as a mixture-of-transformers
(MoT) model runs them — a typed layout a family declares instead of index lists of its own.

The shape (Cosmos 3 omni is the first family on it; a second MoT family — a BAGEL- or
Transfusion-style model — declares the same)::

    position  0 ............ und_len ...................................... length
              [ text (und) ][ vision (gen) ][ sound (gen) ][ action (gen) ]
               causal over    full attention over every und and gen token
               und only       (the generation pathway's queries)

* a :class:`Segment` is one modality's contiguous run of tokens: its ``modality`` (``text``,
  ``vision``, ``sound``, ``action``, or a family's own), its ``pathway`` (:data:`UND`: the
  understanding pathway, causal self-attention among und tokens; :data:`GEN`: the generation
  pathway, full attention over und + gen keys), its ``start`` and token ``grid`` ``(T, H, W)``
  (text and 1-D streams ``(L, 1, 1)``), the ``noisy`` frames along ``T`` (the ones denoised; the
  rest are clean conditioning) and, for an action stream, its embodiment ``domain``;
* a :class:`PackedLayout` is the ordered segments — every und segment before every gen segment
  (what lets the und pathway be computed once: it never sees a gen token) — plus the sequence's
  position ids (``[3, length]`` for 3-D mRoPE, or ``[length]``), with the derived indexes a
  forward reads: ``und_len``, a segment's ``sequence_indexes`` and ``noisy_indexes`` (where its
  predictions are read), and the same relative to the gen pathway (``gen_*``).

:data:`ATTENTION` states the attention pattern in words (docs, ``describe``). The layout is
built once per request and per CFG branch (the branches' text lengths differ); only the
modality tokens and their timesteps change per step. Families declare their layout with
:func:`pack` and read it; nothing here knows a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from attrs import define, field

#: the understanding pathway (causal over its own tokens) and the generation pathway
UND, GEN = "und", "gen"
#: the attention pattern of a packed MoT sequence
ATTENTION = {UND: "causal self-attention over the und tokens (a text prefix); never sees a gen token",
             GEN: "full attention: gen queries over every und and gen key/value"}


def _grid(v: Sequence[int]) -> tuple[int, int, int]:
    t = tuple(int(x) for x in v)
    if len(t) != 3 or min(t) < 1:
        raise ValueError(f"Segment.grid: three positive sizes (T, H, W), got {v!r}")
    return t  # type: ignore[return-value]


@define(frozen=True)
class Segment:
    """One modality's contiguous tokens in a packed sequence (see the module docstring)."""

    modality: str
    pathway: str = field(validator=lambda _i, _a, v: _pathway(v))
    start: int
    grid: tuple[int, int, int] = field(converter=_grid)
    noisy: tuple[int, ...] = field(default=(), converter=lambda v: tuple(int(x) for x in v))
    domain: str | None = None

    @property
    def frame_tokens(self) -> int:
        return self.grid[1] * self.grid[2]

    @property
    def length(self) -> int:
        return self.grid[0] * self.frame_tokens

    @property
    def end(self) -> int:
        return self.start + self.length

    def sequence_indexes(self, device: Any = None) -> torch.Tensor:
        return torch.arange(self.start, self.end, dtype=torch.long, device=device)

    def noisy_indexes(self, device: Any = None) -> torch.Tensor:
        """Sequence positions of the noisy frames' tokens, frame by frame (where predictions are read)."""
        n = self.frame_tokens
        out = [i for f in self.noisy for i in range(self.start + f * n, self.start + (f + 1) * n)]
        return torch.tensor(out, dtype=torch.long, device=device)

    def noisy_frames(self, device: Any = None) -> torch.Tensor:
        return torch.tensor(self.noisy, dtype=torch.long, device=device)


def _pathway(v: str) -> None:
    if v not in (UND, GEN):
        raise ValueError(f"Segment.pathway: {UND!r} or {GEN!r}, got {v!r}")


@define(frozen=True)
class PackedLayout:
    """Segments in sequence order (und before gen, contiguous) and the position ids."""

    segments: tuple[Segment, ...] = field(converter=tuple)
    position_ids: torch.Tensor

    def __attrs_post_init__(self) -> None:
        at, seen_gen = 0, False
        for s in self.segments:
            if s.start != at:
                raise ValueError(f"PackedLayout: segment {s.modality!r} starts at {s.start}, expected {at} (contiguous)")
            if s.pathway == UND and seen_gen:
                raise ValueError(f"PackedLayout: und segment {s.modality!r} after a gen segment")
            seen_gen |= s.pathway == GEN
            at = s.end
        if self.position_ids.shape[-1] != at:
            raise ValueError(f"PackedLayout: {self.position_ids.shape[-1]} position ids for {at} tokens")

    @property
    def length(self) -> int:
        return self.segments[-1].end if self.segments else 0

    @property
    def und_len(self) -> int:
        return sum(s.length for s in self.segments if s.pathway == UND)

    @property
    def gen_len(self) -> int:
        return self.length - self.und_len

    def get(self, modality: str) -> Segment | None:
        return next((s for s in self.segments if s.modality == modality), None)

    def __getitem__(self, modality: str) -> Segment:
        seg = self.get(modality)
        if seg is None:
            raise KeyError(f"the packed layout has no {modality!r} segment")
        return seg

    def gen_indexes(self, modality: str, *, noisy: bool = False, device: Any = None) -> torch.Tensor:
        """A gen segment's (noisy) positions relative to the gen pathway's first token."""
        seg = self[modality]
        idx = seg.noisy_indexes(device) if noisy else seg.sequence_indexes(device)
        return idx - self.und_len

    def describe(self) -> dict[str, Any]:
        """JSON-safe: each segment's modality, pathway, span, grid, noisy frames and domain."""
        return {"length": self.length, "und_len": self.und_len, "attention": dict(ATTENTION),
                "segments": [{"modality": s.modality, "pathway": s.pathway, "start": s.start, "length": s.length,
                              "grid": list(s.grid), "noisy": list(s.noisy), "domain": s.domain}
                             for s in self.segments]}


def pack(parts: Sequence[tuple[str, str, Sequence[int], Sequence[int], str | None]],
         positions: Sequence[torch.Tensor]) -> PackedLayout:
    """A layout from ``(modality, pathway, grid, noisy, domain)`` parts in order and each part's
    position ids (concatenated along the last axis)."""
    segs, at = [], 0
    for modality, pathway, grid, noisy, domain in parts:
        seg = Segment(modality=modality, pathway=pathway, start=at, grid=tuple(grid), noisy=tuple(noisy),
                      domain=domain)
        segs.append(seg)
        at = seg.end
    return PackedLayout(segments=tuple(segs), position_ids=torch.cat(list(positions), dim=-1))


__all__ = ["ATTENTION", "GEN", "UND", "PackedLayout", "Segment", "pack"]
