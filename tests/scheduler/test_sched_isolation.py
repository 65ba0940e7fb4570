"""One request must never hurt another in a batched diffusion step (issue 43, finding 3): a poison
request whose row turns NaN inside a batch of nine fails alone with a clear error, and the eight
others complete exactly as they do without it (and as each does alone)."""

from __future__ import annotations

from typing import Any

import torch

from omniloop.request import Status
from omniloop_scheduler.testing import make_runtime, req


def _final(stream):
    return [e for e in stream if e.output is not None][-1].output


def _normal(i: int) -> dict[str, Any]:
    return req(6, seed=10 + i, prompt=f"a red fox number {i}", rid=f"normal-{i}")


def _poison_transformer(rt: Any, poison_texts: list[torch.Tensor]) -> None:
    """The transformer's output rows for the poison prompt's embeddings turn NaN."""
    tr = rt.model.components["transformer"]
    real = tr.forward

    def forward(lat, t, text, *a, **k):
        out = real(lat, t, text, *a, **k)
        for j in range(text.shape[0]):
            if any(torch.equal(text[j], p) for p in poison_texts):
                out = out.clone()
                out[j] = float("nan")
        return out

    tr.forward = forward


def _texts_of(rt: Any, request: dict[str, Any]) -> list[torch.Tensor]:
    tr = rt.model.components["transformer"]
    real, seen = tr.forward, []

    def spy(lat, t, text, *a, **k):
        seen.extend(text[j].clone() for j in range(text.shape[0]))
        return real(lat, t, text, *a, **k)

    tr.forward = spy
    try:
        assert rt.generate(request).ok
    finally:
        del tr.forward
    return seen


def test_a_nan_row_fails_its_request_alone_in_a_batched_step(sched_checkpoint: Any, runtime: Any) -> None:
    alone = [runtime.generate(_normal(i)).artifacts["video"].frames for i in range(8)]
    poison = req(6, seed=99, prompt="poison", rid="poison")
    shared = _texts_of(runtime, _normal(0))  # the unconditional branch's embedding is everyone's
    texts = [t for t in _texts_of(runtime, poison) if not any(torch.equal(t, u) for u in shared)]
    assert texts

    clean = make_runtime(sched_checkpoint, scheduler="step", scheduler_options={"max_batch": 16})
    clean_outs = [_final(s) for s in [clean.stream(_normal(i)) for i in range(8)]]
    assert all(o.ok for o in clean_outs)

    rt = make_runtime(sched_checkpoint, scheduler="step", scheduler_options={"max_batch": 16})
    _poison_transformer(rt, texts)
    streams = [rt.stream(_normal(i)) for i in range(4)] + [rt.stream(poison)] + [rt.stream(_normal(i)) for i in range(4, 8)]
    outs = [_final(s) for s in streams]
    bad = outs.pop(4)

    assert bad.status is Status.FAILED
    assert bad.error is not None and "non-finite" in bad.error.message and bad.error.type == "FloatingPointError"
    assert [o.status for o in outs] == [Status.COMPLETED] * 8, [o.error for o in outs]
    # batched with the poison (the nine shared forwards) ...
    assert any(d.action == "batched_step" and "poison" in d.request_ids and len(d.request_ids) == 9
               for d in rt.scheduler.trace)
    for o, c, a in zip(outs, clean_outs, alone, strict=True):
        # ... and still bit-identical to the same batch without it, and to each request alone
        assert torch.equal(o.artifacts["video"].frames, c.artifacts["video"].frames)
        torch.testing.assert_close(o.artifacts["video"].frames.float(), a.float(), atol=1.0, rtol=0)


def test_a_row_that_raises_in_a_batched_forward_fails_its_request_alone(sched_checkpoint: Any, runtime: Any) -> None:
    """The toy family declares ``step_batch_retry_alone``: when the batched forward raises (the
    poison's row makes the transformer raise), each request's step runs alone — the poison fails
    with the error, the eight others complete exactly as in the same batch without it."""
    poison = req(6, seed=99, prompt="poison", rid="poison-raise")
    shared = _texts_of(runtime, _normal(0))
    texts = [t for t in _texts_of(runtime, poison) if not any(torch.equal(t, u) for u in shared)]
    clean = make_runtime(sched_checkpoint, scheduler="step", scheduler_options={"max_batch": 16})
    clean_outs = [_final(s) for s in [clean.stream(_normal(i)) for i in range(8)]]

    rt = make_runtime(sched_checkpoint, scheduler="step", scheduler_options={"max_batch": 16})
    tr = rt.model.components["transformer"]
    real = tr.forward

    seen = [0]

    def forward(lat, t, text, *a, **k):  # from the poison's third step on, its row breaks any forward
        if any(torch.equal(text[j], p) for j in range(text.shape[0]) for p in texts):
            seen[0] += 1
            if seen[0] > 4:
                raise RuntimeError("injected: this row breaks the forward")
        return real(lat, t, text, *a, **k)

    tr.forward = forward
    streams = [rt.stream(_normal(i)) for i in range(4)] + [rt.stream(poison)] + [rt.stream(_normal(i)) for i in range(4, 8)]
    outs = [_final(s) for s in streams]
    bad = outs.pop(4)
    assert bad.status is Status.FAILED and "injected" in bad.error.message
    assert [o.status for o in outs] == [Status.COMPLETED] * 8, [o.error for o in outs]
    assert any(d.action == "batched_step" and "poison-raise" in d.request_ids for d in rt.scheduler.trace)
    for o, c in zip(outs, clean_outs, strict=True):
        assert torch.equal(o.artifacts["video"].frames, c.artifacts["video"].frames)
