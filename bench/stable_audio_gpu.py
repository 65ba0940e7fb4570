"""Stable Audio Open on one GPU: omniloop's stable-audio family beside diffusers eager and diffusers + torch.compile.

Random weights, the real DiT (timing does not depend on the values), built in-process: diffusers'
``StableAudioDiTModel`` at Stable Audio Open 1.0's configuration (24 blocks, 24 heads of 64, 12
key/value heads, 64 latent channels, ``sample_size`` 1024 → 47.55 s of stereo at 44.1 kHz;
1.06 B parameters), the ``StableAudioProjectionModel`` (768 → 768, seconds 0..512), a 2-layer
T5 of width 768 (128 tokens: the text context's shape is Stable Audio Open's, its depth is not)
and an ``AutoencoderOobleck`` with the released hop (2048) but a narrow decoder (decoding is not
what is compared). ``CosineDPMSolverMultistepScheduler`` (SDE, torchsde Brownian tree), CFG 7 with
a negative prompt (uncond and cond rows in one forward of two), bf16, the full 47.55 s window.

Sides (``--only`` picks any):

==========================  ==========================================================================
``diffusers``               ``StableAudioPipeline`` eager
``diffusers-compile``       same pipeline, ``torch.compile(transformer, fullgraph=True)`` (whole model)
``diffusers-compile-cg``    same, ``mode="reduce-overhead"`` (inductor's CUDA graphs over the whole model)
``omniloop``                the stable-audio family eager (our outer forward, blocks via run_blocks)
``omniloop-compile``        + deploy ``compile: true`` (each block ``torch.compile(fullgraph=True)``)
``omniloop-cudnn-compile``  + attention backend ``sdpa-cudnn`` (omniloop-attention)
``omniloop-compile-cg``     ``omniloop-compile`` with ``options.compile_mode: reduce-overhead`` (each
                            compiled block replayed as a CUDA graph)
``omniloop-graph``          ``omniloop`` with ``options.cuda_graphs: true`` (the whole DiT forward one
                            CUDA graph replay; eager blocks)
``omniloop-compile-graph``  ``omniloop-compile`` + ``options.cuda_graphs: true`` (the compiled blocks
                            inside the one captured forward)
``...-prefetch``            any omniloop side + ``options.noise_prefetch: true`` (the next step's
                            Brownian-tree noise computed in a worker thread while the DiT runs)
==========================  ==========================================================================

``--breakdown`` also times, on its own, the scheduler's Brownian-tree noise query (20 queries at
the bench's shape, synchronised) and one DiT forward of the ``omniloop-compile`` side (host time to
launch it and time to finish it). Besides the comparison with
diffusers eager, each side's final latents are compared with ``omniloop``'s (``..._vs_omniloop``):
a CUDA graph replays the kernels it captured, so ``omniloop-graph`` should equal ``omniloop``.

Per side: seconds per denoise step (median over steps 1..N-1 of every measured run; diffusers'
steps are marked by its ``callback`` after a ``torch.cuda.synchronize()``, omniloop's after each
denoise unit), end-to-end seconds (prompt to waveform), warm-up seconds (compilation), peak memory,
and the final latents' relative RMS difference to diffusers eager. Runs are interleaved (every
other round reversed) after one warm-up run per side. JSON to ``--out`` (default ``$OUT`` or
``bench/results/``) after every phase.

    python bench/stable_audio_gpu.py                 # on the H200
    python bench/stable_audio_gpu.py --smoke         # tiny configs on a CPU, compile backend 'eager'
"""

from __future__ import annotations

import datetime as dt
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _repo_paths

_repo_paths.add_repo_packages()

from _common import command_line, library_versions, machine, rel_rms, step_times, sync  # noqa: E402
from _sides import (  # noqa: E402
    build_sides,
    copy_if_room,
    finish,
    measure,
    omniloop_options,
    omniloop_run,
    parser,
    saver,
    setting,
    warm_up,
)
from _sides import summarize as summarize_sides  # noqa: E402

