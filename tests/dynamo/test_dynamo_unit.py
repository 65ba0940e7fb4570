"""omniloop-dynamo without ai-dynamo: request mapping, responses, metrics, the command hook,
the fallback engine and the cost estimate. Fast (toy family only)."""

from __future__ import annotations

import asyncio
import base64
import importlib.util

import click
import pytest
from click.testing import CliRunner

from omniloop.request import ImagePart, TaskType
from omniloop_dynamo.metrics import WorkerMetrics
from omniloop_dynamo.protocol import (
    InvalidRequest,
    api_field,
    image_response,
    map_image_request,
    map_video_request,
    parse_size,
    video_data,
    video_response,
)

PNG_B64 = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


def video(**kw):
    return map_video_request({"model": "m", "prompt": "a fox", **kw}, request_id="r1", default_fps=16.0)


def err(fn, *a, **kw) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        fn(*a, **kw)
    return info.value


# -- video requests ------------------------------------------------------------------------------


def test_video_request_maps_every_field() -> None:
    m = video(size="832x480", response_format="b64_json", nvext={
        "num_frames": 33, "num_inference_steps": 20, "guidance_scale": 4.5, "seed": 7, "negative_prompt": "blur",
        "fps": 24})
    (r,) = m.requests
    assert m.kind == "video" and m.response_format == "b64_json" and m.output_format == "mp4" and not m.stream
    assert r.task is TaskType.T2V and r.request_id == "r1"
    assert (r.prompt, r.negative_prompt) == ("a fox", "blur")
    d = r.diffusion
    assert (d.width, d.height, d.frames, d.steps, d.guidance_scale, d.seed, d.fps) == (832, 480, 33, 20, 4.5, 7, 24.0)
    assert r.outputs.stream_progress is False


def test_video_defaults_are_left_to_the_model() -> None:
    m = video()
    d = m.requests[0].diffusion
    assert (d.width, d.height, d.frames, d.steps, d.guidance_scale, d.seed) == (None,) * 6
    assert m.response_format == "url"  # the protocol's default


def test_seconds_become_frames() -> None:
    assert video(seconds=5).requests[0].diffusion.frames == 81  # 5 s at the model's 16 fps, plus t=0
    assert video(seconds=2, nvext={"fps": 8}).requests[0].diffusion.frames == 17
    assert video(seconds=5, nvext={"num_frames": 9}).requests[0].diffusion.frames == 9
    e = err(map_video_request, {"model": "m", "prompt": "x", "seconds": 2}, request_id="r")  # no default fps
    assert e.field == "seconds"
    assert err(video, seconds=0).field == "seconds"


@pytest.mark.parametrize("size", ["big", "832", "x480", "832x", "-1x4", "0x480", "1.5x2"])
def test_bad_sizes(size: str) -> None:
    e = err(video, size=size)
    assert e.field == "size"


def test_parse_size_variants() -> None:
    assert parse_size(" 64 x 32 ") == (64, 32)
    assert parse_size("64X32") == (64, 32)
    assert parse_size(None) == (None, None)


@pytest.mark.parametrize("nvext,field", [
    ({"num_inference_steps": 0}, "nvext.num_inference_steps"),
    ({"num_inference_steps": "20"}, "nvext.num_inference_steps"),
    ({"num_frames": True}, "nvext.num_frames"),
    ({"guidance_scale": -1}, "nvext.guidance_scale"),
    ({"seed": -3}, "nvext.seed"),
    ({"fps": 0}, "nvext.fps"),
    ({"negative_prompt": 3}, "nvext.negative_prompt"),
    ({"boundary_ratio": 0.9}, "nvext.boundary_ratio"),
    ({"guidance_scale_2": 3.0}, "nvext.guidance_scale_2"),
    ({"cfg": 3.0}, "nvext.cfg"),
])
def test_bad_nvext_names_the_field(nvext: dict, field: str) -> None:
    assert err(video, nvext=nvext).field == field


def test_other_bad_fields() -> None:
    assert err(map_video_request, {"model": "m"}, request_id="r").field == "prompt"
    assert err(video, response_format="mp4").field == "response_format"
    assert err(video, output_format="webm").field == "output_format"
    assert err(video, stream="yes").field == "stream"
    assert err(video, nvext=[1]).field == "nvext"


