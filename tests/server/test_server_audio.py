"""The audio endpoints (``omniloop_server.audio``) on a real server over the toy-audio family
(``omniloop.testing.toy_audio``: a deterministic sine per prompt): the official ``openai`` SDK's
``audio.speech.create`` unchanged (wav, mp3, ...), every file decoded with PyAV (rate, channels,
duration, pitch); the job route (create, poll, content, cancel, delete); ``/openapi.json`` and
``/v1/models``; bad input as one 422 before any compute. The server README's audio snippets are
copied from here."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from omniloop.testing.toy_audio import ToyAudioPlugin, build_toy_audio_checkpoint, prompt_frequency

openai = pytest.importorskip("openai")
av = pytest.importorskip("av")

from openai import OpenAI  # noqa: E402

T = 60.0
RATE, CHANNELS, MAX_SECONDS = 16000, 2, 6.0


def decode(data: bytes) -> tuple[int, int, float, np.ndarray]:
    """(sample rate, channels, seconds, channel 0) of an audio file's bytes."""
    with av.open(io.BytesIO(data)) as c:
        parts, rate, channels = [], 0, 0
        for frame in c.decode(c.streams.audio[0]):
            rate, channels = frame.sample_rate, len(frame.layout.channels)
            arr = frame.to_ndarray().astype(np.float64)
            arr = arr if frame.format.is_planar else arr.reshape(-1, channels).T
            parts.append(arr[0] / (32768.0 if frame.format.name.startswith("s16") else 1.0))
    x = np.concatenate(parts)
    return rate, channels, x.shape[0] / rate, x


def peak_hz(x: np.ndarray, rate: int) -> float:
    spec = np.abs(np.fft.rfft(x * np.hanning(x.shape[0])))
    return float(spec.argmax()) * rate / x.shape[0]


def make_audio_runtime(ckpt: Path, **deploy: Any) -> Any:
    from omniloop_scheduler.testing import make_runtime

    return make_runtime(ckpt, ("toy-audio", ToyAudioPlugin()), scheduler="step", **deploy)


@pytest.fixture(scope="module")
def audio_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_toy_audio_checkpoint(tmp_path_factory.mktemp("toy-audio"), sample_rate=RATE, channels=CHANNELS,
                                      max_seconds=MAX_SECONDS)


