"""A composed deployment (``pipeline: prompt-upsample``): a tiny Qwen2 upsampler then a tiny Wan
T2V model, in one request. The composition adds no math of its own, so both halves are compared
bit for bit (CPU float32) with the families run alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import omniloop_compose.plugin as compose_plugin
from omniloop import Runtime
from omniloop.artifacts import Text, VideoFrames
from omniloop.errors import DeployError, RequestError
from omniloop.request import EventKind, Status
from omniloop_compose import ComposedRuntime, CompositionSpec

PROMPT = "a red fox runs in the snow"
INSTRUCTION = "expand this prompt into a detailed video description"


def t2v(prompt: str = PROMPT, **extra: Any) -> dict[str, Any]:
    return {"task": "t2v", "inputs": [{"type": "text", "text": prompt}],
            "diffusion": {"seed": 7, "steps": 2}, **extra}


@pytest.fixture(scope="module")
def composed(composed_deploy: dict[str, Any], compose_manager: Any) -> ComposedRuntime:
    rt = Runtime.from_deploy(composed_deploy, manager=compose_manager())
    assert isinstance(rt, ComposedRuntime)
    return rt


@pytest.fixture(scope="module")
def run(composed: ComposedRuntime) -> tuple[list[Any], Any]:
    events = list(composed.stream(t2v(request_id="req-1")))
    return events, events[-1].output


def test_request_runs_upsample_then_video(run: tuple[list[Any], Any]) -> None:
    events, out = run
    assert out.status is Status.COMPLETED, out.error
    assert all(e.request_id == "req-1" for e in events)
    nodes = [e.node for e in events if e.kind is EventKind.PROGRESS]
    top = [n.split("/")[0] for n in nodes]
    last_up = max(i for i, n in enumerate(top) if n == "upsample")
    first_video = min(i for i, n in enumerate(top) if n == "video")
    assert last_up < first_video  # the upsampler finished before the video node started
    assert "upsample/decode" in nodes and "video/denoise" in nodes  # both families' nodes are visible
    announced = [e for e in events if e.artifact == "expanded_prompt"]
    assert len(announced) == 1 and announced[0].node == "upsample"
    assert announced[0].value is out.artifacts["expanded_prompt"]
    assert isinstance(out.artifacts["expanded_prompt"], Text) and isinstance(out.artifacts["video"], VideoFrames)
    assert set(out.metrics["nodes"]) == {"upsample", "video"}
    assert out.metrics["nodes"]["upsample"]["usage"]["completion_tokens"] == len(out.artifacts["expanded_prompt"].token_ids)
    assert [e.kind for e in events].count(EventKind.FINAL) == 1


def test_expanded_prompt_equals_qwen_alone(run: tuple[list[Any], Any], tiny_paths: dict[str, Any], compose_manager: Any) -> None:
    _, out = run
    alone = Runtime.from_model(tiny_paths["qwen"], manager=compose_manager()).generate({
        "task": "reason",
        "inputs": [{"type": "text", "role": "system", "text": INSTRUCTION}, {"type": "text", "role": "user", "text": PROMPT}],
        "sampling": {"max_tokens": 12, "temperature": 0},
    })
    expanded = out.artifacts["expanded_prompt"]
    assert expanded.token_ids == alone.artifacts["text"].token_ids
    assert expanded.text == alone.artifacts["text"].text
    assert expanded.text.strip() and expanded.text != PROMPT


def test_video_equals_plain_wan_with_expanded_prompt(
    run: tuple[list[Any], Any], tiny_paths: dict[str, Any], compose_manager: Any
) -> None:
    _, out = run
    plain = Runtime.from_model(tiny_paths["wan"], manager=compose_manager()).generate(
        t2v(out.artifacts["expanded_prompt"].text))
    assert plain.status is Status.COMPLETED
    assert torch.equal(out.artifacts["video"].frames, plain.artifacts["video"].frames)
    other = Runtime.from_model(tiny_paths["wan"], manager=compose_manager()).generate(t2v(PROMPT))
    assert not torch.equal(out.artifacts["video"].frames, other.artifacts["video"].frames)  # the prompt did change


def test_request_tunes_the_upsampler(composed: ComposedRuntime, tiny_paths: dict[str, Any], compose_manager: Any) -> None:
    out = composed.generate(t2v(node_params={"upsample": {"max_tokens": 3, "instruction": "describe"}}))
    alone = Runtime.from_model(tiny_paths["qwen"], manager=compose_manager()).generate({
        "task": "reason",
        "inputs": [{"type": "text", "role": "system", "text": "describe"}, {"type": "text", "role": "user", "text": PROMPT}],
        "sampling": {"max_tokens": 3, "temperature": 0},
    })
    assert out.artifacts["expanded_prompt"].token_ids == alone.artifacts["text"].token_ids


@pytest.mark.parametrize(("request_", "field"), [
    (t2v(node_params={"upsample": {"max_tokens": 0}}), "node_params.upsample.max_tokens"),
    (t2v(node_params={"upsample": {"temperature": float("nan")}}), "node_params.upsample.temperature"),
    (t2v(node_params={"upsample": {"colour": 1}}), "node_params.upsample"),
    (t2v(diffusion={"steps": 10_000}), "diffusion.steps"),
    ({"task": "reason", "inputs": [{"type": "text", "text": PROMPT}]}, "task"),
    (t2v("   "), "inputs"),
])
def test_bad_requests_refused_before_compute(composed: ComposedRuntime, request_: dict[str, Any], field: str) -> None:
    with pytest.raises(RequestError) as exc:
        composed.stream(request_)  # raises at validation, before the first event
    assert field in str(exc.value)


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any family ``load`` fails the test: deploy errors must come before weights load."""
    from omniloop_qwen.family import QwenFamily
    from omniloop_wan.family import WanFamily

    def boom(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("weights loaded before the deploy was refused")

    monkeypatch.setattr(QwenFamily, "load", boom)
    monkeypatch.setattr(WanFamily, "load", boom)


def _deploy(paths: dict[str, Any], **changes: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"pipeline": "prompt-upsample",
                         "models": {"upsampler": {"path": str(paths["qwen"])}, "video": {"path": str(paths["wan"])}}}
    d.update(changes)
    return d


@pytest.mark.parametrize(("change", "message"), [
    ({"models": {"video": {"path": "WAN"}}}, "models: pipeline 'prompt-upsample' needs a model for role(s) 'upsampler'"),
    ({"models": {"upsampler": {"path": "WAN"}, "video": {"path": "WAN"}}},
     "models.upsampler: role 'upsampler' of pipeline 'prompt-upsample' needs a model for task 'reason'; family 'wan'"),
    ({"models": {"upsampler": {"path": "QWEN"}, "video": {"path": "QWEN"}}},
     "models.video: role 'video' of pipeline 'prompt-upsample' needs a model for task 't2v'; family 'qwen'"),
    ({"pipeline": "prompt-upsampel"}, "pipeline: unknown pipeline 'prompt-upsampel' (registered pipelines: prompt-upsample)"),
    ({"models": {"upsampler": {"path": "QWEN"}, "video": {"path": "WAN"}, "audio": {"path": "WAN"}}},
     "models.audio: pipeline 'prompt-upsample' has no role 'audio'"),
    ({"models": {"upsampler": {"path": "/nonexistent/qwen"}, "video": {"path": "WAN"}}},
     "models.upsampler: model.path: /nonexistent/qwen does not exist"),
    ({"models": {"upsampler": {"path": "QWEN", "family": "nope"}, "video": {"path": "WAN"}}},
     "models.upsampler: model.family: unknown model family 'nope'"),
    ({"model": {"path": "WAN"}}, "model: a composed deploy (pipeline) names its models under models.<role>"),
    ({"pipeline_options": {"upsample": {"max_tokens": -1}}}, "pipeline_options.upsample.max_tokens"),
    ({"pipeline_options": {"upsample": {"colour": 1}}}, "pipeline_options.upsample"),
    ({"pipeline_options": {"max_tokens": 12}}, "pipeline_options.max_tokens: pipeline 'prompt-upsample' has no node 'max_tokens' taking options (nodes with options: upsample)"),
    ({"pipeline_options": {"video": {}}}, "pipeline_options.video: pipeline 'prompt-upsample' has no node 'video' taking options"),
    ({"plugins": {"profiler": {}}}, "plugins: not supported in a composed deploy yet"),
])
def test_bad_deploys_refused_before_weights_load(
    no_weights: None, tiny_paths: dict[str, Any], compose_manager: Any, change: dict[str, Any], message: str
) -> None:
    def fill(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: fill(x) for k, x in v.items()}
        return {"QWEN": str(tiny_paths["qwen"]), "WAN": str(tiny_paths["wan"])}.get(v, v) if isinstance(v, str) else v

    with pytest.raises(DeployError) as exc:
        Runtime.from_deploy(_deploy(tiny_paths, **fill(change)), manager=compose_manager())
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)


