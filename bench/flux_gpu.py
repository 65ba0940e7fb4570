"""FLUX.1-dev on one GPU: omniloop's Flux family beside diffusers' FluxPipeline, eager and compiled.

Random weights, the real architectures (timing does not depend on the values), built in-process
from the same modules for every side: FLUX.1-dev transformer (19 double + 38 single blocks, 3072
wide, guidance embedding), CLIP-L and T5-XXL text encoders, the FLUX VAE, bf16. One request:
1024x1024 (4,096 image + 512 text tokens), 28 steps, guidance 3.5, prompt to uint8-ready pixels.

Sides, each timed in the same process, interleaved (every other round in reverse order):

======================  ======================================================================
``diffusers``           ``FluxPipeline`` eager (its default attention dispatch)
``diffusers-compile``   the same + ``transformer.compile_repeated_blocks(fullgraph=True)``
                        (regional ``torch.compile`` of every double/single block), undone after
``omniloop``            the ``flux`` family: ``FluxFamily.from_components`` over the same modules,
                        one ``Execution`` node by node
``omniloop-compile``    the same with deploy ``compile: true`` (each block
                        ``torch.compile(fullgraph=True, dynamic=False)``, as the Wan family does)
``omniloop-…``          any ``omniloop[-cudnn|-fa4|-fa3|-fp8][-fp8lin][-fused][-gelu][-mod][-compile][-autotune][-graphs]`` in ``SIDES``:
                        the deploy's attention backend (``sdpa-cudnn``, ``flash-attn-4``, ``flash-attn-3``, ``cudnn-fp8``;
                        omniloop_flux.attention), ``options.qkv: fused``, ``options.ffn_gelu: fused``, ``options.modulation:
                        per-request`` (``mod``), ``options.qk_norm_rope: fused`` (``rope``), ``compile: true``,
                        ``options.cuda_graphs: true`` (omniloop_kit.graphs); ``autotune``: ``options.compile_mode:
                        max-autotune-no-cudagraphs`` (inductor tries Triton GEMM templates too). A side with another
                        backend or fused projections runs its own copy of the transformer (same
                        weights), so its processors never touch another side's
======================  ======================================================================

Per side (bench/_sides.py): seconds per denoise step (median over the rounds' steps after the
first, each step closed by a ``torch.cuda.synchronize()``) and end to end (prompt to image), peak
memory, the final latents' relative RMS difference to diffusers eager. Every side first runs a
2-step warm-up (kernels, cuDNN plans, compilation, graph capture). The record also holds the
step's bf16 matmul limit (``flops_per_step`` at 790 TFLOP/s) and each side's fraction of it.
JSON to ``--out`` (default ``$OUT`` or bench/results/) after every phase.

    python bench/flux_gpu.py                       # H200: JSON to bench/results/
    python bench/flux_gpu.py --smoke               # tiny sizes, float32, CPU
"""

from __future__ import annotations

import contextlib
import datetime
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _repo_paths

_repo_paths.add_repo_packages()

from _common import (  # noqa: E402
    command_line,
    default_dtype,
    diffusers_compiled,
    library_versions,
    machine,
    run_omniloop,
    step_marker,
    step_times,
    sync,
)
from _sides import (  # noqa: E402
    apply_linear_precision,
    attention_spec,
    build_sides,
    copy_if_room,
    measure,
    omniloop_setting,
    parser,
    profile,
    saver,
    setting,
    warm_up,
)
from _sides import summarize as summarize_sides  # noqa: E402

PROMPT = "a red fox jumps over the lazy dog in the snow, close up photo"
GUIDANCE = 3.5
SEED = 42

FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu")
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
              dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
FLUX_VAE = dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
                up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512], layers_per_block=2,
                latent_channels=16, norm_num_groups=32, sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159,
                use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=True)
SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
                 num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True)
