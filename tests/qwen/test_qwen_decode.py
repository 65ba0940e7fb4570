"""Greedy decode is token-exact vs transformers' ``generate(do_sample=False)`` on tiny random
Qwen2 and Qwen3 (GQA) checkpoints — alone, with chunked prefill, and batched with prompts of
other lengths (each equals itself alone); seeded sampling is reproducible; EOS / stop strings /
max_tokens; the chat template; no KV block is left behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from omniloop.request import Status

ARCHES = ("qwen2", "qwen3")


def _ids(rt, prompt: str) -> list[int]:
    return rt.model.components["tokenizer"](prompt)["input_ids"]


def _kv_empty(rt) -> None:
    cache = rt.model.components["kv_cache"]
    cache.check()
    assert cache.used_blocks == 0 and cache.reserved_blocks == 0 and cache.sequences == 0


@pytest.mark.parametrize("arch", ARCHES)
def test_greedy_alone_matches_transformers(arch, qwen_runtime, hf_reference, req, prompts) -> None:
    rt = qwen_runtime(arch)
    for prompt in prompts:
        out = rt.generate(req(prompt, max_tokens=24))
        assert out.status is Status.COMPLETED, out.error
        text = out.artifacts["text"]
        ref = hf_reference(arch, _ids(rt, prompt), 24)
        assert text.token_ids == ref, prompt
        assert text.text == rt.model.components["tokenizer"].decode(ref, skip_special_tokens=True)
        assert out.metrics["usage"] == {"prompt_tokens": len(_ids(rt, prompt)), "completion_tokens": len(ref),
                                        "total_tokens": len(_ids(rt, prompt)) + len(ref)}
    _kv_empty(rt)


@pytest.mark.parametrize("arch", ARCHES)
def test_chunked_prefill_matches_transformers(arch, qwen_runtime, hf_reference, req, prompts) -> None:
    rt = qwen_runtime(arch, options={"prefill_chunk": 5, "kv_block_size": 4})
    prompt = prompts[2]
    n = len(_ids(rt, prompt))
    steps = []
    for ev in rt.stream(req(prompt, max_tokens=12)):
        if ev.node == "decode" and ev.step is not None:
            steps.append((ev.step, ev.total))
        out = ev.output or None
    assert out is not None and out.status is Status.COMPLETED, out
    assert out.artifacts["text"].token_ids == hf_reference(arch, _ids(rt, prompt), 12)
    chunks = -(-n // 5)
    assert steps[-1] == (1 + chunks + 11, 1 + chunks + 11)  # join step, prefill chunks, then one token per step
    _kv_empty(rt)


@pytest.mark.parametrize("arch", ARCHES)
def test_batched_prompts_of_different_lengths_each_equal_alone(arch, qwen_runtime, hf_reference, req, prompts) -> None:
    rt = qwen_runtime(arch, scheduler="step", scheduler_options={"max_batch": 8})
    streams = [rt.stream(req(p, max_tokens=10 + 3 * i)) for i, p in enumerate(prompts)]
    outs = [[e for e in s if e.output is not None][-1].output for s in streams]
    for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        assert out.status is Status.COMPLETED, out.error
        assert out.artifacts["text"].token_ids == hf_reference(arch, _ids(rt, p), 10 + 3 * i), p
    ids = {o.request_id for o in outs}  # (the runtime is shared with other tests)
    sizes = [len(d.request_ids) for d in rt.scheduler.trace if d.action == "batched_step" and ids & set(d.request_ids)]
    assert max(sizes) == len(prompts)  # every sequence's decode step in one forward
    assert min(sizes) < len(prompts)  # the batch shrank as sequences finished (continuous batching)
    _kv_empty(rt)


def test_seeded_sampling_is_reproducible_and_batch_independent(qwen_runtime, req, prompts) -> None:
    rt = qwen_runtime("qwen3")

    def sample(seed: int, **s):
        r = req(prompts[0], max_tokens=20, temperature=0.9, node_params={"decode": {"seed": seed}})
        r["sampling"].update(s)
        out = rt.generate(r)
        assert out.status is Status.COMPLETED, out.error
        return out.artifacts["text"].token_ids

    a, b, c = sample(7), sample(7), sample(8)
    assert a == b and a != c
    k1 = sample(7, top_k=1)  # top_k=1 is greedy whatever the seed
    assert k1 == sample(9, top_k=1) == rt.generate(req(prompts[0], max_tokens=20)).artifacts["text"].token_ids
    assert sample(3, top_p=0.5) == sample(3, top_p=0.5)
    # the same seeded requests batched together give what each gives alone
    rs = rt_step = qwen_runtime("qwen3", scheduler="step")
    streams = [rs.stream(req(prompts[0], max_tokens=20, temperature=0.9, node_params={"decode": {"seed": s}}))
               for s in (7, 8)]
    got = [[e for e in s if e.output is not None][-1].output.artifacts["text"].token_ids for s in streams]
    assert got == [a, c]
    assert any(d.action == "batched_step" for d in rt_step.scheduler.trace)


def test_diffusion_seed_seeds_sampling_too(qwen_runtime, req, prompts) -> None:
    rt = qwen_runtime("qwen2")
    runs = [rt.generate(req(prompts[1], temperature=1.0, diffusion={"seed": 5})).artifacts["text"].token_ids for _ in range(2)]
    assert runs[0] == runs[1]


def test_stop_string_ends_the_text_before_it(qwen_runtime, req, prompts) -> None:
    rt = qwen_runtime("qwen2")
    full = rt.generate(req(prompts[0], max_tokens=24)).artifacts["text"]
    stop = full.text[6:9]
    cut = full.text.find(stop)
    assert stop and cut >= 0
    out = rt.generate(req(prompts[0], max_tokens=24, node_params={"decode": {"stop": [stop]}}))
    assert out.artifacts["text"].text == full.text[:cut]
    assert out.metrics["finish_reason"] == "stop"
    assert full.token_ids[: len(out.artifacts["text"].token_ids)] == out.artifacts["text"].token_ids
    assert len(out.artifacts["text"].token_ids) < 24
    _kv_empty(rt)


def test_eos_from_generation_config_stops_like_transformers(tiny_qwen, qwen_runtime, runtime_at, req, tmp_path, prompts) -> None:
    base = qwen_runtime("qwen3")
    greedy = base.generate(req(prompts[0], max_tokens=24)).artifacts["text"].token_ids
    k = next(i for i in range(3, len(greedy)) if greedy[i] not in greedy[:i])
    ckpt = Path(shutil.copytree(tiny_qwen("qwen3"), tmp_path / "eos"))
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [greedy[k]], "pad_token_id": 0}))
    rt = runtime_at(ckpt)
    out = rt.generate(req(prompts[0], max_tokens=24))
    assert out.artifacts["text"].token_ids == greedy[: k + 1]  # the EOS token is the last id, as in generate
    assert out.metrics["finish_reason"] == "stop"
    hf = AutoModelForCausalLM.from_pretrained(ckpt)
    ids = torch.tensor([_ids(rt, prompts[0])])
    ref = hf.generate(ids, do_sample=False, max_new_tokens=24)[0, ids.shape[1]:].tolist()
    assert ref == out.artifacts["text"].token_ids


def test_chat_template_when_inputs_have_roles(qwen_runtime, hf_reference, req) -> None:
    rt = qwen_runtime("qwen2")
    tok = rt.model.components["tokenizer"]
    r = {"task": "reason", "inputs": [{"type": "text", "text": "be brief", "role": "system"},
                                      {"type": "text", "text": "describe a river"}],
         "sampling": {"max_tokens": 8, "temperature": 0.0}}
    out = rt.generate(r)
    chat = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "describe a river"}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok(chat, add_special_tokens=False)["input_ids"]
    assert ids[-3:] == tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"][-3:]
    assert out.metrics["usage"]["prompt_tokens"] == len(ids)
    assert out.artifacts["text"].token_ids == hf_reference("qwen2", ids, 8)
    # a plain prompt can ask for the template too
    forced = rt.generate(req("describe a river", max_tokens=4, node_params={"decode": {"chat": True}}))
    plain_chat = tok(tok.apply_chat_template([{"role": "user", "content": "describe a river"}], tokenize=False,
                                             add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    assert forced.metrics["usage"]["prompt_tokens"] == len(plain_chat)


def test_streamed_partial_text_adds_up_to_the_final_text(qwen_runtime, req, prompts) -> None:
    rt = qwen_runtime("qwen2")
    parts, final = [], None
    for ev in rt.stream(req(prompts[2], max_tokens=16, outputs={"stream_partial": True})):
        if ev.kind == "partial":
            parts.append(ev.value)
        if ev.output is not None:
            final = ev.output.artifacts["text"]
    assert "".join(p.text for p in parts) == final.text
    assert [t for p in parts for t in p.token_ids] == final.token_ids