def test_single_model_runtime_refuses_a_composed_deploy(tiny_paths: dict[str, Any], compose_manager: Any) -> None:
    with pytest.raises(DeployError, match=r"is a composed deploy .* Runtime\.from_deploy"):
        Runtime(_deploy(tiny_paths), manager=compose_manager())


def test_composition_graph_is_validated() -> None:
    from omniloop.artifacts import Latents
    from omniloop.errors import GraphError
    from omniloop.request import TaskType
    from omniloop_compose import ComposedNode, RoleSpec

    def req(*a: Any) -> dict[str, Any]:
        return {}

    up = ComposedNode(name="up", role="text", request=req, reads={"prompt": Text}, writes={"p2": Text}, outputs={"text": "p2"})
    bad = ComposedNode(name="vid", role="video", request=req, reads={"p2": Latents}, writes={"v": VideoFrames})
    roles = (RoleSpec("text", TaskType.REASON), RoleSpec("video", TaskType.T2V))
    with pytest.raises(GraphError, match="node 'vid': reads 'p2' as Latents, but 'up' writes it as Text"):
        CompositionSpec(name="x", task=TaskType.T2V, roles=roles, nodes=(up, bad), inputs={"prompt": Text})
    orphan = ComposedNode(name="vid", role="video", request=req, reads={"p3": Text}, writes={"v": VideoFrames})
    with pytest.raises(GraphError, match="node 'vid': reads 'p3', which no node writes"):
        CompositionSpec(name="x", task=TaskType.T2V, roles=roles, nodes=(up, orphan), inputs={"prompt": Text})
    stray = ComposedNode(name="vid", role="audio", request=req, reads={"p2": Text}, writes={"v": VideoFrames})
    with pytest.raises(GraphError, match="role 'audio' is not a role"):
        CompositionSpec(name="x", task=TaskType.T2V, roles=roles, nodes=(up, stray), inputs={"prompt": Text})