def test_image_reference_makes_i2v() -> None:
    r = video(input_reference=f"data:image/png;base64,{PNG_B64}").requests[0]
    assert r.task is TaskType.I2V
    img = r.image()
    assert isinstance(img, ImagePart) and img.data_b64 == PNG_B64 and img.path is None
    assert video(input_reference=PNG_B64).requests[0].image().data_b64 == PNG_B64  # bare base64


def test_image_reference_refusals() -> None:
    assert "does not fetch URLs" in err(video, input_reference="https://example.invalid/a.png").message
    assert "disabled" in err(video, input_reference="/etc/passwd").message
    assert "disabled" in err(video, input_reference="file:///etc/passwd").message
    assert err(video, input_reference="data:image/png,rawbytes").field == "input_reference"
    assert err(video, input_reference="not base64 !!").field == "input_reference"
    m = map_video_request({"model": "m", "prompt": "x", "input_reference": "file:///tmp/a.png"}, request_id="r",
                          allow_local_files=True)
    assert m.requests[0].image().path == "/tmp/a.png"


def test_passthrough_knobs_and_unknown_fields() -> None:
    extra = {"media_passthrough": {"shift": 3.0, "priority": 5, "plugin_params": {"cache-dit": {"Fn": 4}}}}
    r = video(extra_args=extra).requests[0]
    assert r.diffusion.shift == 3.0 and r.priority == 5 and r.plugin_params == {"cache-dit": {"Fn": 4}}
    e = err(video, extra_args={"media_passthrough": {"model_path": "/x", "foo": 1}})
    assert e.field == "foo" and "model_path" in e.message
    assert err(video, extra_args={"media_passthrough": {"priority": 500}}).field == "priority"  # omniloop's range


def test_api_field_names() -> None:
    assert api_field("diffusion.steps") == "nvext.num_inference_steps"
    assert api_field("diffusion.width") == "size"
    assert api_field("task") == "input_reference"
    assert api_field("plugin_params.x") == "plugin_params.x"


# -- image requests ------------------------------------------------------------------------------


def test_image_request_fans_out_n_with_consecutive_seeds() -> None:
    m = map_image_request({"model": "m", "prompt": "a cat", "n": 3, "size": "64x32", "quality": "hd",
                           "nvext": {"seed": 10, "num_inference_steps": 4}}, request_id="r")
    assert m.kind == "image" and m.output_format == "png" and m.ignored == ["quality"]
    assert [r.diffusion.seed for r in m.requests] == [10, 11, 12]
    assert [r.request_id for r in m.requests] == ["r-0", "r-1", "r-2"]
    assert all(r.task is TaskType.T2I and (r.diffusion.width, r.diffusion.height) == (64, 32) for r in m.requests)
    one = map_image_request({"prompt": "x", "input_reference": PNG_B64}, request_id="q")
    assert one.requests[0].task is TaskType.I2I and one.requests[0].request_id == "q"


def test_image_request_errors() -> None:
    assert err(map_image_request, {"prompt": "x", "n": 11}, request_id="r").field == "n"
    assert err(map_image_request, {"prompt": "x", "n": 0}, request_id="r").field == "n"
    assert err(map_image_request, {"prompt": "x", "output_format": "jpeg"}, request_id="r").field == "output_format"
    assert err(map_image_request, {"prompt": "x", "nvext": {"num_frames": 3}}, request_id="r").field == "nvext.num_frames"


# -- responses and metrics ---------------------------------------------------------------------------


