"""DMD2 (distribution-matching distillation) for few-step students, independent of how the
student draws its sample.

Three roles, each a flow-matching transformer called as diffusers' Wan transformer is
(``model(hidden_states=x, timestep=t, encoder_hidden_states=emb, return_dict=False)[0]`` is the
velocity ``v``, ``x_s = (1 - s) x0 + s n``, ``v = n - x0``, model timestep ``1000 s``):

* the **teacher** (frozen) gives the *real* score: its x0 prediction with classic CFG
  (``u + g (c - u)``, ``DMDConfig.teacher_guidance``);
* the **critic** (trainable, starts as the teacher) gives the *fake* score: it learns, by flow
  matching on the student's own samples (:func:`critic_loss`), the distribution the student draws;
* the **student** (trainable) draws a sample ``x0`` through a ``rollout`` (gradient through the
  student) and is pushed along ``fake - real`` (:func:`distribution_matching_loss`).

The choices (DMD2, Yin et al. 2024, as FastVideo's FastWan recipe runs it):

* DM loss: noise the student's ``x0`` to ``s`` drawn uniformly in model time
  ``[t_min, t_max]`` (then shifted by ``dm_shift``), ``grad = (x0_fake - x0_real) /
  mean|x0 - x0_real|`` (per sample; the DMD normaliser), loss ``0.5 * MSE(x0, stopgrad(x0 - grad))``
  whose gradient w.r.t. ``x0`` is ``grad / numel``;
* two time-scale update rule: ``critic_steps`` critic updates per student update (DMD2 uses 5);
* no regression loss and no GAN head (the demo's teacher is cheap enough that the student starts
  from it, so the regression term DMD1 needed is not);
* the student's rollout is the runtime's ``few-step`` sampler (:class:`FewStepRollout`): it calls
  ``omniloop_policies.samplers.FewStepSampler.init/step`` itself, so training samples exactly what
  ``omniloop generate --sampler few-step`` samples. Backward simulation: each student update exits
  at a random step ``k`` of the schedule (the sampler run with the first ``k + 1`` timesteps,
  which returns that step's ``x0``), gradient through the exit step only (DMD2 / Self-Forcing), so
  every step of the schedule is trained on the inputs the sampler gives it.

LoRA roles (:class:`AdapterRole`): student and critic as two named LoRA adapters of one frozen
base; the teacher is the base with adapters off. That is how the recipe runs on a real Wan
checkpoint (one 14B base in memory, two small adapters trained). :func:`train_dmd` does not care:
a role is anything callable as above with ``parameters()``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import attrs
import torch
from attrs import define, field


@define(frozen=True, kw_only=True)
class DMDConfig:
    """The recipe's knobs. ``t_min``/``t_max`` are fractions of the model's time range
    (0 = clean, 1 = noise) for the DM loss's and the critic's noise level, ``dm_shift`` the flow
    shift applied to the uniform draw (``s = shift u / (1 + (shift - 1) u)``)."""

    teacher_guidance: float = 5.0
    critic_steps: int = 5
    student_lr: float = 2e-5
    critic_lr: float = 4e-5
    betas: tuple[float, float] = (0.0, 0.999)
    weight_decay: float = 0.0
    t_min: float = 0.02
    t_max: float = 0.98
    dm_shift: float = 3.0
    #: per-sample normaliser of the DM gradient: ``"mean_abs"`` (DMD's ``mean |x0 - x0_real|``) or ``"none"``
    normalise: str = "mean_abs"
    grad_clip: float = 1.0
    #: bf16 autocast for the forwards when the tensors are on CUDA
    autocast: bool = True
    #: the critic-only iterations between two student updates train on the last student update's
    #: samples (new noise levels and noises each time) instead of rolling the student out again:
    #: a rollout is most of a critic iteration's cost (3/4 of it for the causal student on CPU), so
    #: this buys more student updates per budget, at the price of fewer distinct samples for the
    #: critic (its batch per student update, not ``critic_steps`` batches); DMD2 rolls out afresh
    reuse_samples: bool = False
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        if not 0.0 <= self.t_min < self.t_max <= 1.0:
            raise ValueError(f"DMDConfig: need 0 <= t_min < t_max <= 1, got {self.t_min}, {self.t_max}")
        if self.critic_steps < 1:
            raise ValueError(f"DMDConfig.critic_steps must be >= 1, got {self.critic_steps}")
        if self.normalise not in ("mean_abs", "none"):
            raise ValueError(f"DMDConfig.normalise must be 'mean_abs' or 'none', got {self.normalise!r}")
        for name in ("teacher_guidance", "student_lr", "critic_lr", "dm_shift", "grad_clip"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0 or (name == "dm_shift" and v == 0):
                raise ValueError(f"DMDConfig.{name} must be finite and > 0, got {v!r}")


@define(frozen=True)
class Text:
    """Text embeddings of a batch: ``cond`` ``[B, L, D]`` and the empty prompt's ``uncond``
    (``[1, L, D]`` or ``[B, L, D]``; the teacher's CFG needs it)."""

    cond: torch.Tensor
    uncond: torch.Tensor | None = None


@define(frozen=True)
class Batch:
    """One training batch: the student's initial noise and the prompts' embeddings."""

    noise: torch.Tensor
    text: Text


class Role(Protocol):
    def __call__(self, **kwargs: Any) -> Any: ...

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...


#: ``rollout(student, noise, text, generator) -> x0`` with gradient through the student
Rollout = Callable[[Role, torch.Tensor, Text, torch.Generator | None], torch.Tensor]


def velocity(model: Role, x: torch.Tensor, timestep: torch.Tensor, emb: torch.Tensor, *, autocast: bool = True) -> torch.Tensor:
    """The model's velocity in float32 (bf16 autocast on CUDA when ``autocast``)."""
    t = timestep.expand(x.shape[0]) if timestep.ndim == 0 else timestep
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast and x.is_cuda):
        v = model(hidden_states=x, timestep=t, encoder_hidden_states=emb, return_dict=False)[0]
    return v.float()


