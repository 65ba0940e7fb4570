"""Continuous batching through the step scheduler: sequences join and leave the decode batch
between steps (each still equals itself alone), a cancelled sequence's KV blocks are free at the
next step, and admission waits for KV room instead of failing a request mid-decode."""

from __future__ import annotations

import gc

from omniloop.request import EventKind, Status


def _final(stream):
    return [e for e in stream if e.output is not None][-1].output


def _tokens(out):
    assert out.status is Status.COMPLETED, out.error
    return out.artifacts["text"].token_ids


def test_a_sequence_joins_a_running_batch(qwen_runtime, req, prompts) -> None:
    alone = qwen_runtime("qwen3")
    want = [_tokens(alone.generate(req(p, max_tokens=n))) for p, n in ((prompts[0], 14), (prompts[1], 4), (prompts[2], 8))]
    rt = qwen_runtime("qwen3", scheduler="step", scheduler_options={"max_batch": 8})
    a, b = rt.stream(req(prompts[0], max_tokens=14)), rt.stream(req(prompts[1], max_tokens=4))
    first = []
    for ev in a:  # drive the pool until a is well into its decode
        first.append(ev)
        if ev.node == "decode" and ev.step == 6:
            break
    c = rt.stream(req(prompts[2], max_tokens=8))  # joins between steps
    out_c, out_b = _final(c), _final(b)
    out_a = _final(a)
    assert [_tokens(out_a), _tokens(out_b), _tokens(out_c)] == want
    ids = {o.request_id for o in (out_a, out_b, out_c)}
    # (the runtime is shared with other tests: look at the batches of these three only)
    batches = [set(d.request_ids) for d in rt.scheduler.trace if d.action == "batched_step" and ids & set(d.request_ids)]
    assert {out_a.request_id, out_b.request_id} in batches  # a and b decoded together ...
    assert {out_a.request_id, out_c.request_id} in batches  # ... b left, c joined a's batch
    assert all(s <= ids for s in batches)
    cache = rt.model.components["kv_cache"]
    assert cache.used_blocks == 0 and cache.reserved_blocks == 0


def test_cancel_frees_kv_blocks_at_the_next_step(qwen_runtime, req, prompts) -> None:
    rt = qwen_runtime("qwen2", scheduler="step")
    cache = rt.model.components["kv_cache"]
    a = rt.stream(req(prompts[0], max_tokens=30))
    b = rt.stream(req(prompts[2], max_tokens=30))
    for ev in a:
        if ev.node == "decode" and ev.step == 4:
            break
    assert cache.sequences == 2
    tickets = {t.request_id: t for t in rt.scheduler.pool.running}
    victim = next(rid for rid, t in tickets.items() if t.execution.request.inputs[0].text == prompts[2])
    rt.scheduler.pool.request_cancel(victim)
    next(a)  # one more unit: the cancellation takes effect at this step boundary
    assert cache.sequences == 1 and not cache.is_live(tickets[victim].execution.state.loops["decode"].extra["seq"])
    out_b = _final(b)
    assert out_b.status is Status.CANCELLED
    assert _final(a).status is Status.COMPLETED
    assert cache.used_blocks == 0 and cache.reserved_blocks == 0
    cache.check()


def test_abandoned_stream_is_cancelled_and_freed(qwen_runtime, req, prompts) -> None:
    rt = qwen_runtime("qwen2", scheduler="step")
    cache = rt.model.components["kv_cache"]
    s = rt.stream(req(prompts[2], max_tokens=30))
    for ev in s:
        if ev.node == "decode" and ev.step == 3:
            break
    assert cache.sequences == 1
    s.close()  # the caller stops iterating: the scheduler cancels the request and frees its blocks
    assert cache.sequences == 0 and cache.used_blocks == 0 and cache.reserved_blocks == 0


def test_serial_failure_frees_blocks(qwen_runtime, req, prompts, monkeypatch) -> None:
    rt = qwen_runtime("qwen2")
    cache = rt.model.components["kv_cache"]
    paged = rt.model.components["paged"]
    calls = {"n": 0}
    real = paged.forward

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real(*a, **k)

    monkeypatch.setattr(paged, "forward", flaky)
    out = rt.generate(req(prompts[0], max_tokens=10))
    assert out.status is Status.FAILED and "boom" in out.error.message and out.error.node == "decode"
    assert cache.sequences == 0 and cache.used_blocks == 0 and cache.reserved_blocks == 0


