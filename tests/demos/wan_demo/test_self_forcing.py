"""The causal student's Self-Forcing rollout (``omniloop_wan_demo_training.self_forcing``, issue 41):
without gradient it is the runtime's causal rollout (``Runtime.stream`` of the same transformer,
same seed and prompt: the same latents and frames, bit for bit on CPU float32), batched or not;
with gradient only each chunk's exit step carries it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omniloop.request import EventKind
from omniloop.runtime import Runtime
from omniloop.testing import make_manager
from omniloop_kit.causal import CausalOptions
from omniloop_wan import plugin as wan_plugin
from omniloop_wan.causal import CausalWan
from omniloop_wan.stages import encode_text, to_uint8_frames
from omniloop_wan_demo_training.self_forcing import BatchKV, SelfForcingRollout, causal_rollout, stream_noise

ROLLOUT = {"chunk_frames": 1, "steps": 3, "shift": 3.0}
FRAMES, CHUNKS = 9, 3  # 9 frames = 3 latent frames = 3 chunks of 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omniloop_wan.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("self-forcing") / "t2v", variant="t2v", scheduler="flow_euler")


@pytest.fixture(scope="module")
def rt(tiny: Path) -> Runtime:
    return Runtime.from_model(tiny, manager=make_manager(("wan", wan_plugin), toy=False),
                              options={"rollout": "causal", "rollout_options": ROLLOUT})


def _streamed(rt: Runtime, prompt: str, seed: int) -> torch.Tensor:
    req = {"task": "t2v", "prompt": prompt, "outputs": {"stream_partial": True},
           "diffusion": {"frames": FRAMES, "seed": seed, "height": 32, "width": 32, "guidance_scale": 1.0}}
    events = list(rt.stream(req))
    assert events[-1].kind is EventKind.FINAL and events[-1].output.ok
    return torch.cat([e.value.frames for e in events if e.kind is EventKind.PARTIAL])


def _text(rt: Runtime, prompt: str) -> torch.Tensor:
    c = rt.model.components
    return encode_text(c["tokenizer"], c["text_encoder"], prompt, torch.device("cpu"), torch.float32)[0]


def _frames(vae, latents: torch.Tensor) -> torch.Tensor:
    from omniloop_wan.causal import StreamingDecoder

    dec = StreamingDecoder(vae)
    return torch.cat([to_uint8_frames(dec.decode(latents[:, :, i:i + 1])) for i in range(latents.shape[2])])


def test_rollout_without_grad_is_the_runtime_stream(rt):
    comps = rt.model.components
    tf = comps["transformer"]
    opts = CausalOptions(**ROLLOUT)
    eng = CausalWan(tf, comps["vae"], options=opts, height=32, width=32)
    for prompt, seed in (("a red circle moving left", 0), ("a blue square moving up", 5)):
        text = _text(rt, prompt)
        noise = stream_noise([seed], CHUNKS, eng.chunk_shape())
        with torch.no_grad():
            got = causal_rollout(tf, noise, text, opts)
        stream = eng.open_stream(seed)
        want = torch.cat([o.latents for o in eng.run(stream, text, CHUNKS, decode=False)], dim=2)
        stream.free()
        assert torch.equal(got, want)  # the same ops in the same order: bit for bit
        assert torch.equal(_frames(comps["vae"], got), _streamed(rt, prompt, seed))
        # the callable the recipe takes, exit "last": the same clip
        with torch.no_grad():
            assert torch.equal(SelfForcingRollout(opts, exit="last")(tf, noise, text, torch.Generator()), got)


def test_fresh_rollout_with_seeds_is_the_runtime_stream_with_the_fresh_sampler(tiny):
    """``renoise="fresh"`` given each stream's seed draws the runtime's own step noise
    (``omniloop_kit.causal.step_noise``): the training rollout equals ``Runtime.stream`` deployed
    with ``rollout_options.sampler: "fresh"``, bit for bit (latents and frames); the rollout
    follows ``options.sampler`` when ``renoise`` is not given."""
    rt = Runtime.from_model(tiny, manager=make_manager(("wan", wan_plugin), toy=False),
                            options={"rollout": "causal", "rollout_options": {**ROLLOUT, "sampler": "fresh"}})
    comps = rt.model.components
    tf = comps["transformer"]
    opts = CausalOptions(**ROLLOUT, sampler="fresh")
    eng = CausalWan(tf, comps["vae"], options=opts, height=32, width=32)
    for prompt, seed in (("a red circle moving left", 0), ("a blue square moving up", 5)):
        text = _text(rt, prompt)
        noise = stream_noise([seed], CHUNKS, eng.chunk_shape())
        with torch.no_grad():
            got = causal_rollout(tf, noise, text, opts, seeds=[seed])
            assert torch.equal(causal_rollout(tf, noise, text, CausalOptions(**ROLLOUT), renoise="fresh", seeds=[seed]),
                               got)
            assert not torch.allclose(got, causal_rollout(tf, noise, text, CausalOptions(**ROLLOUT)), atol=1e-4)
        stream = eng.open_stream(seed)
        want = torch.cat([o.latents for o in eng.run(stream, text, CHUNKS, decode=False)], dim=2)
        stream.free()
        assert torch.equal(got, want)
        assert torch.equal(_frames(comps["vae"], got), _streamed(rt, prompt, seed))
    # a batch: each stream's own seed (matmul blocking may round differently, as in the batch test)
    texts = torch.cat([_text(rt, "a red circle moving left"), _text(rt, "a green star moving down")])
    noise = stream_noise([1, 2], CHUNKS, eng.chunk_shape())
    with torch.no_grad():
        both = causal_rollout(tf, noise, texts, opts, seeds=[1, 2])
        for i, sd in enumerate((1, 2)):
            torch.testing.assert_close(both[i:i + 1], causal_rollout(tf, noise[i:i + 1], texts[i:i + 1], opts, seeds=[sd]),
                                       atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="seeds"):
        causal_rollout(tf, noise, texts, opts, seeds=[1])


def test_a_batch_rolls_out_each_stream(rt):
    """Two streams in one batch == each alone. Batched matmuls may round differently on CPU
    (another blocking), so 1e-5 (float32, a 2-block model over 3 chunks x 3 steps)."""
    comps = rt.model.components
    tf = comps["transformer"]
    opts = CausalOptions(**ROLLOUT)
    shape = (1, 16, 1, 4, 4)
    texts = [_text(rt, "a red circle moving left"), _text(rt, "a green star moving down")]
    noise = stream_noise([1, 2], CHUNKS, shape)
    with torch.no_grad():
        both = causal_rollout(tf, noise, torch.cat(texts), opts)
        for i in range(2):
            torch.testing.assert_close(both[i:i + 1], causal_rollout(tf, noise[i:i + 1], texts[i], opts),
                                       atol=1e-5, rtol=1e-5)


def test_gradient_only_through_the_exit_steps(rt):
    import copy

    tf = copy.deepcopy(rt.model.components["transformer"]).requires_grad_(True)  # the runtime's is frozen
    opts = CausalOptions(**ROLLOUT)
    text = _text(rt, "a red circle moving left")
    noise = stream_noise([0], CHUNKS, (1, 16, 1, 4, 4)).requires_grad_(True)
    x0 = causal_rollout(tf, noise, text, opts, exits=[0, 2, 1])
    assert x0.requires_grad and x0.shape == noise.shape
    # a chunk's output depends on its noise only through no-grad steps unless its exit is step 0;
    # the earlier chunks reach it only through detached keys/values
    (g,) = torch.autograd.grad(x0[:, :, 1].sum(), noise, retain_graph=True)
    assert torch.count_nonzero(g) == 0
    (g,) = torch.autograd.grad(x0[:, :, 0].sum(), noise, retain_graph=True)
    assert torch.count_nonzero(g[:, :, 0]) > 0 and torch.count_nonzero(g[:, :, 1:]) == 0
    x0.square().mean().backward()
    assert all(p.grad is not None and torch.count_nonzero(p.grad) > 0 for p in tf.blocks[0].attn1.parameters())
    # the x0 prediction at an earlier exit differs from the full rollout's chunk
    with torch.no_grad():
        full = causal_rollout(tf, noise.detach(), text, opts)
    assert not torch.allclose(x0[:, :, 0].detach(), full[:, :, 0])


def test_fresh_renoise_is_dmd2s_few_step_sampler(rt):
    """``renoise="fresh"``: between a chunk's steps the x0 prediction ``x - s v`` is re-noised to
    ``s'`` with fresh noise from the generator, ``(1 - s') x0 + s' n`` (DMD2's sampler), written
    out here by hand for one chunk of 2 steps; ``"euler"`` (the default) stays the runtime's."""
    from omniloop_wan.causal import chunk_forward

    tf = rt.model.components["transformer"]
    opts = CausalOptions(chunk_frames=1, steps=2, shift=3.0)
    text = _text(rt, "a red circle moving left")
    noise = stream_noise([3], 1, (1, 16, 1, 4, 4))
    s0, s1, _ = opts.sigmas()

    def t(s: float) -> torch.Tensor:
        return torch.full((1,), s * 1000.0)

    with torch.no_grad():
        got = causal_rollout(tf, noise, text, opts, renoise="fresh", generator=torch.Generator().manual_seed(7))
        fresh = torch.randn(noise.shape, generator=torch.Generator().manual_seed(7))
        x = (1.0 - s1) * (noise - s0 * chunk_forward(tf, noise, t(s0), text, 0)) + s1 * fresh
        want = x - s1 * chunk_forward(tf, x, t(s1), text, 0)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        assert not torch.allclose(got, causal_rollout(tf, noise, text, opts))
        # the same generator state, the same clip; the callable passes its generator on
        r = SelfForcingRollout(opts, exit="last", renoise="fresh")
        assert torch.equal(r(tf, noise, text, torch.Generator().manual_seed(7)), got)
        # one step per chunk: nothing to re-noise, the runtime's rollout
        one = CausalOptions(chunk_frames=1, steps=1, shift=3.0)
        assert torch.equal(causal_rollout(tf, noise, text, one, renoise="fresh", generator=torch.Generator()),
                           causal_rollout(tf, noise, text, one))
    with pytest.raises(ValueError, match="renoise"):
        causal_rollout(tf, noise, text, opts, renoise="ddim")
    with pytest.raises(ValueError, match="renoise"):
        SelfForcingRollout(opts, renoise="ddim")


