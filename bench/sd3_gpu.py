"""SD3.5-medium on one GPU: omniloop's SD3 family beside diffusers eager and diffusers + torch.compile.

Random weights, the real architectures (timing does not depend on the values), built in-process:
the SD3.5-medium ``SD3Transformer2DModel`` (24 joint blocks, 1536 wide, RMS q/k norm, dual
attention in blocks 0-12; 2.24 B parameters), SD3's 16-channel ``AutoencoderKL``, CLIP-L / CLIP-G
(``CLIPTextModelWithProjection``) and T5-XXL (``T5EncoderModel``) encoders, FlowMatchEuler with
shift 3.0; tokenizers are small local ``tokenizer.json`` files (no download). bf16, 1024x1024,
28 steps, CFG 7.0 with a negative prompt (the pipeline default: cond and uncond as one batch of two).

Configurations (``--only`` picks any):

==========================  ==========================================================================
``diffusers``               ``StableDiffusion3Pipeline`` eager
``diffusers-compile``       same pipeline, ``torch.compile(transformer, fullgraph=True)`` (whole model)
``omniloop``                omniloop SD3 family eager (our outer forward, joint blocks via run_blocks)
``omniloop-compile``        + deploy ``compile: true`` (each joint step ``torch.compile(fullgraph=True)``)
``omniloop-cudnn-compile``  + attention backend ``sdpa-cudnn`` (omniloop-attention)
``omniloop-cudnn-fused-…``  ``omniloop-cudnn-fused-compile``: + ``options.qkv: fused`` (not in the default set)
``omniloop-…``              any ``omniloop[-cudnn|-fa4|-fa3|-fp8][-fp8lin][-fused][-gelu][-compile][-graphs]`` in ``SIDES``: the
                            backend (``sdpa-cudnn``, ``flash-attn-4``, ``flash-attn-3``, ``cudnn-fp8``), ``qkv: fused``,
                            ``ffn_gelu: fused`` (``-gelu``),
                            ``compile: true``, ``options.cuda_graphs: true`` (omniloop_kit.graphs)
==========================  ==========================================================================

The record also holds the step's bf16 matmul limit (``flops_per_step`` at 790 TFLOP/s) and each
side's fraction of it.

Each side has its own transformer copy (same weights) so that processors installed by one never
touch another. Per side: seconds per denoise step (median over steps 1..N-1 of every measured run;
step 0 holds the loop's set-up), end-to-end seconds (prompt to uint8 image; diffusers to its
``output_type="np"`` image), warm-up seconds (compilation), peak memory, and the final latents'
relative RMS difference to diffusers eager (``omniloop`` runs the same kernels: expected 0).
Runs are interleaved (every other round reversed) after one warm-up run per side. JSON goes to
``$OUT`` if set, else ``bench/results/``, after every phase (partial results survive a timeout).

    python bench/sd3_gpu.py                     # on the H200 (~4-5 min including compilation)
    python bench/sd3_gpu.py --smoke             # tiny configs on a CPU, compile backend 'eager': checks the script
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _repo_paths

_repo_paths.add_repo_packages()

from _common import command_line, library_versions, machine, step_marker, step_times, sync  # noqa: E402
from _sides import (  # noqa: E402
    apply_linear_precision,
    attention_spec,
    build_sides,
    copy_if_room,
    measure,
    omniloop_run,
    omniloop_setting,
    parser,
    profile,
    saver,
    setting,
    warm_up,
)
from _sides import summarize as summarize_sides  # noqa: E402

PROMPT = "a red fox jumps over the lazy dog in the snow, close up photo"
NEGATIVE = "blurry, low quality, watermark"
GUIDANCE = 7.0
SEED = 42

#: SD3.5-medium (stabilityai/stable-diffusion-3.5-medium transformer/config.json)
SD35M = dict(
    sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
    num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
    pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
)
VAE = dict(
    in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2,
    norm_num_groups=32, sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
    use_post_quant_conv=False,
)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              projection_dim=768, max_position_embeddings=77, hidden_act="quick_gelu", bos_token_id=2, eos_token_id=3)
CLIP_G = dict(CLIP_L, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
              projection_dim=1280, hidden_act="gelu")
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
              dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)

SIDES = ("diffusers", "diffusers-compile", "omniloop", "omniloop-compile", "omniloop-cudnn-compile",
         "omniloop-cudnn-fused-compile", "omniloop-compile-graphs", "omniloop-cudnn-compile-graphs",
         "omniloop-cudnn-fused-compile-graphs", "omniloop-fa4-compile", "omniloop-fa4-compile-graphs",
         "omniloop-fa4-fused-compile-graphs", "omniloop-fp8-fused-compile-graphs",
         "omniloop-cudnn-fp8lin-compile-graphs", "omniloop-fp8-fp8lin-compile-graphs",
         "omniloop-fused-compile-graphs", "omniloop-fa3-fused-compile-graphs", "omniloop-fa3-fused-gelu-compile-graphs")
DEFAULT_SIDES = SIDES[:5]
#: the bf16 GEMM rate this H200 reaches on large shapes (bench/README, the Wan matmul-limit table)
BF16_GEMM_TFLOPS = 790.0


def flops_per_step(cfg: dict[str, Any], size: int, txt_len: int, batch: int = 2) -> float:
    """Matmul FLOPs of one CFG step (``batch`` rows): per joint block 12 D^2 per image token (Q/K/V,
    output, the 4x feed-forward) and per context token (the last block, ``context_pre_only``: Q/K/V
    only), 4 L^2 D of joint attention; a dual-attention block's image-only ``attn2`` adds 4 D^2 per
    image token and 4 N^2 D. Embeddings and modulation (one token) are left out (< 0.1 %)."""
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    n_img = (size // 8 // cfg["patch_size"]) ** 2
    layers, dual = cfg["num_layers"], len(cfg.get("dual_attention_layers") or ())
    length = n_img + txt_len
    linear = 2 * d * d * (layers * 12 * n_img + (layers - 1) * 12 * txt_len + 3 * txt_len + dual * 4 * n_img)
    attention = layers * 4 * length**2 * d + dual * 4 * n_img**2 * d
    return float(batch * (linear + attention))


def build_components(device: torch.device, dtype: torch.dtype, smoke: bool) -> dict[str, Any]:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import (
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        PreTrainedTokenizerFast,
        T5Config,
        T5EncoderModel,
        T5TokenizerFast,
    )

    from omniloop_sd3 import tiny

    tok_dir = Path(tempfile.mkdtemp(prefix="sd3-bench-tok-"))
    tiny._clip_tokenizer(tok_dir / "clip_l", pad="<|endoftext|>")
    tiny._clip_tokenizer(tok_dir / "clip_g", pad="!")
    tiny._t5_tokenizer(tok_dir / "t5")
    torch.manual_seed(0)
    if smoke:
        tf_cfg = tiny.transformer_kwargs("sd35-medium")
        clip_l = dict(CLIP_L, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      projection_dim=16, vocab_size=256)
        clip_g = dict(clip_l)
        t5 = dict(T5_XXL, vocab_size=256, d_model=40, d_kv=8, d_ff=48, num_layers=2, num_heads=2)
        vae = dict(VAE, block_out_channels=(8, 8, 8, 8), norm_num_groups=4, layers_per_block=1)
    else:
        tf_cfg, clip_l, clip_g, t5, vae = SD35M, CLIP_L, CLIP_G, T5_XXL, VAE
    with torch.device(device):
        comps: dict[str, Any] = {
            "transformer": SD3Transformer2DModel(**tf_cfg),
            "vae": AutoencoderKL(**vae),
            "text_encoder": CLIPTextModelWithProjection(CLIPTextConfig(**clip_l)),
            "text_encoder_2": CLIPTextModelWithProjection(CLIPTextConfig(**clip_g, pad_token_id=0)),
            "text_encoder_3": T5EncoderModel(T5Config(**t5)),
        }
    for m in comps.values():
        m.to(dtype=dtype).eval().requires_grad_(False)
    comps["tokenizer"] = PreTrainedTokenizerFast.from_pretrained(str(tok_dir / "clip_l"))
    comps["tokenizer_2"] = PreTrainedTokenizerFast.from_pretrained(str(tok_dir / "clip_g"))
    comps["tokenizer_3"] = T5TokenizerFast.from_pretrained(str(tok_dir / "t5"))
    comps["scheduler"] = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    return comps


def with_transformer(comps: dict[str, Any], tf: Any) -> dict[str, Any]:
    return {**comps, "transformer": tf}


class DiffusersSide:
    def __init__(self, name: str, comps: dict[str, Any], compiled: bool, compile_backend: str) -> None:
        from diffusers import StableDiffusion3Pipeline

        self.name = name
        tf = comps["transformer"]
        self.note = ""
        if compiled:
            tf = torch.compile(tf, fullgraph=True, backend=compile_backend)
            self.note = f"torch.compile(transformer, fullgraph=True, backend={compile_backend!r})"
        c = comps
        self.pipe = StableDiffusion3Pipeline(
            transformer=tf, vae=c["vae"], text_encoder=c["text_encoder"], text_encoder_2=c["text_encoder_2"],
            text_encoder_3=c["text_encoder_3"], tokenizer=c["tokenizer"], tokenizer_2=c["tokenizer_2"],
            tokenizer_3=c["tokenizer_3"], scheduler=type(c["scheduler"]).from_config(c["scheduler"].config),
        )
        self.pipe.set_progress_bar_config(disable=True)

    def run(self, steps: int, size: int) -> dict[str, Any]:
        final: dict[str, torch.Tensor] = {}
        marks, on_step = step_marker(steps, final)
        sync()
        t0 = time.perf_counter()
        out = self.pipe(prompt=PROMPT, negative_prompt=NEGATIVE, height=size, width=size, num_inference_steps=steps,
                        guidance_scale=GUIDANCE, generator=torch.Generator("cpu").manual_seed(SEED), output_type="np",
                        callback_on_step_end=on_step, callback_on_step_end_tensor_inputs=["latents"])
        sync()
        total = time.perf_counter() - t0
        image = torch.from_numpy((out.images[0] * 255).round().astype("uint8"))
        return {"total": total, "steps": step_times(marks), "latents": final["latents"], "image": image}


class OmniloopSide:
    def __init__(self, name: str, comps: dict[str, Any], device: torch.device, dtype: torch.dtype, *,
                 compiled: bool, compile_backend: str, attention: str = "sdpa", qkv: str = "separate",
                 graphs: bool = False, linears: str = "dtype", keep: tuple[str, ...] = (),
                 ffn_gelu: str = "reference") -> None:
        from omniloop.deploy import DeployConfig
        from omniloop.execution import BuiltPipeline
        from omniloop.request import TaskType
        from omniloop_sd3.family import SD3Family

        self.name = name
        backend = attention_spec(attention)
        deploy = DeployConfig(device=str(device), dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
                              compile=compiled, attention_backend=attention, linear_precision=linears,
                              linear_precision_options={"keep": list(keep)} if keep else {})
        options: dict[str, Any] = {"deploy": deploy, "compile_backend": compile_backend, "qkv": qkv, "ffn_gelu": ffn_gelu}
        if graphs:
            options["cuda_graphs"] = True
        if backend is not None:
            options["attention"] = backend
        fam = SD3Family()
        self.model = fam.from_components(comps, device=device, dtype=dtype, options=options)
        lin_note = apply_linear_precision(self.model, fam, deploy)
        spec = fam.build_pipeline(self.model, TaskType.T2I, options)
        self.built = BuiltPipeline(spec=spec, components=comps, device=device, dtype=dtype, options=options)
        self.note = f"compile={compiled} attention={attention} qkv={qkv} ffn_gelu={ffn_gelu} cuda_graphs={graphs}{lin_note}"

    def run(self, steps: int, size: int) -> dict[str, Any]:
        body = {"task": "t2i", "prompt": PROMPT, "negative_prompt": NEGATIVE,
                "diffusion": {"steps": steps, "guidance_scale": GUIDANCE, "seed": SEED, "height": size, "width": size},
                "outputs": {"return_latents": True}}
        from omniloop_kit.graphs import captured

        result, out = omniloop_run(self.built, body)
        result["metrics"]["cuda_graphs_captured"] = captured(self.model.components["transformer"])
        return {**result, "image": out.artifacts["image"].pixels}



def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = parser(__doc__.split("\n")[0], steps=28, budget_s=400.0, sides=DEFAULT_SIDES)
    ap.add_argument("--size", type=int, default=1024)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    device, dtype, compile_backend, only = setting(ap, args, SIDES)
    size = 32 if args.smoke else args.size
    steps = 3 if args.smoke else args.steps
    torch.backends.cuda.matmul.allow_tf32 = False

    date = dt.date.today().isoformat()
    tag = "smoke" if args.smoke else f"sd35m-{size}"
    record: dict[str, Any] = {
        "bench": "sd3_gpu", "date": date, "command": command_line("bench/sd3_gpu.py", argv),
        "machine": machine(device=str(device), dtype=str(dtype).replace("torch.", ""), **library_versions()),
        "config": {"model": "tiny sd35-medium" if args.smoke else "SD3.5-medium architecture, random weights",
                   "size": size, "steps": steps, "guidance_scale": GUIDANCE, "cfg": "cond+uncond batch of two",
                   "repeats": args.repeats, "compile_backend": compile_backend},
        "sides": {}, "notes": [],
    }
    txt_len = 77 + 256  # CLIP-L/G states (77) + T5 (max_sequence_length 256), the pipeline's default
    tf_cfg = SD35M if not args.smoke else None
    if tf_cfg is not None:
        flops = flops_per_step(tf_cfg, size, txt_len)
        record["matmul_limit"] = {
            "tflop_per_step": round(flops / 1e12, 2), "bf16_gemm_tflops": BF16_GEMM_TFLOPS,
            "limit_s_per_step": round(flops / (BF16_GEMM_TFLOPS * 1e12), 5),
            "how": "flops_per_step(): linears and attention of one CFG step (2 rows), at the bf16 GEMM rate"}
    out_path = Path(args.out) / f"sd3_gpu-{tag}-{date}.json"
    save = saver(record, out_path)

    t = time.perf_counter()
    base = build_components(device, dtype, args.smoke)
    record["notes"].append(f"built components in {time.perf_counter() - t:.1f} s; transformer "
                           f"{sum(p.numel() for p in base['transformer'].parameters()) / 1e9:.3f} B params")
    def make(name: str) -> Any:
        tf = base["transformer"] if name in ("diffusers", "diffusers-compile") else copy_if_room(base["transformer"])
        comps = with_transformer(base, tf)
        if name.startswith("diffusers"):
            return DiffusersSide(name, comps, name.endswith("compile"), compile_backend)
        st = omniloop_setting(name)
        if st["modulation"] != "per-step" or st["qk_norm_rope"] != "reference":
            raise ValueError(f"side {name!r}: the SD3 family has no options.modulation or options.qk_norm_rope "
                             "('mod' and 'rope' are FLUX side words)")
        if device.type == "cpu":  # smoke: the same paths with the core sdpa and no graphs (CUDA only);
            st.update(attention="sdpa", graphs=False, ffn_gelu="reference")  # cuBLASLt's GELU epilogue too
        return OmniloopSide(name, comps, device, dtype, compiled=st["compile"], compile_backend=compile_backend,
                            attention=st["attention"], qkv=st["qkv"], graphs=st["graphs"], linears=st["linears"],
                            keep=st["keep"], ffn_gelu=st["ffn_gelu"])

    sides = build_sides(only, record, make)
    save()

    def run(side: Any, n: int) -> dict[str, Any]:
        return side.run(n, size)  # type: ignore[no-any-return]

    with torch.no_grad():
        warm_up(sides, record, run, t_start=t_start, budget_s=args.budget_s, save=save)
        runs = measure(sides, record, run, steps=steps, repeats=args.repeats, t_start=t_start, budget_s=args.budget_s,
                       save=save, summarize=summarize)
        if args.profile:
            profile([s for s in sides if runs.get(s.name)], record, run, save=save)
    summarize(record, runs)
    record["wall_s"] = round(time.perf_counter() - t_start, 1)
    save()
    print(json.dumps({"wrote": str(out_path), "summary": record.get("summary")}, indent=1))
    return 0


def summarize(record: dict[str, Any], runs: dict[str, list[dict[str, Any]]]) -> None:
    """The shared summary, plus each side's largest pixel difference to diffusers eager."""
    ref = runs.get("diffusers") or []

    def extra(name: str, rs: list[dict[str, Any]], _: Any) -> dict[str, Any]:
        if not ref:
            return {}
        return {"image_max_abs_diff_vs_diffusers": int((rs[-1]["image"].int() - ref[-1]["image"].int()).abs().max())}

    summarize_sides(record, runs, extra)
    limit = (record.get("matmul_limit") or {}).get("limit_s_per_step")
    if limit:
        for entry in (record.get("summary") or {}).values():
            entry["fraction_of_matmul_limit"] = round(limit / entry["s_per_step"], 3)


if __name__ == "__main__":
    sys.exit(main())
