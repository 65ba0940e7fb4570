"""The deploy's attention backend inside a diffusers model's attention modules: a family's
processor (diffusers' op for op, attention computed by ``AttentionBackendSpec.fn(q, k, v)`` on
``[B, heads, L, D]``) derives from :class:`BackendProcessor`, and :func:`install` puts one on every
attention module of a model (Wan's ``WanAttention``).

* :meth:`BackendProcessor.attend` — ``[B, L, H, D]`` in and out like diffusers' dispatcher; a 2-D
  mask is broadcast over heads and queries; a backend declaring ``accepts_grid`` (``sparse-tile``)
  gets the self-attention token grid as ``grid=(T, H, W)``;
* :func:`set_token_grid` — the grid of the forward about to run, told to the model's grid-taking
  processors (eager, before the blocks: a backend's ``prepare_grid(grid, device)`` runs outside
  compiled code);
* :func:`installed`, :func:`restored` — the backend a model runs; diffusers' own processors put
  back for a while (reference runs, benchmarks);
* :class:`JointAttnProcessor` — joint (MMDiT) attention over image and context tokens, a family's
  subclass declaring only its layout (FLUX's ``FluxBackendAttnProcessor``, SD3's
  ``SD3AttnProcessor``); :func:`install_joint` / :func:`uninstall`; ``options.qkv: fused``
  (:data:`QKV`, :func:`qkv_option`) from the buffers :func:`fuse_projections` registers, and
  :func:`refuse_fused_qkv`, the adapters' check of it.

A runtime loads its own modules, so runtimes do not interfere; modules shared by several runtimes
(``from_components``) carry the backend of the last one installed (a warning says so).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from omniloop.errors import DeployError

from . import qk_norm_rope as knr
from .options import choice_option

log = logging.getLogger("omniloop_kit")

_INSTALLED: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
#: per model: the installed processors whose backend takes the token grid (``accepts_grid``)
_GRID_PROCESSORS: weakref.WeakKeyDictionary[torch.nn.Module, list[Any]] = weakref.WeakKeyDictionary()


class BackendProcessor:
    """A diffusers attention processor computing attention with ``fn(q, k, v)`` (``[B, H, L, D]``)."""

    def __init__(self, fn: Callable[..., torch.Tensor], backend: str = "custom") -> None:
        self.fn = fn
        self.backend = backend
        #: the backend takes ``grid=(T, H, W)`` on self-attention calls (e.g. ``sparse-tile``)
        self.wants_grid = bool(getattr(fn, "accepts_grid", False))
        #: the latent token grid of the current forward (set by :func:`set_token_grid`)
        self.grid: tuple[int, int, int] | None = None

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None = None, grid: tuple[int, int, int] | None = None) -> torch.Tensor:
        """``[B, L, H, D]`` in and out, like diffusers' dispatcher; the backend sees ``[B, H, L, D]``."""
        q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
        return self.attend_heads_first(q, k, v, attention_mask, grid).permute(0, 2, 1, 3)

    def attend_heads_first(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           attention_mask: torch.Tensor | None = None,
                           grid: tuple[int, int, int] | None = None) -> torch.Tensor:
        """The backend call on ``[B, H, L, D]``: a 2-D ``[B, L]`` mask is broadcast over heads and
        queries; ``grid`` is passed (unmasked calls only) to a backend that takes it."""
        if grid is not None and attention_mask is None:
            return self.fn(q, k, v, grid=grid)
        if attention_mask is None:
            return self.fn(q, k, v)
        if attention_mask.ndim == 2 and attention_mask.shape[0] == q.shape[0]:
            attention_mask = attention_mask.unsqueeze(1).unsqueeze(1)
        return self.fn(q, k, v, attn_mask=attention_mask)


#: ``options.qkv``: Q/K/V as three linears (diffusers' default) or ``fused``: one GEMM over
#: ``[W_q; W_k; W_v]`` (another GEMM shape may round differently: not guaranteed bit-exact)
QKV = ("separate", "fused")
#: the non-persistent buffers :func:`fuse_projections` registers on an attention module, beside the
#: separate projections (module state, so ``torch.compile`` lifts them per module like the weights)
FUSED_BUFFERS = {"sample": ("omniloop_qkv_weight", "omniloop_qkv_bias"),
                 "context": ("omniloop_add_qkv_weight", "omniloop_add_qkv_bias")}
