"""The step scheduler batches equal-shape Cosmos 3 requests: one gen-pathway forward per CFG
branch over every request (the text K/V of each gathered from the pool), each request then
combining with its own guidance scale and stepping its own UniPC instance. A batched request
equals the same request alone within 2e-5 (a batched GEMM rounds differently in the last bits;
``exact`` requests are never batched)."""

from __future__ import annotations

import torch

from omniloop.request import Status
from omniloop.testing import stream_together


def _run_together(rt, reqs):
    finals = stream_together(rt, reqs)
    outs = [finals[r["request_id"]] for r in reqs]
    assert all(o.status is Status.COMPLETED for o in outs), [o.error for o in outs]
    return outs


def test_batched_equals_alone(runtime, t2v):
    step = runtime("qwen", step=True)
    reqs = [{**t2v(seed=11, steps=3, guidance_scale=6.0), "request_id": "b1"},
            {**t2v(seed=12, steps=3, guidance_scale=4.0), "request_id": "b2"},
            {**t2v(seed=13, steps=3, guidance_scale=6.0), "request_id": "b3"}]
    outs = _run_together(step, reqs)
    batched = [d for d in step.scheduler.trace if d.action == "batched_step" and len(d.request_ids) == 3]
    assert len(batched) == 3, [(d.action, d.request_ids) for d in step.scheduler.trace]  # every denoise step
    alone = runtime("qwen")
    for req, out in zip(reqs, outs, strict=True):
        ref = alone.generate(req).artifacts["latents"].tensor
        got = out.artifacts["latents"].tensor
        assert torch.allclose(got, ref, rtol=0, atol=2e-5), (got - ref).abs().max()


def test_exact_requests_not_batched(runtime, t2v):
    step = runtime("qwen", step=True)
    reqs = [{**t2v(seed=21, steps=2), "exact": True, "request_id": "e1"},
            {**t2v(seed=22, steps=2), "exact": True, "request_id": "e2"}]
    outs = _run_together(step, reqs)
    ids = {"e1", "e2"}
    assert not [d for d in step.scheduler.trace if d.action == "batched_step" and set(d.request_ids) & ids]
    alone = runtime("qwen")
    for req, out in zip(reqs, outs, strict=True):
        assert torch.equal(out.artifacts["latents"].tensor, alone.generate(req).artifacts["latents"].tensor)


def test_sound_and_action_requests_batch_too(runtime, t2v, tmp_path):
    import numpy as np
    from PIL import Image

    step = runtime("qwen", step=True)
    sound = [{**t2v(seed=31 + i, steps=2), "audio": {"enabled": True}, "request_id": f"s{i}"} for i in range(2)]
    path = tmp_path / "frame.png"
    Image.fromarray(np.random.default_rng(5).integers(0, 256, size=(60, 90, 3), dtype=np.uint8)).save(path)
    act = [{"task": "i2v", "prompt": "pick up the cup", "inputs": [{"type": "image", "path": str(path)}],
            "action": {"mode": "policy", "chunk_size": 4, "domain": "bridge_orig_lerobot", "resolution_tier": 256},
            "diffusion": {"seed": 41 + i, "steps": 2}, "outputs": {"return_latents": True}, "request_id": f"a{i}"}
           for i in range(2)]
    outs = _run_together(step, sound + act)
    for ids in ({"s0", "s1"}, {"a0", "a1"}):
        assert [d for d in step.scheduler.trace if d.action == "batched_step" and set(d.request_ids) == ids]
    alone = runtime("qwen")
    for req, out in zip(sound + act, outs, strict=True):
        ref = alone.generate(req)
        for key in ("latents", "sound_latents"):
            if key in ref.artifacts:
                assert torch.allclose(out.artifacts[key].tensor, ref.artifacts[key].tensor, rtol=0, atol=2e-5)
        if "action" in ref.artifacts:
            assert torch.allclose(out.artifacts["action"].values, ref.artifacts["action"].values, rtol=0, atol=2e-5)
