"""Batched denoise steps across LTX-2 requests through the ``step`` scheduler.

Three requests of one shape — different prompts, seeds, a negative prompt or none, different video
and audio guidance scales — are streamed side by side; the step scheduler co-batches their steps:
each guidance pass (CFG pair, STG, modality isolation) is ONE transformer call over all their rows,
then each request combines with its own scales and steps its own two schedulers.

Tolerance: the batched results equal each request run alone within ``BATCHED_ATOL`` on both final
latent streams. Measured (tiny ``a``, CPU, 1 thread, 3 steps all batched): max |Δ| video latents
3.0e-6, 2.4e-6, 2.6e-6; audio latents 1.7e-6, 2.1e-6, 4.8e-6. Not bit-exact: stacking changes the row count of every GEMM, and CPU kernels round
differently for other shapes.
"""

from __future__ import annotations

from typing import Any

import torch

from omniloop.request import Status
from omniloop.testing import check_streamed_together, stream_together

BATCHED_ATOL = 2e-5


def test_batched_steps_equal_each_request_alone(runtime: Any, t2v: Any) -> None:
    reqs = [
        {**t2v(seed=11, negative="blurry", audio={"guidance": 5.0}), "request_id": "one", "diffusion": {"seed": 11, "frames": 5, "steps": 3}},
        {**t2v(seed=12, prompt="a cat at night"), "request_id": "two", "diffusion": {"seed": 12, "frames": 5, "steps": 3}},
        {**t2v(seed=13, prompt="a city", node_params={"denoise": {"stg": 0.5, "rescale": 0.2}}), "request_id": "three",
         "diffusion": {"seed": 13, "frames": 5, "steps": 3, "guidance_scale": 4.0}},
    ]
    for out, a in check_streamed_together(runtime("a"), runtime("a", step=True), reqs, min_batched=3):
        for key in ("latents", "audio_latents"):
            torch.testing.assert_close(out.artifacts[key].tensor, a.artifacts[key].tensor, atol=BATCHED_ATOL, rtol=0)
        assert out.metrics["denoise"]["transformer_calls"] == 9


def test_different_passes_do_not_batch_together(runtime: Any, t2v: Any) -> None:
    rt = runtime("a", step=True)
    reqs = [{**t2v(seed=1), "request_id": "all", "diffusion": {"seed": 1, "frames": 5, "steps": 2}},
            {**t2v(seed=2, node_params={"denoise": {"modality": 1.0}}, audio={"modality": 1.0}), "request_id": "no-mod",
             "diffusion": {"seed": 2, "frames": 5, "steps": 2}}]
    finals = stream_together(rt, reqs)
    assert all(o.status is Status.COMPLETED for o in finals.values())
    assert finals["no-mod"].metrics["denoise"]["passes"] == ["cfg", "stg"]
    mixed = [d for d in rt.scheduler.trace if d.action == "batched_step" and set(d.request_ids) == {"all", "no-mod"}]
    assert not mixed


def test_compiled_blocks_match_eager(tiny_ckpt: Any, make_runtime: Any, runtime: Any, t2v: Any) -> None:
    """Deploy ``compile: true`` (dynamo tracing, ``compile_backend: eager``: no code generation on
    CPU) runs each transformer block compiled — the STG block of this perturbed-attention model
    eager — with the same results as the eager model."""
    rt = make_runtime(tiny_ckpt("a"), compile=True, options={"compile_backend": "eager"})
    req = t2v(seed=4, frames=5)
    out, ref = rt.generate(req), runtime("a").generate(req)
    assert out.status is Status.COMPLETED, out.error
    assert out.metrics["denoise"]["compiled_blocks"] is True
    for key in ("latents", "audio_latents"):
        assert torch.equal(out.artifacts[key].tensor, ref.artifacts[key].tensor)


def test_batched_i2v_steps_equal_each_request_alone(runtime: Any, t2v: Any, tmp_path: Any) -> None:
    """i2v requests (the first frame kept at timestep 0) batch with each other, not with t2v ones."""
    import numpy as np
    from PIL import Image

    Image.fromarray(np.random.default_rng(1).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(tmp_path / "f.png")
    image = [{"type": "image", "path": str(tmp_path / "f.png")}]
    reqs = [{**t2v(seed=21, audio={"guidance": 3.0}), "task": "i2v", "inputs": image, "request_id": "i1"},
            {**t2v(seed=22, prompt="a city"), "task": "i2v", "inputs": image, "request_id": "i2"},
            {**t2v(seed=23), "request_id": "t"}]
    for r in reqs:
        r["diffusion"]["steps"] = 2
    alone = [runtime("a").generate(r) for r in reqs]
    rt = runtime("a", step=True)
    finals = stream_together(rt, reqs)
    pairs = [set(d.request_ids) for d in rt.scheduler.trace if d.action == "batched_step"]
    assert {"i1", "i2"} in pairs and not any("t" in p and len(p) > 1 for p in pairs), pairs
    for a, req in zip(alone, reqs, strict=True):
        out = finals[req["request_id"]]
        assert out.status is Status.COMPLETED, out.error
        for key in ("latents", "audio_latents"):
            torch.testing.assert_close(out.artifacts[key].tensor, a.artifacts[key].tensor, atol=BATCHED_ATOL, rtol=0)