def test_random_exits_come_from_the_generator():
    r = SelfForcingRollout(CausalOptions(**ROLLOUT))
    a = r.exits(50, torch.Generator().manual_seed(0))
    assert a == r.exits(50, torch.Generator().manual_seed(0)) and set(a) == {0, 1, 2}
    assert SelfForcingRollout(CausalOptions(**ROLLOUT), exit="last").exits(4, None) == [2] * 4
    with pytest.raises(ValueError, match="exit"):
        SelfForcingRollout(CausalOptions(**ROLLOUT), exit="first")


def test_bad_inputs_are_refused(rt):
    tf = rt.model.components["transformer"]
    text = torch.zeros(1, 4, tf.config.text_dim)
    with pytest.raises(ValueError, match="whole chunks"):
        causal_rollout(tf, torch.zeros(1, 16, 3, 4, 4), text, CausalOptions(chunk_frames=2, steps=2))
    with pytest.raises(ValueError, match="exits"):
        causal_rollout(tf, torch.zeros(1, 16, 2, 4, 4), text, CausalOptions(chunk_frames=1, steps=2), exits=[0, 2])


def test_batch_kv_window_and_sink():
    kv = BatchKV(window=2, sink=1)
    for i in range(4):
        assert kv.visible() == {0: [], 1: [0], 2: [0, 1], 3: [0, 2]}[i]
        kv.record(0, torch.full((1, 2, 1, 1), float(i)), torch.zeros(1, 2, 1, 1))
        kv.commit()
    with pytest.raises(RuntimeError, match="commit"):
        kv.commit()


