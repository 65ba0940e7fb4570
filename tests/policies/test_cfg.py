"""CFG policies: combine formulas, batched dispatch, gating (forward counts), expert invalidation."""

from __future__ import annotations

import pytest
import torch

from omniloop.loop import LoopState, StepContext
from omniloop.request import DiffusionParams, OmniRequest, TaskType
from omniloop_policies import (
    AdaptiveGateCFG,
    BoundaryRouter,
    ClassicCFG,
    EmbeddedGuidance,
    GuiderCFG,
    IntervalCFG,
    PerModalityCFG,
    PolicyError,
    PolicyMenu,
    guided_prediction,
    predict_branches,
    stack_forward,
)
from omniloop_policies.testing import WAN_UNIPC_CONFIG, ToyDenoiseLoop, ToyDenoiser

#: Batched (stacked) vs two-forward CFG on the fp32 ToyDenoiser (Linear layers, CPU, 2 threads):
#: measured max |diff| of one guided prediction (scale 5) over 80 cases: 1.05e-5 (the stacked
#: matmul has a different M and blocking, so the last bits differ); after a 10-step UniPC loop:
#: <= 1e-5. Tolerances below are ~5x the measurements. With a batch-invariant model the two are
#: bit-identical (tested).
BATCHED_STEP_ATOL = 5e-5
BATCHED_LOOP_ATOL = 1e-4


def ctx(i: int = 0, n: int = 10, t: float = 700.0, expert: str | None = None) -> StepContext:
    return StepContext(request_id="r", node="denoise", step_index=i, num_steps=n, timestep=t, expert=expert)


def t2v(**diffusion) -> OmniRequest:
    return OmniRequest(task=TaskType.T2V, diffusion=DiffusionParams(**diffusion))


class Counting:
    """forward(step) for predict_branches that records the branches it was called for."""

    def __init__(self, preds: dict[str, torch.Tensor]):
        self.preds = preds
        self.calls: list[str] = []

    def __call__(self, step: StepContext) -> torch.Tensor:
        self.calls.append(step.branch)
        return self.preds[step.branch]


def preds(seed: int = 0, shape=(1, 4, 2, 3, 3), dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"cond": torch.randn(shape, generator=g).to(dtype), "uncond": torch.randn(shape, generator=g).to(dtype)}


# -- classic ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_classic_is_the_diffusers_pipeline_formula_bit_for_bit(dtype):
    p = preds(dtype=dtype)
    cfg = ClassicCFG()
    state = cfg.init(10, scale=5.0)
    fwd = Counting(p)
    out = guided_prediction(cfg, ctx(), state, forward=fwd)
    assert torch.equal(out, p["uncond"] + 5.0 * (p["cond"] - p["uncond"]))  # pipeline_wan.py
    assert out.dtype == dtype and fwd.calls == ["cond", "uncond"]


def test_classic_matches_the_diffusers_cfg_guider():
    from diffusers.guiders import ClassifierFreeGuidance

    p = preds()
    cfg = ClassicCFG()
    ours = guided_prediction(cfg, ctx(), cfg.init(10, scale=4.5), forward=Counting(p))
    theirs = ClassifierFreeGuidance(guidance_scale=4.5).forward(p["cond"], p["uncond"]).pred
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("scale", [0.0, 1.0])
def test_scale_at_most_one_computes_only_the_conditional_branch(scale):
    cfg = ClassicCFG()
    state = cfg.init(10, scale=scale)
    fwd = Counting(preds())
    out = guided_prediction(cfg, ctx(), state, forward=fwd)
    assert fwd.calls == ["cond"] and torch.equal(out, preds()["cond"])
    assert cfg.branches(state) == ("cond",)


def test_guidance_rescale_matches_diffusers():
    from diffusers.guiders.guider_utils import rescale_noise_cfg

    p = preds()
    cfg = ClassicCFG(rescale=0.7)
    out = guided_prediction(cfg, ctx(), cfg.init(10, scale=6.0), forward=Counting(p))
    want = rescale_noise_cfg(p["uncond"] + 6.0 * (p["cond"] - p["uncond"]), p["cond"], 0.7)
    assert torch.allclose(out, want, atol=0, rtol=1e-6)


def test_per_expert_scale_follows_step_expert():
    p = preds()
    cfg = ClassicCFG()
    state = cfg.init(10, scale=4.0, scales_by_expert={"transformer_2": 3.0})
    hi = guided_prediction(cfg, ctx(expert="transformer"), state, forward=Counting(p))
    lo = guided_prediction(cfg, ctx(expert="transformer_2"), state, forward=Counting(p))
    assert torch.equal(hi, p["uncond"] + 4.0 * (p["cond"] - p["uncond"]))
    assert torch.equal(lo, p["uncond"] + 3.0 * (p["cond"] - p["uncond"]))


