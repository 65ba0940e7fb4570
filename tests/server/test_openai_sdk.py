"""The official ``openai`` Python SDK against a real uvicorn server on 127.0.0.1 (issue 23).

The SDK sends ``POST /v1/videos`` as multipart/form-data (``prompt``, ``model``, ``seconds``,
``size``, an optional ``input_reference`` file; ``extra_body`` keys as more form fields, nested
ones bracketed); every other call is JSON or a GET. Everything here goes through the SDK's own
request building and response parsing: models, the video lifecycle (create, retrieve, poll,
create_and_poll, download_content with variants, list with pagination, cancel, delete), i2v with
``input_reference`` on a tiny Wan I2V checkpoint, images.generate on the toy family, and the
SDK's typed errors carrying our messages. The server README's snippets are copied from here.
"""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")

from openai import OpenAI  # noqa: E402
from openai.types import Video  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # "The Sora API is scheduled to ..."

T = 60.0


def png(size: int = 16, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format="PNG")
    return buf.getvalue()


def mp4_frames(data: bytes) -> int:
    import av

    with av.open(io.BytesIO(data)) as container:
        return sum(1 for _ in container.decode(video=0))


@pytest.fixture
def sdk(server: Any) -> Iterator[tuple[OpenAI, Any]]:
    url, app = server
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=T)
    try:
        yield client, app
    finally:
        client.close()


def test_models(sdk: Any) -> None:
    client, _app = sdk
    models = client.models.list()
    assert [m.id for m in models] == ["ckpt"]
    model = client.models.retrieve("ckpt")
    assert model.id == "ckpt" and model.owned_by == "omniloop"
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("sora-2")
    assert "this server serves 'ckpt'" in exc.value.message


def test_create_and_poll_then_download_every_variant(sdk: Any) -> None:
    client, _ = sdk
    # the SDK's own call (multipart/form-data); the toy model runs at 8 fps: 1 s → 8 frames
    video = client.videos.create_and_poll(
        model="ckpt",
        prompt="a red circle moving up",
        seconds="1",
        size="16x16",
        extra_body={"steps": 3, "seed": 7, "negative_prompt": "blurry", "omniloop": {"diffusion": {"shift": 2.0}}},
    )
    assert isinstance(video, Video)
    assert video.status == "completed" and video.progress == 100
    assert (video.seconds, video.size, video.model, video.prompt) == ("1", "16x16", "ckpt", "a red circle moving up")
    assert video.model_extra["frames"] == 8 and video.model_extra["metrics"]["steps"] == 3
    assert video.model_extra["metrics"]["seed"] == 7
    # the object validates against the SDK's schema (size aside: ours are not Sora's sizes)
    Video.model_validate({**video.to_dict(), "size": "720x1280"})

    content = client.videos.download_content(video.id)
    thumb = client.videos.download_content(video.id, variant="thumbnail")
    sheet = client.videos.download_content(video.id, variant="spritesheet")
    assert content.content[4:8] == b"ftyp" and mp4_frames(content.content) == 8
    assert thumb.content.startswith(b"\x89PNG") and sheet.content.startswith(b"\x89PNG")

    again = client.videos.retrieve(video.id)
    assert again.id == video.id and again.status == "completed"


def test_create_then_poll_and_the_same_fields_in_json(sdk: Any) -> None:
    client, _ = sdk
    video = client.videos.create(model="ckpt", prompt="a blue square", seconds="0.5", size="16x16",
                                 extra_body={"steps": 2})
    done = client.videos.poll(video.id, poll_interval_ms=20)
    assert video.status in ("queued", "in_progress") and video.progress >= 0
    assert done.status == "completed" and done.model_extra["frames"] == 4

    # the same body as JSON (the SDK's generic post sends JSON), extra knobs included
    j = client.post("/videos", cast_to=Video, body={"model": "ckpt", "prompt": "a blue square", "seconds": "0.5",
                                                    "size": "16x16", "steps": 2, "seed": 5,
                                                    "omniloop": {"diffusion": {"shift": 2.0}}})
    done = client.videos.poll(j.id, poll_interval_ms=20)
    assert done.status == "completed" and done.model_extra["frames"] == 4 and done.model_extra["metrics"]["seed"] == 5


def test_list_follows_pagination(sdk: Any) -> None:
    client, _ = sdk
    ids = [client.videos.create(prompt=f"clip {i}", size="16x16", extra_body={"steps": 2, "frames": 2}).id for i in range(5)]
    page = client.videos.list(limit=2, order="asc")
    assert [v.id for v in page.data] == ids[:2] and page.has_more
    assert [v.id for v in client.videos.list(limit=2, order="asc")] == ids  # auto-pagination: 3 pages
    assert [v.id for v in client.videos.list(limit=3)] == ids[::-1]  # newest first by default
    for i in ids:
        client.videos.poll(i, poll_interval_ms=20)


