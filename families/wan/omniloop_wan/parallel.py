"""Wan across ranks: CFG-parallel and Ulysses sequence-parallel attention (deploy ``parallel: {sp, cfg}``).

The mesh, the Ulysses exchange, the CFG-parallel step and the block-interceptor binding are
omniloop-kit's (:mod:`omniloop_kit.parallel`); Wan's part is its self-attention processors and
where its forward splits and gathers the tokens. The ranks form a ``cfg x sp`` mesh,
``rank = cfg_index * sp + sp_index``.

* **cfg**: with two planned guidance branches (cond, uncond), the ``cfg`` ranks compute one
  branch each and exchange predictions (``all_gather``); every rank then combines and advances the
  same latents. Each branch's forward is the very forward single-process Wan runs (batch of one),
  so the result is ``torch.equal`` to one process (classic, unbatched CFG; a ``batched`` CFG policy
  stacks both branches in one forward single-process, which is only equal up to batch invariance).
  Steps planning one branch (guidance off) run it on every rank.
* **sp** (Ulysses): after patch embedding each ``sp`` rank keeps ``1/sp`` of the tokens (and of the
  rotary tables); self-attention exchanges q/k/v with an all-to-all so each rank attends over the
  *whole* sequence for ``heads/sp`` heads, then exchanges back; cross-attention needs no exchange
  (its keys are the text). The tokens are gathered before the output norm. The attention is the
  same math per head; what differs from one process is that the linear layers (projections, FFN)
  multiply ``L/sp``-row instead of ``L``-row matrices, which the BLAS may block and sum in a
  different order: fp32 results differ in the last bits (tests/parallel states the tolerance).
  The token count must be divisible by ``sp`` (refused with one error otherwise). A block
  interceptor (cache-dit, fbcache) is bound to the sp group (``bind_process_group``): its residual
  comparison is reduced over the ranks, so all ranks skip the same blocks.
"""

from __future__ import annotations

from typing import Any

import torch

from omniloop.context import StageContext
from omniloop.errors import RequestError
from omniloop.interceptors import BlockContext, run_blocks
from omniloop.loop import LoopState, RequestState
from omniloop_kit.parallel import (
    Mesh,
    ParallelLoop,
    bind_block_interceptor,
    gather_tokens,
    head_groups,
    mesh_for,
    ulysses,
)

from .denoise import Denoise
from .transformer import embed, head

#: the axes Wan implements (``capabilities.parallel.axes``)
AXES = frozenset({"sp", "cfg"})


def install_ulysses(model: torch.nn.Module, mesh: Mesh, groups: int | None = None) -> None:
    """Give every self-attention (``attn1``) of ``model`` a processor whose attention is Ulysses'
    (``groups``: head groups to pipeline, default :func:`head_groups`)."""
    from .attention import WanBackendAttnProcessor

    if getattr(model, "_omniloop_ulysses", None) == (mesh, groups):
        return
    for block in model.blocks:
        proc = block.attn1.processor
        if not isinstance(proc, WanBackendAttnProcessor):
            raise RuntimeError(f"Wan sp: self-attention runs {type(proc).__name__}, not omniloop's processor")
        fn = getattr(proc, "_omniloop_local_fn", proc.fn)
        backend = getattr(proc, "_omniloop_local_backend", proc.backend)
        g = groups if groups is not None else head_groups(block.attn1.heads, mesh.sp)
        new = WanBackendAttnProcessor(ulysses(fn, mesh, g), f"{backend}+ulysses{mesh.sp}", "reference")
        new._omniloop_local_fn = fn  # type: ignore[attr-defined]
        new._omniloop_local_backend = backend  # type: ignore[attr-defined]
        block.attn1.set_processor(new)
    model._omniloop_ulysses = (mesh, groups)  # type: ignore[assignment]


def sp_forward(model: Any, mesh: Mesh, hidden_states: torch.Tensor, timestep: torch.Tensor,
               encoder_hidden_states: torch.Tensor, encoder_hidden_states_image: torch.Tensor | None,
               block_ctx: BlockContext | None) -> torch.Tensor:
    """:func:`omniloop_wan.transformer.wan_forward` with the token sequence split across the sp ranks."""
    n, me = mesh.sp, mesh.sp_rank
    cos, sin = model.rope(hidden_states)
    hidden, temb, proj, context, grid = embed(model, hidden_states, timestep, encoder_hidden_states,
                                              encoder_hidden_states_image)
    tokens = grid[0] * grid[1] * grid[2]
    if tokens % n:
        raise ValueError(f"parallel.sp: {tokens} latent tokens are not divisible by sp={n} (choose another frames/height/width)")
    rotary_emb = (cos.chunk(n, dim=1)[me], sin.chunk(n, dim=1)[me])
    if proj.ndim == 4:  # one timestep per token: each rank keeps its tokens' modulation
        proj = proj.chunk(n, dim=1)[me].contiguous()
    local = hidden.chunk(n, dim=1)[me].contiguous()

    def call(block: Any, hidden: torch.Tensor) -> torch.Tensor:
        return block(hidden, context, proj, rotary_emb)

    local = run_blocks(model.blocks, local, block_ctx, call)
    return head(model, gather_tokens(local, mesh), temb, grid)


class ParallelDenoise(ParallelLoop, Denoise):
    """:class:`~omniloop_wan.denoise.Denoise` with the branches spread over the cfg ranks
    (omniloop-kit's :class:`~omniloop_kit.parallel.ParallelLoop`) and each forward's sequence over
    the sp ranks (see the module docstring)."""

    def __init__(self, model_config: dict[str, Any], menu: Any, sp: int, cfg: int) -> None:
        super().__init__(model_config, menu)
        self.sp, self.cfg = sp, cfg

    def init(self, ctx: StageContext, state: RequestState) -> LoopState:
        loop = super().init(ctx, state)
        if self.sp > 1:  # refuse before the first forward: Ulysses splits the tokens evenly
            _f, _c, frames, height, width = loop.tensors["latents"].shape
            p_t, p_h, p_w = ctx.components["transformer"].config.patch_size
            tokens = (frames // p_t) * (height // p_h) * (width // p_w)
            if tokens % self.sp:
                raise RequestError(
                    "diffusion.height",
                    f"this size gives {tokens} latent tokens, not divisible by parallel.sp={self.sp} "
                    "(choose frames/height/width giving a multiple)",
                )
        return loop

    def forward(self, ctx: StageContext, expert: str, batch: dict[str, Any], block_ctx: BlockContext | None) -> torch.Tensor:
        if self.sp == 1:
            return super().forward(ctx, expert, batch, block_ctx)
        model = ctx.components[expert]
        install_ulysses(model, self.mesh)
        bind_block_interceptor(ctx.block_interceptor, self.mesh)
        return sp_forward(model, self.mesh, batch["hidden_states"], batch["timestep"],
                          batch["encoder_hidden_states"], batch["encoder_hidden_states_image"], block_ctx)


def attention_heads(path: Any) -> int | None:
    """The transformer's attention heads, from its config file (no weights read)."""
    from . import checkpoint as ck

    try:
        root = ck.resolve_root(path)
        cfg = ck.read_json(root / "transformer" / "config.json", "transformer config")
    except Exception:
        return None
    heads = cfg.get("num_attention_heads")
    return int(heads) if isinstance(heads, int) else None


__all__ = ["AXES", "Mesh", "ParallelDenoise", "attention_heads", "bind_block_interceptor", "head_groups",
           "install_ulysses", "mesh_for", "sp_forward", "ulysses"]
