"""Wan across ranks: CFG-parallel and Ulysses sequence-parallel attention (deploy ``parallel: {sp, cfg}``).

Runs inside omniloop-parallel's worker pool (every rank runs the same request, SPMD; the process
group is ``torch.distributed``'s default one). The ranks form a ``cfg x sp`` mesh,
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
import torch.distributed as dist

from omniloop.context import StageContext
from omniloop.errors import RequestError
from omniloop.interceptors import BlockContext, call_model, run_blocks
from omniloop.loop import LoopState, RequestState, StepResult

from .denoise import Denoise, _note_expert, split_rows, stack_inputs

#: the axes Wan implements (``capabilities.parallel.axes``)
AXES = frozenset({"sp", "cfg"})


class Mesh:
    """This rank's place in the ``cfg x sp`` mesh and the groups of its two axes (None: the axis is 1)."""

    def __init__(self, sp: int, cfg: int) -> None:
        if not dist.is_initialized():
            raise RuntimeError("Wan parallel: torch.distributed is not initialised (run through omniloop-parallel's pool)")
        world = dist.get_world_size()
        if world != sp * cfg:
            raise RuntimeError(f"Wan parallel: the process group has {world} ranks, parallel: {{sp: {sp}, cfg: {cfg}}} needs {sp * cfg}")
        self.sp, self.cfg, self.rank = sp, cfg, dist.get_rank()
        self.sp_rank, self.cfg_rank = self.rank % sp, self.rank // sp
        self.sp_group: Any = None
        self.cfg_group: Any = None
        # every rank creates every group, in the same order (new_group is collective)
        if sp > 1 and cfg > 1:
            for c in range(cfg):
                g = dist.new_group([c * sp + j for j in range(sp)])
                if c == self.cfg_rank:
                    self.sp_group = g
            for j in range(sp):
                g = dist.new_group([c * sp + j for c in range(cfg)])
                if j == self.sp_rank:
                    self.cfg_group = g
        else:  # one axis spans the world: the default group
            self.sp_group = dist.group.WORLD if sp > 1 else None
            self.cfg_group = dist.group.WORLD if cfg > 1 else None


_MESHES: dict[tuple[int, int], Mesh] = {}


def mesh_for(sp: int, cfg: int) -> Mesh:
    key = (sp, cfg)
    if key not in _MESHES:
        _MESHES[key] = Mesh(sp, cfg)
    return _MESHES[key]


# -- Ulysses ------------------------------------------------------------------------------------
class _Exchange:
    """One all-to-all in flight: ``x`` split in ``n`` along ``scatter_dim``, part ``i`` sent to rank
    ``i``, what arrives concatenated along ``gather_dim`` (in rank order) by :meth:`wait`.

    NCCL: one ``all_to_all_single`` on the communication stream (``async_op``), so the compute
    stream keeps running until :meth:`wait`. gloo (CPU, tests): ``all_gather`` of the whole tensor,
    then each rank keeps its part (same result, more traffic)."""

    def __init__(self, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any, n: int) -> None:
        self.scatter_dim, self.gather_dim, self.n = scatter_dim, gather_dim, n
        self.nccl = dist.get_backend(group) == "nccl"
        if self.nccl:
            # [n, *x.shape with scatter_dim / n]: part i first-axis i (no copy when the parts are
            # already contiguous blocks, e.g. heads of a batch-of-one tensor)
            self.send = x.unflatten(scatter_dim, (n, -1)).movedim(scatter_dim, 0).contiguous()
            self.recv = torch.empty_like(self.send)
            self.work = dist.all_to_all_single(self.recv, self.send, group=group, async_op=True)
        else:
            self.me = dist.get_rank(group)
            self.send = x.contiguous()
            self.full = [torch.empty_like(self.send) for _ in range(n)]
            self.work = dist.all_gather(self.full, self.send, group=group, async_op=True)

    def wait(self) -> torch.Tensor:
        self.work.wait()
        if not self.nccl:
            return torch.cat([f.chunk(self.n, dim=self.scatter_dim)[self.me] for f in self.full], dim=self.gather_dim)
        # recv[i] is rank i's part: put that axis just outside gather_dim and merge the two
        return self.recv.movedim(0, self.gather_dim).flatten(self.gather_dim, self.gather_dim + 1)