PROMPT = "the sound of a hammer hitting a wooden surface, 120 bpm"
NEGATIVE = "low quality, noise"
GUIDANCE = 7.0
SEED = 42

#: stabilityai/stable-audio-open-1.0 transformer/config.json
SAO_DIT = dict(sample_size=1024, in_channels=64, num_layers=24, attention_head_dim=64, num_attention_heads=24,
               num_key_value_attention_heads=12, out_channels=64, cross_attention_dim=768, time_proj_dim=256,
               global_states_input_dim=1536, cross_attention_input_dim=768)
SAO_PROJECTION = dict(text_encoder_dim=768, conditioning_dim=768, min_value=0, max_value=512)
T5 = dict(d_model=768, d_kv=64, d_ff=3072, num_layers=2, num_heads=12, relative_attention_num_buckets=32,
          relative_attention_max_distance=128, feed_forward_proj="relu", pad_token_id=0, eos_token_id=1,
          decoder_start_token_id=0)
VAE = dict(encoder_hidden_size=128, downsampling_ratios=[2, 4, 4, 8, 8], channel_multiples=[1, 2, 4, 8, 16],
           decoder_channels=16, decoder_input_channels=64, audio_channels=2, sampling_rate=44100)

OMNILOOP_SIDES = ("omniloop", "omniloop-compile", "omniloop-cudnn-compile", "omniloop-compile-cg", "omniloop-graph",
                  "omniloop-compile-graph")
SIDES = ("diffusers", "diffusers-compile", "diffusers-compile-cg", *OMNILOOP_SIDES, *(f"{s}-prefetch" for s in OMNILOOP_SIDES))


def build_components(device: torch.device, dtype: torch.dtype, smoke: bool) -> dict[str, Any]:
    from diffusers import AutoencoderOobleck, CosineDPMSolverMultistepScheduler, StableAudioDiTModel
    from diffusers.pipelines.stable_audio import StableAudioProjectionModel
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast

    from omniloop_kit.tiny import T5_CONFIG, t5_unigram_tokenizer
    from omniloop_stable_audio import tiny

    if smoke:
        c = tiny.CONFIGS["stereo"]
        dit = dict(sample_size=c["length"], in_channels=c["latent"], num_layers=2, attention_head_dim=8,
                   num_attention_heads=4, num_key_value_attention_heads=2, out_channels=c["latent"],
                   cross_attention_dim=32, time_proj_dim=16, global_states_input_dim=2 * 24, cross_attention_input_dim=24)
        proj = dict(text_encoder_dim=16, conditioning_dim=24, min_value=0, max_value=16)
        t5 = dict(T5, d_model=16, d_kv=8, d_ff=32, num_heads=2)
        vae = dict(encoder_hidden_size=16, downsampling_ratios=[2, 4], channel_multiples=[1, 2], decoder_channels=8,
                   decoder_input_channels=c["latent"], audio_channels=2, sampling_rate=400)
        max_tokens = 16
    else:
        dit, proj, t5, vae, max_tokens = SAO_DIT, SAO_PROJECTION, T5, VAE, 128
    tok_dir = Path(tempfile.mkdtemp(prefix="sa-bench-tok-")) / "tokenizer"
    vocab = t5_unigram_tokenizer(tok_dir, PROMPT.replace(",", " ").split() + NEGATIVE.replace(",", " ").split())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**T5_CONFIG, "model_max_length": max_tokens}))
    torch.manual_seed(0)
    with torch.device(device):
        comps: dict[str, Any] = {
            "transformer": StableAudioDiTModel(**dit),
            "projection_model": StableAudioProjectionModel(**proj),
            "text_encoder": T5EncoderModel(T5Config(vocab_size=vocab, **t5)),
            "vae": AutoencoderOobleck(**vae),
        }
    for name, m in comps.items():
        m.to(dtype=torch.float32 if name == "vae" else dtype).eval().requires_grad_(False)
    comps["tokenizer"] = T5TokenizerFast.from_pretrained(str(tok_dir))
    comps["scheduler"] = CosineDPMSolverMultistepScheduler(sigma_min=0.3, sigma_max=500, sigma_data=1.0,
                                                           sigma_schedule="exponential", solver_order=2,
                                                           prediction_type="v_prediction", solver_type="midpoint")
    return comps