@pytest.fixture(scope="module")
def audio_server(audio_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from omniloop_server import create_app
    from omniloop_server.testing import serving

    rt = make_audio_runtime(audio_ckpt, limits={"max_steps": 50})
    app = create_app(rt, output_dir=tmp_path_factory.mktemp("audio-out"), shutdown_timeout=0, poll_after_ms=20)
    with serving(app) as url:
        yield url


@pytest.fixture
def client(audio_server: str) -> OpenAI:
    return OpenAI(base_url=f"{audio_server}/v1", api_key="unused", timeout=T, max_retries=0)


@pytest.mark.parametrize(("fmt", "rate"), [("wav", RATE), ("mp3", RATE), ("flac", RATE), ("opus", 48000),
                                           ("aac", RATE)])
def test_openai_sdk_speech_create_returns_a_file_that_decodes(client: OpenAI, audio_ckpt: Path, fmt: str,
                                                              rate: int) -> None:
    speech = client.audio.speech.create(
        model=audio_ckpt.name, voice="alloy", input="a glass bell", response_format=fmt,
        extra_body={"seconds": 1.5, "steps": 6, "guidance": 1.0, "seed": 7},
    )
    data = speech.read()
    assert speech.response.headers["x-sample-rate"] == str(RATE)
    assert speech.response.headers["x-channels"] == str(CHANNELS)
    got_rate, channels, seconds, x = decode(data)
    assert (got_rate, channels) == (rate, CHANNELS)
    slack = 2048 / RATE if fmt == "aac" else 1e-3  # raw ADTS keeps the encoder's padding
    assert 1.5 - 1e-3 <= seconds <= 1.5 + slack
    assert abs(peak_hz(x, got_rate) - prompt_frequency("a glass bell")) < 2.0


def test_the_readme_snippet(audio_server: str, audio_ckpt: Path, tmp_path: Path) -> None:
    client = OpenAI(base_url=f"{audio_server}/v1", api_key="unused")
    speech = client.audio.speech.create(
        model=audio_ckpt.name, voice="alloy", input="a glass bell", response_format="wav",
        extra_body={"seconds": 1.5, "steps": 6, "guidance": 1.0, "seed": 7},
    )
    speech.write_to_file(tmp_path / "bell.wav")
    assert decode((tmp_path / "bell.wav").read_bytes())[:3] == (RATE, CHANNELS, 1.5)


def test_speech_wav_equals_the_python_api_and_takes_the_extra_body_fields(client: OpenAI, audio_ckpt: Path) -> None:
    """seconds, start, steps, guidance, seed and negative_prompt all reach the request: the wav is
    the Python API's samples for the same request, at 16 bits."""
    from omniloop.runtime import Runtime
    from omniloop.testing import make_manager

    body = {"seconds": 2.0, "start": 1.0, "steps": 5, "guidance": 3.0, "seed": 11, "negative_prompt": "hiss"}
    data = client.audio.speech.create(model=audio_ckpt.name, voice="alloy", input="a low hum", response_format="wav",
                                      extra_body=body).read()
    rt = Runtime.from_model(audio_ckpt, manager=make_manager(("toy-audio", ToyAudioPlugin()), toy=False))
    want = rt.generate({"task": "t2a", "prompt": "a low hum", "negative_prompt": "hiss",
                        "audio": {"seconds": 2.0, "start": 1.0},
                        "diffusion": {"steps": 5, "guidance_scale": 3.0, "seed": 11}}).artifacts["audio"].samples
    with av.open(io.BytesIO(data)) as c:
        got = np.concatenate([f.to_ndarray() for f in c.decode(audio=0)], axis=1).reshape(-1, 2).T / 32768.0
    assert got.shape == tuple(want.shape)
    assert float(np.abs(got - want.numpy()).max()) <= 1.0 / 32768 + 1e-6
    assert float(want.abs().max()) > 0.5  # guidance 3 with a negative prompt: 0.25 + 3 x 0.25 = 1.0, clamped


def test_pcm_is_raw_samples_and_the_default_format_is_mp3(audio_server: str) -> None:
    r = httpx.post(f"{audio_server}/v1/audio/speech", json={"input": "a bell", "voice": "x", "response_format": "pcm",
                                                            "seconds": 0.5}, timeout=T)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/pcm"
    assert len(r.content) == round(0.5 * RATE) * CHANNELS * 2
    r = httpx.post(f"{audio_server}/v1/audio/speech", json={"input": "a bell", "voice": "x", "seconds": 0.5}, timeout=T)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg"
    assert decode(r.content)[:2] == (RATE, CHANNELS)


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"seconds": 0}, "seconds", "must be > 0"),
    ({"seconds": -2}, "seconds", "must be > 0"),
    ('"seconds": 1e999', "seconds", "finite"),  # JSON text: a number too large for a float is inf
    ({"seconds": "nan"}, "seconds", "expected a number"),
    ({"seconds": 7}, "seconds", "longer than the checkpoint's maximum of 6 s"),
    ({"seconds": 2, "start": 5}, "seconds", "audio.start + audio.seconds = 7 s"),
    ({"response_format": "ogg"}, "response_format", "must be one of"),
    ({"speed": 1.5}, "speed", "only 1.0"),
    ({"instructions": "whisper"}, "instructions", "not supported"),
    ({"steps": 51}, "steps", "above this deployment's limit of 50"),
    ({"omniloop": {"diffusion": {"frames": 4}}}, "omniloop.diffusion.frames", "makes audio"),
    ({"model": "other"}, "model", "unknown model"),
])
def test_bad_speech_input_is_one_422_before_compute(audio_server: str, body: dict[str, Any] | str, param: str,
                                                    message: str) -> None:
    before = httpx.get(f"{audio_server}/metrics", timeout=T).text
    if isinstance(body, str):
        r = httpx.post(f"{audio_server}/v1/audio/speech", content=f'{{"input": "a bell", "voice": "alloy", {body}}}',
                       headers={"content-type": "application/json"}, timeout=T)
    else:
        r = httpx.post(f"{audio_server}/v1/audio/speech", json={"input": "a bell", "voice": "alloy", **body}, timeout=T)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err
    assert _submitted(httpx.get(f"{audio_server}/metrics", timeout=T).text) == _submitted(before)