def test_response_shapes() -> None:
    d = video_data(b64_json="AAAA", fps=15.6)
    assert d == {"output_format": "mp4", "b64_json": "AAAA", "fps": 16}
    r = video_response(response_id="v1", model="m", data=[d], inference_time_s=1.23456789)
    assert {k: r[k] for k in ("id", "object", "model", "status", "progress")} == {
        "id": "v1", "object": "video", "model": "m", "status": "completed", "progress": 100}
    assert isinstance(r["created"], int) and r["inference_time_s"] == 1.234568 and "error" not in r
    i = image_response(data=[{"b64_json": "QQ=="}], size="8x8")
    assert i["output_format"] == "png" and i["size"] == "8x8" and isinstance(i["created"], int)
    if importlib.util.find_spec("dynamo") is not None:  # validate against ai-dynamo's own models
        from dynamo.common.protocols.image_protocol import NvImagesResponse
        from dynamo.common.protocols.video_protocol import NvVideosResponse

        NvVideosResponse.model_validate(r)
        NvImagesResponse.model_validate(i)


def test_metrics_exposition() -> None:
    m = WorkerMetrics("tiny")
    m.start(2.0)
    m.start(3.0)
    m.finish("video", "completed", 2.0, 2.5)
    m.reject("video", "invalid")
    text = m.render({"waiting": 1, "running": 1, "finished": {"completed": 1}, "rejected": {"invalid": 1}})
    lines = {ln.rpartition(" ")[0]: float(ln.rpartition(" ")[2]) for ln in text.splitlines() if not ln.startswith("#")}
    assert lines['omniloop_dynamo_requests_total{model="tiny",kind="video",outcome="completed"}'] == 1
    assert lines['omniloop_dynamo_requests_total{model="tiny",kind="video",outcome="invalid"}'] == 1
    assert lines['omniloop_dynamo_inflight_requests{model="tiny"}'] == 1
    assert lines['omniloop_dynamo_outstanding_predicted_seconds{model="tiny"}'] == 3.0
    assert lines['omniloop_dynamo_request_predicted_seconds_count{model="tiny"}'] == 2
    assert lines['omniloop_dynamo_request_seconds_bucket{model="tiny",le="5.0"}'] == 1
    assert lines['omniloop_engine_waiting_requests{model="tiny"}'] == 1
    assert "# TYPE omniloop_dynamo_request_seconds histogram" in text


# -- command hook --------------------------------------------------------------------------------------


def test_register_commands_adds_dynamo_worker(tmp_path) -> None:
    from omniloop_dynamo import plugin

    cli = click.Group("omniloop")
    plugin.omniloop_register_commands(cli=cli)
    assert "dynamo-worker" in cli.commands
    res = CliRunner().invoke(cli, ["dynamo-worker", "--help"])
    assert res.exit_code == 0 and "--deploy" in res.output and "--discovery-backend" in res.output
    res = CliRunner().invoke(cli, ["dynamo-worker"])
    assert res.exit_code == 2 and "--deploy" in res.output
    if importlib.util.find_spec("dynamo") is None:
        deploy = tmp_path / "d.json"
        deploy.write_text("{}")
        res = CliRunner().invoke(cli, ["dynamo-worker", "--deploy", str(deploy)])
        assert res.exit_code == 1 and "install-dynamo.sh" in res.output, res.output


def test_plugin_is_discovered_and_healthy() -> None:
    from omniloop.plugins import PluginManager

    pm = PluginManager()
    cli = click.Group("omniloop")
    pm.register_commands(cli)
    rec = next((r for r in pm.records.values() if r.target == "omniloop_dynamo.plugin"), None)
    assert rec is not None and rec.ok, rec
    assert "dynamo-worker" in cli.commands


# -- engines and cost ----------------------------------------------------------------------------------


def test_fallback_engine_and_cost_estimate(toy_runtime_factory) -> None:
    from omniloop_dynamo.engine import CostEstimator, EngineClosedError, ThreadEngine

    rt = toy_runtime_factory()

    async def go() -> None:
        eng = await ThreadEngine(rt).start()
        cost = CostEstimator(rt, eng)
        req = map_video_request({"model": "toy", "prompt": "a dot", "stream": True, "nvext": {"seed": 1}},
                                request_id="a").requests[0]
        h = eng.submit(req)
        kinds = [ev.kind.value async for ev in h.events()]
        out = await h.result(timeout=60)
        assert out.ok and kinds[-1] == "final" and "progress" in kinds
        cost.observe(req, 1.0, out)
        p = cost.predict(req)
        assert p is not None and p > 0
        # cancel a queued request: it ends cancelled, never hangs
        long = map_video_request({"model": "toy", "prompt": "b", "nvext": {"num_inference_steps": 50}},
                                 request_id="b").requests[0]
        h1, h2 = eng.submit(long), eng.submit(req.__class__(**{**_fields(req), "request_id": "c"}))
        assert eng.cancel("c")
        assert (await h2.result(timeout=60)).status.value == "cancelled"
        assert (await h1.result(timeout=60)).ok
        await eng.shutdown(drain=True, timeout=30)
        with pytest.raises(EngineClosedError):
            eng.submit(req)

    asyncio.run(go())