class DiffusersSide:
    def __init__(self, name: str, comps: dict[str, Any], compiled: bool, compile_backend: str,
                 mode: str | None = None) -> None:
        from diffusers import StableAudioPipeline

        self.name = name
        tf = comps["transformer"]
        self.note = ""
        if compiled:
            kw = {} if mode is None else {"mode": mode}
            tf = torch.compile(tf, fullgraph=True, backend=compile_backend, **kw)
            self.note = f"torch.compile(transformer, fullgraph=True, backend={compile_backend!r}, mode={mode!r})"
        c = comps
        self.pipe = StableAudioPipeline(vae=c["vae"], text_encoder=c["text_encoder"], projection_model=c["projection_model"],
                                        tokenizer=c["tokenizer"], transformer=tf,
                                        scheduler=type(c["scheduler"]).from_config(c["scheduler"].config))
        self.pipe.set_progress_bar_config(disable=True)

    def run(self, steps: int) -> dict[str, Any]:
        marks: list[float] = []
        final: dict[str, torch.Tensor] = {}

        def on_step(i: int, t: Any, latents: torch.Tensor) -> None:
            sync()
            marks.append(time.perf_counter())
            if i == steps - 1:
                final["latents"] = latents.detach().clone()

        sync()
        t0 = time.perf_counter()
        with _vae_cast(self.pipe.vae):
            out = self.pipe(prompt=PROMPT, negative_prompt=NEGATIVE, num_inference_steps=steps, guidance_scale=GUIDANCE,
                            generator=torch.Generator("cpu").manual_seed(SEED), callback=on_step, callback_steps=1)
        sync()
        total = time.perf_counter() - t0
        return {"total": total, "steps": step_times(marks), "latents": final["latents"], "audio": out.audios[0].float()}


class _vae_cast:
    """diffusers passes the latents to the VAE in the DiT's dtype; ours is float32: cast on the way in."""

    def __init__(self, vae: Any) -> None:
        self.vae = vae

    def __enter__(self) -> None:
        vae, real = self.vae, self.vae.decode
        self.real = real
        vae.decode = lambda z, *a, **k: real(z.float(), *a, **k)

    def __exit__(self, *exc: Any) -> None:
        del self.vae.decode


class OmniloopSide:
    def __init__(self, name: str, comps: dict[str, Any], device: torch.device, dtype: torch.dtype, *,
                 compiled: bool, compile_backend: str, attention: str = "sdpa", mode: str | None = None,
                 graphs: bool = False, prefetch: bool = False) -> None:
        from omniloop.execution import BuiltPipeline
        from omniloop.request import TaskType
        from omniloop_stable_audio.family import StableAudioFamily

        self.name = name
        options = omniloop_options(device, dtype, compiled=compiled, compile_backend=compile_backend,
                                   attention=attention)
        if mode is not None:
            options["compile_mode"] = mode
        if graphs:
            options["cuda_graphs"] = True
        if prefetch:
            options["noise_prefetch"] = True
        fam = StableAudioFamily()
        comps = {**comps, "vae": _Float32Vae(comps["vae"])}
        self.model = fam.from_components(comps, device=device, dtype=dtype, options=options)
        spec = fam.build_pipeline(self.model, TaskType.T2A, options)
        self.built = BuiltPipeline(spec=spec, components=self.model.components, device=device, dtype=dtype,
                                   options=options)
        self.note = f"compile={compiled} attention={attention} compile_mode={mode} cuda_graphs={graphs} noise_prefetch={prefetch}"

    def run(self, steps: int) -> dict[str, Any]:
        body = {"task": "t2a", "prompt": PROMPT, "negative_prompt": NEGATIVE,
                "diffusion": {"steps": steps, "guidance_scale": GUIDANCE, "seed": SEED},
                "outputs": {"return_latents": True}}
        result, out = omniloop_run(self.built, body)
        return {**result, "audio": out.artifacts["audio"].samples}


