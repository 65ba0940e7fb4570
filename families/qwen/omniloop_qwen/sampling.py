"""Choosing the next token: greedy at temperature 0, otherwise seeded temperature / top-k / top-p.

Each request draws from its own ``torch.Generator``, so a request's tokens do not depend on what
else ran in its batch (up to the logits themselves).
"""

from __future__ import annotations

import torch
from attrs import define


@define(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def next_token(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None) -> int:
    """The next token from float32 logits ``[vocab]``."""
    if s.greedy:
        return int(torch.argmax(logits).item())
    x = logits.float().cpu() / s.temperature
    if 0 < s.top_k < x.numel():
        kth = torch.topk(x, s.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
        drop = before >= s.top_p  # keeps the smallest prefix reaching top_p (at least one token)
        x = x.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
