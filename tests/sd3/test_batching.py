"""Batched denoise steps across requests through the ``step`` scheduler.

Two same-shape t2i requests (different prompts, negative prompts and seeds) are streamed side by
side; the step scheduler co-batches their denoise steps (``Denoise.batch_key`` equal) into one
transformer forward of four rows (uncond/cond of each), then each request combines its own CFG and
steps its own scheduler instance.

Tolerance: batched results equal each request run alone within ``BATCHED_ATOL`` on the final
latents and one uint8 level on the image. Measured (tiny fp32 checkpoint, CPU, 1 thread, 4 steps,
3 of them batched): max |Δ| latents 3.2e-6 and 2.2e-6, images within one level. Not guaranteed bit-exact:
stacking changes the row count of every GEMM and the batch of every attention call, and CPU
kernels may block (and so round) differently for different shapes; each request's rows are
otherwise exactly what it computes alone (SD3 pads every prompt to a fixed length).
"""

from __future__ import annotations

from typing import Any

import torch

from omniloop.request import Status
from omniloop.runtime import Runtime
from omniloop.testing import completed_latents, make_manager

BATCHED_ATOL = 2e-5


def _step_runtime(ckpt: Any) -> Runtime:
    import omniloop_scheduler.plugin as scheduler_plugin
    import omniloop_sd3.plugin as sd3_plugin

    manager = make_manager(("sd3", sd3_plugin), ("scheduler", scheduler_plugin), toy=False, scheduler=False)
    return Runtime.from_model(ckpt, manager=manager, scheduler="step", scheduler_options={"max_batch": 4})


def test_batched_steps_equal_each_request_alone(tiny_ckpt, sd3_runtime, t2i_request):
    reqs = [
        {**t2i_request(seed=11, steps=4, prompt="a red fox", negative="blurry"), "request_id": "one"},
        {**t2i_request(seed=12, steps=4, prompt="a blue bird flies over the sea", negative=None), "request_id": "two"},
    ]
    serial = sd3_runtime()
    alone = [serial.generate(r) for r in reqs]
    rt = _step_runtime(tiny_ckpt())
    streams = [rt.stream(r) for r in reqs]
    finals = {}
    for ev in streams[1]:  # driving one stream advances the other too (one shared pool)
        if ev.kind.value == "final":
            finals["two"] = ev.output
    for ev in streams[0]:
        if ev.kind.value == "final":
            finals["one"] = ev.output
    batched = [d for d in rt.scheduler.trace if d.action == "batched_step" and len(d.request_ids) == 2]
    assert len(batched) >= 2, [(d.action, d.request_ids) for d in rt.scheduler.trace]
    for a, rid in zip(alone, ("one", "two"), strict=True):
        out = finals[rid]
        assert out.status is Status.COMPLETED, out.error
        torch.testing.assert_close(completed_latents(out), completed_latents(a), atol=BATCHED_ATOL, rtol=0)
        diff = (out.artifacts["image"].pixels.int() - a.artifacts["image"].pixels.int()).abs().max().item()
        assert diff <= 1


def test_batch_key_refuses_what_cannot_batch(sd3_runtime, t2i_request):
    rt = sd3_runtime()
    keys = []
    for r in (t2i_request(seed=1), t2i_request(seed=2, prompt="a cat"), t2i_request(seed=3, height=48),
              {**t2i_request(seed=4), "exact": True}, t2i_request(seed=5, guidance_scale=3.0)):
        ex = rt.prepare(r)
        while ex.batch_key() is None and not ex.done and ex.current_node != "denoise":
            ex.advance()
        ex.advance()  # the first denoise step; the next step is batchable too
        keys.append(ex.batch_key())
    assert keys[0] is not None and keys[0] == keys[1]  # other prompt and seed: same key
    assert keys[2] != keys[0]  # another size
    assert keys[3] is None  # exact requests never batch
    assert keys[4] != keys[0]  # another guidance scale


def test_a_request_whose_row_raises_fails_alone_in_a_batched_step(sd3_runtime, t2i_request):
    """Issue 43, finding 3 (exceptions): SD3 declares ``step_batch_retry_alone`` for its denoise
    loop: the poison (its row breaks every forward it is in) fails with its error, its three
    batch-mates complete as they do alone (a raising batched forward is re-run one request at a time)."""
    from omniloop.testing.conformance import check_row_raises_alone
    from omniloop_sd3.denoise import Denoise

    rt = sd3_runtime()
    normal = [{**t2i_request(seed=11 + i, steps=4, prompt=p), "request_id": f"n{i}"}
              for i, p in enumerate(["a red fox", "a blue bird flies over the sea", "the cat sits"])]
    poison = {**t2i_request(seed=99, steps=4, prompt="a poisoned prompt"), "request_id": "poison"}
    outs, alone = check_row_raises_alone(rt, normal, poison, Denoise, "encoder_hidden_states")
    for o, a in zip(outs, alone, strict=True):
        assert o.metrics["policies"] == a.metrics["policies"]