_PROJECTIONS = {"sample": ("to_q", "to_k", "to_v"), "context": ("add_q_proj", "add_k_proj", "add_v_proj")}
#: the fused modules diffusers' own ``fuse_qkv_projections`` adds (``attn.fused_projections``)
_DIFFUSERS_FUSED = {"sample": "to_qkv", "context": "to_added_qkv"}


def _normed(norm: Any, x: torch.Tensor) -> torch.Tensor:
    return x if norm is None else norm(x)


class JointAttnProcessor(BackendProcessor):
    """Joint (MMDiT) attention over image and context tokens — diffusers' ``FluxAttnProcessor`` and
    ``JointAttnProcessor2_0`` op for op — computing attention with the deploy's backend.

    A family's subclass declares what differs between them (class attributes):

    * ``context_first`` — the context tokens before the image tokens in the joint sequence (FLUX)
      or after them (SD3);
    * ``heads_first`` — the q/k norms, the rotary embedding and the concatenation on ``[B, H, L, D]``
      views (SD3) or on ``[B, L, H, D]`` (FLUX);
    * ``contiguous_split`` — the two parts of the output made contiguous before their projections,
      as diffusers' FLUX processor does (torch's linear then takes its fused-bias path; SD3's
      projects the views, matmul then bias: equal on CPU float32 in the tests, kept op for op for
      other devices).

    The module decides the rest, as in diffusers: its q/k norms where it has them, the rotary
    embedding where the block passes one, the context's output projection unless
    ``context_pre_only``, the output projection unless ``pre_only`` (FLUX's single-stream blocks).
    Q/K/V: with ``fused_qkv`` one ``F.linear`` over the buffers :func:`fuse_projections` registered;
    else diffusers' fused ``to_qkv`` where ``fuse_qkv_projections`` made one; else the three linears.
    """

    context_first = False
    heads_first = True
    contiguous_split = False

    def __init__(self, fn: Callable[..., torch.Tensor], backend: str = "custom", fused_qkv: bool = False,
                 fused_norm_rope: bool = False) -> None:
        from diffusers.models.embeddings import apply_rotary_emb

        super().__init__(fn, backend)
        self.fused_qkv = fused_qkv
        #: q/k norms, concatenation and rotary embedding by :func:`omniloop_kit.qk_norm_rope.joint_norm_rope`
        #: where it takes the call (``[B, L, H, D]`` layouts only; ``options.qk_norm_rope: fused``)
        self.fused_norm_rope = fused_norm_rope and not self.heads_first
        self.rotary = apply_rotary_emb

    def project(self, attn: Any, x: torch.Tensor, which: str) -> tuple[torch.Tensor, ...]:
        """Q, K, V of ``x``: ``which`` is ``sample`` (image tokens) or ``context``."""
        if self.fused_qkv:
            weight, bias = FUSED_BUFFERS[which]
            return F.linear(x, getattr(attn, weight), getattr(attn, bias)).chunk(3, dim=-1)
        if attn.fused_projections:
            return getattr(attn, _DIFFUSERS_FUSED[which])(x).chunk(3, dim=-1)
        return tuple(getattr(attn, name)(x) for name in _PROJECTIONS[which])

    def heads(self, x: torch.Tensor, head_dim: int) -> torch.Tensor:
        x = x.unflatten(-1, (-1, head_dim))
        return x.transpose(1, 2) if self.heads_first else x

    def joint_qkv(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None,
                  image_rotary_emb: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The joint sequence's normed, rotated query and key and its value (diffusers' ops)."""
        query, key, value = self.project(attn, hidden_states, "sample")
        context = None if encoder_hidden_states is None else self.project(attn, encoder_hidden_states, "context")
        if self.fused_norm_rope:
            fused = self._fused_qkv(attn, (query, key, value), context, image_rotary_emb)
            if fused is not None:
                return fused
        head_dim = key.shape[-1] // attn.heads
        query, key, value = (self.heads(t, head_dim) for t in (query, key, value))
        query, key = _normed(attn.norm_q, query), _normed(attn.norm_k, key)
        seq = 2 if self.heads_first else 1
        if context is not None:
            cq, ck, cv = (self.heads(t, head_dim) for t in context)
            cq, ck = _normed(attn.norm_added_q, cq), _normed(attn.norm_added_k, ck)
            query, key, value = (torch.cat([c, x] if self.context_first else [x, c], dim=seq)
                                 for x, c in ((query, cq), (key, ck), (value, cv)))
        if image_rotary_emb is not None:
            query = self.rotary(query, image_rotary_emb, sequence_dim=seq)
            key = self.rotary(key, image_rotary_emb, sequence_dim=seq)
        return query, key, value

    def _fused_qkv(self, attn: Any, sample: tuple[torch.Tensor, ...], context: tuple[torch.Tensor, ...] | None,
                   rotary: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """:meth:`joint_qkv` by the fused kernel, or None where it does not take the call."""
        heads = attn.heads
        parts = [(sample, (attn.norm_q, attn.norm_k))]
        if context is not None:
            ctx = (context, (attn.norm_added_q, attn.norm_added_k))
            parts = [ctx, *parts] if self.context_first else [*parts, ctx]
        qs, ks, vs = ([p[0][i] for p in parts] for i in range(3))
        nq, nk = ([p[1][i] for p in parts] for i in range(2))
        if not (knr.supported(qs, nq, rotary, heads) and knr.supported(ks, nk, rotary, heads)):
            return None
        value = torch.cat([v.unflatten(-1, (heads, -1)) for v in vs], dim=1) if len(vs) > 1 else \
            vs[0].unflatten(-1, (heads, -1))
        return knr.joint_norm_rope(qs, nq, rotary, heads), knr.joint_norm_rope(ks, nk, rotary, heads), value

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb: Any = None,
                 *args: Any, **kwargs: Any) -> Any:
        query, key, value = self.joint_qkv(attn, hidden_states, encoder_hidden_states, image_rotary_emb)
        if self.heads_first:
            out = self.attend_heads_first(query, key, value, attention_mask).transpose(1, 2)
        else:
            out = self.attend(query, key, value, attention_mask)
        out = out.flatten(2, 3).to(query.dtype)
        context = None
        if encoder_hidden_states is not None:
            n = encoder_hidden_states.shape[1]
            if self.context_first:
                context, out = out.split_with_sizes([n, out.shape[1] - n], dim=1)
            else:
                out, context = out.split_with_sizes([out.shape[1] - n, n], dim=1)
            if self.contiguous_split:
                out, context = out.contiguous(), context.contiguous()
            if not attn.context_pre_only:
                context = attn.to_add_out(context)
        if not attn.pre_only:
            out = attn.to_out[1](attn.to_out[0](out))
        return out if context is None else (out, context)


def fuse_projections(attn: Any) -> None:
    """Register ``[W_q; W_k; W_v]`` (and the biases) of the image and of the context projections as
    :data:`FUSED_BUFFERS` on ``attn``, beside the separate linears (which stay for everyone else); once."""
    for which, names in _PROJECTIONS.items():
        wname, bname = FUSED_BUFFERS[which]
        mods = [getattr(attn, n, None) for n in names]
        if any(m is None for m in mods) or wname in attn._buffers:
            continue
        attn.register_buffer(wname, torch.cat([m.weight for m in mods], dim=0).detach(), persistent=False)
        bias = torch.cat([m.bias for m in mods], dim=0).detach() if all(m.bias is not None for m in mods) else None
        attn.register_buffer(bname, bias, persistent=False)


def unfuse_projections(attn: Any) -> None:
    """Drop the buffers :func:`fuse_projections` registered."""
    for names in FUSED_BUFFERS.values():
        for name in names:
            attn._buffers.pop(name, None)


def install_joint(model: torch.nn.Module, modules: Sequence[Any], processor: type[JointAttnProcessor],
                  backend: Any = None, *, fused_qkv: bool = False, fused_norm_rope: bool = False) -> int:
    """Put a ``processor`` of ``backend`` (an ``AttentionBackendSpec``; None: the core ``sdpa``) on
    each of ``modules``, their projections fused first with ``fused_qkv``, the q/k norms and rotary
    embedding by the kit's kernel with ``fused_norm_rope`` (:mod:`omniloop_kit.qk_norm_rope`, whose
    ``prepare`` runs here, outside any compiled trace); returns how many."""
    from omniloop.builtin import sdpa

    fn, name = (sdpa, "sdpa") if backend is None else (backend.fn, backend.name)
    if fused_qkv:
        for m in modules:
            fuse_projections(m)
    if fused_norm_rope:
        knr.prepare()
    return install(model, modules, lambda: processor(fn, name, fused_qkv=fused_qkv, fused_norm_rope=fused_norm_rope),
                   name)


def uninstall(model: torch.nn.Module, modules: Sequence[Any], make: Callable[[], Any]) -> None:
    """``make()`` (diffusers' own processor) back on each of ``modules``, their fused buffers dropped."""
    for m in modules:
        m.set_processor(make())
        unfuse_projections(m)
    _INSTALLED.pop(model, None)
    _GRID_PROCESSORS.pop(model, None)


def qkv_option(options: Any) -> str:
    """``options.qkv`` (:data:`QKV`), or one ``DeployError`` naming it."""
    return choice_option(options, "qkv", QKV)


def refuse_fused_qkv(model: Any, options: Mapping[str, Any]) -> None:
    """An ``AdapterSupport.check``: ``options.qkv: fused`` computes Q/K/V without the ``to_q``/``to_k``/
    ``to_v`` linears an adapter hooks, so adapters refuse it at load."""
    if options.get("qkv", "separate") == "fused":
        raise DeployError("adapters: options.qkv 'fused' computes Q/K/V without the to_q/to_k/to_v linears an "
                          "adapter hooks; use qkv 'separate' with adapters")


def fused_qkv_update_refusal(options: Mapping[str, Any]) -> str | None:
    """A ``FamilyCapabilities.weight_update_refusal``: ``options.qkv: fused`` computes Q/K/V from a
    concatenated copy of the ``to_q``/``to_k``/``to_v`` weights, which ``update_weights`` would leave
    stale (and an adapter registered at run time would be bypassed)."""
    if options.get("qkv", "separate") == "fused":
        return ("options.qkv 'fused' computes Q/K/V from a concatenated copy of to_q/to_k/to_v that an update "
                "would leave stale; update the weights of a deployment with qkv 'separate'")
    return None


def install(model: torch.nn.Module, modules: Sequence[Any], make: Callable[[], BackendProcessor], name: str) -> int:
    """Put ``make()`` (a processor of the backend ``name``) on each of ``modules`` (``model``'s
    attention modules); returns how many got one."""
    previous = _INSTALLED.get(model)
    if previous is not None and previous != name:
        log.warning("attention backend of shared %s components changed from %r to %r: every runtime using "
                    "these modules now runs %r", type(model).__name__, previous, name, name)
    procs = []
    for m in modules:
        proc = make()
        m.set_processor(proc)
        if proc.wants_grid and not m.is_cross_attention:
            procs.append(proc)
    _INSTALLED[model] = name
    if procs:
        _GRID_PROCESSORS[model] = procs
    else:
        _GRID_PROCESSORS.pop(model, None)
    return len(modules)


def set_token_grid(model: torch.nn.Module, grid: tuple[int, int, int], device: Any) -> None:
    """Tell ``model``'s self-attention processors the latent token grid ``(frames, rows, columns)``
    of the forward about to run; a no-op unless the installed backend takes a grid."""
    procs = _GRID_PROCESSORS.get(model)
    if not procs:
        return
    grid = (int(grid[0]), int(grid[1]), int(grid[2]))
    prepared: set[int] = set()
    for proc in procs:
        proc.grid = grid
        prepare = getattr(proc.fn, "prepare_grid", None)
        if prepare is not None and id(proc.fn) not in prepared:
            prepare(grid, device)
            prepared.add(id(proc.fn))


def installed(model: torch.nn.Module) -> str | None:
    """The backend name installed on ``model``'s attention modules, or None (diffusers' own)."""
    return _INSTALLED.get(model)


@contextlib.contextmanager
def restored(modules: Sequence[Any], make: Callable[[], Any]) -> Iterator[None]:
    """Run ``modules`` with ``make()`` (diffusers' own processor), then put theirs back."""
    saved = [(m, m.processor) for m in modules]
    for m in modules:
        m.set_processor(make())
    try:
        yield
    finally:
        for m, proc in saved:
            m.set_processor(proc)


__all__ = ["FUSED_BUFFERS", "QKV", "BackendProcessor", "JointAttnProcessor", "fuse_projections", "fused_qkv_update_refusal",
           "install",
           "install_joint", "installed", "qkv_option", "refuse_fused_qkv", "restored", "set_token_grid",
           "unfuse_projections", "uninstall"]
