"""Deploy ``offload: model | sequential`` on the tiny Wan checkpoint (omniloop-offload).

On CPU the storage and the execution device are both ``cpu``: the offload machinery (node-driven
moves, block hooks, the prefetch schedule) runs and outputs must be ``torch.equal`` to the
unoffloaded runtime's. The strict tests swap in ``omniloop_offload.PoisonMover`` (an evicted
weight is NaN, so any weight a node or block computes with while it is not loaded shows in the
output) and record where every component is when each node and block runs. The CUDA test runs the real
pinned-memory / side-stream path and skips without a GPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import omniloop_adapters.plugin as adapters_plugin
import omniloop_offload.plugin as offload_plugin
from omniloop.errors import DeployError
from omniloop.runtime import Deployment, Runtime
from omniloop.testing import make_manager
from omniloop_offload import PoisonMover, install

from .conftest import _t2v_request, wan_plugin


def wan_manager() -> Any:
    """The Wan family, the offload mechanism (omniloop-offload) and the inline serial scheduler."""
    return make_manager(("wan", wan_plugin), ("offload", offload_plugin), toy=False)


def _strict(rt: Runtime, mode: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """Replace ``rt``'s offloader by a strict, tracing one of ``mode``; returns the trace."""
    trace: list[tuple[str, str, tuple[str, ...]]] = []
    if rt.offload is not None:
        rt.offload.remove()
    rt.offload = install(rt.model, rt.family, mode, rt.device, mover=PoisonMover(rt.device), trace=trace)
    rt._pipelines.clear()
    return trace


def _outputs(rt: Runtime, request: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    out = rt.generate(request)
    assert out.status.value == "completed", out.error
    return out.artifacts["video"].frames, out.artifacts["latents"].tensor


@pytest.fixture(scope="module")
def reference(wan_runtime) -> tuple[torch.Tensor, torch.Tensor]:
    return _outputs(wan_runtime(), _t2v_request())


@pytest.mark.parametrize("mode", ["model", "sequential"])
def test_offload_output_equals_no_offload(tiny_ckpt, t2v_request, reference, mode: str) -> None:
    rt = Runtime.from_model(tiny_ckpt(), manager=wan_manager(), offload=mode)
    assert rt.offload is not None and rt.offload.mode == mode
    video, latents = _outputs(rt, t2v_request())
    assert torch.equal(video, reference[0]) and torch.equal(latents, reference[1])


@pytest.mark.parametrize("mode", ["model", "sequential"])
def test_strict_schedule_t2v(tiny_ckpt, t2v_request, reference, mode: str) -> None:
    """Every weight used is loaded (NaN otherwise); one node's components at a time; at most two
    transformer blocks resident when a block runs (sequential)."""
    rt = Runtime.from_model(tiny_ckpt(), manager=wan_manager(), offload=mode)
    trace = _strict(rt, mode)
    video, latents = _outputs(rt, t2v_request())
    assert torch.equal(video, reference[0]) and torch.equal(latents, reference[1])
    stages = {name: resident for ev, name, resident in trace if ev == "stage"}
    comps = lambda res: {r.split(".")[0] for r in res}  # noqa: E731
    assert comps(stages["text_encode"]) == {"text_encoder"}
    assert comps(stages["denoise"]) == {"transformer"}
    assert comps(stages["vae_decode"]) == {"vae"}
    runs = [(name, res) for ev, name, res in trace if ev == "run"]
    if mode == "model":
        assert runs == []  # no block hooks in model mode
        assert "transformer" in stages["denoise"]
        return
    n_tf = len(rt.model.components["transformer"].blocks)
    n_te = len(rt.model.components["text_encoder"].encoder.block)
    tf_runs = [(n, r) for n, r in runs if n.startswith("transformer.blocks.")]
    # 3 steps x 2 CFG forwards x every block, in order
    assert [n for n, _ in tf_runs] == [f"transformer.blocks.{i}" for i in range(n_tf)] * 6
    assert len([n for n, _ in runs if n.startswith("text_encoder.")]) == 2 * n_te  # prompt + negative
    for name, res in runs:
        stack = name.rsplit(".", 1)[0]
        blocks = [r for r in res if r.startswith(stack + ".")]
        assert name in res and len(blocks) <= 2, (name, res)
        assert not any(r.startswith("vae") for r in res)
    # the next block was prefetched while the current one ran
    i = next(k for k, (ev, name, _) in enumerate(trace) if ev == "run" and name == "transformer.blocks.0")
    assert ("prefetch", "transformer.blocks.1") == trace[i - 1][:2]


def test_strict_sequential_with_cache_interceptor(tiny_ckpt, t2v_request) -> None:
    """A block interceptor that skips blocks (fbcache) leaves stale prefetches: still at most two
    resident, output equal to the same deploy without offload."""
    plugins = {"fbcache": {"threshold": 1.0, "warmup_steps": 1}}
    try:
        base = Runtime.from_model(tiny_ckpt(), plugins=plugins)
    except DeployError as exc:  # not installed in this environment
        pytest.skip(str(exc))
    ref = _outputs(base, t2v_request(steps=4))
    rt = Runtime.from_model(tiny_ckpt(), plugins=plugins, offload="sequential")
    trace = _strict(rt, "sequential")
    got = _outputs(rt, t2v_request(steps=4))
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    for ev, _name, res in trace:
        if ev == "run":
            assert len([r for r in res if r.startswith("transformer.blocks.")]) <= 2


def test_interleaved_requests(tiny_ckpt, reference) -> None:
    """Two requests advanced in turn, one unit each (what the step scheduler does when it cannot
    batch them): one's text encode and decode run between the other's denoise steps, so the
    components move back and forth; the outputs are unchanged."""
    rt = Runtime.from_model(tiny_ckpt(), manager=wan_manager(), offload="sequential")
    trace = _strict(rt, "sequential")
    alone = Runtime.from_model(tiny_ckpt(), manager=wan_manager()).generate(_t2v_request(seed=8, steps=2))
    execs = [rt.prepare(_t2v_request()), rt.prepare(_t2v_request(seed=8, steps=2))]
    for _ in range(3):  # the first one into its denoise loop: validate, text_encode, step 1
        execs[0].advance()
    while not all(e.done for e in execs):
        for e in execs:
            e.advance()
    assert torch.equal(execs[0].output.artifacts["video"].frames, reference[0])
    assert torch.equal(execs[1].output.artifacts["latents"].tensor, alone.artifacts["latents"].tensor)
    loads = [name for ev, name, _ in trace if ev == "load" and "." not in name]
    assert loads.count("transformer") >= 2  # evicted by the other request's nodes and loaded again


def test_i2v_offload_sequential_equals(tiny_ckpt, i2v_request) -> None:
    ref = Runtime.from_model(tiny_ckpt("i2v"), manager=wan_manager())
    rt = Runtime.from_model(tiny_ckpt("i2v"), manager=wan_manager(), offload="sequential")
    _strict(rt, "sequential")
    a, b = _outputs(ref, i2v_request()), _outputs(rt, i2v_request())
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("deploy,match", [
    ({"offload": "sequential", "compile": True}, r"^offload: 'sequential' does not combine with compile"),
    ({"offload": "model", "adapters": {"a": "/nonexistent.safetensors"}}, r"^offload: 'model' does not combine with LoRA adapters yet \(adapters: a\)$"),
    ({"offload": "model", "parallel": {"cfg": 2}}, r"^offload: 'model' runs in one process"),
    ({"offload": "everything"}, r"offload: .*everything"),
])
def test_bad_offload_deploys_refused_at_load(tiny_ckpt, deploy: dict[str, Any], match: str) -> None:
    import omniloop_parallel.plugin as parallel_plugin  # a parallel deploy is routed to its runtime loader

    manager = make_manager(("wan", wan_plugin), ("offload", offload_plugin), ("adapters", adapters_plugin),
                           ("parallel", parallel_plugin), toy=False)
    with pytest.raises(DeployError, match=match) as info:
        Deployment({"model": {"path": str(tiny_ckpt())}, **deploy}, manager=manager)
    assert "\n" not in str(info.value)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["model", "sequential"])