class _Float32Vae(torch.nn.Module):
    """The float32 VAE taking latents of any dtype (the family hands it the DiT's)."""

    def __init__(self, vae: Any) -> None:
        super().__init__()
        self.vae = vae
        self.config = vae.config

    def decode(self, z: torch.Tensor, *a: Any, **k: Any) -> Any:
        return self.vae.decode(z.float(), *a, **k)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = parser(__doc__.split("\n")[0], steps=20, budget_s=150.0, sides=SIDES)
    ap.add_argument("--breakdown", action="store_true", help="also time the noise query and one DiT forward alone")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    device, dtype, compile_backend, only = setting(ap, args, SIDES)
    steps = 3 if args.smoke else args.steps

    date = dt.date.today().isoformat()
    tag = "smoke" if args.smoke else "sao-47s-h200"
    record: dict[str, Any] = {
        "bench": "stable_audio_gpu", "date": date, "command": command_line("bench/stable_audio_gpu.py", argv),
        "machine": machine(device=str(device), dtype=str(dtype).replace("torch.", ""), **library_versions()),
        "config": {"model": "tiny" if args.smoke else "Stable Audio Open 1.0 DiT architecture, random weights",
                   "seconds": "the whole window (47.55 s at 44.1 kHz stereo: 1024 latent frames)",
                   "steps": steps, "guidance_scale": GUIDANCE, "cfg": "uncond + cond rows in one forward",
                   "repeats": args.repeats, "compile_backend": compile_backend},
        "sides": {}, "notes": [],
    }
    out_path = Path(args.out)
    if out_path.suffix != ".json":
        out_path = out_path / f"stable_audio_gpu-{tag}-{date}.json"
    save = saver(record, out_path)

    t = time.perf_counter()
    base = build_components(device, dtype, args.smoke)
    record["notes"].append(f"built components in {time.perf_counter() - t:.1f} s; DiT "
                           f"{sum(p.numel() for p in base['transformer'].parameters()) / 1e9:.3f} B params")

    def make(name: str) -> Any:
        tf = base["transformer"] if name == "diffusers" else copy_if_room(base["transformer"])
        comps = {**base, "transformer": tf}
        if name.startswith("diffusers"):
            cg = name.endswith("-cg") and compile_backend == "inductor"
            return DiffusersSide(name, comps, "compile" in name, compile_backend, "reduce-overhead" if cg else None)
        cg = "-cg" in name and compile_backend == "inductor"
        return OmniloopSide(name, comps, device, dtype, compiled="compile" in name, compile_backend=compile_backend,
                            mode="reduce-overhead" if cg else None, graphs="-graph" in name,
                            prefetch=name.endswith("-prefetch"),
                            attention="sdpa-cudnn" if "cudnn" in name and device.type == "cuda" else "sdpa")

    sides = build_sides(only, record, make)
    save()

    def run(side: Any, n: int) -> dict[str, Any]:
        return side.run(n)  # type: ignore[no-any-return]

    with torch.no_grad():
        warm_up(sides, record, run, t_start=t_start, budget_s=args.budget_s, save=save)
        if args.breakdown:
            try:
                record["breakdown"] = breakdown(base, sides, device, dtype, steps)
            except Exception as exc:
                record["breakdown"] = {"failed": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-1500:]}
            print(json.dumps({"breakdown": record["breakdown"]}), flush=True)
            save()
        runs = measure(sides, record, run, steps=steps, repeats=args.repeats, t_start=t_start, budget_s=args.budget_s,
                       save=save, summarize=summarize)
    return finish(record, runs, t_start=t_start, save=save, out_path=out_path, summarize=summarize)


