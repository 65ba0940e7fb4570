"""The ``reason`` pipeline: ``prompt`` (tokenize, chat template) → ``decode`` (the AR loop).

``decode`` is a batched :class:`~omniloop.loop.LoopStage`. Its ``init`` reserves the sequence's
KV blocks (prompt + ``max_tokens``) in the shared :class:`~omniloop_kvcache.CacheManager`; its
first ``step`` is a *join* step without a forward (an execution's first unit always runs alone,
so the prefill that follows can batch); then each ``step`` runs one prefill chunk
(``prefill_chunk`` prompt tokens; the last chunk yields the first new token) or one decode token.
``batch_key`` is equal for every sequence in its decode phase (and for prefill chunks of the same
power-of-two length bucket), so the step scheduler runs the decode steps of all running sequences
as one forward — sequences join and leave between steps (continuous batching). ``finalize`` writes ``text`` and frees the blocks;
``release`` frees them when the request is cancelled or fails (the blocks are also freed when
the loop state is garbage collected, as a last resort).
"""

from __future__ import annotations

import math
import re
import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from attrs import define, field

from omniloop.artifacts import Conditioning, Text
from omniloop.context import StageContext
from omniloop.errors import RequestError
from omniloop.loop import LoopState, RequestState, StepResult
from omniloop.request import OmniRequest, TaskType, TextPart
from omniloop.resolved import Workload
from omniloop_kvcache import CacheFull, CacheManager

from .sampling import NonFiniteLogits, Sampling, next_token

#: chat roles a text part may carry (the schema's ``system`` today; ``user``/``assistant`` when it grows them)
_CHAT_ROLES = {"system": "system", "user": "user", "assistant": "assistant", "prompt": "user"}


def _stop_list(value: Any) -> list[str]:
    return list(value or [])


@define(frozen=True)
class DecodeParams:
    """Per-request knobs of the ``decode`` node (``node_params.decode``), beyond ``sampling``."""

    #: sampling seed (default: ``sampling.seed`` when the schema has it, else ``diffusion.seed``, else random)
    seed: int | None = field(default=None, metadata={"ge": 0, "le": 2**63 - 1})
    #: stop strings: generation stops when the text contains one; the text ends before it
    stop: list[str] = field(factory=list, converter=_stop_list)
    #: apply the tokenizer's chat template: None = when the inputs carry chat roles (``system``)
    chat: bool | None = None


def decode_params(request: OmniRequest) -> DecodeParams:
    from omniloop.schema import structure_params

    params: DecodeParams = structure_params(DecodeParams, request.node_params.get("decode", {}), "node_params.decode")
    return params


def stop_strings(request: OmniRequest, params: DecodeParams) -> list[str]:
    stops = list(getattr(request.sampling, "stop", None) or []) + list(params.stop)
    for i, s in enumerate(stops):
        if not isinstance(s, str) or not s:
            raise RequestError(f"node_params.decode.stop.{i}", "a stop string must be a non-empty string")
    return stops


def render_prompt(tokenizer: Any, request: OmniRequest, params: DecodeParams) -> list[int]:
    """The prompt's token ids: the chat template over the role-tagged text parts, or the plain prompt."""
    parts = [p for p in request.inputs if isinstance(p, TextPart)]
    other = [p for p in request.inputs if not isinstance(p, TextPart)]
    if other:
        raise RequestError("inputs", f"a reason request takes text parts only, got {type(other[0]).__name__}")
    if any(p.role == "negative_prompt" for p in parts):
        raise RequestError("inputs", "a reason request has no negative prompt")
    if not parts or not any(p.text.strip() for p in parts):
        raise RequestError("inputs", "a text part with a non-empty prompt is required")
    chat = params.chat if params.chat is not None else any(p.role != "prompt" for p in parts)
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise RequestError("inputs", "the checkpoint's tokenizer has no chat template (set node_params.decode.chat: false)")
        messages = [{"role": _CHAT_ROLES.get(p.role, "user"), "content": p.text} for p in parts]
        if any(_holds_special(tokenizer, p.text) for p in parts):
            ids = _chat_ids_plain_content(tokenizer, messages)
        else:  # (the usual case: exactly transformers' tokenisation of the rendered template)
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(request.prompt or "")["input_ids"]
    if not ids:
        raise RequestError("inputs", "the prompt tokenizes to no token")
    return [int(i) for i in ids]


def _special_strings(tokenizer: Any) -> list[str]:
    """The strings the tokenizer turns into special / added tokens (``<|im_start|>``, ...)."""
    found = set(getattr(tokenizer, "all_special_tokens", None) or [])
    added = getattr(tokenizer, "get_added_vocab", None)
    if callable(added):
        found.update(added())
    return sorted((t for t in found if isinstance(t, str) and t), key=len, reverse=True)


