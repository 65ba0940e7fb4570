"""``cudnn-fp8``: attention with q/k/v in FP8 (e4m3) through cuDNN's ``sdpa_fp8`` graph (Hopper).

What runs: q, k and v are scaled per tensor so that their largest magnitude maps to the top of
e4m3 (448), rounded to e4m3 and handed to a cuDNN frontend graph (``nvidia-cudnn-frontend``)
with their descales. The kernel rescales the logits, takes the softmax in float32, quantises the
probabilities to e4m3 (scale 448: they lie in [0, 1]), multiplies by v in FP8 and — on Hopper the
FP8 forward only writes FP8 — writes the output in e4m3 too (scaled by ``O_HEADROOM / amax(v)``:
each output row is a convex combination of v rows, so ``|o| <= amax(v)``). The output is
dequantised to the query's dtype.

Why per tensor: e4m3 is a floating-point format, so a scale only sets where its ~17 octaves of
range sit; precision (3 mantissa bits) is the same for every normal value. Per-head scales only
help when heads differ by several octaves (``bench/attention_fp8_quality.py`` measures per tensor
against per head on activations captured from a real wan-demo forward).

Distribution-altering: refused for ``exact: true`` requests; never a fallback. Refused at load
without CUDA, off Hopper (sm90) or without the ``cudnn`` module (``pip install
'omniloop-attention[fp8]'``). A call with an attention mask or ``is_causal`` is an error.

The graph call is a ``torch.library`` custom op (``omniloop_attention::cudnn_fp8_sdpa``) so that
``torch.compile(fullgraph=True)`` keeps it in the graph; graphs are built once per shape and
stride pattern and cached.

Which of cuDNN's execution plans runs (``attention_options: {plan: ...}``, :data:`PLAN_MODES`):
``heuristic`` takes the first plan of heuristic mode A (then FALLBACK) that builds — cuDNN's own
pick; ``fastest`` builds every plan of modes A, B and FALLBACK for the shape and, at the first call
with that shape, runs each a few times on the real inputs and keeps the fastest (a one-time cost of
about a second per shape; the timings are kept in :data:`PLAN_TIMINGS`). Every plan computes the
same graph; they differ in kernels and tiling, so outputs may differ in rounding.

The Wan family can hand over q and k already quantised by its fused QK-norm + rotary Triton
kernel (:meth:`CudnnFP8Attention.attend_quantized`; ``omniloop_wan.attention``), saving the
separate quantisation passes over q and k.
"""

from __future__ import annotations

import importlib.util
import math
import threading
from typing import Any

import torch
from attrs import define

E4M3_MAX = 448.0
#: ``attention_options.plan`` values (see the module docstring)
PLAN_MODES = ("heuristic", "fastest")
#: output scale = O_HEADROOM / amax(v): below 448 so that rounding of the quantised
#: probabilities (which can push a row's weights a few % above 1) never saturates
O_HEADROOM = 384.0
#: probabilities lie in [0, 1]: the kernel scales them by this before rounding to e4m3
P_SCALE = E4M3_MAX
_TINY = 1e-12


def fp8_dtype() -> torch.dtype | None:
    return getattr(torch, "float8_e4m3fn", None)


def cudnn_fp8_available() -> str | None:
    """None when the cuDNN FP8 attention graph can run here, else the reason it cannot."""
    if fp8_dtype() is None:
        return f"this torch ({torch.__version__}) has no float8_e4m3fn dtype"
    if not torch.cuda.is_available():
        return "CUDA is not available on this machine"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return (f"cuDNN FP8 attention is enabled for Hopper (sm90) only; this GPU is sm{major}{minor} "
                "(pre-Hopper GPUs have no FP8 tensor cores; Blackwell is untested here)")
    if importlib.util.find_spec("cudnn") is None:
        return "the nvidia-cudnn-frontend package (module 'cudnn') is not installed (pip install 'omniloop-attention[fp8]')"
    try:
        import cudnn

        version = int(cudnn.backend_version())
    except Exception as exc:  # a broken install or a missing libcudnn: say so at load
        return f"the cudnn frontend cannot load: {type(exc).__name__}: {exc}"
    if version < 90100:
        return f"cuDNN FP8 attention needs cuDNN >= 9.1 (this one is {version})"
    return None


