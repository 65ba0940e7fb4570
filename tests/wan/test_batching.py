"""Batched denoise steps across requests: ``Denoise.batch_key`` / ``Denoise.step_batch``.

Requests with different prompts and seeds but the same model, size, step, sampler and CFG policy
run their steps as one stacked forward; each keeps its own scheduler instance and CFG state.

Tolerance: batched results equal each request run alone within ``BATCHED_ATOL`` on the final
latents and one uint8 level on the frames. Measured (tiny fp32 checkpoints, CPU, 1 thread, four
requests, 6 steps, steps 1-5 batched): max |Δ| latents t2v 1.8e-6, wan22 2.6e-6, i2v 2.5e-6,
ti2v 2.9e-6 (classic CFG); frames differ by at most one level. Not bit-exact: stacking changes
the row count of every GEMM and the batch of every attention call, and the CPU kernels block
(and so round) differently for different shapes; each request's own rows are otherwise exactly
what it computes alone (Wan pads every prompt to 512 tokens, so no padding is added).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omniloop.request import Status
from omniloop.testing import advance_in_lockstep

from .test_policies import with_denoise

BATCHED_ATOL = 2e-5

PROMPTS = ["a red fox jumps over the lazy dog", "a blue bird flies over the sea", "the cat sits",
           "big horse runs in the snow at night"]


def requests(make: Any, n: int = 3, **diffusion: Any) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        r = make(seed=i + 1, **diffusion)
        r["inputs"][0]["text"] = PROMPTS[i % len(PROMPTS)]
        out.append(r)
    return out


def assert_close_to_alone(outs: list[Any], alone: list[Any]) -> None:
    for o, a in zip(outs, alone, strict=True):
        assert o.status is Status.COMPLETED, o.error
        torch.testing.assert_close(o.artifacts["latents"].tensor, a.artifacts["latents"].tensor,
                                   atol=BATCHED_ATOL, rtol=0)
        diff = (o.artifacts["video"].frames.int() - a.artifacts["video"].frames.int()).abs().max().item()
        assert diff <= 1


@pytest.mark.parametrize(
    "variant, cfg",
    [("t2v", "classic"), ("t2v", "batched"), ("wan22", "classic"), ("i2v", "classic"), ("ti2v", "batched"),
     ("t2v", "interval")],
)
def test_batched_steps_equal_each_request_alone(wan_runtime, t2v_request, i2v_request, variant, cfg):
    rt = wan_runtime(variant)
    make = i2v_request if variant == "i2v" else t2v_request
    size = {"height": 64, "width": 64} if variant == "ti2v" else {}
    params = {"cfg": cfg, **({"cfg_window": [0.0, 0.5]} if cfg == "interval" else {})}
    reqs = [with_denoise(r, **params) for r in requests(make, steps=4, **size)]
    alone = [rt.generate(r) for r in reqs]
    outs, batched = advance_in_lockstep(rt, reqs)
    assert batched == 4  # steps 0..3 (each loop is initialised at the end of the unit before it)
    assert_close_to_alone(outs, alone)
    for o, a in zip(outs, alone, strict=True):  # per-request policy state, not shared
        assert o.metrics["policies"] == a.metrics["policies"]
        assert o.metrics["experts"] == a.metrics["experts"]


def test_different_negative_prompts_batch_too(wan_runtime, t2v_request):
    """The unconditional rows stack each request's own negative prompt."""
    rt = wan_runtime("t2v")
    reqs = requests(t2v_request, steps=4)
    reqs[1]["inputs"][1]["text"] = "static, ugly"  # another negative prompt
    alone = [rt.generate(r) for r in reqs]
    outs, batched = advance_in_lockstep(rt, reqs)
    assert batched == 4
    assert_close_to_alone(outs, alone)


def _keys_after_first_step(rt: Any, reqs: list[dict[str, Any]]) -> list[Any]:
    exes = [rt.prepare(r) for r in reqs]
    for e in exes:
        while e.loop is None or e.loop.step < 1:
            e.advance()
    keys = [e.batch_key() for e in exes]
    for e in exes:
        e.cancel()
        e.run()
    return keys