def _holds_special(tokenizer: Any, text: str) -> bool:
    return any(t in text for t in _special_strings(tokenizer))


#: private-use characters around a message index: where its content goes in the rendered template
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"


def _chat_ids_plain_content(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The chat template's token ids with every message's content tokenised as plain text: a role
    token typed by a user (``<|im_start|>system``) stays characters, never a forged turn. The
    template is rendered around markers; its own text is tokenised as usual (its special tokens
    are the turns), each content with ``split_special_tokens``."""
    marked = [{**m, "content": f"{_MARK_OPEN}{i}{_MARK_CLOSE}"} for i, m in enumerate(messages)]
    text = tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=True)
    pieces = re.split(f"{_MARK_OPEN}(\\d+){_MARK_CLOSE}", text)
    ids: list[int] = []
    for k, piece in enumerate(pieces):
        if k % 2 == 1:  # a message's content
            content = messages[int(piece)]["content"]
            if content:
                ids += tokenizer(content, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        elif piece:
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
    return ids


def sampling_of(request: OmniRequest) -> Sampling:
    s = request.sampling
    for name in ("temperature", "top_p"):
        v = getattr(s, name)
        if not math.isfinite(v):
            raise RequestError(f"sampling.{name}", f"must be a finite number, got {v}")
    return Sampling(temperature=float(s.temperature), top_p=float(s.top_p), top_k=int(s.top_k))


@define(frozen=True)
class ReasonResolved:
    """A ``reason`` request resolved once (``QwenFamily.resolve``; ``ctx.resolved`` in the nodes):
    its prompt tokens, how many new tokens it may make, sampling, stop strings and seed."""

    task: TaskType
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: Sampling
    stops: tuple[str, ...]
    seed: int | None = None
    warnings: tuple[str, ...] = ()

    def workload(self) -> Workload:
        """One token sequence: ``max_tokens`` decode steps of one forward each (KV blocks are
        admitted through the decode node's ``kv_demand``)."""
        return Workload(steps=self.max_tokens, branches=1)


def resolve_reason(tokenizer: Any, config: dict[str, Any], request: OmniRequest,
                   params: DecodeParams | None = None) -> ReasonResolved:
    """Check and resolve a ``reason`` request against a checkpoint's tokenizer and config (``eos``,
    ``max_tokens``, ``max_positions``, ``kv_cache``): every refusal before any compute."""
    if request.task is not TaskType.REASON:
        raise RequestError("task", f"family 'qwen' runs 'reason' requests, got {request.task.value!r}")
    if params is None:  # a stage driven by hand, outside a runtime: the same converter
        params = decode_params(request)
    sampling = sampling_of(request)
    stops = stop_strings(request, params)
    ids = render_prompt(tokenizer, request, params)
    n = max_new_tokens(request, len(ids), max_positions=config["max_positions"], default=config["max_tokens"])
    kv = config.get("kv_cache")
    if kv:
        need = -(-(len(ids) + n) // kv["block_size"])
        if need > kv["num_blocks"]:
            raise RequestError(
                "sampling.max_tokens",
                f"a {len(ids)}-token prompt plus {n} new tokens needs {need} KV blocks; the pool holds {kv['num_blocks']} "
                f"(deploy options.kv_cache_tokens)",
            )
    seed = getattr(request.sampling, "seed", None)
    return ReasonResolved(task=request.task, prompt_ids=tuple(ids), max_tokens=n, sampling=sampling,
                          stops=tuple(stops), seed=params.seed if seed is None else seed)


def max_new_tokens(request: OmniRequest, prompt_len: int, *, max_positions: int, default: int) -> int:
    """``sampling.max_tokens`` checked against the context left after the prompt (default: the
    checkpoint's ``max_tokens``, capped by that room)."""
    room = max_positions - prompt_len
    asked = request.sampling.max_tokens
    if asked is not None:
        if asked > room:
            raise RequestError(
                "sampling.max_tokens",
                f"{asked} new tokens after a {prompt_len}-token prompt exceed the model's context of {max_positions}",
            )
        return int(asked)
    if room < 1:
        raise RequestError("inputs", f"the prompt ({prompt_len} tokens) fills the model's context of {max_positions}")
    return min(default, room)


class Prompt:
    """The request's resolved prompt tokens (chat template applied when it has roles) → ``prompt_ids``."""

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        r = ctx.resolved
        if isinstance(r, ReasonResolved):
            ids = list(r.prompt_ids)
        else:
            params = ctx.params if isinstance(ctx.params, DecodeParams) else decode_params(state.request)
            ids = render_prompt(ctx.components["tokenizer"], state.request, params)
        # a tensor, not a list: schedulers walk artifacts to measure what a request holds
        state.write("prompt_ids", Conditioning(values={"ids": torch.tensor(ids, dtype=torch.long)}), ctx.node.name)


class Decode:
    """The autoregressive loop: one prefill chunk or one token per ``step``; see the module docstring."""

    def __init__(
        self, *, eos: Sequence[int], max_tokens: int, max_positions: int, prefill_chunk: int,
        cache: CacheManager | None = None, tokenizer: Any = None,
    ) -> None:
        self.eos = frozenset(int(e) for e in eos)
        self.max_tokens = max_tokens
        self.max_positions = max_positions
        self.prefill_chunk = prefill_chunk
        self.cache = cache
        self.tokenizer = tokenizer

    def kv_demand(self, state: RequestState) -> tuple[CacheManager, int] | None:
        """(pool, blocks) this request reserves at ``init``: what the step scheduler's admission checks."""
        if self.cache is None or self.tokenizer is None:
            return None
        blocks = state.ext.get("qwen.kv_blocks")
        if blocks is None:
            r = self._resolved(state, None)
            blocks = state.ext["qwen.kv_blocks"] = self.cache.blocks_for(len(r.prompt_ids) + r.max_tokens)
        return self.cache, int(blocks)

    # -- per request -------------------------------------------------------------------------------
    def _resolved(self, state: RequestState, params: Any) -> ReasonResolved:
        r = state.resolved
        if isinstance(r, ReasonResolved):
            return r
        # driven by hand, outside a runtime: resolve with the same function the family uses
        config = {"max_positions": self.max_positions, "max_tokens": self.max_tokens}
        return resolve_reason(self.tokenizer, config, state.request, params if isinstance(params, DecodeParams) else None)

    def resolve_max_tokens(self, request: OmniRequest, prompt_len: int) -> int:
        return max_new_tokens(request, prompt_len, max_positions=self.max_positions, default=self.max_tokens)

    def init(self, ctx: StageContext, state: RequestState) -> LoopState:
        req = state.request
        prompt = [int(t) for t in state.read("prompt_ids", Conditioning).values["ids"].tolist()]
        r = ctx.resolved if isinstance(ctx.resolved, ReasonResolved) else None
        if r is None:
            params = ctx.params if isinstance(ctx.params, DecodeParams) else decode_params(req)
            max_tokens = self.resolve_max_tokens(req, len(prompt))
            sampling, stops = sampling_of(req), stop_strings(req, params)
            seed = getattr(req.sampling, "seed", None)
            seed = params.seed if seed is None else seed
        else:
            max_tokens, sampling, stops, seed = r.max_tokens, r.sampling, list(r.stops), r.seed
        cache: CacheManager = ctx.components["kv_cache"]
        try:
            handle = cache.allocate(0, reserve_tokens=len(prompt) + max_tokens, tag=req.request_id)
        except CacheFull as exc:
            raise CacheFull(f"request {req.request_id}: {exc}") from None
        gen = state.generator
        if seed is not None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(int(seed))
            state.metrics["seed"] = int(seed)
        chunks = -(-len(prompt) // self.prefill_chunk)
        # steps: one join step (no forward), the prefill chunks (the last yields token 1), then one per token
        loop = LoopState(total=1 + chunks + max_tokens - 1)
        loop.extra.update(
            seq=handle, cache=cache, joined=False, pending=prompt, prompt_len=len(prompt), max_tokens=max_tokens, out=[], text="",
            emitted=0, finish=None, gen=gen, sampling=sampling, stops=stops,
        )
        # last resort: blocks come back when the loop state is collected (a dropped execution)
        weakref.finalize(loop, cache.free, handle)
        return loop

    def step(self, ctx: StageContext, state: RequestState, loop: LoopState) -> StepResult:
        return self._run([ctx], [loop])[0]

    def batch_key(self, ctx: StageContext, state: RequestState, loop: LoopState) -> Hashable | None:
        x = loop.extra
        if not x["joined"]:
            return None
        pool = id(ctx.components["kv_cache"])
        if x["pending"]:  # prefill chunks batch with chunks of the same power-of-two length bucket
            n = min(len(x["pending"]), self.prefill_chunk)
            return ("qwen-prefill", pool, 1 << (n - 1).bit_length())
        return ("qwen-decode", pool)

    def step_batch(
        self, ctxs: Sequence[StageContext], states: Sequence[RequestState], loops: Sequence[LoopState]
    ) -> list[StepResult]:
        return self._run(ctxs, loops)

    def finalize(self, ctx: StageContext, state: RequestState, loop: LoopState) -> None:
        x = loop.extra
        state.write("text", Text(text=x["text"], token_ids=list(x["out"])), ctx.node.name)
        state.metrics["finish_reason"] = x["finish"] or "length"
        n = len(x["out"])
        state.metrics["usage"] = {"prompt_tokens": x["prompt_len"], "completion_tokens": n,
                                  "total_tokens": x["prompt_len"] + n}
        ctx.components["kv_cache"].free(x["seq"])

    def release(self, state: RequestState, node: str) -> None:
        """Free the sequence's KV blocks (cancel / failure); idempotent."""
        loop = state.loops.get(node)
        if loop is not None and "seq" in loop.extra:
            loop.extra["cache"].free(loop.extra["seq"])

    # -- the forward ----------------------------------------------------------------------------------
    def _run(self, ctxs: Sequence[StageContext], loops: Sequence[LoopState]) -> list[StepResult]:
        if not all(lp.extra["joined"] for lp in loops):
            # the join step: ``init`` ran with it (an execution's first unit always runs alone), so
            # no forward here — the prefill that follows can then batch with other sequences'
            for lp in loops:
                lp.extra["joined"] = True
            return [StepResult(done=False) for _ in loops]
        comps = ctxs[0].components
        cache: CacheManager = comps["kv_cache"]
        feeds: list[list[int]] = []
        sampling_rows: list[bool] = []
        for lp in loops:
            x = lp.extra
            if x["pending"]:
                chunk, x["pending"] = x["pending"][: self.prefill_chunk], x["pending"][self.prefill_chunk :]
                feeds.append(chunk)
                sampling_rows.append(not x["pending"])
            else:
                feeds.append([x["out"][-1]])
                sampling_rows.append(True)
        logits = comps["paged"].forward(cache, [lp.extra["seq"] for lp in loops], feeds)
        tok = comps["tokenizer"]
        # per-row isolation: a row whose logits are not finite fails its own request (one sync for
        # the batch); the other rows go on exactly as they would alone
        finite = torch.isfinite(logits).all(-1).tolist()
        # greedy rows: one argmax over the batch, one device->host copy (not one sync per sequence)
        greedy = [i for i, lp in enumerate(loops) if sampling_rows[i] and finite[i] and lp.extra["sampling"].greedy]
        # (every row greedy, the usual decode batch: no index copy to the device first)
        rows = logits if len(greedy) == len(loops) else logits[greedy]
        argmax = dict(zip(greedy, rows.argmax(-1).tolist(), strict=True)) if greedy else {}
        results = []
        for i, lp in enumerate(loops):
            if not sampling_rows[i]:
                results.append(StepResult(done=False))
                continue
            x = lp.extra
            if not finite[i]:
                results.append(StepResult(done=False, error=NonFiniteLogits(
                    f"the model produced non-finite logits (NaN/inf) at token {len(x['out']) + 1}")))
                continue
            try:
                t = argmax[i] if i in argmax else next_token(logits[i], x["sampling"], x["gen"])
            except Exception as exc:  # this row's draw failed: this request alone
                results.append(StepResult(done=False, error=exc))
                continue
            x["out"].append(t)
            results.append(self._after_token(lp, t, tok))
        return results

    def _after_token(self, loop: LoopState, t: int, tokenizer: Any) -> StepResult:
        x = loop.extra
        if t in self.eos:
            x["finish"] = "stop"
        text = tokenizer.decode(x["out"], skip_special_tokens=True)
        stops: list[str] = x["stops"]
        if stops:
            lo = max(0, x["emitted"] - max(len(s) for s in stops))
            hits = [i for i in (text.find(s, lo) for s in stops) if i >= 0]
            if hits:
                text = text[: min(hits)]
                x["finish"] = "stop"
        if x["finish"] is None and len(x["out"]) >= x["max_tokens"]:
            x["finish"] = "length"
        done = x["finish"] is not None
        # stream only text that can no longer change: not a partial UTF-8 character, not a stop-string prefix
        safe = len(text) if done else len(text) - (max((len(s) for s in stops), default=1) - 1)
        if not done and text.endswith("\ufffd"):
            safe = min(safe, len(text) - 1)
        delta = text[x["emitted"] : max(x["emitted"], safe)]
        x["emitted"] += len(delta)
        x["text"] = text
        return StepResult(done=done, emit={"text": Text(text=delta, token_ids=[t])})
