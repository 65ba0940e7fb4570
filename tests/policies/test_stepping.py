"""omniloop_policies.stepping: the shared body of a family's denoise step (begin, forwards, finish).

Checked against the policies' own ``pol.predict`` + ``pol.advance`` (bit for bit: the helpers only
order the calls), with the step interceptors seeing each forward's inputs and the taps' order."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omniloop.interceptors import BlockContext
from omniloop.loop import LoopState, StepContext
from omniloop.request import DiffusionParams, OmniRequest, TaskType
from omniloop_policies import PolicyMenu, forward_groups
from omniloop_policies.stepping import (
    batchable,
    begin_step,
    begin_steps,
    branch_predictions,
    check_index,
    finish_step,
    peek_plan,
    plan_together,
    policy_names,
    stack_rows,
    unstack_rows,
)
from omniloop_policies.testing import WAN_UNIPC_CONFIG, ToyDenoiser

EMBEDS = {"cond": torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(1)),
          "uncond": torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(2))}


class Recorder:
    """A step interceptor (what ``call_model`` uses of one: ``name``, ``forward``) recording
    (branch, rows of its forward's input) and computing."""

    name = "rec"

    def __init__(self) -> None:
        self.seen: list[tuple[str | None, int]] = []

    def forward(self, step: StepContext, state: Any, inputs: dict[str, Any], compute: Any) -> torch.Tensor:
        self.seen.append((step.branch, int(inputs["x"].shape[0])))
        return compute()


def fake_ctx(*, interceptors: tuple = (), taps: bool = False) -> SimpleNamespace:
    tapped: list[tuple[str, str | None]] = []
    prefixes: list[tuple[str | None, str]] = []

    def block_context(step: StepContext, loop: LoopState, prefix: str = "blocks") -> BlockContext | None:
        prefixes.append((step.branch, prefix))
        return None

    return SimpleNamespace(
        node=SimpleNamespace(name="denoise"), step_interceptors=interceptors, taps_enabled=taps,
        tap=lambda name, value, step=None: tapped.append((name, None if step is None else step.branch)),
        block_context=block_context, tapped=tapped, prefixes=prefixes,
    )


def start(cfg: str) -> tuple[Any, LoopState, SimpleNamespace]:
    menu = PolicyMenu.build(WAN_UNIPC_CONFIG, default_cfg=cfg)
    req = OmniRequest(task=TaskType.T2V, diffusion=DiffusionParams(steps=4, guidance_scale=5.0))
    pol = menu.resolve(req)
    loop = LoopState()
    loop.tensors["latents"] = torch.randn(1, 4, 2, 3, 3, generator=torch.Generator().manual_seed(0))
    pol.init(loop, device="cpu")
    return pol, loop, SimpleNamespace(request=SimpleNamespace(request_id="r1"))


def run_with_helpers(cfg: str, ctx: SimpleNamespace) -> torch.Tensor:
    model = ToyDenoiser()
    pol, loop, state = start(cfg)
    while True:
        pol_, step = begin_step(ctx, state, loop)
        assert pol_ is pol and step.node == "denoise" and step.request_id == "r1"
        t = pol.timestep(loop)
        with torch.no_grad():
            x = loop.tensors["latents"]
            preds = branch_predictions(
                ctx, step, loop, forward_groups(pol.cfg, pol.plan(step, loop)),
                batch=lambda group, x=x: {"x": torch.cat([x] * len(group)),
                                          "e": torch.cat([EMBEDS[b] for b in group])},
                forward=lambda batch, bctx, t=t: model(batch["x"], t, batch["e"]),
                split=lambda out, group: dict(zip(group, out.chunk(len(group)), strict=True)),
                prefix="transformer.blocks",
            )
        result = finish_step(ctx, pol, step, loop, preds)
        loop.step += 1
        if result.done:
            return loop.tensors["latents"]


def run_reference(cfg: str) -> torch.Tensor:
    model = ToyDenoiser()
    pol, loop, _ = start(cfg)
    while not pol.done(loop):
        step = pol.step_context(loop, request_id="r1", node="denoise")
        t = pol.timestep(loop)
        x = loop.tensors["latents"]
        with torch.no_grad():
            guided = pol.predict(
                step, loop, forward=lambda s, x=x, t=t: model(x, t, EMBEDS[s.branch]),
                forward_batch=lambda s, group, x=x, t=t: model(torch.cat([x] * len(group)), t,
                                                                torch.cat([EMBEDS[b] for b in group])),
            )
            loop.tensors["latents"] = pol.advance(step, loop, guided, x)
        loop.step += 1
    return loop.tensors["latents"]


@pytest.mark.parametrize("cfg", ["classic", "batched"])
def test_the_helpers_equal_the_policies_own_predict_bit_for_bit(cfg):
    assert torch.equal(run_with_helpers(cfg, fake_ctx()), run_reference(cfg))


@pytest.mark.parametrize(("cfg", "forwards"), [("classic", [("cond", 1), ("uncond", 1)]), ("batched", [("cond+uncond", 2)])])
def test_interceptors_see_each_forward_and_taps_come_in_order(cfg, forwards):
    rec = Recorder()
    ctx = fake_ctx(interceptors=(rec,), taps=True)
    run_with_helpers(cfg, ctx)
    assert rec.seen == forwards * 4  # 4 steps, the forward's own inputs (a stacked group: 2 rows)
    names = [f[0] for f in forwards]
    assert ctx.prefixes == [(n, "transformer.blocks") for n in names] * 4
    one_step = [("noise_pred", "cond"), ("noise_pred", "uncond"), ("guided", None), ("latents", None)]
    assert ctx.tapped == one_step * 4


def test_finish_step_without_a_context_and_the_index_check():
    pol, loop, state = start("classic")
    ctx = fake_ctx()
    _, step = begin_step(ctx, state, loop)
    x = loop.tensors["latents"]
    result = finish_step(None, pol, step, loop, {"cond": torch.zeros_like(x), "uncond": torch.zeros_like(x)})
    assert result.done is False and loop.tensors["latents"] is not x
    # the runtime did not advance loop.step, so the sampler (now at 1) and the loop (0) disagree
    with pytest.raises(RuntimeError, match=r"node 'denoise': the sampler is at step 1 but the loop at 0; "
                                           r"loop.step is advanced by the runtime"):
        begin_step(ctx, state, loop)
    loop.step = 1
    check_index(loop, pol.step_context(loop, request_id="r1", node="denoise"))


def test_stack_rows_is_request_major_then_branch_and_unstack_undoes_it():
    a = {"x": torch.full((1, 2), 1.0), "e": {"cond": torch.full((1, 3), 10.0), "uncond": torch.full((1, 3), 20.0)}}
    b = {"x": torch.full((2, 2), 2.0), "e": {"cond": torch.full((2, 3), 30.0), "uncond": torch.full((2, 3), 40.0)}}

    def row(inp, br):
        return {"x": inp["x"], "e": inp["e"][br], "image": None}

    batch = stack_rows([a, b], ("uncond", "cond"), row)
    assert list(batch) == ["x", "e", "image"] and batch["image"] is None
    assert batch["e"][:, 0].tolist() == [20.0, 10.0, 40.0, 40.0, 30.0, 30.0]
    assert batch["x"][:, 0].tolist() == [1.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    back = unstack_rows(batch["e"], [1, 2], ("uncond", "cond"))
    for inp, parts in zip([a, b], back, strict=True):
        assert parts.keys() == {"uncond", "cond"}
        for br, t in parts.items():
            assert torch.equal(t, inp["e"][br])
    # one request, one branch: the tensors themselves, no copy
    one = stack_rows([a], ("cond",), row)
    assert one["e"] is a["e"]["cond"] and one["x"] is a["x"]
    assert unstack_rows(one["x"], [1], ("cond",))[0]["cond"] is one["x"]


def test_stack_rows_refuses_an_input_present_for_some_rows_only():
    with pytest.raises(ValueError, match="'image' is None for some rows and a tensor for others"):
        stack_rows([0, 1], ("cond",), lambda i, b: {"image": None if i else torch.zeros(1)})


def batch_ctx(**over: Any) -> SimpleNamespace:
    ctx = fake_ctx()
    ctx.block_interceptor, ctx.block_taps = None, None
    for k, v in over.items():
        setattr(ctx, k, v)
    return ctx


def test_batchable_only_when_nothing_watches_one_request():
    pol, loop, state = start("classic")
    state.request.exact = False
    got = batchable(batch_ctx(), state, loop)
    assert got is not None and got[0] is pol and got[1].step_index == 0
    for over in ({"block_interceptor": object()}, {"step_interceptors": (Recorder(),)}, {"block_taps": object()},
                 {"taps_enabled": True}):
        assert batchable(batch_ctx(**over), state, loop) is None
    state.request.exact = True
    assert batchable(batch_ctx(), state, loop) is None
    state.request.exact = False
    loop.step = 1  # the sampler is still at 0
    assert batchable(batch_ctx(), state, loop) is None


@pytest.mark.parametrize(("cfg", "scale", "want"), [("classic", 5.0, ("cond", "uncond")), ("classic", 1.0, ("cond",)),
                                                    ("batched", 5.0, ("cond", "uncond")), ("adaptive-gate", 5.0, None)])
def test_peek_plan_equals_the_plan_without_counting_it(cfg, scale, want):
    menu = PolicyMenu.build(WAN_UNIPC_CONFIG, default_cfg=cfg)
    pol = menu.resolve(OmniRequest(task=TaskType.T2V, diffusion=DiffusionParams(steps=4, guidance_scale=scale)))
    loop = LoopState()
    pol.init(loop, device="cpu")
    step = pol.step_context(loop, request_id="r", node="denoise")
    before = pol.metrics(loop)
    assert peek_plan(pol, step, loop) == want
    assert pol.metrics(loop) == before  # nothing counted
    if want is not None:
        assert tuple(pol.plan(step, loop)) == want


def test_begin_steps_and_plan_together():
    (p1, l1, s1), (p2, l2, s2) = start("classic"), start("classic")
    ctxs = [fake_ctx(), fake_ctx()]
    pols, steps = begin_steps(ctxs, [s1, s2], [l1, l2])
    assert pols == [p1, p2] and [s.step_index for s in steps] == [0, 0]
    assert plan_together(pols, steps, [l1, l2]) == ("cond", "uncond")
    _, l3, s3 = start("classic")
    l3.policy_state["cfg"].enabled = False  # guidance off for this one: it plans cond only
    pols, steps = begin_steps([fake_ctx(), fake_ctx()], [s1, s3], [l1, l3])
    with pytest.raises(RuntimeError, match="step_batch: requests plan different branches"):
        plan_together(pols, steps, [l1, l3])


@pytest.mark.parametrize("cfg", ["classic", "batched", "interval"])
def test_policy_names_are_the_menu_names(cfg):
    menu = PolicyMenu.build(WAN_UNIPC_CONFIG, default_cfg=cfg)
    pol = menu.resolve(OmniRequest(task=TaskType.T2V, diffusion=DiffusionParams(steps=4)))
    names = policy_names(menu, pol)
    assert names["cfg"] == cfg  # "batched" is ClassicCFG(batched=True), named "classic" by its class
    assert names["sampler"] in menu.samplers
