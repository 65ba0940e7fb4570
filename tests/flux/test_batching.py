"""Batched denoise steps across requests through the ``step`` scheduler.

Two (or three) same-shape image requests with different prompts, seeds and guidance run their
steps as one stacked transformer forward (``Denoise.batch_key`` / ``step_batch``); each keeps its
own scheduler instance, guidance value and generator.

Tolerance: batched results equal each request run alone within ``BATCHED_ATOL`` on the final
latents and one uint8 level on the image. Measured (tiny fp32 checkpoints, CPU, 1 thread):
max |Δ| latents 4.8e-7 (dev, 2 requests) and 2.4e-7 (schnell, 3), images identical. Not bit-exact: stacking changes the row count of every GEMM and
the batch of every attention call, and the CPU kernels block (and so round) differently for
different shapes; each request's own rows are otherwise what it computes alone (Flux pads every
prompt to ``max_sequence_length`` tokens, so no padding is added).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from omniloop.request import Status

BATCHED_ATOL = 2e-5
PROMPTS = ["a red fox jumps over the lazy dog", "a blue bird flies over the sea", "the cat sits in the snow"]


def _requests(make, n, variant_guidance=True):
    out = []
    for i in range(n):
        r = make(seed=i + 1, steps=4, prompt=PROMPTS[i])
        if variant_guidance:
            r["diffusion"]["guidance_scale"] = 2.0 + i
        out.append(r)
    return out


def _close(batched, alone):
    for o, a in zip(batched, alone, strict=True):
        assert o.status is Status.COMPLETED, o.error
        torch.testing.assert_close(o.artifacts["latents"].tensor, a.artifacts["latents"].tensor, atol=BATCHED_ATOL, rtol=0)
        diff = (o.artifacts["image"].frames.int() - a.artifacts["image"].frames.int()).abs().max().item()
        assert diff <= 1


@pytest.mark.parametrize("variant, n", [("dev", 2), ("schnell", 3)])
def test_step_scheduler_batches_same_shape_requests(flux_runtime, make_t2i, variant, n):
    alone = [flux_runtime(variant).generate(r) for r in _requests(make_t2i, n)]
    rt = flux_runtime(variant, scheduler="step")
    streams = [rt.stream(r) for r in _requests(make_t2i, n)]
    outs = [[e for e in s if e.output is not None][-1].output for s in streams]
    _close(outs, alone)
    sizes = [len(d.request_ids) for d in rt.scheduler.trace if d.action == "batched_step"]
    assert sizes and max(sizes) == n  # every request's step in one forward
    assert any(not torch.equal(a.artifacts["latents"].tensor, b.artifacts["latents"].tensor)
               for a, b in itertools.pairwise(alone))  # the requests really differ


def test_i2i_requests_batch_too(flux_runtime, make_i2i, input_png):
    reqs = [make_i2i(input_png, seed=s, steps=5) for s in (1, 2)]
    alone = [flux_runtime("dev").generate(r) for r in reqs]
    rt = flux_runtime("dev", scheduler="step")
    streams = [rt.stream(r) for r in reqs]
    outs = [[e for e in s if e.output is not None][-1].output for s in streams]
    _close(outs, alone)
    assert any(d.action == "batched_step" for d in rt.scheduler.trace)


def test_different_sizes_do_not_batch(flux_runtime, make_t2i):
    rt = flux_runtime("dev", scheduler="step")
    reqs = [make_t2i(seed=1, steps=3), make_t2i(seed=2, steps=3, height=48)]
    streams = [rt.stream(r) for r in reqs]
    outs = [[e for e in s if e.output is not None][-1].output for s in streams]
    assert all(o.status is Status.COMPLETED for o in outs)
    assert not any(d.action == "batched_step" for d in rt.scheduler.trace)


def test_a_request_whose_row_raises_fails_alone_in_a_batched_step(flux_runtime, make_t2i):
    """Issue 43, finding 3 (exceptions): FLUX declares ``step_batch_retry_alone`` for its denoise
    loop: the poison (its row breaks every forward it is in) fails with its error, its three
    batch-mates complete as they do alone (a raising batched forward is re-run one request at a time)."""
    from omniloop.testing.conformance import check_row_raises_alone
    from omniloop_flux.denoise import Denoise

    rt = flux_runtime("dev")
    normal = _requests(make_t2i, 3, variant_guidance=False)
    poison = make_t2i(seed=99, steps=4, prompt="a poisoned prompt")
    outs, alone = check_row_raises_alone(rt, normal, poison, Denoise, "context")
    _close(outs, alone)
