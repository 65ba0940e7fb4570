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
======================  ======================================================================

Per side: seconds per denoise step (median over the rounds' steps 2..28, each step closed by a
``torch.cuda.synchronize()``) and end to end (prompt to image). Every side first runs a 2-step
warm-up (kernels, cuDNN plans, compilation). Also recorded: whether omniloop's final latents equal
diffusers' (eager vs eager; compiled vs compiled).

    python bench/flux_gpu.py                       # H200: JSON to bench/results/
    python bench/flux_gpu.py --smoke --device cpu  # tiny sizes, float32, any machine
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
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
    write_record,
)

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
SIDES = ("diffusers", "diffusers-compile", "omniloop", "omniloop-compile")


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
                 backend: str) -> None:
        from omniloop.deploy import DeployConfig
        from omniloop.execution import BuiltPipeline
        from omniloop.request import TaskType
        from omniloop_flux.family import FluxFamily

        self.name = name
        self.compiled = name.endswith("compile")
        deploy = DeployConfig(device=str(device), dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
                              compile=self.compiled)
        options: dict[str, Any] = {"deploy": deploy, "compile_backend": backend}
        fam = FluxFamily()
        self.model = fam.from_components(comps, device=device, dtype=dtype, options=options,
                                         defaults={"max_sequence_length": max_len})
        spec = fam.build_pipeline(self.model, TaskType.T2I, options)
        self.built = BuiltPipeline(spec=spec, components=comps, device=device, dtype=dtype, options=options)

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
        return {"total": total, "steps": per_step, "latents": lat, "metrics": out.metrics.get("denoise")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU-friendly), float32")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--only", default=",".join(SIDES))
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--tag", default="h200")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend of both compiled sides")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    size = 64 if args.smoke else args.size
    max_len = 32 if args.smoke else 512
    t = time.perf_counter()
    comps = build_components(device, dtype, args.smoke)
    build_s = time.perf_counter() - t
    print(f"built components in {build_s:.1f} s", flush=True)
    names = [n for n in args.only.split(",") if n]
    be = args.compile_backend
    sides = [DiffusersSide(n, comps, max_len, be) if n.startswith("diffusers")
             else OmniloopSide(n, comps, device, dtype, max_len, be) for n in names]
    results: dict[str, dict[str, Any]] = {s.name: {"totals": [], "steps": []} for s in sides}
    latents: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for s in sides:  # warm-up, compilation included
            t = time.perf_counter()
            s.run(2, size)
            results[s.name]["warmup_s"] = round(time.perf_counter() - t, 3)
            print(json.dumps({"side": s.name, "warmup_s": results[s.name]["warmup_s"]}), flush=True)
        for rep in range(args.repeats):
            for s in (sides if rep % 2 == 0 else sides[::-1]):
                r = s.run(args.steps, size)
                results[s.name]["totals"].append(r["total"])
                results[s.name]["steps"].extend(r["steps"])
                latents[s.name] = r["latents"]
                print(json.dumps({"side": s.name, "rep": rep, "s_total": round(r["total"], 3),
                                  "s_per_step_median": round(statistics.median(r["steps"]), 4)}), flush=True)
    rows = {}
    for name, r in results.items():
        rows[name] = {"s_per_step": round(statistics.median(r["steps"]), 5),
                      "s_end_to_end": round(statistics.median(r["totals"]), 4),
                      "s_end_to_end_all": [round(x, 4) for x in r["totals"]], "warmup_s": r["warmup_s"]}
    base = rows.get("diffusers")
    for row in rows.values():
        if base:
            row["per_step_speedup_vs_diffusers_eager"] = round(base["s_per_step"] / row["s_per_step"], 3)
            row["end_to_end_speedup_vs_diffusers_eager"] = round(base["s_end_to_end"] / row["s_end_to_end"], 3)
        if "diffusers-compile" in rows:
            dc = rows["diffusers-compile"]
            row["per_step_speedup_vs_diffusers_compile"] = round(dc["s_per_step"] / row["s_per_step"], 3)
            row["end_to_end_speedup_vs_diffusers_compile"] = round(dc["s_end_to_end"] / row["s_end_to_end"], 3)
    same = {}
    for a, b in (("diffusers", "omniloop"), ("diffusers-compile", "omniloop-compile")):
        if a in latents and b in latents:
            x, y = latents[a].float(), latents[b].float()
            same[f"{b}_vs_{a}"] = {"equal": bool(torch.equal(latents[a], latents[b])),
                                   "max_abs_diff": float((x - y).abs().max())}
    record = {
        "bench": f"flux_gpu-{args.tag}" + ("-smoke" if args.smoke else ""),
        "date": datetime.date.today().isoformat(),
        "command": command_line("bench/flux_gpu.py", argv if argv is not None else sys.argv[1:]),
        "machine": machine(**library_versions()),
        "what": {"model": "FLUX.1-dev architecture, random weights" if not args.smoke else "tiny smoke sizes",
                 "dtype": str(dtype).replace("torch.", ""), "height": size, "width": size, "steps": args.steps,
                 "guidance_scale": GUIDANCE, "max_sequence_length": max_len, "repeats": args.repeats,
                 "image_tokens": (size // 16) ** 2, "compile_backend": args.compile_backend, "build_components_s": round(build_s, 1)},
        "results": rows,
        "final_latents": same,
    }
    path = write_record(record, args.out)
    print(json.dumps(rows, indent=1))
    print(json.dumps(same))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
