"""Our forward of a Qwen2 / Qwen3 causal LM over paged KV.

The weights stay in transformers' module objects (embedding, norms, projections, MLP, rotary
embedding: the same math, so parity with ``generate`` holds); attention is ours: each sequence's
new K/V are written into the :class:`~omniloop_kvcache.CacheManager` at the slots its block table
gives, then every query attends over K/V gathered from the cache through the padded slot table
(a torch reference implementation: exact on CPU float32, GQA through SDPA's ``enable_gqa``, Qwen3's q/k
RMS norm before RoPE). One call runs any mix of sequences, each with any number of new tokens
(a prefill chunk or one decode token), padded to the longest; padded queries attend to a valid
key and are dropped.

Two attention backends (``attention=``; the family's ``options.paged_attention`` picks one):

* ``torch`` — the reference above (K/V gathered into a padded ``[B, L]`` batch, SDPA with a mask);
* ``triton`` — :func:`omniloop_qwen.paged_attention.paged_attention`: a Triton kernel that reads
  the cache's block table and per-row lengths itself (no gather copy, no mask), one query row per
  new token (a decode step is one row per sequence; a prefill chunk is causal rows). CUDA, or
  Triton's CPU interpreter under ``TRITON_INTERPRET=1`` (tests).

**CUDA graphs** (``cuda_graphs=True``, triton on CUDA; the family's ``options.decode_cuda_graphs``):
a decode step (one token per sequence) replays a captured graph instead of launching ~40 kernels
per layer from Python. Graphs are captured lazily, one per (batch bucket, context bucket) — powers
of two — over static inputs: one int32 row per sequence ``[token, position, new slot, kv length,
block table...]``, copied to the device in one transfer per step. A batch padded up to its bucket
repeats its first row (the same token written to the same slot: identical values), whose outputs
are dropped. Batches above ``MAX_GRAPH_BATCH`` or contexts above the model's positions run eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from omniloop_kvcache import CacheManager, KVHandle, KVLayout

from .paged_attention import attention_rows, paged_attention

if TYPE_CHECKING:
    from .fused import FusedWeights


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class PagedQwen:
    """A transformers Qwen2/Qwen3 ``*ForCausalLM`` run with attention over a paged KV cache."""

    def __init__(self, hf_model: Any, attention: str = "torch", cuda_graphs: bool = False, fused: bool = False) -> None:
        if attention not in ("torch", "triton"):
            raise ValueError(f"attention: expected 'torch' or 'triton', got {attention!r}")
        if fused and attention != "triton":
            raise ValueError("fused: the fused decode step needs the triton attention")
        self.attention = attention
        self.hf = hf_model
        base = hf_model.model
        self.embed = base.embed_tokens
        self.layers = list(base.layers)
        self.norm = base.norm
        self.rotary = base.rotary_emb
        self.lm_head = hf_model.lm_head
        cfg = hf_model.config
        self.num_heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads)
        self.groups = self.num_heads // self.kv_heads
        self.scaling = self.head_dim**-0.5
        self.qk_norm = hasattr(self.layers[0].self_attn, "q_norm")
        p = next(hf_model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 0) or 32768)
        if cuda_graphs and (attention != "triton" or self.device.type != "cuda"):
            raise ValueError("cuda_graphs: needs the triton attention on a CUDA device")
        self.graphs: DecodeGraphs | None = DecodeGraphs(self) if cuda_graphs else None
        self.fused: FusedWeights | None = None
        if fused:
            from .fused import FusedWeights

            self.fused = FusedWeights(self)

    def layout(self) -> KVLayout:
        return KVLayout(layers=len(self.layers), kv_heads=self.kv_heads, head_dim=self.head_dim,
                        dtype=self.dtype, device=self.device)

    @torch.no_grad()
    def forward(self, cache: CacheManager, handles: Sequence[KVHandle], tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        """Append ``tokens[i]`` to sequence ``handles[i]``; return float32 logits ``[B, vocab]``
        of each sequence's last new token."""
        b = len(handles)
        n = [len(t) for t in tokens]
        if b == 0 or min(n) < 1:
            raise ValueError("forward: every sequence needs at least one new token")
        past = [cache.length(h) for h in handles]
        t_max = max(n)
        dev = self.device
        decode = t_max == 1  # one new token per sequence: no padding, every query row valid
        if decode and self.graphs is not None:  # the per-step host work kept small: lists, one numpy row block
            slot_list = [cache.append(h, 1) for h in handles]
            new_slots = slot_list[0] if b == 1 else torch.cat(slot_list)
            blocks, held = cache.block_tables(handles)
            replayed = self.graphs.run(cache, [t[0] for t in tokens], past, new_slots, held, blocks)
            if replayed is not None:
                return replayed
            ids = torch.tensor([[t[0]] for t in tokens], dtype=torch.long)
            pos = torch.tensor([[p0] for p0 in past], dtype=torch.long)
        else:
            ids = torch.tensor([[*t, *([0] * (t_max - len(t)))] for t in tokens], dtype=torch.long)
            # padding repeats the last position (its output is dropped)
            pos = torch.tensor([[p0 + min(j, ni - 1) for j in range(t_max)] for p0, ni in zip(past, n, strict=True)],
                               dtype=torch.long)
            new_slots = torch.cat([cache.append(h, ni) for h, ni in zip(handles, n, strict=True)])
        if decode and self.fused is not None:  # the fused step, eagerly (no graph, or a batch above the graphs')
            blocks, held = cache.block_tables(handles)
            meta = torch.empty((b, 4 + blocks.shape[1]), dtype=torch.int32)
            meta[:, 0], meta[:, 1], meta[:, 2], meta[:, 3] = ids[:, 0], pos[:, 0], new_slots, held
            meta[:, 4:] = blocks
            return self.decode_static(cache, meta.to(dev), torch.arange(b, dtype=torch.int32, device=dev),
                                      int(held.max()), None)
        new_slots = new_slots.to(dev)
        valid = None if decode else (torch.arange(t_max)[None, :] < torch.tensor(n)[:, None]).to(dev)  # [B, T]
        if self.attention == "triton":
            blocks, held = cache.block_tables(handles)
            held_list = held.tolist()
            row_seq, kv_lens = attention_rows(held_list, n)
            rows = torch.tensor([row_seq, kv_lens], dtype=torch.int32).to(dev)
            blocks, max_len = blocks.to(dev), max(held_list)
        else:
            table, ctx_len = cache.slot_table(handles)
            table = table.to(dev)
            start = torch.tensor([cache.start(h) for h in handles])
            key_pos = start[:, None] + torch.arange(table.shape[1])[None, :]  # [B, L] absolute positions
            mask = (key_pos[:, None, :] <= pos[:, :, None]) & (torch.arange(table.shape[1])[None, None, :] < ctx_len[:, None, None])
            mask = mask[:, None].to(dev)  # [B, 1, T, L]
        ids, pos = ids.to(dev), pos.to(dev)

        h = self.embed(ids)
        cos, sin = self.rotary(h, pos)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v = self._qkv(layer, h, cos, sin)
            k_new, v_new = k.transpose(1, 2), v.transpose(1, 2)  # [B, T, Hkv, D]
            if decode:
                cache.write(li, new_slots, k_new.reshape(b, -1, self.head_dim), v_new.reshape(b, -1, self.head_dim))
            else:
                cache.write(li, new_slots, k_new[valid], v_new[valid])
            if self.attention == "triton":
                q_rows = q.reshape(b, -1, self.head_dim) if decode else q.transpose(1, 2)[valid]  # [R, Hq, D]
                o_rows = paged_attention(q_rows, cache.k[li], cache.v[li], blocks, rows[1], rows[0],
                                         block_size=cache.block_size, scale=self.scaling, max_len=max_len)
                if decode:
                    o = o_rows.view(b, 1, -1)
                else:
                    o = o_rows.new_zeros((b, t_max, self.num_heads, self.head_dim))
                    o[valid] = o_rows
                    o = o.view(b, t_max, -1)
            else:
                kc, vc = cache.gather(li, table)  # [B, L, Hkv, D]
                kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
                o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, scale=self.scaling,
                                                   enable_gqa=self.groups > 1)
                o = o.transpose(1, 2).reshape(b, t_max, -1)
            h = h + attn.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        last = h[:, 0] if decode else h[torch.arange(b, device=dev), torch.tensor(n, device=dev) - 1]
        logits: torch.Tensor = self.lm_head(self.norm(last)).float()
        return logits

    def _qkv(self, layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v ``[B, heads, T, D]`` of ``layer`` for hidden states ``h`` ``[B, T, hidden]``, RoPE applied."""
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        shape = (h.shape[0], h.shape[1], -1, self.head_dim)
        q = attn.q_proj(x).view(shape)
        k = attn.k_proj(x).view(shape)
        v = attn.v_proj(x).view(shape)
        if self.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = (q * cos) + (_rotate_half(q) * sin)
        k = (k * cos) + (_rotate_half(k) * sin)
        return q, k, v

    def decode_static(self, cache: CacheManager, meta: torch.Tensor, row_seq: torch.Tensor, max_len: int,
                      splits: int | None) -> torch.Tensor:
        """A decode step from device tensors only (what :class:`DecodeGraphs` captures): ``meta``
        int32 ``[B, 4 + blocks]`` rows ``[token, position, new slot, kv length, block table...]``;
        float32 logits ``[B, vocab]``. With ``fused``: :func:`omniloop_qwen.fused.fused_decode_static`."""
        if self.fused is not None:
            from .fused import fused_decode_static

            return fused_decode_static(self, self.fused, cache, meta, row_seq, max_len, splits)
        b = meta.shape[0]
        ids, pos, slots = meta[:, 0:1].long(), meta[:, 1:2].long(), meta[:, 2].long()
        kv_lens, table = meta[:, 3].contiguous(), meta[:, 4:]
        h = self.embed(ids)  # [B, 1, hidden]
        cos, sin = self.rotary(h, pos)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, h, cos, sin)
            cache.write(li, slots, k.reshape(b, -1, self.head_dim), v.reshape(b, -1, self.head_dim))
            o = paged_attention(q.reshape(b, -1, self.head_dim), cache.k[li], cache.v[li], table, kv_lens, row_seq,
                                block_size=cache.block_size, scale=self.scaling, max_len=max_len, splits=splits)
            h = h + layer.self_attn.o_proj(o.view(b, 1, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits: torch.Tensor = self.lm_head(self.norm(h[:, 0])).float()
        return logits

    @torch.no_grad()
    def full_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Logits of the last token when the whole context is re-run without a cache (the
        re-prefill baseline the bench compares a decode step against)."""
        out = self.hf(torch.tensor([list(ids)], device=self.device), use_cache=False)
        logits: torch.Tensor = out.logits[0, -1].float()
        return logits


#: the largest batch a decode graph is captured for (larger batches run eagerly)
MAX_GRAPH_BATCH = 256
#: the smallest context bucket of a decode graph, in tokens
MIN_GRAPH_CONTEXT = 256


class DecodeGraphs:
    """CUDA graphs of :meth:`PagedQwen.decode_static`, one per (batch, context) bucket; see the module docstring."""

    def __init__(self, model: PagedQwen) -> None:
        self.model = model
        # (cache id, batch bucket, blocks) -> the graph and everything its replays read or write
        self.graphs: dict[tuple[int, int, int], _DecodeGraph] = {}
        self.captures = 0
        self.replays = 0

    @staticmethod
    def _bucket(n: int, floor: int = 1) -> int:
        return max(floor, 1 << max(0, n - 1).bit_length())

    def run(self, cache: CacheManager, ids: Sequence[int] | torch.Tensor, pos: Sequence[int] | torch.Tensor,
            slots: torch.Tensor, held: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor | None:
        """Logits ``[B, vocab]`` of one decode step through a graph (None: run it eagerly).

        Host work per step: the rows are filled in a numpy array (not torch ops, ~1 us each instead
        of several), copied into the graph's pinned host buffer and sent with one asynchronous copy
        (the previous step's copy is waited for before the buffer is rewritten)."""
        b = len(ids)
        bs = cache.block_size
        held_np = held.numpy()
        ctx_tokens = self._bucket(int(held_np.max()), MIN_GRAPH_CONTEXT)
        if b > MAX_GRAPH_BATCH or ctx_tokens > self._bucket(self.model.max_positions, MIN_GRAPH_CONTEXT):
            return None
        bb, width = self._bucket(b), -(-ctx_tokens // bs)
        nb = blocks.shape[1]
        if nb > width:
            return None
        rows = np.empty((bb, 4 + width), dtype=np.int32)
        rows[:b, 0], rows[:b, 1], rows[:b, 2], rows[:b, 3] = ids, pos, slots.numpy(), held_np
        rows[:b, 4 : 4 + nb] = blocks.numpy()
        rows[:b, 4 + nb :] = 0
        rows[b:] = rows[0]  # padding rows repeat row 0: the same K/V to the same slot, outputs dropped
        key = (id(cache), bb, width)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(cache, torch.from_numpy(rows), ctx_tokens)
            self.graphs[key] = entry
        if tuple(entry.meta.shape) != rows.shape:  # (the key fixes the shape; never replay past a buffer)
            raise RuntimeError(f"decode graph {key}: static meta {tuple(entry.meta.shape)} != step {rows.shape}")
        if entry.host is not None:  # CUDA: pinned buffer, asynchronous copy
            if entry.copied is not None:
                entry.copied.synchronize()  # the previous step's copy has read the buffer
            entry.host.numpy()[...] = rows
            entry.meta.copy_(entry.host, non_blocking=True)
            if entry.copied is not None:
                entry.copied.record()
        else:
            entry.meta.copy_(torch.from_numpy(rows))
        entry.graph.replay()
        self.replays += 1
        return entry.logits[:b].clone()

    def _capture(self, cache: CacheManager, host: torch.Tensor, ctx_tokens: int) -> _DecodeGraph:
        from .paged_attention import choose_splits

        m = self.model
        bb = host.shape[0]
        # the static inputs are allocated before the capture, outside the graph's pool: the entry
        # must hold every one of them for as long as the graph may replay (a replay reads their
        # addresses; a freed, reused row_seq once made every replay index the block table with
        # garbage: an illegal memory access on the H200)
        meta = host.to(m.device)
        row_seq = torch.arange(bb, dtype=torch.int32, device=m.device)
        splits = choose_splits(bb, m.kv_heads, ctx_tokens, m.device)
        side = torch.cuda.Stream(device=m.device)
        side.wait_stream(torch.cuda.current_stream(m.device))
        with torch.no_grad(), torch.cuda.stream(side):  # warm-up: compiles the kernels, writes this step's K/V
            for _ in range(2):
                m.decode_static(cache, meta, row_seq, ctx_tokens, splits)
        torch.cuda.current_stream(m.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # each graph its own memory pool (a few MB of activations plus its logits): replays in any order stay safe
        with torch.no_grad(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
            logits = m.decode_static(cache, meta, row_seq, ctx_tokens, splits)
        self.captures += 1
        host_buf, copied = None, None
        if m.device.type == "cuda":
            host_buf = torch.empty(tuple(host.shape), dtype=torch.int32, pin_memory=True)
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
        return _DecodeGraph(graph=graph, meta=meta, row_seq=row_seq, logits=logits, cache=cache,
                            ctx_tokens=ctx_tokens, splits=splits, host=host_buf, copied=copied)


class _DecodeGraph:
    """One captured decode graph and what it reads or writes by address: the static ``meta`` and
    ``row_seq`` inputs, the output ``logits`` (in the graph's pool) and the cache whose K/V it
    writes — all kept alive with the graph."""

    __slots__ = ("cache", "copied", "ctx_tokens", "graph", "host", "logits", "meta", "row_seq", "splits")

    def __init__(self, *, graph: Any, meta: torch.Tensor, row_seq: torch.Tensor, logits: torch.Tensor,
                 cache: CacheManager, ctx_tokens: int, splits: int, host: torch.Tensor | None = None,
                 copied: Any = None) -> None:
        self.graph, self.meta, self.row_seq, self.logits = graph, meta, row_seq, logits
        self.cache, self.ctx_tokens, self.splits = cache, ctx_tokens, splits
        #: CUDA: the pinned host copy of ``meta`` and the event of its last copy to the device
        self.host, self.copied = host, copied
