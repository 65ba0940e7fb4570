"""Bit-exact parity with diffusers' ``StableAudioPipeline`` (CPU float32, ``torch.equal`` on the
final latents and on the waveforms) on two tiny checkpoints of different configurations.

* ``stereo`` (linear text projection, GQA cross-attention): a negative prompt and two waveforms per
  prompt (``diffusion.num_outputs: 2`` — samples seeded ``seed + i``, diffusers' list of
  generators), run through the step scheduler, which batches the two samples' steps and decodes as
  diffusers batches ``num_waveforms_per_prompt``; and the default call (no negative prompt: the
  zero negative embedding) on the serial scheduler.
* ``mono`` (identity projection, three blocks): a non-zero start second with an explicit length,
  and a start with the window's end left at the checkpoint's maximum, CFG off.

The math is the same op for op, so nothing but equality is accepted. (Why the two-waveform case runs
batched: the reference computes both waveforms in one forward, and CPU GEMM kernels round
differently for other row counts — a sample computed alone differs in the last bits, which the
SDE sampler then amplifies.)
"""

from __future__ import annotations

from typing import Any

import torch

from omniloop.request import Status

PROMPT = "a square wave playing three beats per second"
NEGATIVE = "low quality noise"


def _reference(pipe: Any, *, seed: int, steps: int, n: int = 1, negative: str | None = None, start: float = 0.0,
               seconds: float | None = None, guidance: float = 7.0) -> tuple[torch.Tensor, torch.Tensor]:
    kw: dict[str, Any] = {"prompt": PROMPT, "negative_prompt": negative, "num_inference_steps": steps,
                          "guidance_scale": guidance, "num_waveforms_per_prompt": n, "audio_start_in_s": start}
    if seconds is not None:
        kw["audio_end_in_s"] = start + seconds

    def gens() -> Any:  # one generator per waveform (seed + i); a single one for one waveform
        g = [torch.Generator().manual_seed(seed + i) for i in range(n)]
        return g if n > 1 else g[0]

    latents = pipe(**kw, generator=gens(), output_type="latent").audios
    audio = pipe(**kw, generator=gens()).audios
    return latents, audio


def _samples(out: Any) -> list[Any]:
    assert out.status is Status.COMPLETED, out.error
    return list(out.samples) if out.samples else [out]


def _assert_equal(outs: list[Any], latents: torch.Tensor, audio: torch.Tensor, rate: int) -> None:
    assert len(outs) == latents.shape[0] == audio.shape[0]
    for i, o in enumerate(outs):
        assert torch.equal(o.artifacts["latents"].tensor[0], latents[i]), f"sample {i}: latents differ"
        a = o.artifacts["audio"]
        assert a.samples.dtype == torch.float32 and a.sample_rate == rate
        assert a.samples.shape == audio[i].shape, (a.samples.shape, audio[i].shape)
        assert torch.equal(a.samples, audio[i]), f"sample {i}: waveform differs"


def test_negative_prompt_two_waveforms_bit_exact(runtime, reference, t2a):
    rt = runtime("stereo", step=True)
    out = rt.generate(t2a(seed=3, steps=5, negative=NEGATIVE, num_outputs=2))
    outs = _samples(out)
    assert [o.metrics["seed"] for o in outs] == [3, 4]
    latents, audio = _reference(reference("stereo"), seed=3, steps=5, n=2, negative=NEGATIVE)
    _assert_equal(outs, latents, audio, 400)
    assert tuple(outs[0].artifacts["audio"].samples.shape) == (2, 128)  # stereo, the whole 0.32 s
    batched = [d for d in rt.scheduler.trace if d.action == "batched_step" and set(d.request_ids) ==
               {o.request_id for o in outs}]
    assert len(batched) == 5 + 1  # every denoise step and the decode


def test_default_call_zero_negative_bit_exact(runtime, reference, t2a):
    out = runtime("stereo").generate(t2a(seed=7, steps=4))
    latents, audio = _reference(reference("stereo"), seed=7, steps=4)
    _assert_equal(_samples(out), latents, audio, 400)


def test_nonzero_start_bit_exact(runtime, reference, t2a):
    rt = runtime("mono")
    out = rt.generate(t2a(seed=5, steps=5, audio={"start": 0.1, "seconds": 0.2}))
    latents, audio = _reference(reference("mono"), seed=5, steps=5, start=0.1, seconds=0.2)
    _assert_equal(_samples(out), latents, audio, 256)
    assert tuple(out.artifacts["audio"].samples.shape) == (1, int(0.3 * 256) - int(0.1 * 256))  # diffusers' cut


def test_start_with_default_end_and_cfg_off_bit_exact(runtime, reference, t2a):
    out = runtime("mono").generate(t2a(seed=2, steps=4, negative=NEGATIVE, guidance_scale=1.0, audio={"start": 0.05}))
    latents, audio = _reference(reference("mono"), seed=2, steps=4, start=0.05, negative=NEGATIVE, guidance=1.0)
    _assert_equal(_samples(out), latents, audio, 256)
    assert any("negative prompt is not used" in w for w in out.metrics["warnings"])


def test_the_next_steps_noise_is_prefetched(tiny_ckpt, make_runtime, reference, t2a, monkeypatch):
    """Deploy ``options.noise_prefetch``: the Brownian-tree query of step i + 1 runs in a worker
    thread during step i (omniloop_stable_audio.noise); the scheduler takes it — and the result
    stays bit-exact."""
    from omniloop_stable_audio import noise

    taken: list[bool] = []
    real = noise.PrefetchedNoise.__call__

    def spy(self: Any, sigma: Any, sigma_next: Any) -> Any:
        taken.append(self.pending is not None and self.pending[0] == (float(sigma), float(sigma_next)))
        return real(self, sigma, sigma_next)

    monkeypatch.setattr(noise.PrefetchedNoise, "__call__", spy)
    out = make_runtime(tiny_ckpt(), options={"noise_prefetch": True}).generate(t2a(seed=9, steps=5, negative=NEGATIVE))
    assert taken == [True] * 4  # steps 2..5 (the sampler is made by the first step)
    latents, audio = _reference(reference("stereo"), seed=9, steps=5, negative=NEGATIVE)
    _assert_equal(_samples(out), latents, audio, 400)


def test_graph_and_prefetch_options_checked(tiny_ckpt, make_runtime):
    import pytest

    from omniloop.errors import DeployError

    with pytest.raises(DeployError, match=r"options\.cuda_graphs: CUDA graphs need a CUDA device"):
        make_runtime(tiny_ckpt(), options={"cuda_graphs": True})
    with pytest.raises(DeployError, match=r"options\.cuda_graphs: expected true or false"):
        make_runtime(tiny_ckpt(), options={"cuda_graphs": "yes"})
    with pytest.raises(DeployError, match=r"options\.noise_prefetch: expected true or false"):
        make_runtime(tiny_ckpt(), options={"noise_prefetch": 1})
    with pytest.raises(DeployError, match=r"options\.noise_prefetch: Stable Audio 3"):
        make_runtime(tiny_ckpt("sa3"), options={"noise_prefetch": True})