def _submitted(metrics: str) -> float:
    """Requests the engine accepted (a refused body never reaches it)."""
    (value,) = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                if line.startswith("omniloop_requests_submitted_total")]
    return value


def test_a_json_nan_literal_is_an_unreadable_body(audio_server: str) -> None:
    r = httpx.post(f"{audio_server}/v1/audio/speech", content=b'{"input": "a", "voice": "x", "seconds": NaN}',
                   headers={"content-type": "application/json"}, timeout=T)
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"


def test_audio_job_create_poll_content(audio_server: str) -> None:
    r = httpx.post(f"{audio_server}/v1/audio/generations",
                   json={"prompt": "a distant horn", "seconds": 2.5, "response_format": "flac", "seed": 1}, timeout=T)
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["object"] == "audio.generation" and job["status"] in ("queued", "in_progress", "completed")
    assert job["seconds"] == 2.5 and job["response_format"] == "flac"
    deadline = time.monotonic() + T
    while job["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline
        time.sleep(0.02)
        job = httpx.get(f"{audio_server}/v1/audio/generations/{job['id']}", timeout=T).json()
    assert job["status"] == "completed" and job["progress"] == 100, job
    assert (job["sample_rate"], job["channels"]) == (RATE, CHANNELS)
    c = httpx.get(f"{audio_server}/v1/audio/generations/{job['id']}/content", timeout=T)
    assert c.status_code == 200 and c.headers["content-type"] == "audio/flac"
    rate, channels, seconds, x = decode(c.content)
    assert (rate, channels) == (RATE, CHANNELS) and abs(seconds - 2.5) < 1e-3
    assert abs(peak_hz(x, rate) - prompt_frequency("a distant horn")) < 2.0
    d = httpx.delete(f"{audio_server}/v1/audio/generations/{job['id']}", timeout=T)
    assert d.json()["deleted"] is True
    assert httpx.get(f"{audio_server}/v1/audio/generations/{job['id']}", timeout=T).status_code == 404


def test_audio_job_refusals_and_unknown_ids(audio_server: str) -> None:
    r = httpx.post(f"{audio_server}/v1/audio/generations", json={"prompt": "x", "seconds": 60}, timeout=T)
    assert r.status_code == 422 and r.json()["error"]["param"] == "seconds"
    r = httpx.post(f"{audio_server}/v1/audio/generations", json={"input": "x"}, timeout=T)
    assert r.status_code == 422
    for path in ("", "/content"):
        r = httpx.get(f"{audio_server}/v1/audio/generations/nope{path}", timeout=T)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_cancelled_job_has_no_content(audio_ckpt: Path, tmp_path: Path) -> None:
    """A job cancelled while it runs ends failed (code cancelled) and its content is a 409."""
    from omniloop_server import create_app
    from omniloop_server.testing import serving

    rt = make_audio_runtime(audio_ckpt, limits={"max_steps": 100_000})
    slow = rt.family.build_pipeline  # every step sleeps a little, so the cancel lands mid-loop
    from omniloop.testing import toy_audio

    class SlowDenoise(toy_audio.Denoise):
        def step(self, ctx: Any, state: Any, loop: Any) -> Any:
            time.sleep(0.01)
            return super().step(ctx, state, loop)

    def build(model: Any, task: Any, options: Any) -> Any:
        import attrs

        spec = slow(model, task, options)
        nodes = tuple(attrs.evolve(n, stage=SlowDenoise()) if n.name == "denoise" else n for n in spec.nodes)
        return attrs.evolve(spec, nodes=nodes)

    rt.family.build_pipeline = build
    app = create_app(rt, output_dir=tmp_path, shutdown_timeout=0, poll_after_ms=20)
    with serving(app) as url:
        job = httpx.post(f"{url}/v1/audio/generations", json={"prompt": "x", "steps": 5000}, timeout=T).json()
        httpx.post(f"{url}/v1/audio/generations/{job['id']}/cancel", timeout=T)
        deadline = time.monotonic() + T
        while job["status"] not in ("completed", "failed"):
            assert time.monotonic() < deadline
            time.sleep(0.02)
            job = httpx.get(f"{url}/v1/audio/generations/{job['id']}", timeout=T).json()
        assert job["status"] == "failed" and job["error"]["code"] == "cancelled", job
        r = httpx.get(f"{url}/v1/audio/generations/{job['id']}/content", timeout=T)
        assert r.status_code == 409


def test_models_lists_t2a_and_openapi_documents_both_routes(audio_server: str) -> None:
    models = httpx.get(f"{audio_server}/v1/models", timeout=T).json()
    assert models["data"][0]["tasks"] == ["t2a"] and models["data"][0]["family"] == "toy-audio"
    doc = httpx.get(f"{audio_server}/openapi.json", timeout=T).json()
    assert doc["paths"]["/v1/audio/speech"]["post"]["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/SpeechCreate"}
    assert "/v1/audio/generations/{job_id}/content" in doc["paths"]
    speech = doc["components"]["schemas"]["SpeechCreate"]["properties"]
    assert {"input", "voice", "response_format", "seconds", "start", "steps", "guidance", "seed",
            "negative_prompt"} <= set(speech)
    assert set(speech["response_format"]["anyOf"][0]["enum"]) == {"wav", "flac", "mp3", "opus", "aac", "pcm"}


def test_a_video_model_refuses_audio_routes_and_audio_windows(server: tuple[str, Any]) -> None:
    url, _ = server
    r = httpx.post(f"{url}/v1/audio/speech", json={"input": "a bell", "voice": "alloy"}, timeout=T)
    assert r.status_code == 422 and r.json()["error"]["param"] == "model"
    assert "does not make audio (no t2a task" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/videos", json={"prompt": "a fox", "omniloop": {"audio": {"seconds": 2}}}, timeout=T)
    assert r.status_code == 422 and r.json()["error"]["param"] == "omniloop.audio", r.text


def test_a_video_with_sound_is_served_as_an_mp4_with_its_audio_track(tmp_path: Path) -> None:
    """toy-av (a t2v family declaring audio_tasks, as LTX-2 will): POST /v1/videos takes the audio
    window in the omniloop object and the job's mp4 carries the AAC track, as long as the video."""
    from omniloop_server import create_app
    from omniloop_server.testing import serving

    ckpt = build_toy_audio_checkpoint(tmp_path / "toy-av", family="toy-av", sample_rate=RATE, fps=8.0)
    app = create_app(make_audio_runtime(ckpt), output_dir=tmp_path / "out", shutdown_timeout=0, poll_after_ms=20)
    with serving(app) as url:
        job = httpx.post(f"{url}/v1/videos", json={"prompt": "a horn", "omniloop": {"audio": {"seconds": 2.0}}},
                         timeout=T).json()
        deadline = time.monotonic() + T
        while job["status"] not in ("completed", "failed"):
            assert time.monotonic() < deadline
            time.sleep(0.02)
            job = httpx.get(f"{url}/v1/videos/{job['id']}", timeout=T).json()
        assert job["status"] == "completed", job
        data = httpx.get(f"{url}/v1/videos/{job['id']}/content", timeout=T).content
    with av.open(io.BytesIO(data)) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        assert a.codec_context.name == "aac" and a.sample_rate == RATE
        v_s, a_s = float(v.duration * v.time_base), float(a.duration * a.time_base)
    assert abs(v_s - 2.0) <= 1 / 8 and abs(a_s - v_s) <= 1 / 8
    rate, channels, _, x = decode(data)
    assert (rate, channels) == (RATE, CHANNELS) and abs(peak_hz(x, rate) - prompt_frequency("a horn")) < 2.0


def test_an_earlier_runs_audio_files_are_deleted_at_start(audio_ckpt: Path, tmp_path: Path) -> None:
    from omniloop_server import create_app

    folder = tmp_path / "out" / "audio"
    folder.mkdir(parents=True)
    ours, other = folder / f"{'ab' * 16}.wav", folder / "notes.wav"
    ours.write_bytes(b"x")
    other.write_bytes(b"x")
    create_app(make_audio_runtime(audio_ckpt), output_dir=tmp_path / "out")
    assert not ours.exists() and other.exists()  # only names this server makes


def test_hostile_audio_bodies_never_get_a_5xx(audio_server: str) -> None:
    """Bodies with the audio endpoints' field names and arbitrary values (and raw junk): a 200 with
    audio, or a 4xx in OpenAI's shape; never a 5xx."""
    from hypothesis import HealthCheck, example, given, settings
    from hypothesis import strategies as st

    from omniloop_server.body_schema import AudioGenerationCreate, SpeechCreate, fields_of

    names = sorted(fields_of(SpeechCreate) | fields_of(AudioGenerationCreate) | {"n", "extra"})
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-10, 10), st.floats(-1e6, 1e6, allow_nan=False),
                        st.sampled_from(["wav", "mp3", "pcm", "alloy", "", "1.5", "a bell", "../x"]), st.text(max_size=8))
    values = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(st.sampled_from(["audio", "diffusion",
                       "seconds", "steps"]), st.one_of(scalars, st.dictionaries(st.sampled_from(["seconds", "start",
                       "steps"]), scalars, max_size=2)), max_size=2))
    bodies = st.dictionaries(st.sampled_from(names), values, max_size=6)
    limits = {"seconds": 0.25}  # keep the 200s short
    statuses: dict[int, int] = {}

    with httpx.Client(base_url=audio_server, timeout=T) as client:
        @settings(max_examples=80, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @example(path="/v1/audio/speech", body={"response_format": "wav"}, raw=None, valid_base=True)
        @example(path="/v1/audio/generations", body={"seconds": -1}, raw=None, valid_base=True)
        @given(path=st.sampled_from(["/v1/audio/speech", "/v1/audio/generations"]), body=bodies,
               raw=st.one_of(st.none(), st.binary(max_size=40)), valid_base=st.booleans())
        def run(path: str, body: dict[str, Any], raw: bytes | None, valid_base: bool) -> None:
            if valid_base:  # a readable request underneath, so that some get through to compute
                base = {"input": "a bell", "voice": "alloy"} if path.endswith("speech") else {"prompt": "a bell"}
                body = {**base, "seconds": 0.25, **{k: v for k, v in body.items() if k not in ("input", "prompt")}}
            if isinstance(body.get("seconds"), (int, float)) and not isinstance(body["seconds"], bool):
                body = {**body, **limits}
            if raw is not None:
                r = client.post(path, content=raw, headers={"content-type": "application/json"})
            else:
                r = client.post(path, json=body)
            assert r.status_code < 500, (path, body, r.text)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code >= 400:
                assert r.json()["error"]["message"], r.text

        run()
    assert statuses.get(200, 0) > 0 and any(400 <= c < 500 for c in statuses), statuses
