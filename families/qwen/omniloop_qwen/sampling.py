"""Choosing the next token: greedy at temperature 0, otherwise seeded temperature / top-k / top-p.

Each request draws from its own ``torch.Generator``, so a request's tokens do not depend on what
else ran in its batch (up to the logits themselves).

The kernels' rule for tiny knobs (one request's knobs must never produce NaN in a shared batch):
a ``temperature`` below :data:`MIN_TEMPERATURE` means greedy (``logits / 1e-30`` overflows to
inf, and softmax of inf is NaN), and a ``top_p`` below :data:`MIN_TOP_P` means the single most
likely token — also greedy. At or above the floors the float32 scaling stays finite. A row whose logits are not finite fails its own request
(:class:`NonFiniteLogits`), never the batch.
"""

from __future__ import annotations

import torch
from attrs import define

#: below this a temperature means greedy (the argmax): the distribution is a point mass anyway
MIN_TEMPERATURE = 1e-4
#: below this a top_p keeps only the most likely token: greedy
MIN_TOP_P = 1e-6


class NonFiniteLogits(FloatingPointError):
    """The model's logits for one sequence hold NaN/inf: that request fails, its batch-mates go on."""


@define(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_p < MIN_TOP_P


def next_token(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None) -> int:
    """The next token from float32 logits ``[vocab]``; raises :class:`NonFiniteLogits` for a row
    that is not finite (the caller fails that request alone)."""
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteLogits("the model produced non-finite logits (NaN/inf) for this sequence")
    if s.greedy:
        return int(torch.argmax(logits).item())
    x = logits.float().cpu() / s.temperature
    if not bool(torch.isfinite(x).all()):  # unreachable above the floor; never sample from inf
        return int(torch.argmax(logits).item())
    if 0 < s.top_k < x.numel():
        kth = torch.topk(x, s.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
        drop = before >= s.top_p  # keeps the smallest prefix reaching top_p (at least one token)
        drop[0] = False
        x = x.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