def _fields(req) -> dict:
    import attrs

    return {f.name: getattr(req, f.name) for f in attrs.fields(type(req))}


def test_async_engine_is_used_when_available(toy_runtime_factory) -> None:
    pytest.importorskip("omniloop_scheduler")
    from omniloop_dynamo.engine import CostEstimator, make_engine

    rt = toy_runtime_factory()
    eng = make_engine(rt, "step")
    assert type(eng).__name__ == "AsyncEngine"

    async def go() -> None:
        await eng.start()
        cost = CostEstimator(rt, eng)
        req = map_video_request({"model": "toy", "prompt": "a", "nvext": {"seed": 2}}, request_id="x").requests[0]
        predicted = cost.predict(req)
        assert predicted is not None and predicted > 0  # from the scheduler's cost model
        out = await eng.submit(req).result(timeout=60)
        assert out.ok
        await eng.shutdown(drain=True, timeout=30)

    asyncio.run(go())


def test_b64_roundtrip_of_reference_reaches_family_validation(toy_runtime_factory) -> None:
    """An I2V request for a model without i2v is refused by runtime.prepare, before any compute."""
    from omniloop.errors import RequestError

    rt = toy_runtime_factory()
    req = video(input_reference=base64.b64encode(base64.b64decode(PNG_B64)).decode()).requests[0]
    with pytest.raises(RequestError) as info:
        rt.prepare(req)
    assert api_field(info.value.path) == "input_reference"


# -- issue 14: hostile values, ids and paths -------------------------------------------------------

NAN, INF, HUGE = float("nan"), float("inf"), 10**5000


@pytest.mark.parametrize("body,field", [
    ({"nvext": {"guidance_scale": NAN}}, "nvext.guidance_scale"),
    ({"nvext": {"guidance_scale": INF}}, "nvext.guidance_scale"),
    ({"nvext": {"fps": NAN}}, "nvext.fps"),
    ({"nvext": {"fps": INF}}, "nvext.fps"),
    ({"nvext": {"fps": 1e-300}}, "nvext.fps"),
    ({"nvext": {"fps": 1e308}}, "nvext.fps"),
    ({"nvext": {"seed": HUGE}}, "nvext.seed"),
    ({"nvext": {"guidance_scale": HUGE}}, "nvext.guidance_scale"),
    ({"seconds": NAN}, "seconds"),
    ({"seconds": INF}, "seconds"),
    ({"seconds": 1e308}, "seconds"),
    ({"seconds": "1e308"}, "seconds"),
    ({"seconds": HUGE}, "seconds"),
    ({"extra_args": {"media_passthrough": {"shift": NAN}}}, "shift"),
    ({"extra_args": {"media_passthrough": {"plugin_params": {"p": {"x": INF}}}}}, "plugin_params.p.x"),
    ({"prompt": "\ud800"}, "prompt"),
    ({"prompt": "a\x00b"}, "prompt"),
])
def test_non_finite_and_huge_numbers_and_bad_text_are_client_errors(body: dict, field: str) -> None:
    e = err(video, **body)
    assert e.field == field, str(e)
    str(e).encode("utf-8")


@pytest.mark.parametrize("body", [
    {"size": "x" * (1 << 20)},
    {"response_format": "y" * (1 << 20)},
    {"output_format": "z" * (1 << 20)},
    {"nvext": {"k" * (1 << 20): 1}},
    {"nvext": {"num_inference_steps": "s" * (1 << 20)}},
    {"extra_args": {"media_passthrough": {"q" * (1 << 20): 1}}},
    {"extra_args": {"media_passthrough": {"node_params": {"n" * (1 << 20): 1}}}},
])
def test_errors_never_echo_a_huge_value(body: dict) -> None:
    assert len(str(err(video, **body))) < 1200