# --------------------------------------------------------------------------------------------
# quantisation (eager torch; fused by torch.compile)
# --------------------------------------------------------------------------------------------


def quantize(x: torch.Tensor, granularity: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """``(x8, descale)``: ``x8 = round_e4m3(x / descale)``, same shape and layout as ``x``.

    ``granularity``: ``tensor`` (one scale, ``descale`` shaped ``[1, 1, 1, 1]``) or ``head``
    (``x`` is ``[B, H, L, D]``; one scale per (batch, head), ``descale`` ``[B, H, 1, 1]``;
    the cuDNN graph takes per-tensor descales only — ``head`` is for the numerical reference)."""
    if granularity == "tensor":
        amax = x.detach().abs().amax().float().reshape(1, 1, 1, 1)
    elif granularity == "head":
        amax = x.detach().abs().amax(dim=(-2, -1), keepdim=True).float()
    else:
        raise ValueError(f"granularity must be 'tensor' or 'head', not {granularity!r}")
    amax = amax.clamp_min(_TINY)
    scale = E4M3_MAX / amax
    x8 = (x.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(fp8_dtype())
    return x8, amax / E4M3_MAX


def smooth(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x - mean, mean)``, the mean taken over the tokens (dim -2) of each (batch, head, channel).

    Subtracting K's token mean changes no attention output in exact arithmetic (each query's
    logits all shift by ``q . mean``, which the softmax removes) and V's is added back after
    (each output row is a convex combination of V's rows). What it changes is the rounding: K and
    V of a DiT carry a large per-channel offset shared by every token, and e4m3's 3 mantissa bits
    are spent on that offset instead of on what differs between tokens (SageAttention, Zhang et
    al. 2024, smooths K for the same reason)."""
    mean = x.float().mean(dim=-2, keepdim=True)
    return x.float() - mean, mean


def reference_fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, granularity: str = "tensor",
                            q8: tuple[torch.Tensor, torch.Tensor] | None = None,
                            k8: tuple[torch.Tensor, torch.Tensor] | None = None,
                            v8: tuple[torch.Tensor, torch.Tensor] | None = None,
                            quantize_p: bool = True, quantize_o: bool = True,
                            smooth_k: bool = False, smooth_v: bool = False) -> torch.Tensor:
    """The FP8 kernel's arithmetic in plain torch (float32 math on e4m3-rounded values), ``[B, H, L, D]``.

    ``q8`` / ``k8`` / ``v8``: ``(values, descale)`` already quantised (pass ``(x, 1.0)`` to leave
    one input unrounded in a study). ``smooth_k`` / ``smooth_v``: subtract the token mean before
    rounding (:func:`smooth`; V's mean is added back to the output, after its rounding).

    Not bit-equal to cuDNN's kernel (which keeps a running max over key tiles, so its
    probabilities are rounded relative to the tile's running max, and whose accumulation order
    differs): it is the numerical model used to choose scales and to bound the kernel in tests.
    Memory is ``B*H*Lq*Lk`` floats: small shapes only."""
    v_mean = None
    if smooth_k and k8 is None:
        k = smooth(k)[0]
    if smooth_v and v8 is None:
        v, v_mean = smooth(v)
    if q8 is None:
        q8 = quantize(q, granularity)
    if k8 is None:
        k8 = quantize(k, granularity)
    if v8 is None:
        v8 = quantize(v, granularity)
    qf = q8[0].float() * q8[1]
    kf = k8[0].float() * k8[1]
    vf = v8[0].float() * v8[1]
    s = (qf @ kf.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))
    denom = p.sum(dim=-1, keepdim=True)
    if quantize_p:
        p = (p * P_SCALE).to(fp8_dtype()).float() / P_SCALE
    o = (p @ vf) / denom
    if quantize_o:
        # |o| <= amax(v) (each row a convex combination of v's rows): for a quantised v this is
        # descale * 448, for one passed unrounded its own largest magnitude
        amax_v = (vf.abs().amax(dim=(-2, -1), keepdim=True) if granularity == "head" else vf.abs().amax()).clamp_min(_TINY)
        o_scale = O_HEADROOM / amax_v
        o = (o * o_scale).clamp(-E4M3_MAX, E4M3_MAX).to(fp8_dtype()).float() / o_scale
    if v_mean is not None:
        o = o + v_mean
    return o.to(q.dtype)


# --------------------------------------------------------------------------------------------
# the cuDNN graph, as a custom op
# --------------------------------------------------------------------------------------------

_LOCK = threading.Lock()
_HANDLES: dict[int, Any] = {}
_GRAPHS: dict[tuple[Any, ...], Any] = {}
#: graph key -> the plan index picked by ``plan: fastest`` (absent: not tuned yet)
_PICKED: dict[tuple[Any, ...], int] = {}
#: graph key -> [{"index", "name", "ms"} or {"index", "name", "error"}] of the ``fastest`` tuning
PLAN_TIMINGS: dict[tuple[Any, ...], list[dict[str, Any]]] = {}

# uids of the graph's tensors
_Q, _K, _V, _O = 0, 1, 2, 3
_DQ, _DK, _DV, _DS, _SS, _SO = 5, 6, 7, 8, 9, 10
_AMAX_S, _AMAX_O = 11, 12


def _handle(device: int) -> Any:
    import cudnn

    h = _HANDLES.get(device)
    if h is None:
        with torch.cuda.device(device):
            h = _HANDLES[device] = cudnn.create_handle()
    return h


def _graph_key(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, o_stride: tuple[int, ...], attn_scale: float,
               plan: str) -> tuple[Any, ...]:
    return (q8.device.index, tuple(q8.shape), tuple(k8.shape), tuple(v8.shape), q8.stride(), k8.stride(), v8.stride(),
            o_stride, attn_scale, plan)


def _graph(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, o_stride: tuple[int, ...], attn_scale: float,
           plan: str = "heuristic") -> Any:
    import cudnn

    key = _graph_key(q8, k8, v8, o_stride, attn_scale, plan)
    g = _GRAPHS.get(key)
    if g is not None:
        return g
    with _LOCK:
        g = _GRAPHS.get(key)
        if g is not None:
            return g
        fp8 = cudnn.data_type.FP8_E4M3
        f32 = cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32,
                          handle=_handle(q8.device.index))
        Q = g.tensor(uid=_Q, dim=tuple(q8.shape), stride=q8.stride(), data_type=fp8)
        K = g.tensor(uid=_K, dim=tuple(k8.shape), stride=k8.stride(), data_type=fp8)
        V = g.tensor(uid=_V, dim=tuple(v8.shape), stride=v8.stride(), data_type=fp8)
        one = dict(dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=f32)
        dq, dk, dv, ds, ss, so = (g.tensor(uid=u, **one) for u in (_DQ, _DK, _DV, _DS, _SS, _SO))
        kw = dict(q=Q, k=K, v=V, descale_q=dq, descale_k=dk, descale_v=dv, descale_s=ds, scale_s=ss, scale_o=so,
                  attn_scale=attn_scale, use_causal_mask=False)
        try:
            out, _stats, amax_s, amax_o = g.sdpa_fp8(generate_stats=False, **kw)
        except TypeError:  # frontends before 1.13 call it is_inference
            out, _stats, amax_s, amax_o = g.sdpa_fp8(is_inference=True, **kw)
        B, H, Lq, _ = q8.shape
        out.set_uid(_O).set_output(True).set_dim((B, H, Lq, v8.shape[-1])).set_stride(o_stride).set_data_type(fp8)
        amax_o.set_uid(_AMAX_O).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(f32)
        try:  # an output of the graph in every frontend seen so far; tolerated if absent
            amax_s.set_uid(_AMAX_S).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(f32)
        except Exception:
            pass
        try:
            g.validate()
            g.build_operation_graph()
            if plan == "fastest":  # every candidate built; timed at the first call (_tune)
                g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
                g.check_support()
                g.build_plans(cudnn.build_plan_policy.ALL)
            else:
                g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
                g.check_support()
                g.build_plans()
        except Exception as exc:
            raise RuntimeError(
                f"cudnn-fp8: cuDNN has no FP8 attention kernel for q {tuple(q8.shape)}, k {tuple(k8.shape)}, "
                f"v {tuple(v8.shape)} (head_dim {q8.shape[-1]}) on this GPU: {type(exc).__name__}: {str(exc)[:300]}"
            ) from exc
        _GRAPHS[key] = g
        return g


def _tune(g: Any, key: tuple[Any, ...], pack: dict[int, Any], handle: Any, device: torch.device,
          repeats: int = 5) -> int:
    """``plan: fastest``: time every plan of ``g`` on ``pack`` (the call's own tensors; the output is
    rewritten by the real run after) and select the fastest; returns its index."""
    import cudnn

    rows: list[dict[str, Any]] = []
    stream = torch.cuda.current_stream(device)
    for i in range(int(g.get_execution_plan_count())):
        try:
            name = str(g.get_plan_name_at_index(i))
        except Exception:  # a name is only for the record
            name = f"plan {i}"
        try:
            ws = torch.empty(max(int(g.get_workspace_size_plan_at_index(i)), 1), device=device, dtype=torch.uint8)
            cudnn.set_stream(handle, stream.cuda_stream)
            g.execute_plan_at_index(pack, ws, index=i, handle=handle)  # warm-up (and: does it run?)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            for _ in range(repeats):
                g.execute_plan_at_index(pack, ws, index=i, handle=handle)
            end.record(stream)
            end.synchronize()
            rows.append({"index": i, "name": name, "ms": start.elapsed_time(end) / repeats})
        except Exception as exc:  # a plan that does not run here is skipped, and recorded
            rows.append({"index": i, "name": name, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    timed = [r for r in rows if "ms" in r]
    if not timed:
        raise RuntimeError(f"cudnn-fp8: no execution plan ran for this shape: {rows}")
    best = min(timed, key=lambda r: r["ms"])["index"]
    g.build_plan_at_index(best)
    PLAN_TIMINGS[key] = rows
    _PICKED[key] = best
    return best


def _bshd_stride(B: int, H: int, L: int, D: int) -> tuple[int, int, int, int]:
    """Strides of a ``[B, H, L, D]`` view of a contiguous ``[B, L, H, D]`` tensor."""
    return (L * H * D, D, H * D, 1)


@torch.library.custom_op("omniloop_attention::cudnn_fp8_sdpa", mutates_args=())
def cudnn_fp8_sdpa(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, descale_q: torch.Tensor,
                   descale_k: torch.Tensor, descale_v: torch.Tensor, scale_o: torch.Tensor,
                   attn_scale: float, plan: str = "heuristic") -> torch.Tensor:
    """cuDNN FP8 SDPA: e4m3 ``[B, H, L, D]`` q/k/v (any strides, unit last stride) and float32
    ``[1, 1, 1, 1]`` descales → the e4m3 output ``* scale_o`` as a contiguous ``[B, Lq, H, Dv]``.
    ``plan``: one of :data:`PLAN_MODES`."""
    import cudnn

    q8, k8, v8 = (x if x.stride(-1) == 1 else x.contiguous() for x in (q8, k8, v8))
    B, H, Lq, _ = q8.shape
    Dv = v8.shape[-1]
    out = torch.empty((B, Lq, H, Dv), device=q8.device, dtype=q8.dtype)
    o_view = out.permute(0, 2, 1, 3)
    if plan not in PLAN_MODES:
        raise ValueError(f"cudnn-fp8: plan must be one of {', '.join(PLAN_MODES)}, not {plan!r}")
    g = _graph(q8, k8, v8, o_view.stride(), attn_scale, plan)
    dev = q8.device
    one = torch.ones((1, 1, 1, 1), device=dev, dtype=torch.float32)
    pack = {
        _Q: q8, _K: k8, _V: v8, _O: o_view,
        _DQ: descale_q.reshape(1, 1, 1, 1).float(), _DK: descale_k.reshape(1, 1, 1, 1).float(),
        _DV: descale_v.reshape(1, 1, 1, 1).float(),
        _DS: one * (1.0 / P_SCALE), _SS: one * P_SCALE, _SO: scale_o.reshape(1, 1, 1, 1).float(),
        _AMAX_S: torch.empty((1, 1, 1, 1), device=dev, dtype=torch.float32),
        _AMAX_O: torch.empty((1, 1, 1, 1), device=dev, dtype=torch.float32),
    }
    handle = _handle(dev.index)
    if plan == "fastest":
        key = _graph_key(q8, k8, v8, o_view.stride(), attn_scale, plan)
        if key not in _PICKED:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("cudnn-fp8 plan 'fastest': the first call of a shape times the plans and "
                                   "cannot run inside a CUDA graph capture; run one call before capturing")
            with _LOCK:
                if key not in _PICKED:
                    _tune(g, key, pack, handle, dev)
    ws = torch.empty(max(int(g.get_workspace_size()), 1), device=dev, dtype=torch.uint8)
    cudnn.set_stream(handle, torch.cuda.current_stream(dev).cuda_stream)
    g.execute(pack, ws, handle=handle)
    return out


@cudnn_fp8_sdpa.register_fake
def _cudnn_fp8_sdpa_fake(q8, k8, v8, descale_q, descale_k, descale_v, scale_o, attn_scale, plan="heuristic"):  # type: ignore[no-untyped-def]
    B, H, Lq, _ = q8.shape
    return q8.new_empty((B, Lq, H, v8.shape[-1]))


class CudnnFP8Attention:
    """The ``cudnn-fp8`` backend's callable: ``fn(q, k, v)`` with bf16/fp16 ``[B, H, L, D]``."""

    #: the Wan processor may pass q and k already quantised (see attend_quantized)
    accepts_quantized_qk = True

    def __init__(self, plan: str = "heuristic") -> None:
        if plan not in PLAN_MODES:
            raise ValueError(f"plan must be one of {', '.join(PLAN_MODES)}, not {plan!r}")
        #: how cuDNN's execution plan is chosen (:data:`PLAN_MODES`)
        self.plan = plan

    def _run(self, q8: torch.Tensor, dq: torch.Tensor, k8: torch.Tensor, dk: torch.Tensor, v: torch.Tensor,
             out_dtype: torch.dtype) -> torch.Tensor:
        v8, dv = quantize(v)
        amax_v = dv * E4M3_MAX
        scale_o = O_HEADROOM / amax_v
        out8 = torch.ops.omniloop_attention.cudnn_fp8_sdpa(q8, k8, v8, dq, dk, dv, scale_o,
                                                            1.0 / math.sqrt(q8.shape[-1]), self.plan)
        out = (out8.float() * (amax_v.reshape(()) / O_HEADROOM)).to(out_dtype)  # [B, L, H, D]
        return out.permute(0, 2, 1, 3)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        if kw.get("attn_mask") is not None or kw.get("is_causal"):
            raise ValueError("cudnn-fp8 backend takes no attention mask and no causal flag")
        extra = sorted(k_ for k_, v_ in kw.items() if k_ not in ("attn_mask", "is_causal") and v_ is not None)
        if extra:
            raise ValueError(f"cudnn-fp8 backend does not take {', '.join(extra)}")
        q8, dq = quantize(q)
        k8, dk = quantize(k)
        return self._run(q8, dq, k8, dk, v, q.dtype)

    def attend_quantized(self, q8: torch.Tensor, descale_q: torch.Tensor, k8: torch.Tensor, descale_k: torch.Tensor,
                         v: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """q and k already e4m3 (``x ≈ x8 * descale``, scalar descales), v in ``out_dtype``; ``[B, H, L, D]``."""
        return self._run(q8, descale_q, k8, descale_k, v, out_dtype)

    def __repr__(self) -> str:
        return f"CudnnFP8Attention(plan={self.plan!r})"


cudnn_fp8 = CudnnFP8Attention()


@define(frozen=True)
class CudnnFP8Options:
    """``attention_options`` of ``cudnn-fp8``: ``plan`` — ``heuristic`` (cuDNN's first buildable plan)
    or ``fastest`` (every plan timed once per shape at its first call; see the module docstring)."""

    plan: str = "heuristic"


def configure(options: CudnnFP8Options) -> CudnnFP8Attention:
    """The backend's callable for ``attention_options`` (``ValueError`` naming a bad ``plan``)."""
    if options.plan not in PLAN_MODES:
        raise ValueError(f"attention_options.plan: must be one of {', '.join(PLAN_MODES)}, not {options.plan!r}")
    return cudnn_fp8 if options.plan == "heuristic" else CudnnFP8Attention(plan=options.plan)

__all__ = [
    "E4M3_MAX",
    "O_HEADROOM",
    "PLAN_MODES",
    "PLAN_TIMINGS",
    "CudnnFP8Attention",
    "CudnnFP8Options",
    "configure",
    "cudnn_fp8",
    "cudnn_fp8_available",
    "cudnn_fp8_sdpa",
    "quantize",
    "reference_fp8_attention",
]