def test_cancel_and_delete(sdk: Any) -> None:
    client, _ = sdk
    video = client.videos.create(prompt="a long one", size="16x16", extra_body={"steps": 300})
    cancelled = client.post(f"/videos/{video.id}/cancel", cast_to=Video)
    done = client.videos.poll(video.id, poll_interval_ms=20)
    # OpenAI's Video has no "cancelled" status: a cancelled job is failed, error.code says why
    assert done.status == "failed" and done.error is not None and done.error.code == "cancelled"
    assert cancelled.id == video.id
    with pytest.raises(openai.ConflictError) as exc:
        client.videos.download_content(video.id)
    assert "was cancelled" in exc.value.message

    deleted = client.videos.delete(video.id)
    assert deleted.deleted is True and deleted.id == video.id and deleted.object == "video.deleted"
    with pytest.raises(openai.NotFoundError) as exc:
        client.videos.retrieve(video.id)
    assert f"no video job '{video.id}'" in exc.value.message

    running = client.videos.create(prompt="deleted while running", size="16x16", extra_body={"steps": 300})
    assert client.videos.delete(running.id).deleted is True  # cancels it, then forgets it
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(running.id)


def test_typed_errors_carry_our_messages(sdk: Any) -> None:
    client, app = sdk
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        client.videos.create(prompt="x", size="30x30")  # the toy model needs multiples of 4
    assert exc.value.body["param"] == "size" and "multiple of 4" in exc.value.message
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        client.videos.create(prompt="x", size="big")
    assert exc.value.body["param"] == "size"
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        client.videos.create(prompt="x", model="sora-2")
    assert exc.value.body["param"] == "model" and "unknown model 'sora-2'" in exc.value.message
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        client.videos.create(prompt="x", extra_body={"steps": 100_000})
    assert exc.value.body["param"] == "steps"
    # the toy checkpoint does t2v and t2i only: an input image is a clear 422
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        client.videos.create(prompt="x", input_reference=("ref.png", png(), "image/png"))
    assert exc.value.body["param"] == "input_reference" and "does not do i2v" in exc.value.message
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        client.videos.create(prompt="x", extra_body={"omniloop": '{"diffusion": '})
    assert exc.value.body["param"] == "omniloop"
    with pytest.raises(openai.BadRequestError) as exc:  # no body at all
        client.post("/videos", cast_to=Video, body=None, options={"headers": {"Content-Type": "application/json"}})
    assert "empty" in exc.value.message
    with pytest.raises(openai.NotFoundError) as exc:
        client.videos.retrieve("video_nope")
    assert exc.value.body["message"] == "no video job 'video_nope'"
    assert app.state.omniloop.engine.stats()["submitted"] == 0


def test_a_full_queue_is_a_rate_limit_error(server_checkpoint: Path, tmp_path: Path) -> None:
    from omniloop_scheduler.testing import make_runtime
    from omniloop_server import create_app
    from omniloop_server.testing import serving

    rt = make_runtime(server_checkpoint, scheduler="step", limits={"max_queue": 1, "max_steps": 100_000},
                      scheduler_options={"max_running": 1})
    app = create_app(rt, output_dir=tmp_path / "out", shutdown_timeout=0, poll_after_ms=20)
    with serving(app) as url, OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=T) as client:
        first = client.videos.create(prompt="x", size="16x16", extra_body={"steps": 100_000})
        deadline = time.monotonic() + T
        while client.videos.retrieve(first.id).status == "queued" and time.monotonic() < deadline:
            time.sleep(0.02)
        client.videos.create(prompt="x", size="16x16", extra_body={"steps": 100_000})  # waits in the queue
        with pytest.raises(openai.RateLimitError) as exc:
            client.videos.create(prompt="x", size="16x16", extra_body={"steps": 2})
        assert exc.value.body["code"] == "queue_full" and "queue" in exc.value.message