def test_cuda_offload_equals_resident(tiny_ckpt, t2v_request, mode: str) -> None:
    ref = Runtime.from_model(tiny_ckpt(), device="cuda", manager=wan_manager())
    a = _outputs(ref, t2v_request())
    del ref
    rt = Runtime.from_model(tiny_ckpt(), device="cuda", manager=wan_manager(), offload=mode)
    b = _outputs(rt, t2v_request())
    assert torch.equal(a[0], b[0]) and torch.equal(a[1].cpu(), b[1].cpu())
    # weights are back in pinned host memory except the last node's components
    tf = rt.model.components["transformer"]
    assert all(p.device.type == "cpu" for p in tf.parameters())


CAUSAL = {"rollout": "causal", "rollout_options": {"chunk_frames": 3, "steps": 2, "kv_slabs": 8, "max_sessions": 2}}


def test_causal_rollout_model_offload_equals(tmp_path) -> None:
    """options.rollout: causal under offload: model (its node uses transformer and vae together)."""
    from omniloop_wan.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path / "causal", variant="t2v", scheduler="flow_euler")
    req = {"task": "t2v", "prompt": "a fox", "diffusion": {"frames": 21, "seed": 3}}
    ref = Runtime.from_model(path, manager=wan_manager(), options=CAUSAL).generate(req)
    rt = Runtime.from_model(path, manager=wan_manager(), options=CAUSAL, offload="model")
    _strict(rt, "model")
    out = rt.generate(req)
    assert out.status.value == "completed", out.error
    assert torch.equal(out.artifacts["video"].frames, ref.artifacts["video"].frames)


def test_causal_rollout_sequential_refused_at_load(tiny_ckpt) -> None:
    with pytest.raises(DeployError, match=r"^offload: 'sequential' cannot stream the blocks of options.rollout: causal") as info:
        Deployment({"model": {"path": str(tiny_ckpt())}, "offload": "sequential", "options": CAUSAL}, manager=wan_manager())
    assert "\n" not in str(info.value)


def test_compute_device_is_the_deploy_device_under_offload() -> None:
    """The fused-kernel checks look at where the model computes, not the host memory it loads into."""
    from omniloop.deploy import load_deploy
    from omniloop_wan.family import compute_device

    cpu = torch.device("cpu")
    assert compute_device({"deploy": load_deploy({"device": "cuda", "offload": "model"})}, cpu) == torch.device("cuda")
    assert compute_device({"deploy": load_deploy({"device": "cuda"})}, cpu) == cpu
    assert compute_device({}, cpu) == cpu