def test_output_types_checked_against_the_role_pipeline(no_weights: None, tiny_paths: dict[str, Any]) -> None:
    """A composition publishing a role output the family's pipeline does not write is refused
    before weights load (qwen can be inspected from its config files)."""
    from omniloop.artifacts import Latents
    from omniloop.family import PolicySpec
    from omniloop.hookspecs import hookimpl
    from omniloop.request import TaskType
    from omniloop_compose import ComposedNode, RoleSpec

    def req(*a: Any) -> dict[str, Any]:
        return {}

    def spec() -> CompositionSpec:
        return CompositionSpec(
            name="bad-types", task=TaskType.T2V, roles=(RoleSpec("upsampler", TaskType.REASON),),
            nodes=(ComposedNode(name="up", role="upsampler", request=req, reads={"prompt": Text},
                                writes={"x": Latents}, outputs={"text": "x"}),),
            inputs={"prompt": Text})

    class Plugin:
        OMNILOOP_HOOK_API = ">=1.0,<2"

        @hookimpl
        def omniloop_register_policies(self, register: Any) -> None:
            register(PolicySpec(name="bad-types", kind="pipeline", factory=spec))

    import omniloop_qwen.plugin as qwen_plugin
    from omniloop.testing import make_manager

    manager = make_manager(("qwen", qwen_plugin), ("bad", Plugin()), ("compose", compose_plugin), toy=False)
    with pytest.raises(DeployError, match=r"models\.upsampler: node .up. publishes .text. as Latents, but the qwen pipeline writes it as Text"):
        Runtime.from_deploy({"pipeline": "bad-types", "models": {"upsampler": {"path": str(tiny_paths["qwen"])}}}, manager=manager)


def test_yaml_deploy_file_and_step_scheduler(tmp_path: Any, tiny_paths: dict[str, Any], run: tuple[list[Any], Any]) -> None:
    """The deploy as a YAML file, both roles under the step scheduler: the same expansion and video."""
    pytest.importorskip("yaml")
    import omniloop_qwen.plugin as qwen_plugin
    import omniloop_scheduler.plugin as scheduler_plugin
    import omniloop_wan.plugin as wan_plugin
    from omniloop.testing import make_manager

    path = tmp_path / "deploy.yaml"
    path.write_text(
        "pipeline: prompt-upsample\n"
        "scheduler: step\n"
        "models:\n"
        f"  upsampler: {{path: '{tiny_paths['qwen']}'}}\n"
        f"  video: {{path: '{tiny_paths['wan']}', family: wan}}\n"
        f"pipeline_options: {{upsample: {{instruction: '{INSTRUCTION}', max_tokens: 12}}}}\n"
    )
    manager = make_manager(("qwen", qwen_plugin), ("wan", wan_plugin), ("scheduler", scheduler_plugin),
                           ("compose", compose_plugin), toy=False, scheduler=False)
    rt = Runtime.from_deploy(path, manager=manager)
    out = rt.generate(t2v())
    _, ref = run
    assert out.artifacts["expanded_prompt"].token_ids == ref.artifacts["expanded_prompt"].token_ids
    assert torch.equal(out.artifacts["video"].frames, ref.artifacts["video"].frames)
    assert rt.describe()["models"]["video"]["scheduler"] == "step"