def breakdown(base: dict[str, Any], sides: list[Any], device: torch.device, dtype: torch.dtype,
              steps: int) -> dict[str, Any]:
    """What one step is made of, each part alone: the scheduler's Brownian-tree noise query (host
    time and synchronised time) and one DiT forward of the omniloop-compile side (host time to
    launch, time to finish)."""
    from diffusers.schedulers.scheduling_dpmsolver_sde import BrownianTreeNoiseSampler

    out: dict[str, Any] = {}
    sch = type(base["scheduler"]).from_config(base["scheduler"].config)
    sch.set_timesteps(steps, device=device)
    tf = base["transformer"]
    x = torch.zeros((1, int(tf.config.in_channels), int(tf.config.sample_size)), dtype=dtype, device=device)
    for rep in range(2):
        ns = BrownianTreeNoiseSampler(x, sigma_min=sch.config.sigma_min, sigma_max=sch.config.sigma_max, seed=SEED)
        host, total = [], []
        for i in range(steps):
            sync()
            t0 = time.perf_counter()
            ns(sch.sigmas[i], sch.sigmas[i + 1])
            t1 = time.perf_counter()
            sync()
            host.append(t1 - t0)
            total.append(time.perf_counter() - t0)
        if rep:
            out["noise_query_host_ms"] = round(statistics.median(host) * 1e3, 3)
            out["noise_query_ms"] = round(statistics.median(total) * 1e3, 3)
    side = next((s for s in sides if s.name == "omniloop-compile"), None)
    if side is not None:
        from omniloop_kit.compile import compiled
        from omniloop_stable_audio.transformer import dit_forward, rotary_embedding

        m = side.model.components["transformer"]
        cb = compiled(m)
        blocks = cb.blocks if cb is not None else None
        g = torch.Generator("cpu").manual_seed(0)
        h = torch.randn((2, int(m.config.in_channels), int(m.config.sample_size)), generator=g).to(device, dtype)
        t = torch.tensor([500.0], device=device)
        cond = int(m.config.cross_attention_input_dim)
        ehs = torch.randn((2, 130, cond), generator=g).to(device, dtype)
        glob = torch.randn((2, 1, int(m.config.global_states_input_dim)), generator=g).to(device, dtype)
        rot = rotary_embedding(m, h.shape[2] + 1, h.device)
        host, total = [], []
        for _ in range(6):
            sync()
            t0 = time.perf_counter()
            dit_forward(m, h, t, ehs, glob, rot, None, blocks=blocks)
            t1 = time.perf_counter()
            sync()
            host.append(t1 - t0)
            total.append(time.perf_counter() - t0)
        out["dit_forward_compiled_host_ms"] = round(statistics.median(host[1:]) * 1e3, 3)
        out["dit_forward_compiled_ms"] = round(statistics.median(total[1:]) * 1e3, 3)
    return out


def summarize(record: dict[str, Any], runs: dict[str, list[dict[str, Any]]]) -> None:
    """The shared summary, plus each side's audio shape and its latents vs ``omniloop`` (eager)."""
    ours = runs.get("omniloop") or []
    ours_lat = ours[-1]["latents"] if ours else None

    def extra(name: str, rs: list[dict[str, Any]], _: Any) -> dict[str, Any]:
        more: dict[str, Any] = {"audio_shape": list(rs[-1]["audio"].shape)}
        if ours_lat is not None and not name.startswith("diffusers"):
            lat = rs[-1]["latents"].to(ours_lat.device).reshape(ours_lat.shape)
            more.update(latents_rel_rms_vs_omniloop=rel_rms(lat, ours_lat),
                        latents_bit_equal_omniloop=bool(torch.equal(lat, ours_lat)))
        return more

    summarize_sides(record, runs, extra)


if __name__ == "__main__":
    sys.exit(main())
