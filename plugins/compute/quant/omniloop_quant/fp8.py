"""FP8 (e4m3) linears: ``torch._scaled_mm`` with per-output-channel weight scales and per-token
activation scales.

:class:`FP8Linear` stands in for an ``nn.Linear``:

* the weight is quantised **once**, when the module is built: per output channel,
  ``scale_w[n] = max_k |W[n, k]| / 448`` and ``Wq = round_e4m3(W / scale_w)`` (a ``[out, in]``
  e4m3 buffer plus a ``[1, out]`` float32 buffer);
* the activation is quantised **per row** (per token) on every call:
  ``scale_x[m] = max_k |x[m, k]| / 448``, ``xq = round_e4m3(clamp(x / scale_x, ±448))`` — one
  row-wise reduction and one elementwise pass, written as plain torch ops so that inside a
  ``torch.compile``'d block (deploy ``compile: true``, ``fullgraph=True``) inductor fuses them
  with the elementwise ops before the linear (no graph break: :func:`quantize_rows` and
  ``torch._scaled_mm`` are both traceable);
* ``torch._scaled_mm(xq, Wq.T, scale_a=scale_x, scale_b=scale_w, bias=b, out_dtype=x.dtype)``:
  the GEMM accumulates in float32, applies both scales and the bias in its epilogue and writes
  the input's dtype (bf16 on the GPU).

So the output is ``(xq * scale_x) @ (Wq * scale_w).T + b`` computed in float32, i.e. exactly the
float32 product of the two dequantised operands (:func:`reference_output` computes that model).

``fast_accum=True`` (deploy ``linear_precision: fp8-fast``) passes ``use_fast_accum=True``: on Hopper the
tensor cores then accumulate the e4m3 products in their own reduced-precision accumulator without
cuBLASLt's periodic promotion to float32 — 1.7–1.8× a bf16 GEMM on Wan 1.3B's shapes instead of
1.3–1.6× (docs/quant-measurements.md), at a cost in accuracy that grows with ``in_features``. On the
CPU the flag changes nothing (the CPU kernel accumulates in float32 either way). Deploy
``linear_precision: fp8-fast-except-down`` sets it on every GEMM except the feed-forwards' down
projections (:func:`install`'s ``down_fast_accum=False``): the down projection reduces over the FFN's
inner width, by far the largest ``in_features`` in these blocks (Wan 1.3B: 8,960 vs 1,536 elsewhere;
14B: 13,824 vs 5,120), where fast accumulation's error is largest.

Shapes: ``_scaled_mm`` needs ``in_features`` and ``out_features`` to be multiples of 16. A linear
that is not is **left as it was** (computed in the model's dtype) and listed in the install
report's ``skipped`` — no padding (padding K or N would cost a copy of the activation per call
for layers too small to gain from FP8; every linear in Wan's blocks is a multiple of 16).

:func:`install` swaps the linears under some root modules in place and remembers what it
replaced; :func:`restore` puts the originals back (benchmarks run FP8 and bf16 configurations on
shared modules). diffusers' ``GELU`` (a ``proj`` linear then the activation) needs nothing
special: its ``proj`` is swapped like any linear. omniloop-wan's ``FusedGeluProjection``
(``options.ffn_gelu: fused``) reads ``proj.weight`` itself for its cuBLASLt GELU epilogue, so it
is replaced as a whole by :class:`FP8GeluProjection` (the FP8 GEMM, then tanh-GELU — fused by
inductor with the next linear's activation quantisation).

A diffusers ``FeedForward`` (``net = [GELU projection, Dropout, Linear]``, as in Wan, FLUX and SD3
blocks) is replaced as a whole by :class:`FP8FeedForward`: the same two FP8 GEMMs with the GELU
between them. On CUDA with :data:`FUSE_GELU_QUANT` set it computes the GELU and the down
projection's per-token quantisation in one Triton pass (:func:`omniloop_quant.kernels.gelu_quantize_rows`)
and hands the e4m3 rows straight to the down GEMM; elsewhere (the CPU, or the flag off) it runs the
torch ops of the separate modules, op for op. Dropout is not applied (inference: ``p`` is 0 in
these models, and FP8 modules are never trained).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from . import kernels as _kernels

#: largest finite e4m3 (``torch.float8_e4m3fn``) magnitude
E4M3_MAX = 448.0
#: the smallest amax a scale is computed from (an all-zero row or channel quantises to zeros)
_TINY_AMAX = 1e-12
#: ``_scaled_mm`` wants both GEMM dimensions of the weight to be multiples of this
ALIGN = 16
#: CUDA compute capability FP8 tensor-core GEMMs need (Ada 8.9, Hopper 9.0 and later)
MIN_CAPABILITY = (8, 9)

FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)

#: :class:`FP8FeedForward` on CUDA: the GELU and the down projection's activation quantisation as one
#: Triton pass (omniloop_quant.kernels) instead of inductor's fused ops. On by default since its H200 run
#: (2026-12-05: the GPU tests pass; Wan 1.3B FP8 step 1.577x -> 1.618x diffusers eager, 14B 1.694x ->
#: 1.712x, same run, the same latents to 1e-5 relative RMS); set False for inductor's own fusion.
FUSE_GELU_QUANT = True
#: an experiment for issue 40, not a deploy mode: with :data:`FUSE_GELU_QUANT` on CUDA, the feed-forward's
#: down GEMM as this many GEMMs over equal slices of its reduction (``in_features``), their outputs summed
#: (:meth:`FP8Linear.forward_quantized_split`) -- with fast accumulation each GEMM's reduced-precision
#: chain is that many times shorter (the down projection's 13,824-long one is why ``fp8-fast-except-down``
#: exists). 1: one GEMM (the default). Benchmarks set it (``bench/wan_gpu.py`` word ``-sk2``). Measured once
#: (H100, session 21): 2 with ``fp8-fast`` ran the Wan 14B FP8 forward at 1.881x diffusers eager against
#: 1.838x for ``fp8-fast-except-down``, with the same verdicts on 48 wan-demo clips; more clips first.
SPLIT_DOWN_K = 1


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Wq [out, in] e4m3, scale [1, out] float32)`` with ``W ≈ Wq * scale.T`` (per output channel)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1, keepdim=True).clamp(min=_TINY_AMAX)
    scale = amax / E4M3_MAX
    q = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return q.contiguous(), scale.reshape(1, -1).contiguous()


def quantize_rows(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(aq [M, K] e4m3, scale [M, 1] float32)`` with ``a ≈ aq * scale`` (per row, i.e. per token).

    Plain torch ops, traceable by dynamo without a break: under ``torch.compile`` inductor emits one
    row-reduction kernel fused with the producer of ``a``."""
    af = a.float()
    scale = af.abs().amax(dim=-1, keepdim=True).clamp(min=_TINY_AMAX) / E4M3_MAX
    q = (af / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return q, scale


def shape_ok(linear: nn.Linear) -> bool:
    """Whether ``_scaled_mm`` takes this linear's weight (both dimensions multiples of 16)."""
    return linear.in_features % ALIGN == 0 and linear.out_features % ALIGN == 0


class FP8Linear(nn.Module):
    """An ``nn.Linear`` computed as an e4m3 GEMM (see the module docstring). Built from a linear,
    whose weight it quantises once; the bias is shared with it (not copied)."""

    def __init__(self, linear: nn.Linear, *, fast_accum: bool = False) -> None:
        super().__init__()
        #: ``use_fast_accum`` of the GEMM (see the module docstring)
        self.fast_accum = bool(fast_accum)
        if not shape_ok(linear):
            raise ValueError(f"FP8Linear: in_features {linear.in_features} and out_features {linear.out_features} "
                             f"must be multiples of {ALIGN}")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        qweight, scale = quantize_weight(linear.weight)
        self.register_buffer("qweight", qweight)
        self.register_buffer("weight_scale", scale)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xq, sx = quantize_rows(x.reshape(-1, self.in_features))
        return self.forward_quantized(xq, sx, x.dtype).reshape(*lead, self.out_features)

    def forward_quantized(self, xq: torch.Tensor, sx: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """The GEMM on an input already quantised per row (``xq [M, in]`` e4m3, ``sx [M, 1]`` float32):
        ``[M, out]`` in ``out_dtype``."""
        bias = self.bias
        if bias is not None and bias.dtype != out_dtype:
            bias = bias.to(out_dtype)
        return torch._scaled_mm(xq, self.qweight.t(), scale_a=sx, scale_b=self.weight_scale, bias=bias,
                                out_dtype=out_dtype, use_fast_accum=self.fast_accum)

    def forward_quantized_split(self, xq: torch.Tensor, sx: torch.Tensor, out_dtype: torch.dtype,
                                parts: int) -> torch.Tensor:
        """:meth:`forward_quantized` as ``parts`` GEMMs over equal column slices of ``xq`` (and of the
        weight's input channels), their ``out_dtype`` outputs summed (the bias added once); one GEMM
        where ``in_features`` does not split into ``parts`` slices of a multiple of 16."""
        k = self.in_features // parts if parts > 1 else self.in_features
        if parts < 2 or self.in_features % parts or k % ALIGN:
            return self.forward_quantized(xq, sx, out_dtype)
        bias = self.bias
        if bias is not None and bias.dtype != out_dtype:
            bias = bias.to(out_dtype)
        out: torch.Tensor | None = None
        for i in range(parts):
            cols = slice(i * k, (i + 1) * k)
            y = torch._scaled_mm(xq[:, cols], self.qweight[:, cols].t(), scale_a=sx, scale_b=self.weight_scale,
                                 bias=bias if i == 0 else None, out_dtype=out_dtype, use_fast_accum=self.fast_accum)
            out = y if out is None else out + y
        assert out is not None
        return out

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight this layer actually multiplies by (``Wq * scale``)."""
        return self.qweight.float() * self.weight_scale.reshape(-1, 1)

    def extra_repr(self) -> str:
        fast = ", fast_accum" if self.fast_accum else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, e4m3{fast}"


class FP8PartLinear(nn.Module):
    """A fused projection (diffusers' ``to_qkv`` = ``[W_q; W_k; W_v]``, ``to_kv``) whose output is ``parts``
    equal row blocks, those in ``keep`` computed in the model dtype and the others as FP8 GEMMs: the deploy's
    ``linear_precision_options.keep`` naming a separate projection (``attn.to_v``) that the deployment computes
    through the fused one. The input is quantised once; each run of adjacent blocks of one kind is one GEMM;
    the outputs are concatenated in the fused order (one copy of the output: the price of keeping part of a
    fused GEMM). The kept rows are copied out of the original weight, so the original can be freed."""

    def __init__(self, linear: nn.Linear, parts: int, keep: Iterable[int], *, fast_accum: bool = False) -> None:
        super().__init__()
        kept = frozenset(keep)
        n = linear.out_features // parts if parts > 0 else 0
        if parts < 2 or n * parts != linear.out_features or not kept or not kept < frozenset(range(parts)):
            raise ValueError(f"FP8PartLinear: {linear.out_features} outputs in {parts} parts, keeping {sorted(kept)}: "
                             "need equal parts and at least one part in FP8 and one kept")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        #: per part, whether it stays in the model dtype
        self.kept = tuple(i in kept for i in range(parts))
        self.pieces = nn.ModuleList()
        start = 0
        while start < parts:
            end = start
            while end < parts and self.kept[end] == self.kept[start]:
                end += 1
            rows = slice(start * n, end * n)
            piece = nn.Linear(linear.in_features, (end - start) * n, bias=linear.bias is not None,
                              device=linear.weight.device, dtype=linear.weight.dtype)
            with torch.no_grad():
                piece.weight.copy_(linear.weight[rows])
                if linear.bias is not None:
                    piece.bias.copy_(linear.bias[rows])
            piece.requires_grad_(False)
            self.pieces.append(piece if self.kept[start] else FP8Linear(piece, fast_accum=fast_accum))
            start = end

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        xq, sx = quantize_rows(flat)
        outs = [p.forward_quantized(xq, sx, x.dtype) if isinstance(p, FP8Linear) else p(flat) for p in self.pieces]
        return torch.cat(outs, dim=-1).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        kinds = "".join("k" if k else "8" for k in self.kept)
        return f"in_features={self.in_features}, out_features={self.out_features}, parts={kinds} (k: kept, 8: e4m3)"


class FP8GeluProjection(nn.Module):
    """``gelu(FP8Linear(x), approximate)``: stands in for a fused GELU projection (``proj`` + activation)."""

    def __init__(self, proj: nn.Linear, approximate: str, *, fast_accum: bool = False) -> None:
        super().__init__()
        self.proj = FP8Linear(proj, fast_accum=fast_accum)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.proj(x), approximate=self.approximate)


class FP8FeedForward(nn.Module):
    """Stands in for a diffusers ``FeedForward`` (GELU projection → dropout → linear): two
    :class:`FP8Linear` GEMMs (``up``, ``down``) with the GELU between (see the module docstring)."""

    def __init__(self, up: nn.Linear, approximate: str, down: nn.Linear, *, fast_accum: bool = False,
                 down_fast_accum: bool | None = None) -> None:
        """``fast_accum``: both GEMMs' ``use_fast_accum``; ``down_fast_accum``, when not None, the down
        GEMM's instead (its reduction is over the inner width, the largest ``in_features``)."""
        super().__init__()
        self.up = FP8Linear(up, fast_accum=fast_accum)
        self.down = FP8Linear(down, fast_accum=fast_accum if down_fast_accum is None else down_fast_accum)
        self.approximate = approximate

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        lead = hidden_states.shape[:-1]
        h = self.up(hidden_states).reshape(-1, self.up.out_features)
        return self._down(h).reshape(*lead, self.down.out_features)

    def forward_quantized(self, xq: torch.Tensor, sx: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """The feed-forward on an input already quantised per row (``xq [M, in]`` e4m3, ``sx [M, 1]``
        float32, e.g. by :func:`omniloop_quant.norm_kernels.residual_norm_quantize_rows`): ``[M, out]``."""
        return self._down(self.up.forward_quantized(xq, sx, out_dtype))

    def _down(self, h: torch.Tensor) -> torch.Tensor:
        """GELU then the down GEMM on the up projection's rows ``h [M, inner]``."""
        if FUSE_GELU_QUANT and _kernels.supported(h):
            q, scale = _kernels.gelu_quantize_rows(h, self.approximate)
            if SPLIT_DOWN_K > 1:
                return self.down.forward_quantized_split(q, scale, h.dtype, SPLIT_DOWN_K)
            return self.down.forward_quantized(q, scale, h.dtype)
        return self.down(torch.nn.functional.gelu(h, approximate=self.approximate))


def _feed_forward_parts(module: nn.Module) -> tuple[nn.Linear, str, nn.Linear] | None:
    """``(up projection, approximate, down projection)`` of a diffusers ``FeedForward`` with a GELU
    (``GELU`` or omniloop-wan's ``FusedGeluProjection``: a ``proj`` linear and an ``approximate`` mode),
    dropouts around the down projection, both linears FP8-shaped; else None. Recognised by shape,
    named so (like :func:`_is_fused_gelu`)."""
    if type(module).__name__ != "FeedForward":
        return None
    net = getattr(module, "net", None)
    if not isinstance(net, nn.ModuleList) or len(net) not in (3, 4):
        return None
    act, drop, down = net[0], net[1], net[2]
    proj, approximate = getattr(act, "proj", None), getattr(act, "approximate", None)
    if (type(act).__name__ not in ("GELU", "FusedGeluProjection") or not isinstance(proj, nn.Linear)
            or approximate not in ("tanh", "none") or not isinstance(drop, nn.Dropout)
            or not isinstance(down, nn.Linear) or (len(net) == 4 and not isinstance(net[3], nn.Dropout))):
        return None
    if not (shape_ok(proj) and shape_ok(down)):
        return None
    return proj, approximate, down


def reference_output(layer: FP8Linear, x: torch.Tensor) -> torch.Tensor:
    """The numerical model of ``layer(x)`` in float32: dequantised activation @ dequantised weight + bias."""
    a = x.reshape(-1, layer.in_features)
    xq, sx = quantize_rows(a)
    out = (xq.float() * sx) @ layer.dequantized_weight().t()
    if layer.bias is not None:
        out = out + layer.bias.float()
    return out.reshape(*x.shape[:-1], layer.out_features)


_CPU_ROWWISE: bool | None = None


def _cpu_rowwise_scales() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes row-wise scales (torch 2.11's asserts one scale per
    tensor, seen on the GPU machine on 2026-12-05; 2.13's takes them). Probed once, on a 16×16 product."""
    global _CPU_ROWWISE
    if _CPU_ROWWISE is None:
        a = torch.ones(16, 16).to(FP8_DTYPE)
        try:
            torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
            _CPU_ROWWISE = True
        except RuntimeError:
            _CPU_ROWWISE = False
    return _CPU_ROWWISE


def unavailable_reason(device: str | torch.device, dtype: torch.dtype | None = None) -> str | None:
    """Why FP8 linears cannot run on ``device`` with model ``dtype`` (None when they can).

    CUDA needs compute capability >= 8.9 (FP8 tensor cores: Ada, Hopper and later) and bf16 weights
    (cuBLASLt's row-wise scaled FP8 GEMM writes bf16). The CPU is allowed where torch's CPU
    ``_scaled_mm`` takes row-wise scales: it computes the same math (slowly) — for tests and
    references, not for speed."""
    if FP8_DTYPE is None or not hasattr(torch, "_scaled_mm"):
        return f"this torch ({torch.__version__}) has no float8_e4m3fn / _scaled_mm"
    dev = torch.device(device)
    if dev.type == "cpu":
        if not _cpu_rowwise_scales():
            return (f"this torch's ({torch.__version__}) CPU _scaled_mm takes one scale per tensor, not the per-row "
                    "and per-channel scales FP8 linears use (torch 2.13's does)")
        return None
    if dev.type != "cuda":
        return f"FP8 GEMMs run on CUDA (capability >= 8.9) or the CPU, not on {dev.type!r}"
    if not torch.cuda.is_available():
        return "CUDA is not available on this machine"
    cap = torch.cuda.get_device_capability(dev)
    if tuple(cap) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(dev)
        return (f"FP8 GEMMs need CUDA compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
                f"(Ada/Hopper); {name} is {cap[0]}.{cap[1]}")
    if dtype is not None and dtype != torch.bfloat16:
        return f"on CUDA the FP8 GEMM writes bfloat16: deploy dtype must be bfloat16, not {str(dtype).removeprefix('torch.')}"
    return None


# --------------------------------------------------------------------------------------------
# swapping modules in place
# --------------------------------------------------------------------------------------------

#: root module -> [(parent, attribute name, original, replacement)]
_SWAPS: weakref.WeakKeyDictionary[nn.Module, list[tuple[nn.Module, str, nn.Module | None, nn.Module]]] = (
    weakref.WeakKeyDictionary()
)


def _is_fused_gelu(module: nn.Module) -> bool:
    """omniloop-wan's ``FusedGeluProjection`` (reads ``proj.weight`` itself), recognised by shape:
    a ``proj`` linear and an ``approximate`` mode, named so."""
    return (type(module).__name__ == "FusedGeluProjection" and isinstance(getattr(module, "proj", None), nn.Linear)
            and isinstance(getattr(module, "approximate", None), str))


def _children(module: nn.Module, prefix: str = "", exclude: Callable[[str], bool] | None = None,
              ) -> Iterable[tuple[nn.Module, str, nn.Module, str]]:
    """(parent, name, child, dotted path) for every module under ``module``, parents before
    children; nothing below a module that will be replaced or that ``exclude`` keeps."""
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        yield module, name, child, path
        if exclude is not None and exclude(path):
            continue
        if not isinstance(child, nn.Linear) and not _is_fused_gelu(child) and _feed_forward_parts(child) is None:
            yield from _children(child, f"{path}.", exclude)


def _feed_forward_downs(root: nn.Module) -> set[int]:
    """``id`` of the down projection (``net[2]``, an ``nn.Linear``) of every diffusers ``FeedForward``
    under ``root`` -- also of one not taken whole by :class:`FP8FeedForward` (e.g. GEGLU, or an up
    projection of unaligned width), whose linears :func:`install` swaps one by one."""
    out: set[int] = set()
    for module in root.modules():
        net = getattr(module, "net", None)
        if (type(module).__name__ == "FeedForward" and isinstance(net, nn.ModuleList) and len(net) >= 3
                and isinstance(net[2], nn.Linear)):
            out.add(id(net[2]))
    return out


def _gemms(module: nn.Module) -> int:
    """How many linears a replacement module quantised (a feed-forward holds two)."""
    return 2 if isinstance(module, FP8FeedForward) else 1


def install(roots: Iterable[nn.Module], *, keep_original: bool = True, names: Iterable[str] | None = None,
            fast_accum: bool = False, down_fast_accum: bool | None = None,
            exclude: Callable[[str], bool] | None = None,
            parts: Mapping[str, tuple[int, frozenset[int]]] | None = None) -> dict[str, Any]:
    """Swap every ``nn.Linear`` under each of ``roots`` (e.g. a transformer's blocks) for an
    :class:`FP8Linear`, in place; returns ``{"quantized": n, "skipped": [names and shapes]}``.

    ``names``: one label per root for the report (default ``root<i>``). A root already installed
    is left as it is. ``keep_original=False`` keeps no reference to the
    replaced modules (their bf16 weights can be freed; :func:`restore` then cannot undo).
    ``fast_accum``: the GEMMs' ``use_fast_accum`` (:class:`FP8Linear`); ``down_fast_accum``, when not
    None, that of the feed-forwards' down projections instead (a diffusers ``FeedForward``'s ``net[2]``,
    :class:`FP8FeedForward`'s ``down``): ``fast_accum=True, down_fast_accum=False`` is deploy
    ``linear_precision: fp8-fast-except-down``. ``exclude(path)``: True keeps the module at that dotted
    path under its root (``"0.attn.to_q"``, a whole ``"0.ff"``) as it is, and everything below it —
    to measure which layers FP8 costs accuracy in (``bench/fp8_error.py --groups``). ``parts``: a fused
    linear's path under its root -> ``(equal parts, the parts kept)``, built as :class:`FP8PartLinear`."""
    quantized = 0
    skipped: list[str] = []
    labels = list(names) if names is not None else None
    for i, root in enumerate(roots):
        label = labels[i] if labels is not None else f"root{i}"
        if root in _SWAPS:
            quantized += sum(_gemms(new) for *_, new in _SWAPS[root] if new is not None)
            continue
        swaps: list[tuple[nn.Module, str, nn.Module | None, nn.Module]] = []
        downs = _feed_forward_downs(root) if down_fast_accum is not None else set()
        for parent, name, child, path in list(_children(root, exclude=exclude)):
            if exclude is not None and exclude(path):
                continue
            new: nn.Module | None = None
            ffn = _feed_forward_parts(child)
            if ffn is not None:
                up, approximate, down = ffn
                new = FP8FeedForward(up, approximate, down, fast_accum=fast_accum, down_fast_accum=down_fast_accum)
            elif _is_fused_gelu(child):
                if shape_ok(child.proj):
                    new = FP8GeluProjection(child.proj, child.approximate, fast_accum=fast_accum)
                else:
                    skipped.append(f"{label}.{path}.proj {child.proj.in_features}->{child.proj.out_features}")
            elif isinstance(child, nn.Linear) and parts and path in parts:
                count, kept = parts[path]
                if child.in_features % ALIGN == 0 and child.out_features % (count * ALIGN) == 0:
                    new = FP8PartLinear(child, count, kept, fast_accum=fast_accum)
                else:
                    skipped.append(f"{label}.{path} {child.in_features}->{child.out_features}")
            elif isinstance(child, nn.Linear):
                if shape_ok(child):
                    down_ = down_fast_accum is not None and id(child) in downs
                    new = FP8Linear(child, fast_accum=bool(down_fast_accum) if down_ else fast_accum)
                else:
                    skipped.append(f"{label}.{path} {child.in_features}->{child.out_features}")
            if new is None:
                continue
            if isinstance(parent, (nn.ModuleList, nn.Sequential)) and name.isdigit():
                parent[int(name)] = new
            else:
                setattr(parent, name, new)
            swaps.append((parent, name, child if keep_original else None, new))
            quantized += _gemms(new)
        _SWAPS[root] = swaps
    return {"quantized": quantized, "skipped": skipped}


def restore(roots: Iterable[nn.Module]) -> int:
    """Put back the modules :func:`install` replaced under ``roots`` (where the FP8 module is still
    in place); returns how many. Raises ``RuntimeError`` for a root installed with
    ``keep_original=False``."""
    n = 0
    for root in roots:
        swaps = _SWAPS.pop(root, [])
        if any(orig is None for _, _, orig, _ in swaps):
            _SWAPS[root] = swaps
            raise RuntimeError("restore: these FP8 linears were installed with keep_original=False")
        for parent, name, original, new in reversed(swaps):
            current = parent[int(name)] if isinstance(parent, (nn.ModuleList, nn.Sequential)) and name.isdigit() \
                else getattr(parent, name)
            if current is not new:
                continue
            if isinstance(parent, (nn.ModuleList, nn.Sequential)) and name.isdigit():
                parent[int(name)] = original
            else:
                setattr(parent, name, original)
            n += 1
    return n


def installed(root: nn.Module) -> bool:
    return root in _SWAPS


__all__ = ["ALIGN", "E4M3_MAX", "FUSE_GELU_QUANT", "MIN_CAPABILITY", "FP8FeedForward", "FP8GeluProjection", "FP8Linear",
           "FP8PartLinear", "install", "installed",
           "quantize_rows", "quantize_weight", "reference_output", "restore", "shape_ok", "unavailable_reason"]