SMOKE = {
    "tf": dict(FLUX_DEV, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
               num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)),
    "clip": dict(CLIP_L, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, projection_dim=32),
    "t5": dict(T5_XXL, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, relative_attention_num_buckets=8),
    "vae": dict(FLUX_VAE, block_out_channels=[8, 8, 8, 8], layers_per_block=1, latent_channels=4, norm_num_groups=4),
}
SIDES = ("diffusers", "diffusers-compile", "omniloop", "omniloop-compile", "omniloop-compile-graphs",
         "omniloop-cudnn-compile", "omniloop-cudnn-compile-graphs", "omniloop-fa4-compile", "omniloop-fa4-compile-graphs",
         "omniloop-fused-compile-graphs", "omniloop-cudnn-fused-compile-graphs", "omniloop-fa4-fused-compile-graphs",
         "omniloop-fp8-fused-compile-graphs", "omniloop-fa3-compile-graphs", "omniloop-fa3-fused-compile-graphs",
         "omniloop-fp8lin-compile", "omniloop-fp8lin-compile-graphs", "omniloop-fp8-fp8lin-compile-graphs",
         "omniloop-fa3-fused-compile-autotune-graphs", "omniloop-cudnn-fused-compile-autotune-graphs",
         "omniloop-fa3-fused-gelu-compile-graphs", "omniloop-fa3-fused-mod-compile-graphs", "omniloop-mod-compile",
         "omniloop-fa3-fused-gelu-mod-compile-graphs", "omniloop-fa3-fused-gelu-mod-rope-compile-graphs",
         "omniloop-fused-gelu-mod-rope-compile-graphs", "omniloop-cudnn-fused-gelu-mod-rope-compile-graphs",
         "omniloop-fa3-fused-rope-compile-graphs", "omniloop-fp8lin-keepv-compile",
         "omniloop-fa3-gelu-mod-rope-compile-graphs", "omniloop-fa3-gelu-mod-rope-fp8lin-compile-graphs",
         "omniloop-fa3-gelu-mod-rope-fp8lin-keepv-compile-graphs", "omniloop-fa3-fused-gelu-mod-rope-fp8lin-compile-graphs",
         "omniloop-fa3-fused-gelu-mod-rope-fp8lin-keepv-compile-graphs", "omniloop-fused-fp8lin-keepv-compile",
         "omniloop-fa3-gelu-mod-rope-fp8lin-keepqkv-compile-graphs", "omniloop-fp8lin-keepqkv-compile",
         "omniloop-fa3-fused-gelu-mod-rope-fp8lin-keepqkv-compile-graphs", "omniloop-fused-fp8lin-keepqkv-compile",
         "omniloop-fa3-gelu-mod-rope-fp8lin-keepqkvmod-compile-graphs", "omniloop-mod-fp8lin-keepqkvmod-compile")
DEFAULT_SIDES = SIDES[:4]
#: the bf16 GEMM rate this H200 reaches on large shapes (bench/README, the Wan matmul-limit table)
BF16_GEMM_TFLOPS = 790.0


