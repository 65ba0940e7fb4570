"""A denoiser family across ranks: CFG-parallel steps and Ulysses sequence-parallel attention
(deploy ``parallel: {sp, cfg}``), inside omniloop-parallel's worker pool (every rank runs the same
request, SPMD; the process group is ``torch.distributed``'s default one).

* :class:`Mesh` / :func:`mesh_for` — this rank's place in the ``cfg x sp`` mesh
  (``rank = cfg_index * sp + sp_index``) and the process groups of its two axes;
* :func:`ulysses` — an attention function ``fn(q, k, v)`` over ``[B, H, L/sp, D]`` shards computed
  over the whole sequence for ``H/sp`` heads (all-to-all exchanges, head groups pipelined);
  :func:`head_groups` picks how many groups;
* :func:`bind_block_interceptor` — a block interceptor (cache-dit, fbcache) reduces its skip
  decision over the sp group, so every rank skips the same blocks;
* :class:`ParallelLoop` — a :class:`~omniloop_kit.denoise.DenoiseLoop` mixin whose step spreads the
  planned guidance branches over the cfg ranks (one branch each, predictions exchanged with
  ``all_gather``; every rank then combines and advances the same latents). Each branch's forward
  is the very forward one process runs, so the result is ``torch.equal`` to one process. The
  family's ``forward`` does the sequence split (its token layout is its own).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from omniloop.context import StageContext
from omniloop.interceptors import BlockContext, call_model
from omniloop.loop import LoopState, RequestState, StepResult


class Mesh:
    """This rank's place in the ``cfg x sp`` mesh and the groups of its two axes (None: the axis is 1)."""

    def __init__(self, sp: int, cfg: int) -> None:
        if not dist.is_initialized():
            raise RuntimeError("parallel: torch.distributed is not initialised (run through omniloop-parallel's pool)")
        world = dist.get_world_size()
        if world != sp * cfg:
            raise RuntimeError(f"parallel: the process group has {world} ranks, parallel: {{sp: {sp}, cfg: {cfg}}} needs {sp * cfg}")
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


def gather_tokens(local: torch.Tensor, mesh: Mesh, dim: int = 1) -> torch.Tensor:
    """Every sp rank's token shard, concatenated in rank order along ``dim``."""
    parts = [torch.empty_like(local) for _ in range(mesh.sp)]
    dist.all_gather(parts, local, group=mesh.sp_group)
    return torch.cat(parts, dim=dim)


class ParallelLoop:
    """A :class:`~omniloop_kit.denoise.DenoiseLoop` mixin (``class P(ParallelLoop, FamilyDenoise)``;
    ``sp`` and ``cfg`` set by the family): the step's branches over the cfg ranks, the forward's
    metrics per rank (``metrics["parallel"]``); batched steps across requests are not combined with
    parallel ranks."""

    sp: int = 1
    cfg: int = 1

    @property
    def mesh(self) -> Mesh:
        return mesh_for(self.sp, self.cfg)

    def step(self, ctx: StageContext, state: RequestState, loop: LoopState) -> StepResult:
        from omniloop_policies import forward_groups, forward_name
        from omniloop_policies.stepping import begin_step, finish_step

        me: Any = self
        pol, step = begin_step(ctx, state, loop)
        expert = step.expert
        me.note(loop, expert)
        plan = tuple(pol.plan(step, loop))  # planned once (policies count their branches)
        split = self.cfg > 1 and len(plan) == self.cfg
        mesh = self.mesh
        groups = ((plan[mesh.cfg_rank],),) if split else forward_groups(pol.cfg, plan)
        with torch.no_grad():
            inp = me.inputs(ctx, state, loop, pol, expert)
            preds: dict[str, torch.Tensor] = {}
            for group in groups:  # this rank's forwards (one branch each under cfg parallel)
                sc = step.with_branch(forward_name(group))
                batch = me.stack([inp], group)
                bctx = ctx.block_context(sc, loop, prefix=me.prefix(expert))

                def compute(batch: dict[str, Any] = batch, bctx: BlockContext | None = bctx) -> torch.Tensor:
                    return me.forward(ctx, expert, batch, bctx)

                out = call_model(ctx.step_interceptors, sc, loop, batch, compute)
                preds.update(me.split(out, [inp], group)[0])
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
        super().finalize(ctx, state, loop)  # type: ignore[misc]

    def batch_key(self, ctx: StageContext, state: RequestState, loop: LoopState) -> None:
        return None


__all__ = ["Mesh", "ParallelLoop", "bind_block_interceptor", "gather_tokens", "head_groups", "mesh_for", "ulysses"]