def test_images_generate(sdk: Any) -> None:
    client, _ = sdk
    from PIL import Image

    result = client.images.generate(model="ckpt", prompt="a cat", n=2, size="16x16", extra_body={"steps": 2, "seed": 3})
    assert len(result.data) == 2 and result.output_format == "png"
    images = [Image.open(io.BytesIO(base64.b64decode(d.b64_json))) for d in result.data]
    assert all(im.size == (16, 16) and im.format == "PNG" for im in images)
    # as URLs of this server (server-made names in the output folder)
    urls = client.images.generate(model="ckpt", prompt="a cat", n=2, size="16x16", response_format="url",
                                  extra_body={"steps": 2, "seed": 3})
    fetched = [client.get(d.url or "", cast_to=httpx.Response).content for d in urls.data]
    assert [Image.open(io.BytesIO(b)).tobytes() for b in fetched] == [im.tobytes() for im in images]
    with pytest.raises(openai.NotFoundError):
        client.get((urls.data[0].url or "").replace(".png", "0.png"), cast_to=httpx.Response)
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        client.images.generate(model="ckpt", prompt="a cat", response_format="gif")  # type: ignore[arg-type]
    assert exc.value.body["param"] == "response_format"


# ---------------------------------------------------------------------------------------------
# i2v: input_reference on a tiny Wan image-to-video checkpoint
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wan_i2v_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    pytest.importorskip("omniloop_wan")
    from omniloop_scheduler.testing import make_runtime
    from omniloop_server import create_app
    from omniloop_server.testing import serving
    from omniloop_wan import plugin as wan_plugin
    from omniloop_wan.tiny import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(tmp_path_factory.mktemp("wan-i2v") / "tiny-i2v", variant="i2v")
    rt = make_runtime(ckpt, ("wan", wan_plugin), scheduler="step")
    app = create_app(rt, output_dir=tmp_path_factory.mktemp("wan-out"), shutdown_timeout=0, poll_after_ms=50)
    with serving(app) as url:
        yield url


def test_i2v_with_input_reference(wan_i2v_server: str) -> None:
    with OpenAI(base_url=f"{wan_i2v_server}/v1", api_key="none", max_retries=0, timeout=T) as client:
        assert "i2v" in client.models.list().data[0].model_extra["tasks"]
        # an uploaded image file, as the SDK sends it; 0.5 s at 16 fps → 8 → Wan's 4k+1: 9 frames
        video = client.videos.create_and_poll(
            model="tiny-i2v",
            prompt="a red fox",
            input_reference=("first_frame.png", png(32), "image/png"),
            seconds="0.5",
            size="32x32",
            extra_body={"steps": 2, "seed": 0},
            poll_interval_ms=50,
        )
        assert video.status == "completed", video.error
        assert video.model_extra["frames"] == 9
        assert mp4_frames(client.videos.download_content(video.id).content) == 9
        # input_reference as {"image_url": a data: URL}: videos.create of SDK 3.57 only uploads files
        # (extract_files refuses a dict), so this form goes as JSON through the SDK's generic post
        data_url = "data:image/png;base64," + base64.b64encode(png(32, (10, 200, 10))).decode()
        created = client.post("/videos", cast_to=Video, body={
            "prompt": "a red fox", "input_reference": {"image_url": data_url}, "size": "32x32", "steps": 2, "frames": 5})
        video = client.videos.poll(created.id, poll_interval_ms=50)
        assert video.status == "completed", video.error
        assert video.model_extra["frames"] == 5
        with pytest.raises(openai.UnprocessableEntityError) as exc:
            client.videos.create(prompt="x", input_reference=("notes.txt", b"not an image", "text/plain"))
        assert exc.value.body["param"] == "input_reference" and "not a readable image" in exc.value.message
        with pytest.raises(openai.UnprocessableEntityError) as exc:
            client.post("/videos", cast_to=Video, body={"prompt": "x", "input_reference": {"image_url": "https://example.com/a.png"}})
        assert exc.value.body["param"] == "input_reference.image_url" and "fetches nothing" in exc.value.message
        with pytest.raises(openai.UnprocessableEntityError) as exc:
            client.post("/videos", cast_to=Video, body={"prompt": "x", "input_reference": {"file_id": "file_123"}})
        assert exc.value.body["param"] == "input_reference.file_id"


def test_the_readme_snippets_are_copied_from_this_file() -> None:
    """Every python block of the server README's SDK section is a run of lines of one of the SDK
    test files (this one: videos; ``_text``: chat and completions; ``_images``: image edits)."""
    import re

    readme = (Path(__file__).parents[2] / "plugins/frontends/server/README.md").read_text()
    section = readme.split("## With the OpenAI SDK", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) >= 15
    sources = [[line.strip() for line in p.read_text().splitlines()]
               for p in sorted(Path(__file__).parent.glob("test_openai_sdk*.py"))]
    assert len(sources) >= 3
    for block in blocks:
        lines = [line.strip() for line in block.strip().splitlines()]
        assert any(src[i:i + len(lines)] == lines for src in sources for i in range(len(src))), block