def test_request_ids_from_the_context_never_become_paths(tmp_path) -> None:
    from omniloop_dynamo.worker import media_path, request_id_for

    for cid in ("../../etc/passwd", "/abs/dir/x", "a\x00b", "é" * 100, "x" * 10_000, "..", ""):
        rid = request_id_for(cid)
        assert rid.startswith("dyn-") and len(rid) <= 64
        assert "/" not in rid and "\x00" not in rid
        assert map_video_request({"prompt": "x"}, request_id=rid).requests[0].request_id == rid
    assert request_id_for("abc-123") == "dyn-abc-123"
    a, b = media_path(tmp_path, ".mp4"), media_path(tmp_path, ".mp4")
    assert a != b and a.parent == b.parent == tmp_path.resolve() and a.suffix == ".mp4"


def test_the_worker_names_media_files_itself(tmp_path) -> None:
    """_encode writes under --media-dir with a worker-made name, whatever the request id."""
    import torch

    from omniloop.artifacts import VideoFrames
    from omniloop.request import OmniOutput, Status
    from omniloop_dynamo.worker import OmniloopDynamoWorker, WorkerOptions

    worker = OmniloopDynamoWorker.__new__(OmniloopDynamoWorker)  # no ai-dynamo needed for _encode
    worker.options = WorkerOptions(deploy="x")
    worker._media_dir = tmp_path / "media"
    worker.model_name = "m"
    mapped = video(response_format="url")
    frames = torch.zeros(2, 16, 16, 3, dtype=torch.uint8)
    out = OmniOutput("r1", Status.COMPLETED, artifacts={"video": VideoFrames(frames=frames, fps=8.0)})
    resp = worker._encode(mapped, [out], "../../escape", 0.1)
    files = list((tmp_path / "media").iterdir())
    assert len(files) == 1 and files[0].suffix == ".mp4" and "escape" not in files[0].name
    assert resp["data"][0]["url"] == files[0].as_uri()
    assert not list(tmp_path.glob("*.mp4")) and not (tmp_path.parent / "escape.mp4").exists()


def test_the_worker_muxes_a_videos_sound_track(tmp_path) -> None:
    """A video with an audio artifact (a family declaring audio_tasks) comes back as an mp4 with its AAC track."""
    import av
    import torch

    from omniloop.artifacts import Audio, VideoFrames
    from omniloop.request import OmniOutput, Status
    from omniloop_dynamo.worker import OmniloopDynamoWorker, WorkerOptions

    worker = OmniloopDynamoWorker.__new__(OmniloopDynamoWorker)
    worker.options = WorkerOptions(deploy="x")
    worker._media_dir = tmp_path / "media"
    worker.model_name = "m"
    t = torch.arange(16000) / 16000
    sound = Audio(samples=torch.stack([0.3 * torch.sin(2 * torch.pi * 440 * t)] * 2), sample_rate=16000)
    out = OmniOutput("r1", Status.COMPLETED, artifacts={
        "video": VideoFrames(frames=torch.zeros(8, 16, 16, 3, dtype=torch.uint8), fps=8.0), "audio": sound})
    worker._encode(video(response_format="url"), [out], "r1", 0.1)
    (path,) = (tmp_path / "media").iterdir()
    with av.open(str(path)) as c:
        assert [s.type for s in c.streams] == ["video", "audio"] and c.streams.audio[0].sample_rate == 16000


def test_the_worker_advertises_the_checkpoints_tasks(toy_runtime_factory) -> None:
    from omniloop_dynamo.worker import OmniloopDynamoWorker, WorkerOptions

    rt = toy_runtime_factory()
    rt.model.tasks = frozenset({TaskType.T2I})
    worker = OmniloopDynamoWorker.__new__(OmniloopDynamoWorker)
    worker.options = WorkerOptions(deploy="x", media_dir=None)
    worker.runtime, worker.model_name = rt, "toy"
    worker.metrics = WorkerMetrics("toy")
    worker._setup_model_facts()
    assert worker._tasks == {"t2i"} and worker.modalities() == ["image"]