# -- batched ------------------------------------------------------------------------------------


def test_batched_declares_one_forward_branch_and_runs_one_forward():
    cfg = ClassicCFG(batched=True)
    state = cfg.init(10, scale=5.0)
    assert cfg.branches(state) == ("cond+uncond",)
    m = ToyDenoiser()
    x = torch.randn(1, 4, 2, 3, 3)
    e = {"cond": torch.randn(1, 6, 8), "uncond": torch.randn(1, 6, 8)}
    seen: list[str] = []

    def forward_batch(step, group):
        seen.append(step.branch)
        return stack_forward(lambda xb, eb: m(xb, 700.0, eb), x, e)(step, group)

    predict_branches(cfg, ctx(), state, forward=lambda s: m(x, 700.0, e[s.branch]), forward_batch=forward_batch)
    assert seen == ["cond+uncond"] and m.forwards == 1 and m.batch_sizes == [2]


def _classic_both_ways(forward, forward_batch):
    """Classic CFG at scale 5 (step 0 of 10) run as two forwards (``False``) and as one batched
    forward (``True``), given both forwards."""
    out = {}
    for batched in (False, True):
        cfg = ClassicCFG(batched=batched)
        out[batched] = guided_prediction(cfg, ctx(), cfg.init(10, scale=5.0), forward=forward, forward_batch=forward_batch)
    return out


def test_batched_equals_two_forward_cfg_within_the_measured_tolerance():
    worst = 0.0
    for seed in range(8):
        for shape in [(1, 4, 2, 4, 4), (2, 16, 3, 8, 8)]:
            m = ToyDenoiser(channels=shape[1], seed=seed)
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(shape, generator=g)
            e = {"cond": torch.randn(shape[0], 6, 8, generator=g), "uncond": torch.randn(shape[0], 6, 8, generator=g)}
            t = torch.full((shape[0],), 700.0)
            out = _classic_both_ways(
                forward=lambda s, m=m, x=x, t=t, e=e: m(x, t, e[s.branch]),
                forward_batch=stack_forward(lambda xb, eb, m=m, t=t: m(xb, t.repeat(2), eb), x, e),
            )
            torch.testing.assert_close(out[True], out[False], atol=BATCHED_STEP_ATOL, rtol=0)
            worst = max(worst, (out[True] - out[False]).abs().max().item())
    assert worst < BATCHED_STEP_ATOL


def test_batched_equals_two_forward_over_a_whole_loop():
    res = {}
    for name in ("classic", "batched"):
        menu = PolicyMenu.build(WAN_UNIPC_CONFIG, default_cfg=name)
        model = ToyDenoiser()
        res[name] = ToyDenoiseLoop(menu, model).run(t2v(steps=10, guidance_scale=5.0), seed=0)
        assert model.forwards == (20 if name == "classic" else 10)
    torch.testing.assert_close(res["batched"], res["classic"], atol=BATCHED_LOOP_ATOL, rtol=0)


def test_batched_is_bit_identical_with_a_batch_invariant_model():
    p_model = lambda x, e: torch.tanh(x * e.mean(dim=(1, 2)).reshape(-1, 1, 1, 1, 1))  # noqa: E731
    x = torch.randn(1, 4, 2, 3, 3)
    e = {"cond": torch.randn(1, 6, 8), "uncond": torch.randn(1, 6, 8)}
    out = _classic_both_ways(forward=lambda s: p_model(x, e[s.branch]), forward_batch=stack_forward(p_model, x, e))
    assert torch.equal(out[True], out[False])


def test_batched_refuses_unequal_embedding_shapes():
    x = torch.randn(1, 4, 2, 3, 3)
    e = {"cond": torch.randn(1, 6, 8), "uncond": torch.randn(1, 5, 8)}
    cfg = ClassicCFG(batched=True)
    with pytest.raises(PolicyError, match="equal-shape embeddings"):
        predict_branches(
            cfg,
            ctx(),
            cfg.init(10, scale=5.0),
            forward=lambda s: x,
            forward_batch=stack_forward(lambda xb, eb: xb, x, e),
        )


# -- interval gating ------------------------------------------------------------------------------