def head_groups(heads: int, sp: int, most: int = 4) -> int:
    """How many head groups :func:`ulysses` pipelines: the most (up to ``most``) that split the heads
    evenly with every group still divisible by ``sp``."""
    return max((g for g in range(1, most + 1) if heads % (g * sp) == 0), default=1)


def ulysses(fn: Any, mesh: Mesh, groups: int = 1) -> Any:
    """``fn(q, k, v)`` on ``[B, H, L/sp, D]`` shards computed over the whole sequence for ``H/sp`` heads.

    With ``groups > 1`` the heads go in that many groups, pipelined: group ``g + 1``'s q/k/v
    exchange and group ``g - 1``'s output exchange are in flight (NCCL's stream) while group ``g``
    attends (the compute stream), so only the first group's inbound and the last group's outbound
    exchange are exposed. The attention is per head, so the result is the same as ``groups=1``."""
    n, group = mesh.sp, mesh.sp_group

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        heads = q.shape[1]
        g_n = groups if heads % (groups * n) == 0 else 1
        step = heads // g_n

        def send(i: int) -> list[_Exchange]:  # heads out, sequence in
            sl = slice(i * step, (i + 1) * step)
            return [_Exchange(t[:, sl], 1, 2, group, n) for t in (q, k, v)]

        inbound = send(0)
        outbound: list[_Exchange] = []
        for i in range(g_n):
            nxt = send(i + 1) if i + 1 < g_n else None
            qi, ki, vi = (x.wait() for x in inbound)
            outbound.append(_Exchange(fn(qi, ki, vi, **kw), 2, 1, group, n))  # sequence out, heads in
            if nxt is not None:
                inbound = nxt
        outs = [x.wait() for x in outbound]
        return outs[0] if g_n == 1 else torch.cat(outs, dim=1)

    return attend


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


def bind_block_interceptor(icpt: Any, mesh: Mesh) -> None:
    """A block interceptor (cache-dit, fbcache) compares residuals of its rank's token shard; bound
    to the sp group it reduces them, so every sp rank takes the same skip decision (else one rank
    would skip blocks — and their all-to-alls — while another runs them)."""
    if icpt is None or getattr(icpt, "process_group", None) is mesh.sp_group:
        return
    bind = getattr(icpt, "bind_process_group", None)
    if not callable(bind):
        raise RuntimeError(
            f"parallel.sp: block interceptor {getattr(icpt, 'name', icpt)!r} cannot reduce its decision over the "
            "sequence-parallel group (it has no bind_process_group)"
        )
    bind(mesh.sp_group)