def test_a_failing_node_ends_the_request(composed: ComposedRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    """The upsampler's failure is the request's failure, named by node; the video node never runs."""
    from omniloop.request import ErrorInfo, OmniEvent, OmniOutput

    def failing(request: Any) -> Any:
        out = OmniOutput(request.request_id if hasattr(request, "request_id") else "x", Status.FAILED,
                         error=ErrorInfo(type="RuntimeError", message="boom", node="decode", step=3))
        yield OmniEvent(out.request_id, EventKind.FINAL, output=out)

    def never(request: Any) -> Any:
        raise AssertionError("the video node ran after a failed upsample")

    monkeypatch.setattr(composed.runtimes["upsampler"], "stream", failing)
    monkeypatch.setattr(composed.runtimes["video"], "stream", never)
    events = list(composed.stream(t2v(request_id="req-fail")))
    out = events[-1].output
    assert out.status is Status.FAILED and out.request_id == "req-fail"
    assert (out.error.node, out.error.step, out.error.message) == ("upsample/decode", 3, "boom")
    assert [e.kind for e in events] == [EventKind.FINAL]


def test_role_options_reach_only_their_role(no_weights: None, tiny_paths: dict[str, Any], compose_manager: Any) -> None:
    """``models.upsampler.options`` sizes the qwen KV pool (a request that cannot fit is refused
    by ComposedDeployment.check, before any weights load); the video role does not get them."""
    from omniloop_compose import ComposedDeployment

    deploy = _deploy(tiny_paths, options={"vae_dtype": "float32"})
    deploy["models"]["upsampler"]["options"] = {"kv_cache_tokens": 16, "kv_block_size": 16}
    dep = ComposedDeployment(deploy, manager=compose_manager())
    assert dep.roles["upsampler"].options["kv_cache_tokens"] == 16
    assert "kv_cache_tokens" not in dep.roles["video"].options
    assert dep.roles["video"].options["vae_dtype"] == "float32" == dep.roles["upsampler"].options["vae_dtype"]
    with pytest.raises(RequestError) as exc:
        dep.check(t2v())
    assert str(exc.value).startswith("node_params.upsample: the upsampler model refuses the reason request this "
                                     "node builds: sampling.max_tokens: ")
    assert "KV blocks" in str(exc.value) and "options.kv_cache_tokens" in str(exc.value)


def test_a_blank_expansion_fails_the_request_at_the_video_node(composed: ComposedRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    from omniloop.request import OmniEvent, OmniOutput

    def blank(request: Any) -> Any:
        out = OmniOutput(request.request_id, Status.COMPLETED, artifacts={"text": Text(text="  ", token_ids=[1])})
        yield OmniEvent(out.request_id, EventKind.FINAL, output=out)

    monkeypatch.setattr(composed.runtimes["upsampler"], "stream", blank)
    out = composed.generate(t2v())
    assert out.status is Status.FAILED
    assert (out.error.node, out.error.type) == ("video", "RequestError")
    assert out.error.message.startswith("node_params.upsample: the upsampler produced an empty prompt")
    assert out.metrics["nodes"]["upsample"] == {}


def test_concurrent_composed_requests_each_equal_alone(composed_deploy: dict[str, Any]) -> None:
    """Two composed requests from two threads under the step scheduler (their upsample and video
    nodes may share steps in each role's scheduler) each equal that request run alone."""
    import threading

    import omniloop_qwen.plugin as qwen_plugin
    import omniloop_scheduler.plugin as scheduler_plugin
    import omniloop_wan.plugin as wan_plugin
    from omniloop.testing import make_manager

    manager = make_manager(("qwen", qwen_plugin), ("wan", wan_plugin), ("scheduler", scheduler_plugin),
                           ("compose", compose_plugin), toy=False, scheduler=False)
    rt = Runtime.from_deploy({**composed_deploy, "scheduler": "step"}, manager=manager)
    prompts = (PROMPT, "a blue bird flies over the sea at night")
    alone = [rt.generate(t2v(p)) for p in prompts]
    together: list[Any] = [None, None]

    def go(i: int) -> None:
        together[i] = rt.generate(t2v(prompts[i]))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for a, b in zip(alone, together, strict=True):
        assert b is not None and b.status is Status.COMPLETED
        assert a.artifacts["expanded_prompt"].token_ids == b.artifacts["expanded_prompt"].token_ids
        assert torch.equal(a.artifacts["video"].frames, b.artifacts["video"].frames)
    assert alone[0].artifacts["expanded_prompt"].text != alone[1].artifacts["expanded_prompt"].text