def test_parallel_streaming_generator_gives_the_same_clips(tiny):
    """bench/adherence.py --workers: clips made in worker processes come back in order, the same
    as one process's (uint8 frames; at most 1 level apart where thread counts round differently)."""
    import numpy as np

    from omniloop_wan_demo.evaluate import ParallelStreamingGenerator, StreamingRuntimeGenerator

    opts = {"rollout": "causal", "rollout_options": ROLLOUT}
    prompts, seeds = ["a red circle moving left", "a blue square moving up", "a green star moving down"], [0, 1, 2]
    kw = dict(frames=FRAMES, height=32, width=32)
    one = StreamingRuntimeGenerator(str(tiny), options=opts, **kw)(prompts, seeds, steps=2, guidance_scale=1.0)
    par = ParallelStreamingGenerator(str(tiny), workers=2, options=opts, per_task=2, **kw)
    try:
        got = par(prompts, seeds, steps=2, guidance_scale=1.0)
    finally:
        par.close()
    assert len(got) == 3 and len(par.timings) == 3
    for a, b in zip(one, got, strict=True):
        assert a.shape == b.shape == (FRAMES, 32, 32, 3)
        assert np.abs(a.astype(int) - b.astype(int)).max() <= 1
    with pytest.raises(ValueError, match="workers"):
        ParallelStreamingGenerator(str(tiny), workers=0)