def build_components(device: torch.device, dtype: torch.dtype, smoke: bool) -> dict[str, Any]:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast

    from omniloop_flux.tiny import build_clip_tokenizer, build_t5_tokenizer

    tmp = Path(tempfile.mkdtemp())
    build_clip_tokenizer(tmp / "tokenizer")
    build_t5_tokenizer(tmp / "tokenizer_2")
    tok = CLIPTokenizer.from_pretrained(str(tmp / "tokenizer"))
    tok2 = T5TokenizerFast.from_pretrained(str(tmp / "tokenizer_2"))
    cfg = SMOKE if smoke else {"tf": FLUX_DEV, "clip": CLIP_L, "t5": T5_XXL, "vae": FLUX_VAE}
    torch.manual_seed(0)
    with torch.device(device), default_dtype(dtype):
        tf = FluxTransformer2DModel(**cfg["tf"]).to(dtype).eval().requires_grad_(False)
        clip = CLIPTextModel(CLIPTextConfig(**cfg["clip"], eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                                            pad_token_id=tok.eos_token_id)).to(dtype).eval().requires_grad_(False)
        t5 = T5EncoderModel(T5Config(**cfg["t5"])).to(dtype).eval().requires_grad_(False)
        vae = AutoencoderKL(**cfg["vae"]).to(dtype).eval().requires_grad_(False)
    return {"transformer": tf, "vae": vae, "text_encoder": clip, "text_encoder_2": t5, "tokenizer": tok,
            "tokenizer_2": tok2, "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER)}


class DiffusersSide:
    def __init__(self, name: str, comps: dict[str, Any], max_len: int, backend: str) -> None:
        from diffusers import FluxPipeline

        self.name = name
        self.backend = backend
        self.comps = comps
        self.max_len = max_len
        c = comps
        self.pipe = FluxPipeline(scheduler=c["scheduler"], vae=c["vae"], text_encoder=c["text_encoder"],
                                 tokenizer=c["tokenizer"], text_encoder_2=c["text_encoder_2"],
                                 tokenizer_2=c["tokenizer_2"], transformer=c["transformer"])
        self.pipe.set_progress_bar_config(disable=True)
        self.note = ("transformer.compile_repeated_blocks(fullgraph=True) for the run" if name.endswith("compile")
                     else "eager")

    def run(self, steps: int, size: int) -> dict[str, Any]:
        final: dict[str, torch.Tensor] = {}
        marks, on_step = step_marker(steps, final)
        ctx = diffusers_compiled(self.comps["transformer"], self.backend) if self.name.endswith("compile") else contextlib.nullcontext()
        with ctx:
            sync()
            t0 = time.perf_counter()
            self.pipe(prompt=PROMPT, height=size, width=size, num_inference_steps=steps, guidance_scale=GUIDANCE,
                      generator=torch.Generator("cpu").manual_seed(SEED), max_sequence_length=self.max_len,
                      output_type="np", callback_on_step_end=on_step, callback_on_step_end_tensor_inputs=["latents"])
            sync()
            total = time.perf_counter() - t0
        return {"total": total, "steps": step_times(marks), "latents": final["latents"]}


class OmniloopSide:
    def __init__(self, name: str, comps: dict[str, Any], device: torch.device, dtype: torch.dtype, max_len: int,
                 backend: str, attention: str = "sdpa", qkv: str = "separate", graphs: bool = False,
                 compiled: bool | None = None, linears: str = "dtype", compile_mode: str | None = None,
                 ffn_gelu: str = "reference", modulation: str = "per-step", qk_norm_rope: str = "reference",
                 keep: tuple[str, ...] = ()) -> None:
        from omniloop.deploy import DeployConfig
        from omniloop.execution import BuiltPipeline
        from omniloop.request import TaskType
        from omniloop_flux.family import FluxFamily

        self.name = name
        self.compiled = name.endswith("compile") if compiled is None else compiled
        spec = attention_spec(attention)
        deploy = DeployConfig(device=str(device), dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
                              compile=self.compiled, attention_backend=attention, linear_precision=linears,
                              linear_precision_options={"keep": list(keep)} if keep else {})
        options: dict[str, Any] = {"deploy": deploy, "compile_backend": backend, "qkv": qkv, "ffn_gelu": ffn_gelu,
                                  "modulation": modulation, "qk_norm_rope": qk_norm_rope}
        if spec is not None:
            options["attention"] = spec
        if graphs:
            options["cuda_graphs"] = True
        if compile_mode:
            options["compile_mode"] = compile_mode
        fam = FluxFamily()
        self.model = fam.from_components(comps, device=device, dtype=dtype, options=options,
                                         defaults={"max_sequence_length": max_len})
        lin_note = apply_linear_precision(self.model, fam, deploy)
        spec_ = fam.build_pipeline(self.model, TaskType.T2I, options)
        self.built = BuiltPipeline(spec=spec_, components=comps, device=device, dtype=dtype, options=options)
        self.note = (f"compile={self.compiled}{f' mode={compile_mode}' if compile_mode else ''} attention={attention} "
                     f"qkv={qkv} ffn_gelu={ffn_gelu} modulation={modulation} qk_norm_rope={qk_norm_rope} cuda_graphs={graphs}"
                     f"{lin_note}")

    def run(self, steps: int, size: int) -> dict[str, Any]:
        from omniloop.artifacts import Latents

        body = {"task": "t2i", "prompt": PROMPT,
                "diffusion": {"steps": steps, "guidance_scale": GUIDANCE, "seed": SEED, "height": size, "width": size}}
        total, per_step, ex = run_omniloop(self.built, body)
        out = ex.output
        if not out.ok:
            raise RuntimeError(f"omniloop request failed: {out.error}")
        from omniloop_flux.denoise import pack_latents

        lat = pack_latents(ex.state.read("denoised", Latents).tensor)
        from omniloop_kit.graphs import captured

        return {"total": total, "steps": per_step, "latents": lat, "metrics": {
            "denoise": out.metrics.get("denoise"),
            "cuda_graphs_captured": captured(self.model.components["transformer"])}}


def flops_per_step(cfg: dict[str, Any], size: int, txt_len: int) -> float:
    """Matmul FLOPs of one FLUX.1 step (one forward, embedded guidance): a double-stream block 12 D^2
    per image and per text token (Q/K/V, output, the 4x MLP), a single-stream block 12 D^2 per
    token (Q/K/V + MLP in, the fused output projection 5D -> D), 4 L^2 D of attention in each.
    Embeddings and modulation (one token) are left out (< 0.1 %)."""
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    n_img = (size // 16) ** 2
    length = n_img + txt_len
    double, single = cfg["num_layers"], cfg["num_single_layers"]
    linear = 2 * 12 * d * d * (double * length + single * length)
    attention = (double + single) * 4 * length**2 * d
    return float(linear + attention)


def device_tag(gpu: str | None) -> str:
    """A short device word for file names: the model of ``gpu`` (``"NVIDIA H100 80GB HBM3"`` -> ``h100``), ``gpu``
    for a name without one, ``cpu`` without a GPU."""
    if not gpu:
        return "cpu"
    model = re.search(r"\b([A-Za-z]{1,2}\d{2,4})\b", gpu.replace("NVIDIA", ""))
    return model.group(1).lower() if model else "gpu"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = parser(__doc__.split("\n")[0], steps=28, budget_s=400.0, sides=DEFAULT_SIDES)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--tag", default=None, help="in the output file's name (default: the device's, e.g. h100, cpu)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (as --smoke picks)")
    ap.add_argument("--compile-backend", default=None, help="torch.compile backend of every compiled side "
                    "(default: inductor on CUDA, eager on CPU)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    device, dtype, compile_backend, only = setting(ap, args, SIDES)
    if args.device == "cpu" and device.type != "cpu":
        device, dtype = torch.device("cpu"), torch.float32
    compile_backend = args.compile_backend or compile_backend
    size = 64 if args.smoke else args.size
    steps = 3 if args.smoke else args.steps
    max_len = 32 if args.smoke else 512
    date = datetime.date.today().isoformat()
    record: dict[str, Any] = {
        "bench": "flux_gpu", "date": date, "command": command_line("bench/flux_gpu.py", argv),
        "machine": machine(device=str(device), dtype=str(dtype).replace("torch.", ""), **library_versions()),
        "config": {"model": "FLUX.1-dev architecture, random weights" if not args.smoke else "tiny smoke sizes",
                   "height": size, "width": size, "steps": steps, "guidance_scale": GUIDANCE,
                   "max_sequence_length": max_len, "image_tokens": (size // 16) ** 2, "repeats": args.repeats,
                   "compile_backend": compile_backend},
        "sides": {}, "notes": [],
    }
    if not args.smoke:
        flops = flops_per_step(FLUX_DEV, size, max_len)
        record["matmul_limit"] = {
            "tflop_per_step": round(flops / 1e12, 2), "bf16_gemm_tflops": BF16_GEMM_TFLOPS,
            "limit_s_per_step": round(flops / (BF16_GEMM_TFLOPS * 1e12), 5),
            "how": "flops_per_step(): linears and attention of one step (one forward), at the bf16 GEMM rate"}
    tag = args.tag or device_tag(record["machine"].get("gpu") if device.type == "cuda" else None)
    out_path = Path(args.out) / f"flux_gpu-{tag}{'-smoke' if args.smoke else ''}-{date}.json"
    save = saver(record, out_path)
    t = time.perf_counter()
    base = build_components(device, dtype, args.smoke)
    record["notes"].append(f"built components in {time.perf_counter() - t:.1f} s")
    copies: dict[tuple[str, str], Any] = {}

    def make(name: str) -> Any:
        if name.startswith("diffusers"):
            return DiffusersSide(name, base, max_len, compile_backend)
        st = omniloop_setting(name)
        if device.type == "cpu":  # smoke: the same paths with the core sdpa and no graphs (CUDA only)
            # and the eager compile backend (no mode); cuBLASLt's GELU epilogue is CUDA-only
            st.update(attention="sdpa", graphs=False, compile_mode=None, ffn_gelu="reference", qk_norm_rope="reference")
        comps = base
        # processors, fused projections, FP8 linears or a compile mode of its own: its own transformer (the
        # kit keeps one set of compiled blocks per transformer; a second mode would replace the first's)
        # (owned block forwards -- gelu, mod -- replace the transformer's blocks: never on the shared one)
        key = (st["attention"], st["qkv"], st["linears"], st["compile_mode"], st["ffn_gelu"], st["modulation"],
               st["qk_norm_rope"], st["keep"])
        if key != ("sdpa", "separate", "dtype", None, "reference", "per-step", "reference", ()):
            if key not in copies:
                copies[key] = copy_if_room(base["transformer"])
            comps = {**base, "transformer": copies[key]}
        return OmniloopSide(name, comps, device, dtype, max_len, compile_backend, attention=st["attention"],
                            qkv=st["qkv"], graphs=st["graphs"], compiled=st["compile"], linears=st["linears"],
                            compile_mode=st["compile_mode"], ffn_gelu=st["ffn_gelu"],
                            modulation=st["modulation"], qk_norm_rope=st["qk_norm_rope"], keep=st["keep"])

    sides = build_sides(only, record, make)
    save()

    def run(side: Any, n: int) -> dict[str, Any]:
        return side.run(n, size)  # type: ignore[no-any-return]

    with torch.no_grad():
        warm_up(sides, record, run, t_start=t_start, budget_s=args.budget_s, save=save)
        runs = measure(sides, record, run, steps=steps, repeats=args.repeats, t_start=t_start,
                       budget_s=args.budget_s, save=save, summarize=summarize)
        if args.profile:
            profile([s for s in sides if runs.get(s.name)], record, run, save=save)
    summarize(record, runs)
    record["wall_s"] = round(time.perf_counter() - t_start, 1)
    save()
    print(json.dumps({"wrote": str(out_path), "summary": record.get("summary")}, indent=1))
    return 0


def summarize(record: dict[str, Any], runs: dict[str, list[dict[str, Any]]]) -> None:
    """The shared summary, plus each side's fraction of the step's bf16 matmul limit; ``results``
    (per side: s/step, end to end, the speedups) and ``final_latents`` (omniloop's against diffusers',
    eager vs eager and compiled vs compiled: equal, max |diff|) as this script wrote them before."""
    summarize_sides(record, runs)
    record["results"] = {name: dict(entry) for name, entry in (record.get("summary") or {}).items()}
    same = {}
    for a, b in (("diffusers", "omniloop"), ("diffusers-compile", "omniloop-compile")):
        if runs.get(a) and runs.get(b):
            x, y = runs[a][-1]["latents"], runs[b][-1]["latents"]
            same[f"{b}_vs_{a}"] = {"equal": bool(torch.equal(x, y)), "max_abs_diff": float((x.float() - y.float()).abs().max())}
    record["final_latents"] = same
    limit = (record.get("matmul_limit") or {}).get("limit_s_per_step")
    if limit:
        for entry in (record.get("summary") or {}).values():
            entry["fraction_of_matmul_limit"] = round(limit / entry["s_per_step"], 3)


if __name__ == "__main__":
    sys.exit(main())