def _draw_sigma(cfg: DMDConfig, n: int, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    u = torch.rand((n,), generator=generator, device=generator.device if generator is not None else device)
    u = (cfg.t_min + (cfg.t_max - cfg.t_min) * u).to(device)
    return cfg.dm_shift * u / (1.0 + (cfg.dm_shift - 1.0) * u)


def _randn_like(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    dev = generator.device if generator is not None else x.device
    return torch.randn(x.shape, generator=generator, device=dev, dtype=torch.float32).to(x.device)


def _bcast(s: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return s.view(-1, *([1] * (x.ndim - 1)))


def distribution_matching_loss(x0_student: torch.Tensor, text: Text, teacher: Role, critic: Role, cfg: DMDConfig,
                               generator: torch.Generator | None = None) -> torch.Tensor:
    """DMD2's generator loss on the student's ``x0`` (gradient flows into ``x0_student`` only).

    Noise ``x0`` to a random ``s``; real = the teacher's CFG x0 prediction, fake = the critic's;
    ``grad = (fake - real) / mean|x0 - real|``; ``0.5 * MSE(x0, stopgrad(x0 - grad))``."""
    x0 = x0_student.float()
    b = x0.shape[0]
    with torch.no_grad():
        s = _draw_sigma(cfg, b, x0.device, generator)
        sb = _bcast(s, x0)
        xt = (1.0 - sb) * x0.detach() + sb * _randn_like(x0, generator)
        t = s * 1000.0
        if cfg.teacher_guidance != 1.0:
            if text.uncond is None:
                raise ValueError("distribution_matching_loss: the teacher's CFG needs text.uncond")
            unc = text.uncond.expand(b, -1, -1) if text.uncond.shape[0] == 1 else text.uncond
            v = velocity(teacher, torch.cat([xt, xt]), torch.cat([t, t]), torch.cat([text.cond, unc]), autocast=cfg.autocast)
            vc, vu = v.chunk(2)
            v_real = vu + cfg.teacher_guidance * (vc - vu)
        else:
            v_real = velocity(teacher, xt, t, text.cond, autocast=cfg.autocast)
        x0_real = xt - sb * v_real
        x0_fake = xt - sb * velocity(critic, xt, t, text.cond, autocast=cfg.autocast)
        grad = x0_fake - x0_real
        if cfg.normalise == "mean_abs":
            norm = (x0.detach() - x0_real).abs().mean(dim=tuple(range(1, x0.ndim)), keepdim=True)
            grad = grad / norm.clamp(min=1e-6)
        grad = torch.nan_to_num(grad)
    return 0.5 * torch.nn.functional.mse_loss(x0, (x0 - grad).detach(), reduction="mean")


def critic_loss(critic: Role, x0_student: torch.Tensor, text: Text, generator: torch.Generator | None = None, *,
                cfg: DMDConfig | None = None) -> torch.Tensor:
    """Flow matching of the critic on the student's (detached) samples: ``x_s = (1 - s) x0 + s n``,
    target ``n - x0``, ``s`` drawn as for the DM loss."""
    cfg = cfg or DMDConfig()
    x0 = x0_student.detach().float()
    s = _draw_sigma(cfg, x0.shape[0], x0.device, generator)
    sb = _bcast(s, x0)
    n = _randn_like(x0, generator)
    v = velocity(critic, (1.0 - sb) * x0 + sb * n, s * 1000.0, text.cond, autocast=cfg.autocast)
    return torch.nn.functional.mse_loss(v, n - x0)


# --------------------------------------------------------------------------------------------------
# The bidirectional few-step rollout: the runtime's few-step sampler, with gradient
# --------------------------------------------------------------------------------------------------


@define(kw_only=True)
class FewStepRollout:
    """The student's sample through ``omniloop_policies.samplers.FewStepSampler`` (its own
    ``init``/``step``: ``x0 = x - s_i v``, re-noise to ``s_{i+1}`` with fresh noise from the
    generator, the last step returns ``x0``), guidance 1 (conditional forward only).

    ``exit``: ``"last"`` runs the whole schedule (what ``omniloop generate`` returns);
    ``"random"`` exits at a step ``k`` drawn from ``exit_generator`` (the sampler run with the
    first ``k + 1`` timesteps: the same draws, ending with step ``k``'s ``x0``). ``grad``:
    ``"exit"`` keeps the graph of the exit step only (the earlier steps run under no_grad),
    ``"all"`` through every step."""

    sampler: Any
    exit: str = field(default="random", validator=attrs.validators.in_(("random", "last")))
    grad: str = field(default="exit", validator=attrs.validators.in_(("exit", "all")))
    exit_generator: torch.Generator = attrs.Factory(lambda: torch.Generator().manual_seed(0))
    autocast: bool = True
    last_exit: int = -1

    def __call__(self, student: Role, noise: torch.Tensor, text: Text, generator: torch.Generator | None) -> torch.Tensor:
        ts = tuple(self.sampler.timesteps_list)
        k = len(ts) - 1 if self.exit == "last" else int(torch.randint(0, len(ts), (1,), generator=self.exit_generator))
        self.last_exit = k
        state = self.sampler.init(None, device=noise.device, generator=generator, timesteps=ts[: k + 1])
        x = noise.float()
        for i in range(state.num_steps):
            with torch.set_grad_enabled(torch.is_grad_enabled() and (self.grad == "all" or i == k)):
                v = velocity(student, x, state.timestep(i), text.cond, autocast=self.autocast)
                x = self.sampler.step(state, v, state.timestep(i), x)
        return x


# --------------------------------------------------------------------------------------------------
# LoRA roles: student and critic as named adapters of one frozen base
# --------------------------------------------------------------------------------------------------


class AdapterRole:
    """One role of a base model carrying peft LoRA adapters (diffusers' ``add_adapter``): calling
    it activates adapter ``name`` (``None``: the teacher, adapters off) and runs the base.
    ``parameters()`` are that adapter's LoRA weights only (the base stays frozen)."""

    def __init__(self, base: torch.nn.Module, name: str | None):
        self.base, self.name = base, name

    def _activate(self) -> None:
        if self.name is None:
            self.base.disable_adapters()
            return
        self.base.enable_adapters()
        self.base.set_adapter(self.name)
        # peft marks only the active adapter trainable; every adapter keeps its own grads
        for n, p in self.base.named_parameters():
            if "lora_" in n:
                p.requires_grad_(True)

    def __call__(self, **kwargs: Any) -> Any:
        self._activate()
        return self.base(**kwargs)

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        if self.name is None:
            return iter(())
        tag = f".{self.name}."
        return ((n, p) for n, p in self.base.named_parameters() if "lora_" in n and tag in n)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return (p for _, p in self.named_parameters())


def lora_roles(base: torch.nn.Module, *, rank: int, alpha: float | None = None, target_modules: Iterable[str] | None = None) -> tuple[AdapterRole, AdapterRole, AdapterRole]:
    """``(student, teacher, critic)`` on one base: adds LoRA adapters ``"student"`` and
    ``"critic"`` (peft ``LoraConfig``, B = 0 so both start as the teacher), freezes the base."""
    from peft import LoraConfig

    targets = list(target_modules or ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"))
    base.requires_grad_(False)
    for name in ("student", "critic"):
        base.add_adapter(LoraConfig(r=rank, lora_alpha=alpha or rank, target_modules=targets, init_lora_weights=True),
                         adapter_name=name)
    return AdapterRole(base, "student"), AdapterRole(base, None), AdapterRole(base, "critic")


# --------------------------------------------------------------------------------------------------
# The alternating loop
# --------------------------------------------------------------------------------------------------


def warm_critic(critic: Role, student: Role, rollout: Rollout, batches: Iterable[Batch], config: DMDConfig, *,
                steps: int, generator: torch.Generator | None = None, log_every: int = 10,
                log: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """``steps`` critic-only updates on the (unchanged) student's samples before :func:`train_dmd`.
    The critic starts as the teacher; when the student does not (a student resumed from an earlier
    run), ``fake - real`` is then the teacher's error, not the student's, until the critic has
    learnt the student's distribution, and with a short budget those student steps are few. AdamW
    at ``config.critic_lr`` (its own optimizer: :func:`train_dmd` makes a fresh one). Returns the
    log (mean critic loss per ``log_every`` updates)."""
    params = _params(critic)
    opt = torch.optim.AdamW(params, lr=config.critic_lr, betas=config.betas, weight_decay=config.weight_decay)
    it = iter(batches)
    out: list[dict[str, Any]] = []
    acc = 0.0
    for i in range(steps):
        batch = next(it)
        with torch.no_grad():
            x0 = rollout(student, batch.noise, batch.text, generator)
        loss = critic_loss(critic, x0, batch.text, generator, cfg=config)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
        opt.step()
        acc += float(loss.detach())
        if (i + 1) % log_every == 0 or i + 1 == steps:
            out.append({"critic_warmup_iter": i + 1, "critic_loss": acc / (i % log_every + 1)})
            if log is not None:
                log(out[-1])
            acc = 0.0
    return out


def _params(role: Role) -> list[torch.nn.Parameter]:
    return [p for p in role.parameters() if p.requires_grad or isinstance(role, AdapterRole)]


def train_dmd(student: Role, teacher: Role, critic: Role, rollout: Rollout, batches: Iterable[Batch], config: DMDConfig,
              steps: int, *, log: Callable[[dict[str, Any]], None] | None = None, log_every: int = 50,
              lr_at: Callable[[int], float] | None = None, on_student_step: Callable[[int], None] | None = None,
              generator: torch.Generator | None = None, stop: Callable[[], bool] | None = None) -> dict[str, Any]:
    """``steps`` iterations (fewer when ``stop()`` turns true: a time box); each one updates the critic, and every ``config.critic_steps``-th
    one (starting with the first) first updates the student. ``lr_at(i)`` scales both learning
    rates (a warm-up / decay factor). Returns ``{"student_steps", "critic_steps", "last"}``."""
    s_params, c_params = _params(student), _params(critic)
    if not s_params or not c_params:
        raise ValueError("train_dmd: the student and the critic need trainable parameters")
    fused = s_params[0].is_cuda
    s_opt = torch.optim.AdamW(s_params, lr=config.student_lr, betas=config.betas, weight_decay=config.weight_decay, fused=fused)
    c_opt = torch.optim.AdamW(c_params, lr=config.critic_lr, betas=config.betas, weight_decay=config.weight_decay, fused=fused)
    for p in teacher.parameters():
        p.requires_grad_(False)
    gen = generator if generator is not None else torch.Generator().manual_seed(config.seed)
    it = iter(batches)
    acc: dict[str, float] = {"dm": 0.0, "critic": 0.0, "n_dm": 0, "n_c": 0}
    s_steps = c_steps = 0
    last: dict[str, Any] = {}
    kept: tuple[torch.Tensor, Text] | None = None  # the last student update's samples (reuse_samples)
    for i in range(steps):
        if stop is not None and stop():
            break
        scale = 1.0 if lr_at is None else float(lr_at(i))
        batch = next(it)
        x0_det = None
        if i % config.critic_steps == 0:
            for g in s_opt.param_groups:
                g["lr"] = config.student_lr * scale
            x0 = rollout(student, batch.noise, batch.text, gen)
            loss = distribution_matching_loss(x0, batch.text, teacher, critic, config, gen)
            s_opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(s_params, config.grad_clip)
            s_opt.step()
            x0_det = x0.detach()
            kept = (x0_det, batch.text)
            s_steps += 1
            acc["dm"] += float(loss.detach())
            acc["n_dm"] += 1
            if on_student_step is not None:
                on_student_step(s_steps)
        text = batch.text
        if x0_det is None and config.reuse_samples and kept is not None:
            x0_det, text = kept
        elif x0_det is None:
            with torch.no_grad():
                x0_det = rollout(student, batch.noise, batch.text, gen)
        for g in c_opt.param_groups:
            g["lr"] = config.critic_lr * scale
        closs = critic_loss(critic, x0_det, text, gen, cfg=config)
        c_opt.zero_grad(set_to_none=True)
        closs.backward()
        torch.nn.utils.clip_grad_norm_(c_params, config.grad_clip)
        c_opt.step()
        c_steps += 1
        acc["critic"] += float(closs.detach())
        acc["n_c"] += 1
        if (i + 1) % log_every == 0 or i + 1 == steps or (stop is not None and acc["n_c"] and stop()):
            last = {"iter": i + 1, "student_steps": s_steps, "lr_scale": scale,
                    "dm_loss": acc["dm"] / acc["n_dm"] if acc["n_dm"] else None, "critic_loss": acc["critic"] / max(1, acc["n_c"])}
            if log is not None:
                log(last)
            acc = {"dm": 0.0, "critic": 0.0, "n_dm": 0, "n_c": 0}
    return {"student_steps": s_steps, "critic_steps": c_steps, "last": last}