def test_interval_gating_skips_exactly_the_forwards_outside_the_window():
    n = 10
    cfg = IntervalCFG(start=0.2, end=0.7)  # full CFG at steps 2..6
    state = cfg.init(n, scale=5.0)
    assert cfg.branches(state) == ("cond", "uncond")
    per_step = []
    for i in range(n):
        fwd = Counting(preds(i))
        out = guided_prediction(cfg, ctx(i, n), state, forward=fwd)
        per_step.append(tuple(fwd.calls))
        p = preds(i)
        want = p["uncond"] + 5.0 * (p["cond"] - p["uncond"]) if 2 <= i < 7 else p["cond"]
        assert torch.equal(out, want)
    assert per_step == [("cond",)] * 2 + [("cond", "uncond")] * 5 + [("cond",)] * 3
    assert sum(map(len, per_step)) == 15  # 2n = 20 without gating
    assert cfg.metrics(state) == {"full_steps": 5, "cond_only_steps": 5}


def test_interval_gating_counts_model_forwards_in_a_loop_classic_and_batched():
    for name, opts, want in [("interval", {}, 15), ("interval", {"batched": True}, 10)]:
        menu = PolicyMenu.build(WAN_UNIPC_CONFIG, default_cfg=name, cfg_options={name: opts})
        model = ToyDenoiser()
        loop = ToyDenoiseLoop(menu, model)
        loop.run(
            OmniRequest(
                task=TaskType.T2V,
                diffusion=DiffusionParams(steps=10, guidance_scale=5.0),
                node_params={"denoise": {"cfg_window": [0.2, 0.7]}},
            ),
            seed=0,
        )
        assert model.forwards == want, (opts, model.batch_sizes)
        if opts:
            assert model.batch_sizes == [1, 1, 2, 2, 2, 2, 2, 1, 1, 1]


def test_interval_matches_the_diffusers_guider_start_stop_rule():
    from diffusers.guiders import ClassifierFreeGuidance

    n = 7
    cfg = IntervalCFG(start=0.3, end=0.8)
    g = ClassifierFreeGuidance(guidance_scale=5.0, start=0.3, stop=0.8)
    for i in range(n):
        g.set_state(i, n, torch.tensor(0.0))
        assert cfg.in_window(ctx(i, n)) == (g.num_conditions == 2), i


@pytest.mark.parametrize("window", [(0.5, 0.5), (-0.1, 0.5), (0.2, 1.5), (0.8, 0.2)])
def test_interval_rejects_bad_windows(window):
    with pytest.raises(PolicyError, match="window"):
        IntervalCFG(start=window[0], end=window[1])


# -- embedded guidance -----------------------------------------------------------------------------


def test_embedded_guidance_is_one_forward_with_the_scale_passed_to_the_model():
    cfg = EmbeddedGuidance(multiplier=1000.0)
    state = cfg.init(10, scale=3.5)
    fwd = Counting(preds())
    out = guided_prediction(cfg, ctx(), state, forward=fwd)
    assert fwd.calls == ["cond"] and torch.equal(out, preds()["cond"])
    assert cfg.model_guidance(ctx(), state) == 3500.0
    assert cfg.branches(state) == ("cond",)


# -- per-modality ------------------------------------------------------------------------------------


def test_per_modality_scales_on_a_dict_prediction():
    cfg = PerModalityCFG(scales={"video": 5.0, "audio": 2.0})
    state = cfg.init(10, scale=4.0)
    v, a = preds(1), preds(2)
    out = cfg.combine(
        ctx(),
        state,
        {
            "cond": {"video": v["cond"], "audio": a["cond"], "action": a["cond"]},
            "uncond": {"video": v["uncond"], "audio": a["uncond"], "action": a["uncond"]},
        },
    )
    assert torch.equal(out["video"], v["uncond"] + 5.0 * (v["cond"] - v["uncond"]))
    assert torch.equal(out["audio"], a["uncond"] + 2.0 * (a["cond"] - a["uncond"]))
    assert torch.equal(out["action"], a["uncond"] + 4.0 * (a["cond"] - a["uncond"]))  # request scale


def test_per_modality_scales_on_a_packed_tensor_with_a_layout():
    cfg = PerModalityCFG(scales={"video": 5.0, "audio": 2.0}, layout=(("video", 6), ("audio", 3)), dim=1)
    state = cfg.init(10, scale=4.0, modality_scales={"audio": 1.5})
    g = torch.Generator().manual_seed(0)
    c, u = torch.randn(2, 9, 4, generator=g), torch.randn(2, 9, 4, generator=g)
    out = cfg.combine(ctx(), state, {"cond": c, "uncond": u})
    assert torch.equal(out[:, :6], u[:, :6] + 5.0 * (c[:, :6] - u[:, :6]))
    assert torch.equal(out[:, 6:], u[:, 6:] + 1.5 * (c[:, 6:] - u[:, 6:]))
    with pytest.raises(PolicyError, match="needs 9"):
        cfg.combine(ctx(), state, {"cond": c[:, :8], "uncond": u[:, :8]})
    with pytest.raises(PolicyError, match="no modality"):
        cfg.init(10, scale=4.0, modality_scales={"sound": 2.0})