def sp_forward(model: Any, mesh: Mesh, hidden_states: torch.Tensor, timestep: torch.Tensor,
               encoder_hidden_states: torch.Tensor, encoder_hidden_states_image: torch.Tensor | None,
               block_ctx: BlockContext | None) -> torch.Tensor:
    """:func:`omniloop_wan.transformer.wan_forward` with the token sequence split across the sp ranks."""
    n, me = mesh.sp, mesh.sp_rank
    batch_size, _c, num_frames, height, width = hidden_states.shape
    p_t, p_h, p_w = model.config.patch_size
    ppf, pph, ppw = num_frames // p_t, height // p_h, width // p_w
    tokens = ppf * pph * ppw
    if tokens % n:
        raise ValueError(f"parallel.sp: {tokens} latent tokens are not divisible by sp={n} (choose another frames/height/width)")

    cos, sin = model.rope(hidden_states)
    rotary_emb = (cos.chunk(n, dim=1)[me], sin.chunk(n, dim=1)[me])
    hidden_states = model.patch_embedding(hidden_states)
    hidden_states = hidden_states.flatten(2).transpose(1, 2).contiguous()
    if timestep.ndim == 2:
        ts_seq_len = timestep.shape[1]
        timestep = timestep.flatten()
    else:
        ts_seq_len = None
    temb, timestep_proj, encoder_hidden_states, encoder_hidden_states_image = model.condition_embedder(
        timestep, encoder_hidden_states, encoder_hidden_states_image, timestep_seq_len=ts_seq_len
    )
    if ts_seq_len is not None:
        timestep_proj = timestep_proj.unflatten(2, (6, -1)).chunk(n, dim=1)[me].contiguous()
    else:
        timestep_proj = timestep_proj.unflatten(1, (6, -1))
    if encoder_hidden_states_image is not None:
        encoder_hidden_states = torch.concat([encoder_hidden_states_image, encoder_hidden_states], dim=1)

    local = hidden_states.chunk(n, dim=1)[me].contiguous()

    def call(block: Any, hidden: torch.Tensor) -> torch.Tensor:
        return block(hidden, encoder_hidden_states, timestep_proj, rotary_emb)

    local = run_blocks(model.blocks, local, block_ctx, call)
    parts = [torch.empty_like(local) for _ in range(n)]
    dist.all_gather(parts, local, group=mesh.sp_group)
    hidden_states = torch.cat(parts, dim=1)

    if temb.ndim == 3:
        shift, scale = (model.scale_shift_table.unsqueeze(0).to(temb.device) + temb.unsqueeze(2)).chunk(2, dim=2)
        shift, scale = shift.squeeze(2), scale.squeeze(2)
    else:
        shift, scale = (model.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
    hidden_states = (model.norm_out(hidden_states.float()) * (1 + scale) + shift).type_as(hidden_states)
    hidden_states = model.proj_out(hidden_states)
    hidden_states = hidden_states.reshape(batch_size, ppf, pph, ppw, p_t, p_h, p_w, -1)
    hidden_states = hidden_states.permute(0, 7, 1, 4, 2, 5, 3, 6)
    return hidden_states.flatten(6, 7).flatten(4, 5).flatten(2, 3)


class ParallelDenoise(Denoise):
    """:class:`~omniloop_wan.denoise.Denoise` with the branches spread over the cfg ranks and each
    forward's sequence over the sp ranks (see the module docstring)."""

    def __init__(self, model_config: dict[str, Any], menu: Any, sp: int, cfg: int) -> None:
        super().__init__(model_config, menu)
        self.sp, self.cfg = sp, cfg

    @property
    def mesh(self) -> Mesh:
        return mesh_for(self.sp, self.cfg)

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

    def step(self, ctx: StageContext, state: RequestState, loop: LoopState) -> StepResult:
        from omniloop_policies import forward_groups, forward_name
        from omniloop_policies.stepping import begin_step, finish_step

        pol, step = begin_step(ctx, state, loop)
        expert = step.expert
        _note_expert(loop, expert)
        plan = tuple(pol.plan(step, loop))  # planned once (policies count their branches)
        split = self.cfg > 1 and len(plan) == self.cfg
        mesh = self.mesh
        groups = ((plan[mesh.cfg_rank],),) if split else forward_groups(pol.cfg, plan)
        with torch.no_grad():
            inp = self.step_inputs(state, loop.tensors["latents"], pol.timestep(loop), pol.precision.dtype_for(expert))
            preds: dict[str, torch.Tensor] = {}
            for group in groups:  # this rank's forwards (one branch each under cfg parallel)
                sc = step.with_branch(forward_name(group))
                batch = stack_inputs([inp], group)
                bctx = ctx.block_context(sc, loop, prefix=f"{expert}.blocks")

                def compute(batch: dict[str, Any] = batch, bctx: BlockContext | None = bctx) -> torch.Tensor:
                    return self.forward(ctx, expert, batch, bctx)

                out = call_model(ctx.step_interceptors, sc, loop, batch, compute)
                preds.update(split_rows(out, [inp], group)[0])
                done = loop.extra.setdefault("parallel_forwards", {})
                done[forward_name(group)] = done.get(forward_name(group), 0) + 1
            if split:  # each cfg rank computed one branch: exchange them
                pred = preds[plan[mesh.cfg_rank]].contiguous()
                gathered = [torch.empty_like(pred) for _ in range(self.cfg)]
                dist.all_gather(gathered, pred, group=mesh.cfg_group)
                preds = dict(zip(plan, gathered, strict=True))
            if ctx.taps_enabled:
                for b, p in preds.items():
                    ctx.tap("noise_pred", p, step.with_branch(b))
        return finish_step(ctx, pol, step, loop, preds)

    def finalize(self, ctx: StageContext, state: RequestState, loop: LoopState) -> None:
        mesh = self.mesh
        state.metrics["parallel"] = {
            "sp": self.sp, "cfg": self.cfg, "rank": mesh.rank, "sp_rank": mesh.sp_rank, "cfg_rank": mesh.cfg_rank,
            # the forwards this rank ran, by branch (under cfg each rank runs its own branch only)
            "forwards": dict(loop.extra.get("parallel_forwards", {})),
        }
        super().finalize(ctx, state, loop)

    # batched steps across requests are not combined with parallel ranks
    def batch_key(self, ctx: StageContext, state: RequestState, loop: LoopState) -> None:
        return None


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
