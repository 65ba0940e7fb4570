"""Stable Audio 3 (diffusers' ``StableAudio3Pipeline``) in the same family: the variant read from
``model_index.json``, bit-exact parity (CPU float32, ``torch.equal`` on the final latents and the
waveforms) on two tiny checkpoints of different configurations, batched equals alone, refusals.

* ``sa3`` (stereo, differential attention, memory tokens, the distilled checkpoint's stochastic
  ping-pong scheduler): a negative prompt with CFG and two waveforms per prompt (through the step
  scheduler, which batches the two samples as diffusers batches ``num_waveforms_per_prompt``; each
  sample's re-noise comes from its own generator, diffusers' list of generators), and the default
  call (guidance off, the checkpoint's default length).
* ``sa3-base`` (mono, plain attention, no memory tokens, DiT patch size 2, deterministic Euler):
  CFG with diffusers' default empty negative prompt.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omniloop.errors import DeployError, RequestError
from omniloop.request import Status
from omniloop.testing import completed_latents

PROMPT = "a square wave playing three beats per second"
NEGATIVE = "low quality noise"
BATCHED_ATOL = 2e-5


def _reference(pipe: Any, *, seed: int, steps: int, seconds: float, n: int = 1, negative: str | None = None,
               guidance: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    kw: dict[str, Any] = {"prompt": PROMPT, "negative_prompt": negative, "num_inference_steps": steps,
                          "guidance_scale": guidance, "num_waveforms_per_prompt": n, "duration": seconds}

    def gens() -> Any:  # one generator per waveform (seed + i); a single one for one waveform
        g = [torch.Generator().manual_seed(seed + i) for i in range(n)]
        return g if n > 1 else g[0]

    return pipe(**kw, generator=gens(), output_type="latent").audios, pipe(**kw, generator=gens()).audios


def _check(outs: list[Any], latents: torch.Tensor, audio: torch.Tensor, rate: int) -> None:
    assert len(outs) == latents.shape[0] == audio.shape[0]
    for i, o in enumerate(outs):
        assert o.status is Status.COMPLETED, o.error
        assert torch.equal(o.artifacts["latents"].tensor[0], latents[i]), f"sample {i}: latents differ"
        a = o.artifacts["audio"]
        assert a.sample_rate == rate and a.samples.shape == audio[i].shape, (a.samples.shape, audio[i].shape)
        assert torch.equal(a.samples, audio[i]), f"sample {i}: waveform differs"


def test_variant_from_model_index(runtime):
    cfg = runtime("sa3").model.config
    assert cfg["pipeline"] == "StableAudio3Pipeline" and cfg["stochastic"] is True
    assert runtime("sa3-base").model.config["stochastic"] is False
    assert runtime("stereo").model.config["pipeline"] == "StableAudioPipeline"


def test_negative_prompt_two_waveforms_bit_exact(runtime, reference, t2a):
    rt = runtime("sa3", step=True)
    out = rt.generate(t2a(seed=3, steps=4, negative=NEGATIVE, num_outputs=2, guidance_scale=3.0,
                          audio={"seconds": 0.3}))
    outs = list(out.samples)
    assert [o.metrics["seed"] for o in outs] == [3, 4]
    latents, audio = _reference(reference("sa3"), seed=3, steps=4, seconds=0.3, n=2, negative=NEGATIVE, guidance=3.0)
    _check(outs, latents, audio, 256)
    assert tuple(outs[0].artifacts["audio"].samples.shape) == (2, int(0.3 * 256))  # stereo, diffusers' cut
    batched = [d for d in rt.scheduler.trace if d.action == "batched_step" and set(d.request_ids) ==
               {o.request_id for o in outs}]
    assert len(batched) == 4 + 1  # every denoise step and the decode


def test_default_call_bit_exact(runtime, reference):
    rt = runtime("sa3")
    out = rt.generate({"task": "t2a", "prompt": PROMPT, "diffusion": {"seed": 7}, "outputs": {"return_latents": True}})
    assert out.metrics["steps"] >= 4
    latents, audio = _reference(reference("sa3"), seed=7, steps=4, seconds=0.25)  # omniloop.json: 4 steps, 0.25 s
    _check([out], latents, audio, 256)
    assert rt.model.config["defaults"]["guidance_scale"] == 1.0  # diffusers': CFG off (distilled)


def test_base_euler_cfg_empty_negative_bit_exact(runtime, reference, t2a):
    out = runtime("sa3-base").generate(t2a(seed=5, steps=5, guidance_scale=4.0, audio={"seconds": 0.32}))
    latents, audio = _reference(reference("sa3-base"), seed=5, steps=5, seconds=0.32, guidance=4.0)
    _check([out], latents, audio, 200)
    assert out.artifacts["audio"].samples.abs().max() <= 1.0  # clamped, as diffusers does


@pytest.mark.slow
def test_batched_steps_equal_each_request_alone(runtime, t2a):
    reqs = [
        {**t2a(seed=11, steps=4, negative="noise", guidance_scale=3.0, audio={"seconds": 0.3}), "request_id": "one"},
        {**t2a(seed=12, steps=4, prompt="a sine tone", guidance_scale=2.0, audio={"seconds": 0.3}), "request_id": "two"},
        {**t2a(seed=13, steps=4, prompt="a drum", guidance_scale=5.0, audio={"seconds": 0.29}), "request_id": "three"},
    ]
    alone = [runtime("sa3").generate(r) for r in reqs]
    from omniloop.testing import advance_in_lockstep

    outs, batched = advance_in_lockstep(runtime("sa3"), reqs)  # 0.3 s and 0.29 s: the same 10 latent frames
    assert batched >= 4
    for o, a in zip(outs, alone, strict=True):
        assert o.status is Status.COMPLETED, o.error
        torch.testing.assert_close(completed_latents(o), completed_latents(a), atol=BATCHED_ATOL, rtol=0)
        torch.testing.assert_close(o.artifacts["audio"].samples, a.artifacts["audio"].samples, atol=1e-4, rtol=0)


def test_other_lengths_do_not_batch(runtime, t2a):
    rt = runtime("sa3")
    exes = [rt.prepare(t2a(seed=1, steps=2, audio={"seconds": s})) for s in (0.3, 0.5)]
    while not all(e.current_node is not None and e.current_node.name == "denoise" for e in exes):
        for e in exes:
            if e.current_node is None or e.current_node.name != "denoise":
                e.advance()
    keys = [e.batch_key() for e in exes]
    assert keys[0] is not None and keys[1] is not None and keys[0] != keys[1]
    for e in exes:
        while not e.done:
            e.advance()


@pytest.mark.parametrize(("variant", "audio", "path", "words"), [
    ("sa3", {"start": 0.1, "seconds": 0.2}, "audio.start", "from 0 s"),
    ("sa3", {"seconds": 2.5}, "audio.seconds", "[0, 2]"),
    ("sa3", {"seconds": 0.0}, "audio.seconds", ""),
    ("sa3-base", {"seconds": 0.05}, "audio.seconds", "[0.1, 1]"),
    ("sa3-base", {"seconds": 0.3}, "audio.seconds", "patch size 2"),  # 15 latent frames
])
def test_bad_windows_refused_before_compute(runtime, t2a, variant, audio, path, words):
    with pytest.raises(RequestError) as err:
        runtime(variant).prepare(t2a(audio=audio))
    assert err.value.path == path and words in str(err.value), str(err.value)


def test_attention_backend_other_than_sdpa_refused(tiny_ckpt, make_runtime):
    from omniloop.family import AttentionBackendSpec
    from omniloop.hookspecs import hookimpl

    class Plugin:
        OMNILOOP_HOOK_API = ">=1.0,<2"

        @hookimpl
        def omniloop_register_attention_backends(self, register: Any) -> None:
            register(AttentionBackendSpec(name="counting", fn=torch.nn.functional.scaled_dot_product_attention))

    with pytest.raises(DeployError, match="attention_backend: 'counting'"):
        make_runtime(tiny_ckpt("sa3"), ("counting", Plugin()), attention_backend="counting")


def test_failing_row_fails_alone_in_a_batched_step(runtime, t2a):
    """``step_batch_retry_alone``: a request whose row breaks every forward it is in fails with its
    error; its batch-mates complete as they do alone."""
    from omniloop.testing import check_fails_alone, forward_rows
    from omniloop_stable_audio.sa3 import Denoise

    rt = runtime("sa3")
    normal = [{**t2a(seed=11 + i, steps=3, prompt=p, audio={"seconds": 0.3}), "request_id": f"n{i}"}
              for i, p in enumerate(["a drum", "a sine tone"])]
    poison = {**t2a(seed=99, steps=3, prompt="a saw wave", audio={"seconds": 0.3}), "request_id": "poison"}
    with forward_rows(Denoise, "encoder_hidden_states") as rows:
        rt.generate(poison)
    check_fails_alone(rt, Denoise, "encoder_hidden_states", rows[:1], normal, poison, BATCHED_ATOL)


def test_conformance_kit(runtime):
    from omniloop.testing.conformance import check_family

    check_family(lambda: runtime("sa3"), {"task": "t2a", "prompt": "a drum", "diffusion": {"steps": 2}}, output="audio")


def test_fbcache_on_the_dit_blocks(tiny_ckpt, make_runtime, t2a):
    import omniloop_fbcache.plugin as fbcache_plugin

    plain = make_runtime(tiny_ckpt("sa3-base"))
    cached = make_runtime(tiny_ckpt("sa3-base"), ("fbcache", fbcache_plugin),
                          plugins={"fbcache": {"threshold": 0.5, "warmup_steps": 1}})
    req = t2a(steps=8, guidance_scale=3.0, audio={"seconds": 0.32})
    baseline = completed_latents(plain.generate(req))
    out = cached.generate(req)
    hits = sum(m["num_cached_steps"] for m in out.metrics["plugins"]["fbcache"].values())
    assert hits > 0 and not torch.equal(completed_latents(out), baseline)
    off = cached.generate({**req, "plugin_params": {"fbcache": {"threshold": 0.0}}})
    assert torch.equal(completed_latents(off), baseline)  # every block computed: exactly the baseline


def test_compiled_blocks_equal_eager(tiny_ckpt, make_runtime, t2a):
    eager = make_runtime(tiny_ckpt("sa3"))
    comp = make_runtime(tiny_ckpt("sa3"), compile=True, options={"compile_backend": "eager"})
    out = comp.generate(t2a(steps=2))
    assert out.metrics["denoise"]["compiled_blocks"] is True
    assert torch.equal(completed_latents(out), completed_latents(eager.generate(t2a(steps=2))))


def test_bad_checkpoints_named(tiny_ckpt, tmp_path, make_runtime):
    import json
    import shutil
    from pathlib import Path

    from omniloop.errors import CheckpointError

    def set_json(path: Path, **values: Any) -> None:
        path.write_text(json.dumps({**json.loads(path.read_text()), **values}))

    cases = [
        (lambda c: set_json(c / "vae" / "config.json", latent_dim=5), "latent_dim=5 but the transformer takes io_channels=8"),
        (lambda c: set_json(c / "duration_embedder" / "config.json", output_dim=7), "output_dim=7"),
        (lambda c: set_json(c / "duration_embedder" / "config.json", max_val=-1.0), "min_val/max_val"),
        (lambda c: set_json(c / "scheduler" / "scheduler_config.json", _class_name="DDIMScheduler"),
         "for Stable Audio 3"),
        (lambda c: set_json(c / "model_index.json", duration_embedder=[None, None]), "'duration_embedder' is not declared"),
        (lambda c: set_json(c / "omniloop.json", defaults={"shift": 3}), "defaults.shift is not a StableAudio3Pipeline"),
    ]
    for i, (edit, words) in enumerate(cases):
        ckpt = tmp_path / f"bad{i}"
        shutil.copytree(tiny_ckpt("sa3"), ckpt)
        edit(ckpt)
        with pytest.raises(CheckpointError) as err:
            make_runtime(ckpt)
        assert words in str(err.value), str(err.value)