# -- adaptive gate -----------------------------------------------------------------------------------


def run_gate(cfg, n=10, experts=None, scale=5.0):
    state = cfg.init(n, scale=scale)
    plans, outs = [], []
    for i in range(n):
        fwd = Counting(preds(i))
        outs.append(guided_prediction(cfg, ctx(i, n, expert=(experts or [None] * n)[i]), state, forward=fwd))
        plans.append(tuple(fwd.calls))
    return state, plans, outs


def test_adaptive_gate_every_one_equals_classic_bit_for_bit():
    _, _, gate = run_gate(AdaptiveGateCFG(every=1))
    _, _, classic = run_gate(ClassicCFG())
    assert all(torch.equal(a, b) for a, b in zip(gate, classic, strict=True))


def test_adaptive_gate_reuses_the_cached_delta_between_full_steps():
    cfg = AdaptiveGateCFG(every=3, warmup=1)
    state, plans, outs = run_gate(cfg)
    full = [i for i, p in enumerate(plans) if p == ("cond", "uncond")]
    assert full == [0, 3, 6, 9]
    assert sum(map(len, plans)) == 14  # 4 full steps x 2 + 6 reuse steps x 1
    # a reuse step is cond + (s - 1) * delta of the last full step
    d3 = preds(3)["cond"] - preds(3)["uncond"]
    assert torch.equal(outs[4], preds(4)["cond"] + 4.0 * d3)
    assert cfg.metrics(state) == {"full_steps": 4, "cond_only_steps": 6, "invalidations": 0}


def test_adaptive_gate_invalidates_its_delta_when_the_expert_switches():
    experts = ["transformer"] * 4 + ["transformer_2"] * 6
    cfg = AdaptiveGateCFG(every=4, warmup=1)
    state, plans, _ = run_gate(cfg, experts=experts)
    full = [i for i, p in enumerate(plans) if len(p) == 2]
    assert full == [0, 4, 8]  # 4: the router switched, the old expert's delta is dropped
    assert state.extra["invalidations"] == 1 and state.extra["expert"] == "transformer_2"


def test_adaptive_gate_sees_the_boundary_router_switch_through_step_context():
    router = BoundaryRouter(boundary_ratio=0.875)
    menu = PolicyMenu.build(
        WAN_UNIPC_CONFIG, default_cfg="adaptive-gate", router=router, cfg_options={"adaptive-gate": {"every": 100}}
    )
    hi, lo = ToyDenoiser(seed=1), ToyDenoiser(seed=2)
    loop = ToyDenoiseLoop(menu, {"transformer": hi, "transformer_2": lo})
    state = loop.init(t2v(steps=12, guidance_scale=5.0), seed=0)
    sstate = state.policy_state["sampler"]
    switch = next(i for i, t in enumerate(sstate.timestep_values) if t < 875.0)
    while not loop.step(state):
        pass
    # every=100: only step 0 and the switch step are full; the switch recomputes on the new expert
    assert hi.forwards == switch + 1 and lo.forwards == (12 - switch) + 1
    assert state.policy_state["cfg"].extra["invalidations"] == 1


def test_adaptive_gate_threshold_keeps_computing_while_the_delta_moves():
    n = 8
    cfg = AdaptiveGateCFG(every=4, warmup=1, threshold=0.05)
    assert cfg.needs_host_sync
    # a delta that never changes: after two full steps agree, it is reused until `every` forces one
    const = preds(0)
    state = cfg.init(n, scale=5.0)
    plans = []
    for i in range(n):
        fwd = Counting(const)
        guided_prediction(cfg, ctx(i, n), state, forward=fwd)
        plans.append(len(fwd.calls))
    assert plans == [2, 2, 1, 1, 1, 2, 1, 1]
    # a delta that keeps moving: every step is full
    _, moving, _ = run_gate(AdaptiveGateCFG(every=4, warmup=1, threshold=0.05), n=n)
    assert [len(p) for p in moving] == [2] * n


def test_adaptive_gate_window_limits_reuse():
    _, plans, _ = run_gate(AdaptiveGateCFG(every=10, warmup=0, start=0.0, end=0.5))
    assert [len(p) for p in plans] == [2, 1, 1, 1, 1, 2, 2, 2, 2, 2]


