"""The fused decode step (``PagedQwen(fused=True)``; the family's ``options.decode_fused``): fewer,
larger kernels per layer for a decode step (one new token per sequence).

Why: at batch 1 a decode step of Qwen2.5-0.5B reads ~1 GB of weights (~0.25 ms on an H200), but the
module-by-module forward launches ~45 kernels per layer (RMSNorm alone is 8 elementwise kernels,
RoPE 10, the MLP 5, the residual adds 2): ~1,100 kernels a step, each a few microseconds even
replayed from a CUDA graph. Here a layer is 10-11 launches:

1. ``x = rms_norm(h)`` — fused with the previous residual add (``h += delta`` then the norm, one
   kernel, :func:`add_rms_norm`);
2. one GEMM for q, k and v (their weights concatenated once at load, bias too; the modules'
   own weights then become row slices of the merged tensor, so it costs no memory);
3. :func:`rope_write`: Qwen3's per-head q/k RMSNorm, RoPE on q and k, K and V stored into the
   paged cache at each row's slot, q out — one kernel for every head of every row;
4. the paged-attention kernel (:func:`omniloop_qwen.paged_attention.paged_attention`, plus its
   split-K merge);
5. ``o_proj``; 6. :func:`add_rms_norm` (residual + post-attention norm);
7. one GEMM for gate and up (concatenated); 8. :func:`silu_mul`; 9. ``down_proj``
   (its residual add is fused into the next layer's norm, or the final norm).

**Numerics.** Each kernel rounds where transformers' modules round (to the model dtype after every
op that torch runs in that dtype: ``q*cos``, ``rotate_half(q)*sin``, their sum; ``silu(g)``, ``*u``;
``h + delta``; the norm's ``x * rsqrt(var + eps)`` cast back, then ``* weight``), with float32 in
between, as torch's bf16 elementwise kernels compute. What can differ: the order of the norm's
float32 sum, ``rsqrt``/``exp`` approximations, and the merged GEMMs (cuBLAS may pick another
reduction split for a wider matrix) — so not bit-equal to the unfused step on CUDA bf16; the tests
state the tolerances (CPU float32 under Triton's interpreter: token-exact vs transformers, logits
within 2e-5 of the unfused triton step).

Kernels are defined on first use (``TRITON_INTERPRET`` is read then), as in
:mod:`omniloop_qwen.paged_attention`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .paged_attention import interpreting, paged_attention

_KERNELS: dict[bool, tuple[Any, Any, Any]] = {}


def _kernels() -> tuple[Any, Any, Any]:
    mode = interpreting()
    if mode in _KERNELS:
        return _KERNELS[mode]
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        # HAS_RES: res[row] = x[row] + res[row] (rounded to res' dtype), then out[row] = norm(res[row]);
        # else out[row] = norm(x[row]). Rows are contiguous, n_cols long.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(res_ptr.dtype.element_ty)
            tl.store(res_ptr + row * n_cols + cols, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / n_cols
        y = (xf * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        y = (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * n_cols + cols, y, mask=mask)

    @triton.jit
    def rope_write_kernel(
        qkv_ptr, cos_ptr, sin_ptr, slot_ptr, qkn_ptr, q_ptr, k_ptr, v_ptr,
        stride_qkv, stride_cs, stride_slot, stride_ks, stride_kh, stride_vs, stride_vh, eps, num_slots,
        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
        QK_NORM: tl.constexpr,
    ):
        # program (row, head): heads 0..HQ-1 are q (-> q_ptr [R, HQ, D]), then HKV k heads, then HKV v
        # heads (-> the cache at the row's slot); q and k get Qwen3's per-head norm (QK_NORM) and RoPE
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        j = tl.arange(0, HALF_PAD)
        m = j < HALF
        src = qkv_ptr + row * stride_qkv + head * D
        x1 = tl.load(src + j, mask=m, other=0.0)
        x2 = tl.load(src + HALF + j, mask=m, other=0.0)
        slot = tl.load(slot_ptr + row * stride_slot).to(tl.int64)
        slot = tl.minimum(tl.maximum(slot, 0), num_slots - 1)  # (defence in depth, as the attention kernel)
        if head < HQ + HKV:
            f1 = x1.to(tl.float32)
            f2 = x2.to(tl.float32)
            if QK_NORM:
                w_off = (head >= HQ).to(tl.int32) * D  # row 0: q_norm's weight, row 1: k_norm's
                w1 = tl.load(qkn_ptr + w_off + j, mask=m, other=0.0).to(tl.float32)
                w2 = tl.load(qkn_ptr + w_off + HALF + j, mask=m, other=0.0).to(tl.float32)
                inv = tl.rsqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / D + eps)
                f1 = (w1 * (f1 * inv).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
                f2 = (w2 * (f2 * inv).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
            c1 = tl.load(cos_ptr + row * stride_cs + j, mask=m, other=0.0).to(tl.float32)
            c2 = tl.load(cos_ptr + row * stride_cs + HALF + j, mask=m, other=0.0).to(tl.float32)
            s1 = tl.load(sin_ptr + row * stride_cs + j, mask=m, other=0.0).to(tl.float32)
            s2 = tl.load(sin_ptr + row * stride_cs + HALF + j, mask=m, other=0.0).to(tl.float32)
            # q*cos + rotate_half(q)*sin, rotate_half(q) = cat(-q2, q1); each product and the sum rounded
            o1 = (f1 * c1).to(x1.dtype).to(tl.float32) - (f2 * s1).to(x1.dtype).to(tl.float32)
            o2 = (f2 * c2).to(x1.dtype).to(tl.float32) + (f1 * s2).to(x1.dtype).to(tl.float32)
            if head < HQ:
                dst = q_ptr + row * (HQ * D) + head * D
                tl.store(dst + j, o1.to(q_ptr.dtype.element_ty), mask=m)
                tl.store(dst + HALF + j, o2.to(q_ptr.dtype.element_ty), mask=m)
            else:
                dst = k_ptr + slot * stride_ks + (head - HQ) * stride_kh
                tl.store(dst + j, o1.to(x1.dtype).to(k_ptr.dtype.element_ty), mask=m)
                tl.store(dst + HALF + j, o2.to(x1.dtype).to(k_ptr.dtype.element_ty), mask=m)
        else:
            dst = v_ptr + slot * stride_vs + (head - HQ - HKV) * stride_vh
            tl.store(dst + j, x1.to(v_ptr.dtype.element_ty), mask=m)
            tl.store(dst + HALF + j, x2.to(v_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def silu_mul_kernel(gu_ptr, out_ptr, n_inter, stride_gu, stride_out, BLOCK: tl.constexpr):
        # out[row] = silu(gu[row, :n]) * gu[row, n:], silu rounded to the dtype first (as torch runs it)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_inter
        g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
        u = tl.load(gu_ptr + row * stride_gu + n_inter + cols, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        o = (s.to(tl.float32) * u.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_out + cols, o, mask=mask)

    _KERNELS[mode] = (add_rms_norm_kernel, rope_write_kernel, silu_mul_kernel)
    return _KERNELS[mode]


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``Qwen2RMSNorm(residual + x)`` of contiguous ``[R, hidden]`` rows; with ``residual`` the sum
    is also written back into ``residual`` (the new residual stream). Returns the normed rows."""
    if x.dim() != 2 or not x.is_contiguous() or (residual is not None and (residual.shape != x.shape or not residual.is_contiguous())):
        raise ValueError(f"add_rms_norm: expected contiguous [rows, hidden] x and residual, got {tuple(x.shape)}")
    if out is None:
        out = torch.empty_like(x if residual is None else residual)
    norm, _, _ = _kernels()
    r, n = x.shape
    norm[(r,)](x, residual if residual is not None else x, weight, out, n, float(eps),
               HAS_RES=residual is not None, BLOCK=_pow2(n))
    return out


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, *, q_heads: int, kv_heads: int, head_dim: int,
               qk_norm: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Split ``qkv`` (``[R, (q_heads + 2 kv_heads) * head_dim]``, q then k then v), apply Qwen3's
    q/k norm (``qk_norm``: ``[2, head_dim]``, q_norm's then k_norm's weight) and RoPE (``cos``/``sin``:
    ``[R, head_dim]``), store K and V into the caches (``[slots, kv_heads, head_dim]``) at
    ``slots[r]`` (int32 ``[R]``, any stride); return q ``[R, q_heads, head_dim]``."""
    r = qkv.shape[0]
    d = head_dim
    if d % 2 or qkv.shape[1] != (q_heads + 2 * kv_heads) * d or qkv.stride(1) != 1:
        raise ValueError(f"rope_write: qkv {tuple(qkv.shape)} is not [rows, ({q_heads} + 2*{kv_heads}) * {d}]")
    if cos.shape != (r, d) or sin.shape != cos.shape or cos.stride() != sin.stride() or cos.stride(1) != 1:
        raise ValueError(f"rope_write: cos/sin {tuple(cos.shape)}/{tuple(sin.shape)}: expected ({r}, {d}), same strides")
    if slots.shape != (r,) or slots.dtype != torch.int32:
        raise ValueError(f"rope_write: slots must be int32 [{r}], got {slots.dtype} {tuple(slots.shape)}")
    if k_cache.shape[1:] != (kv_heads, d) or v_cache.shape != k_cache.shape or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError(f"rope_write: caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} are not [slots, {kv_heads}, {d}]")
    if qk_norm is not None and qk_norm.shape != (2, d):
        raise ValueError(f"rope_write: qk_norm must be [2, {d}], got {tuple(qk_norm.shape)}")
    q = torch.empty((r, q_heads, d), dtype=qkv.dtype, device=qkv.device)
    if r == 0:
        return q
    _, rope, _ = _kernels()
    half = d // 2
    rope[(r, q_heads + 2 * kv_heads)](
        qkv, cos, sin, slots, qk_norm if qk_norm is not None else cos, q, k_cache, v_cache,
        qkv.stride(0), cos.stride(0), slots.stride(0) if r > 1 else 1, k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), float(eps), k_cache.shape[0],
        HQ=q_heads, HKV=kv_heads, D=d, HALF=half, HALF_PAD=_pow2(half), QK_NORM=qk_norm is not None,
    )
    return q


#: columns of the SiLU·mul kernel's program
_SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` = ``[R, 2 * inter]`` (gate columns first), as ``[R, inter]``."""
    r, two = gate_up.shape
    if two % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_mul: expected [rows, 2 * intermediate] with contiguous rows, got {tuple(gate_up.shape)}")
    n = two // 2
    out = torch.empty((r, n), dtype=gate_up.dtype, device=gate_up.device)
    if r == 0:
        return out
    _, _, silu = _kernels()
    block = min(_SILU_BLOCK, _pow2(n))
    silu[(r, -(-n // block))](gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block)
    return out


def _eps(norm: Any) -> float:
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None:
        eps = getattr(norm, "eps", None)
    if eps is None:
        raise ValueError(f"{type(norm).__name__}: no variance_epsilon / eps attribute (not an RMSNorm this path knows)")
    return float(eps)


def _share(merged: torch.Tensor, modules: list[Any], name: str) -> None:
    """Rebind ``module.<name>`` of each module to its row slice of ``merged`` (their ``torch.cat``:
    the same values; the module path — prefill, transformers' own forward — then reads the merged
    tensor's storage, so the merged copy costs no memory)."""
    row = 0
    for mod in modules:
        old = getattr(mod, name)
        n = old.shape[0]
        setattr(mod, name, torch.nn.Parameter(merged[row : row + n], requires_grad=old.requires_grad))
        row += n


class FusedWeights:
    """What the fused step reads besides the transformers modules: per layer q/k/v's weights (and
    biases) concatenated, gate/up's concatenated, q_norm/k_norm's stacked (Qwen3), each norm's
    eps. Built once at load. The modules' own q/k/v and gate/up weights (and biases) are then
    rebound to row slices of the merged tensors (equal values, contiguous), so the merged weights
    add no memory (before that, they held a second copy: ~0.44 GiB for Qwen2.5-0.5B in bf16)."""

    def __init__(self, model: Any) -> None:
        cfg = model.hf.config
        act = str(getattr(cfg, "hidden_act", "silu"))
        self.fused_mlp = act == "silu"
        self.qkv_w: list[torch.Tensor] = []
        self.qkv_b: list[torch.Tensor | None] = []
        self.gate_up: list[torch.Tensor | None] = []
        self.qk_norm: list[torch.Tensor | None] = []
        self.in_eps: list[float] = []
        self.post_eps: list[float] = []
        self.qk_eps: list[float] = []
        with torch.no_grad():
            for layer in model.layers:
                a = layer.self_attn
                projs = (a.q_proj, a.k_proj, a.v_proj)
                biases = [p.bias for p in projs]
                if any(b is not None for b in biases) and not all(b is not None for b in biases):
                    raise ValueError("fused decode: q/k/v projections mix biased and unbiased layers")
                self.qkv_w.append(torch.cat([p.weight for p in projs]).contiguous())
                _share(self.qkv_w[-1], list(projs), "weight")
                qkv_b = torch.cat(biases).contiguous() if biases[0] is not None else None
                if qkv_b is not None:
                    _share(qkv_b, list(projs), "bias")
                self.qkv_b.append(qkv_b)
                mlp = layer.mlp
                plain = all(getattr(getattr(mlp, n, None), "bias", 1) is None for n in ("gate_proj", "up_proj"))
                gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).contiguous() if self.fused_mlp and plain else None
                if gate_up is not None:
                    _share(gate_up, [mlp.gate_proj, mlp.up_proj], "weight")
                self.gate_up.append(gate_up)
                if model.qk_norm:
                    self.qk_norm.append(torch.stack([a.q_norm.weight, a.k_norm.weight]).contiguous())
                    self.qk_eps.append(_eps(a.q_norm))
                else:
                    self.qk_norm.append(None)
                    self.qk_eps.append(1e-6)
                self.in_eps.append(_eps(layer.input_layernorm))
                self.post_eps.append(_eps(layer.post_attention_layernorm))
        self.final_eps = _eps(model.norm)


def fused_decode_static(model: Any, weights: FusedWeights, cache: Any, meta: torch.Tensor, row_seq: torch.Tensor,
                        max_len: int, splits: int | None) -> torch.Tensor:
    """:meth:`PagedQwen.decode_static` with the fused kernels: ``meta`` int32 ``[B, 4 + blocks]``
    rows ``[token, position, new slot, kv length, block table...]``; float32 logits ``[B, vocab]``."""
    m = model
    b = meta.shape[0]
    ids, pos = meta[:, 0].long(), meta[:, 1:2].long()
    slots, kv_lens, table = meta[:, 2], meta[:, 3].contiguous(), meta[:, 4:]
    h = m.embed(ids).contiguous()  # [B, hidden]: the residual stream, updated in place
    cos, sin = m.rotary(h[:, None], pos)  # [B, 1, D] in the model dtype (the checkpoint's own rotary module)
    cos, sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()
    n_layers = len(m.layers)
    x = add_rms_norm(h, m.layers[0].input_layernorm.weight, weights.in_eps[0])
    for li, layer in enumerate(m.layers):
        attn = layer.self_attn
        qkv = F.linear(x, weights.qkv_w[li], weights.qkv_b[li])
        q = rope_write(qkv, cos, sin, slots, cache.k[li], cache.v[li], q_heads=m.num_heads, kv_heads=m.kv_heads,
                       head_dim=m.head_dim, qk_norm=weights.qk_norm[li], eps=weights.qk_eps[li])
        o = paged_attention(q, cache.k[li], cache.v[li], table, kv_lens, row_seq, block_size=cache.block_size,
                            scale=m.scaling, max_len=max_len, splits=splits)
        delta = attn.o_proj(o.view(b, -1))
        x = add_rms_norm(delta, layer.post_attention_layernorm.weight, weights.post_eps[li], residual=h, out=x)
        gate_up = weights.gate_up[li]
        if gate_up is not None:
            delta = layer.mlp.down_proj(silu_mul(F.linear(x, gate_up)))
        else:
            delta = layer.mlp(x)
        last = li + 1 == n_layers
        w, eps = (m.norm.weight, weights.final_eps) if last else (m.layers[li + 1].input_layernorm.weight, weights.in_eps[li + 1])
        x = add_rms_norm(delta.contiguous(), w, eps, residual=h, out=x)
    logits: torch.Tensor = m.lm_head(x).float()
    return logits


def prepare() -> None:
    """Define the kernels now (outside any timed region or capture)."""
    _kernels()


__all__ = ["FusedWeights", "add_rms_norm", "fused_decode_static", "prepare", "rope_write", "silu_mul"]