def test_batch_keys_match_only_compatible_steps(wan_runtime, t2v_request):
    rt = wan_runtime("t2v")
    base = t2v_request(steps=4)
    variants = {
        "same": requests(t2v_request, n=1, steps=4)[0],
        "size": t2v_request(steps=4, height=48),
        "steps": t2v_request(steps=5),
        "scale": t2v_request(steps=4, guidance_scale=4.0),
        "sampler": with_denoise(t2v_request(steps=4), sampler="dpmpp"),
        "cfg": with_denoise(t2v_request(steps=4), cfg="batched"),
        "shift": t2v_request(steps=4, shift=7.0),
    }
    keys = _keys_after_first_step(rt, [base, *variants.values()])
    assert keys[0] is not None
    got = dict(zip(variants, keys[1:], strict=True))
    assert got.pop("same") == keys[0]  # another prompt and seed: batchable
    for name, key in got.items():
        assert key is not None and key != keys[0], name


def test_no_batch_key_when_state_or_plugins_forbid_it(wan_runtime, t2v_request, counting):
    rt = wan_runtime("t2v")
    gate = with_denoise(t2v_request(steps=4), cfg="adaptive-gate")
    exact = {**t2v_request(steps=4), "exact": True}
    assert _keys_after_first_step(rt, [gate, exact]) == [None, None]
    with_icpt, _ = counting("t2v")
    assert _keys_after_first_step(with_icpt, [t2v_request(steps=4)]) == [None]


def test_the_step_scheduler_batches_wan_requests(wan_runtime, t2v_request):
    sched = pytest.importorskip("omniloop_scheduler.testing")
    rt = wan_runtime("t2v")
    reqs = requests(t2v_request, n=4, steps=4)
    for i, r in enumerate(reqs):
        r["request_id"] = f"r{i}"
    alone = [rt.generate(r) for r in reqs]
    outs, engine = sched.engine_outputs(rt, reqs, max_batch=4)
    batched = [d for d in engine.trace if d.action == "batched_step"]
    assert batched and max(len(d.request_ids) for d in batched) == 4
    assert_close_to_alone(outs, alone)



def test_stochastic_sampler_batches_with_each_requests_own_noise(wan_runtime, t2v_request):
    """flow-euler with ``stochastic_sampling`` (wan-demo's default) draws fresh noise at every step
    from each request's generator: batched steps give each request the clip it gets alone."""
    sde = {"sampler": "flow-euler", "sampler_options": {"flow-euler": {"stochastic_sampling": True}}}
    rt = wan_runtime("t2v", policies=sde)
    reqs = requests(t2v_request, steps=4)
    alone = [rt.generate(r) for r in reqs]
    outs, batched = advance_in_lockstep(rt, reqs)
    assert batched == 4
    assert_close_to_alone(outs, alone)
    ode = wan_runtime("t2v", policies={"sampler": "flow-euler"}).generate(reqs[0])
    assert (ode.artifacts["latents"].tensor - alone[0].artifacts["latents"].tensor).abs().max() > 1e-2


def test_a_request_whose_row_raises_fails_alone_in_a_batched_step(wan_runtime, t2v_request):
    """Issue 43, finding 3 (exceptions): Wan declares ``step_batch_retry_alone`` for its denoise
    loop, so a batched forward that raises is re-run one request at a time — the poison (whose
    row breaks every forward it is in) fails with its error; its four batch-mates complete as they
    do alone, policy counts included (the CFG plan of the re-run step is counted once)."""
    from omniloop.testing import forward_rows, raising_rows
    from omniloop_wan.denoise import Denoise

    rt = wan_runtime("t2v")
    normal = requests(t2v_request, n=4, steps=4)
    poison = t2v_request(seed=99, steps=4)
    poison["inputs"][0]["text"] = "a poisoned prompt"
    with forward_rows(Denoise, "encoder_hidden_states") as shared:
        rt.generate(normal[0])
    with forward_rows(Denoise, "encoder_hidden_states") as mine:
        rt.generate(poison)
    rows = [r for r in mine if not any(torch.equal(r, s) for s in shared)]
    assert rows
    alone = [rt.generate(r) for r in normal]
    with raising_rows(Denoise, "encoder_hidden_states", rows, after=1):  # its first step runs alone
        outs, batched = advance_in_lockstep(rt, [*normal[:2], poison, *normal[2:]])
    bad = outs.pop(2)
    assert bad.status is Status.FAILED and "injected" in bad.error.message, bad.error
    assert batched >= 1
    assert_close_to_alone(outs, alone)
    for o, a in zip(outs, alone, strict=True):
        assert o.metrics["policies"] == a.metrics["policies"]