@pytest.mark.parametrize("kw", [{"every": 0}, {"warmup": -1}, {"threshold": -0.1}, {"start": 0.6, "end": 0.5}])
def test_adaptive_gate_rejects_bad_options(kw):
    with pytest.raises(PolicyError):
        AdaptiveGateCFG(**kw)


# -- diffusers guider adapter ---------------------------------------------------------------------------


def test_guider_adapter_runs_a_diffusers_cfg_guider_per_request():
    from diffusers.guiders import ClassifierFreeGuidance

    template = ClassifierFreeGuidance(guidance_scale=7.0, start=0.2, stop=0.6)
    cfg = GuiderCFG(guider=template)
    state = cfg.init(10, scale=5.0)  # the request's scale wins over the template's
    assert state.extra["guider"] is not template and state.extra["guider"].guidance_scale == 5.0
    assert cfg.branches(state) == ("cond", "uncond")
    calls = []
    for i in range(10):
        fwd = Counting(preds(i))
        out = guided_prediction(cfg, ctx(i, 10), state, forward=fwd)
        calls.append(len(fwd.calls))
        want = (
            ClassicCFG().combine(ctx(i), ClassicCFG().init(10, scale=5.0), preds(i)) if 2 <= i < 6 else preds(i)["cond"]
        )
        assert torch.equal(out, want), i
    assert calls == [1, 1, 2, 2, 2, 2, 1, 1, 1, 1]


def test_guider_adapter_keeps_stateful_guiders_per_request():
    from diffusers.guiders import AdaptiveProjectedGuidance

    cfg = GuiderCFG(guider=AdaptiveProjectedGuidance(guidance_scale=5.0, adaptive_projected_guidance_momentum=-0.5))
    a, b = cfg.init(4, scale=5.0), cfg.init(4, scale=5.0)
    assert a.extra["guider"] is not b.extra["guider"]


def test_guider_adapter_refuses_guiders_that_hook_the_model():
    from diffusers.guiders import SkipLayerGuidance

    with pytest.raises(PolicyError, match="hooks the denoiser"):
        GuiderCFG(guider=SkipLayerGuidance(guidance_scale=5.0, skip_layer_guidance_layers=[1]))
    with pytest.raises(PolicyError, match="BaseGuidance"):
        GuiderCFG(guider=object())


# -- step interceptors see the declared branches -------------------------------------------------


class RecordingInterceptor:
    name = "rec"
    graph_safe = True
    distribution_altering = False
    needs_eager = False

    def __init__(self):
        self.seen: list[tuple[str, object]] = []

    def open(self, step, loop, params=None):
        return {"branch": step.branch}

    def forward(self, step, state, inputs, compute):
        assert state == {"branch": step.branch}, "state must be keyed by the forward's branch"
        self.seen.append((step.branch, state["branch"]))
        return compute()

    def close(self, state):
        pass

    def metrics(self, state):
        return {}


@pytest.mark.parametrize(
    "name,opts,want",
    [
        ("interval", {}, {"cond", "uncond"}),
        ("interval", {"batched": True}, {"cond+uncond", "cond"}),
        ("adaptive-gate", {"batched": True, "every": 2}, {"cond+uncond", "cond"}),
    ],
)
def test_step_interceptors_get_state_keyed_by_the_declared_branch_names(name, opts, want):
    menu = PolicyMenu.build(WAN_UNIPC_CONFIG, default_cfg=name, cfg_options={name: opts})
    icpt = RecordingInterceptor()
    loop = ToyDenoiseLoop(menu, ToyDenoiser())
    loop.interceptors = (icpt,)
    state = loop.init(
        OmniRequest(
            task=TaskType.T2V,
            diffusion=DiffusionParams(steps=10, guidance_scale=5.0),
            node_params={"denoise": {"cfg_window": [0.2, 0.7]}},
        ),
        seed=0,
    )
    assert set(state.branches) == want
    while not loop.step(state):
        pass
    assert {b for b, _ in icpt.seen} == want


def test_predict_branches_needs_the_loop_when_interceptors_are_bound():
    cfg = ClassicCFG()
    with pytest.raises(PolicyError, match="pass loop="):
        predict_branches(
            cfg, ctx(), cfg.init(10, scale=5.0), forward=Counting(preds()), interceptors=(RecordingInterceptor(),)
        )
    loop = LoopState()
    loop.plugin_state[("rec", "cond")] = {"branch": "cond"}
    loop.plugin_state[("rec", "uncond")] = {"branch": "uncond"}
    predict_branches(
        cfg,
        ctx(),
        cfg.init(10, scale=5.0),
        forward=Counting(preds()),
        loop=loop,
        interceptors=(RecordingInterceptor(),),
    )
