"""Batched denoise steps (and decodes) across requests through the ``step`` scheduler.

Three requests — different prompts, seeds, negative prompt or none, different guidance scales and
different windows (``audio.seconds`` only conditions and cuts: every request denoises the
checkpoint's whole latent window, so they batch) — are streamed side by side; the step scheduler
co-batches their denoise steps into one DiT forward (uncond rows of all, then cond rows), each
request combines its own CFG and steps its own scheduler, whose Brownian tree is its own.

Tolerance: batched results equal each request run alone within ``BATCHED_ATOL`` on the final
latents (latents here are O(1); the initial noise is O(500)). Measured (tiny stereo checkpoint,
CPU, 1 thread, 4 steps all batched): max |Δ| latents 2.0e-6, 2.7e-6, 9.5e-7; waveforms 8.3e-7. Not bit-exact: stacking changes the
row count of every GEMM, and CPU kernels round differently for other shapes (tests/stable_audio/
test_parity.py shows that the samples of one group batched together equal diffusers' batch exactly).
"""

from __future__ import annotations

import pytest
import torch

from omniloop.testing import check_streamed_together, completed_latents

BATCHED_ATOL = 2e-5


@pytest.mark.slow
def test_batched_steps_equal_each_request_alone(runtime, t2a):
    reqs = [
        {**t2a(seed=11, steps=4, negative="noise", audio={"seconds": 0.2}), "request_id": "one"},
        {**t2a(seed=12, steps=4, prompt="a sine tone", audio={"start": 0.05, "seconds": 0.1}), "request_id": "two"},
        {**t2a(seed=13, steps=4, prompt="a drum", guidance_scale=3.0), "request_id": "three"},
    ]
    for out, a in check_streamed_together(runtime("stereo"), runtime("stereo", step=True), reqs, min_batched=4):
        torch.testing.assert_close(completed_latents(out), completed_latents(a), atol=BATCHED_ATOL, rtol=0)
        assert out.artifacts["audio"].samples.shape == a.artifacts["audio"].samples.shape
        torch.testing.assert_close(out.artifacts["audio"].samples, a.artifacts["audio"].samples, atol=1e-4, rtol=0)


def test_cfg_on_and_off_do_not_batch_together(runtime, t2a):
    rt = runtime("stereo", step=True)
    reqs = [{**t2a(seed=1, steps=2), "request_id": "cfg"}, {**t2a(seed=2, steps=2, guidance_scale=1.0), "request_id": "plain"}]
    streams = [rt.stream(r) for r in reqs]
    for st in streams:
        for _ in st:
            pass
    mixed = [d for d in rt.scheduler.trace if d.action == "batched_step" and set(d.request_ids) == {"cfg", "plain"}]
    # the decode (same latent shape) batches; no denoise step does (different row counts)
    assert len(mixed) <= 1


def test_a_request_whose_row_raises_fails_alone_in_a_batched_step(runtime, t2a):
    """The family declares ``step_batch_retry_alone`` for ``denoise`` (and ``vae_decode``): the
    poison (its row breaks every forward it is in) fails with its error, its batch-mates complete
    as they do alone (the raising batched forward is re-run one request at a time)."""
    from omniloop.testing import check_fails_alone, forward_rows
    from omniloop_stable_audio.denoise import Denoise

    rt = runtime("stereo")
    assert rt.family.capabilities.step_batch_retry_alone == {"denoise", "vae_decode"}
    normal = [{**t2a(seed=11 + i, steps=3, prompt=p), "request_id": f"n{i}"} for i, p in enumerate(["a drum", "a sine"])]
    poison = {**t2a(seed=99, steps=3, prompt="a saw wave"), "request_id": "poison"}
    with forward_rows(Denoise, "encoder_hidden_states") as rows:
        rt.generate(poison)
    # its cond row (row 0, the zero uncond row, is every request's)
    check_fails_alone(rt, Denoise, "encoder_hidden_states", rows[1:2], normal, poison, BATCHED_ATOL)