def test_admission_waits_for_kv_room(tiny_qwen, runtime_at, qwen_runtime, req, prompts) -> None:
    alone = qwen_runtime("qwen2")
    want = [_tokens(alone.generate(req(p, max_tokens=24))) for p in prompts[::3]]
    # 8 blocks of 8 tokens; each request reserves prompt + 24 tokens (4+ blocks): two cannot run at once
    rt = runtime_at(tiny_qwen("qwen2"), scheduler="step", options={"kv_cache_tokens": 64, "kv_block_size": 8})
    streams = [rt.stream(req(p, max_tokens=24)) for p in prompts[::3]]
    outs = [_final(s) for s in streams]
    assert [_tokens(o) for o in outs] == want
    waits = [d for d in rt.scheduler.trace if d.action == "wait"]
    assert waits and "kv cache 'text-kv': needs" in waits[0].reason
    assert not any(d.action == "batched_step" for d in rt.scheduler.trace)
    gc.collect()
    assert rt.model.components["kv_cache"].used_blocks == 0


def test_partial_events_name_the_text_artifact(qwen_runtime, req, prompts) -> None:
    rt = qwen_runtime("qwen2", scheduler="step")
    evs = list(rt.stream(req(prompts[1], max_tokens=3, outputs={"stream_partial": True})))
    partial = [e for e in evs if e.kind is EventKind.PARTIAL]
    assert len(partial) == 3 and {e.artifact for e in partial} == {"text"}


def test_text_requests_are_not_sized_as_video(qwen_runtime, req, prompts) -> None:
    from omniloop_scheduler.models import shape_of

    rt = qwen_runtime("qwen2", scheduler="step")
    shape = shape_of(rt, rt.prepare(req(prompts[0], max_tokens=9)).request)
    assert (shape.pixels, shape.branches, shape.steps) == (1, 1, 9)
    out = rt.generate(req(prompts[0], max_tokens=4, temperature=1.0, node_params={"decode": {"seed": 11}}))
    assert out.metrics["seed"] == 11


def test_conformance_kit_and_gc_frees_a_dropped_execution(qwen_runtime, req, prompts) -> None:
    from omniloop.testing.conformance import check_family

    rt = qwen_runtime("qwen3")
    check_family(lambda: rt, req(prompts[0], max_tokens=6, temperature=1.0), output="text")
    # the kit cancels an execution by hand (no scheduler): its blocks come back when it is collected
    gc.collect()
    cache = rt.model.components["kv_cache"]
    assert cache.sequences == 0 and cache.used_blocks == 0 and cache.reserved_blocks == 0


def test_a_long_prompt_prefills_in_chunks_between_other_sequences_decode_steps(
    qwen_runtime, hf_reference, req, prompts
) -> None:
    rt = qwen_runtime("qwen2", scheduler="step", options={"prefill_chunk": 8})
    tok = rt.model.components["tokenizer"]
    short = rt.stream(req(prompts[0], max_tokens=20))
    for ev in short:  # the short request is decoding ...
        if ev.node == "decode" and ev.step == 4:
            break
    long_ = rt.stream(req(prompts[2], max_tokens=6))  # ... when a 42-token prompt arrives
    out_long, out_short = _final(long_), _final(short)
    assert _tokens(out_long) == hf_reference("qwen2", tok(prompts[2])["input_ids"], 6)
    assert _tokens(out_short) == hf_reference("qwen2", tok(prompts[0])["input_ids"], 20)
    # the long prompt's prefill chunks alternate with the short request's decode steps (no stall)
    order = [d.request_ids for d in rt.scheduler.trace if d.node == "decode" and d.action == "step"
             and set(d.request_ids) & {out_long.request_id, out_short.request_id}]
    long_units = [i for i, ids in enumerate(order) if ids == (out_long.request_id,)]
    short_between = [i for i, ids in enumerate(order) if ids == (out_short.request_id,) and long_units[0] < i < long_units[5]]
    assert len(long_units) >= 6 and short_between  # join + 6 chunks, with short decode steps in between