# ---------------------------------------------------------------------------------------------
# omniloop serve's extra_body names (so one OpenAI SDK call works against both front ends)
# ---------------------------------------------------------------------------------------------


def _extra(**knobs: object) -> dict[str, object]:
    return {"extra_args": {"media_passthrough": knobs}}


def test_serve_style_extra_fields_fill_nvext() -> None:
    r = map_image_request({"model": "m", "prompt": "x", "n": 2, **_extra(steps=3, seed=7, guidance_scale=2.5,
                                                                         negative_prompt="blurry")},
                          request_id="r").requests
    assert [q.diffusion.seed for q in r] == [7, 8] and r[0].diffusion.steps == 3 and r[0].diffusion.guidance_scale == 2.5
    assert r[0].negative_prompt == "blurry"
    v = map_video_request({"model": "m", "prompt": "x", **_extra(num_inference_steps=2)}, request_id="r").requests[0]
    assert v.diffusion.steps == 2
    same = map_video_request({"model": "m", "prompt": "x", "nvext": {"num_inference_steps": 2}}, request_id="r")
    assert same.requests[0].diffusion == v.diffusion


def test_serve_style_extra_field_errors_name_the_field_the_client_wrote() -> None:
    e = err(map_video_request, {"model": "m", "prompt": "x", "nvext": {"seed": 1}, **_extra(seed=2)}, request_id="r")
    assert e.field == "seed" and "given twice" in e.message
    e = err(map_video_request, {"model": "m", "prompt": "x", **_extra(steps=2, num_inference_steps=3)}, request_id="r")
    assert e.field == "num_inference_steps" and "given twice: also set as steps" in e.message
    e = err(map_image_request, {"model": "m", "prompt": "x", **_extra(steps=-1)}, request_id="r")
    assert e.field == "steps"
    e = err(map_image_request, {"model": "m", "prompt": "x", **_extra(seed="7")}, request_id="r")
    assert e.field == "seed"


def test_strength_is_i2i_only() -> None:
    import base64 as b64

    ref = "data:image/png;base64," + b64.b64encode(b"\x89PNG fake").decode()
    r = map_image_request({"model": "m", "prompt": "x", "input_reference": ref, **_extra(strength=0.4)},
                          request_id="r").requests[0]
    assert r.task.value == "i2i" and r.node_params == {"denoise": {"strength": 0.4}}
    r = map_image_request({"model": "m", "prompt": "x", "input_reference": ref,
                           **_extra(strength=0.4, node_params={"denoise": {"cfg": "classic"}})}, request_id="r").requests[0]
    assert r.node_params == {"denoise": {"cfg": "classic", "strength": 0.4}}
    for req, field in [
        ({"model": "m", "prompt": "x", **_extra(strength=0.4)}, "strength"),  # t2i
        ({"model": "m", "prompt": "x", "input_reference": ref,
          **_extra(strength=0.4, node_params={"denoise": {"strength": 0.5}})}, "strength"),
    ]:
        assert err(map_image_request, req, request_id="r").field == field
    e = err(map_video_request, {"model": "m", "prompt": "x", **_extra(strength=0.4)}, request_id="r")
    assert e.field == "strength" and "image-to-image" in e.message
    assert api_field("node_params.denoise.strength") == "strength"


def test_default_fps_comes_from_the_runtime_defaults(tmp_path) -> None:
    from omniloop.runtime import Runtime
    from omniloop.testing import build_toy_checkpoint, make_manager
    from omniloop_dynamo.worker import default_fps

    rt = Runtime.from_model(build_toy_checkpoint(tmp_path / "toy"), manager=make_manager())
    assert default_fps(rt, {"t2v", "t2i"}) == rt.defaults("t2v")["fps"] == 8.0
    m = map_video_request({"model": "m", "prompt": "x", "seconds": 1}, request_id="r", default_fps=8.0)
    assert m.requests[0].diffusion.frames == 9  # seconds * fps + 1
