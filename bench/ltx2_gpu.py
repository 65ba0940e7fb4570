"""LTX-2 on one GPU: one denoise step of both streams (video + audio) through omniloop's ltx2 family
beside diffusers' ``LTX2Pipeline`` eager and with ``torch.compile``.

Random weights (timing does not depend on the values), built in-process on the GPU in bf16:
``LTX2VideoTransformer3DModel`` at its default (LTX-2) widths — video 32 heads x 128, audio 32 x 64,
cross-attention 4096 / 2048, captions 3840, 128 latent channels each — with ``--layers`` blocks
(LTX-2 has 48); a 1-layer Gemma 3 of width 3840 and ``LTX2TextConnectors`` of LTX-2's widths (the
text's shape is LTX-2's: 1024 tokens; its depth is not), the audio VAE at its defaults (16 kHz,
mel 64, 8 latent channels), a video VAE with LTX-2's ratios (32x spatial, 8x temporal, 128
channels; nothing is decoded). 512x768, 121 frames at 24 fps: 6144 video tokens + 126 audio tokens;
diffusers' default guidance: CFG (rows uncond + cond), STG, modality isolation: three transformer
calls per step (LTX-2.0 has no perturbed attention: the STG pass perturbs nothing, as in diffusers).

Sides (seconds per denoise step, median over the steps after the first of every measured run):

======================  ======================================================================
``diffusers``           ``LTX2Pipeline(output_type="latent")`` eager, steps marked by its callback
``omniloop``            the ltx2 family's ``denoise`` node (a runtime-owned step; marks after each)
``diffusers-compile``   + ``transformer.compile_repeated_blocks(fullgraph=True)`` (each block, in place)
``omniloop-compile``    the ltx2 family over the same compiled blocks (its deploy ``compile: true``
                        wraps the same ``torch.compile(block, fullgraph=True)``; reusing diffusers'
                        in-place compiled blocks keeps the device time to one compilation)
======================  ======================================================================

JSON to ``--out`` (default ``$OUT`` or ``bench/results/``) after every phase.

    python bench/ltx2_gpu.py --layers 48           # eager sides, the full depth
    python bench/ltx2_gpu.py --smoke               # tiny shapes on a CPU
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
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

PROMPT = "a robot dancing in the rain, cinematic"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build(layers: int, device: torch.device, dtype: torch.dtype, smoke: bool, tmp: Path) -> dict[str, Any]:
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from omniloop_ltx2.tiny import gemma_tokenizer

    width = 64 if smoke else 3840
    tok = gemma_tokenizer(tmp / "tok")
    tok.model_max_length = 1024
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            te = Gemma3ForConditionalGeneration(Gemma3Config(
                text_config={"vocab_size": len(tok) + 3, "hidden_size": width, "intermediate_size": 256,
                             "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
                             "max_position_embeddings": 2048, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2},
                vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                               "num_attention_heads": 2, "image_size": 8, "patch_size": 4},
                mm_tokens_per_image=4, boi_token_index=len(tok), eoi_token_index=len(tok) + 1,
                image_token_index=len(tok) + 2)).eval()
            kw = {} if not smoke else dict(num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32,
                                           audio_num_attention_heads=2, audio_attention_head_dim=8,
                                           audio_cross_attention_dim=16)
            tf = LTX2VideoTransformer3DModel(num_layers=layers, caption_channels=width, **kw).eval()
            conn = LTX2TextConnectors(caption_channels=width, text_proj_in_factor=2,
                                      **({} if not smoke else dict(video_connector_num_attention_heads=2,
                                                                   video_connector_attention_head_dim=32,
                                                                   audio_connector_num_attention_heads=2,
                                                                   audio_connector_attention_head_dim=32))).eval()
            vae = AutoencoderKLLTX2Video(latent_channels=128, block_out_channels=(8,), decoder_block_out_channels=(8,),
                                         layers_per_block=(1, 1), decoder_layers_per_block=(1, 1),
                                         spatio_temporal_scaling=(True,), decoder_spatio_temporal_scaling=(True,),
                                         decoder_inject_noise=(False, False), downsample_type=("spatiotemporal",),
                                         upsample_residual=(False,), upsample_factor=(1,), patch_size=1, patch_size_t=1,
                                         spatial_compression_ratio=32, temporal_compression_ratio=8).eval()
            avae = AutoencoderKLLTX2Audio().eval()
            voc = LTX2Vocoder(hidden_channels=32).eval()
    finally:
        torch.set_default_dtype(prev)
    sched = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                            shift_terminal=0.1)
    return {"transformer": tf, "vae": vae, "audio_vae": avae, "vocoder": voc, "text_encoder": te, "tokenizer": tok,
            "connectors": conn, "scheduler": sched}


def diffusers_side(comps: dict[str, Any], steps: int, size: tuple[int, int, int], stg_block: int) -> list[float]:
    import copy

    from diffusers import LTX2Pipeline

    pipe = LTX2Pipeline(**{**comps, "scheduler": copy.deepcopy(comps["scheduler"])})
    pipe.set_progress_bar_config(disable=True)
    marks: list[float] = []

    def mark(p: Any, i: int, t: Any, kw: dict[str, Any]) -> dict[str, Any]:
        sync()
        marks.append(time.perf_counter())
        return {}

    f, h, w = size
    pipe(prompt=PROMPT, height=h, width=w, num_frames=f, frame_rate=24.0, num_inference_steps=steps,
         generator=torch.Generator().manual_seed(0), spatio_temporal_guidance_blocks=[stg_block], output_type="latent",
         callback_on_step_end=mark)
    return [b - a for a, b in itertools.pairwise(marks)]


class OmniloopSide:
    def __init__(self, comps: dict[str, Any], device: torch.device, dtype: torch.dtype) -> None:
        from omniloop.deploy import DeployConfig
        from omniloop.execution import BuiltPipeline
        from omniloop.request import TaskType
        from omniloop_ltx2.family import LTX2Family

        options = {"deploy": DeployConfig(device=str(device), dtype="bfloat16" if dtype == torch.bfloat16 else "float32")}
        fam = LTX2Family()
        self.model = fam.from_components(dict(comps), device=device, dtype=dtype, options=options)
        spec = fam.build_pipeline(self.model, TaskType.T2V, options)
        self.built = BuiltPipeline(spec=spec, components=self.model.components, device=device, dtype=dtype,
                                   options=options)

    def run(self, steps: int, size: tuple[int, int, int], stg_block: int) -> list[float]:
        from omniloop.execution import Execution
        from omniloop.schema import request_from_dict

        f, h, w = size
        req = request_from_dict({"task": "t2v", "prompt": PROMPT, "diffusion": {
            "steps": steps, "seed": 0, "frames": f, "height": h, "width": w, "fps": 24.0},
            "node_params": {"denoise": {"stg_blocks": [stg_block]}}})
        ex = Execution(self.built, req)
        marks: list[float] = []
        while not ex.done:
            node = ex.current_node
            if node is not None and node.name.endswith("decode"):
                break  # the denoise steps are what is timed (diffusers' side stops at its latents)
            ex.advance()
            if node is not None and node.name == "denoise":
                sync()
                marks.append(time.perf_counter())
        return [b - a for a, b in itertools.pairwise(marks)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--compile-layers", type=int, default=4, help="blocks of the transformer of the compiled phase")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=80.0, help="start no new phase after this many seconds")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    size = (9, 64, 64) if args.smoke else (121, 512, 768)
    out_path = Path(args.out) / f"ltx2_gpu-{'smoke' if args.smoke else 'h200'}-{dt.date.today().isoformat()}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"command": "python bench/ltx2_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                           "torch": torch.__version__, "size_frames_h_w": list(size), "steps_per_run": args.steps,
                           "passes_per_step": 3, "phases": {}}

    def save() -> None:
        out_path.write_text(json.dumps(doc, indent=1))

    def phase(name: str, layers: int, compiled: bool) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            comps = build(layers, device, dtype, args.smoke, Path(tmp))
            params = sum(p.numel() for p in comps["transformer"].parameters())
            res: dict[str, Any] = {"layers": layers, "transformer_params": params,
                                   "build_seconds": round(time.perf_counter() - t, 2)}
            doc["phases"][name] = res
            stg = min(28, layers - 1)
            side = OmniloopSide(comps, device, dtype)
            with torch.no_grad():
                if compiled:
                    t = time.perf_counter()
                    comps["transformer"].compile_repeated_blocks(fullgraph=True,
                                                                 backend="eager" if args.smoke else "inductor")
                    diffusers_side(comps, 2, size, stg)  # compile (batch 2 and batch 1 graphs)
                    res["compile_warmup_seconds"] = round(time.perf_counter() - t, 2)
                else:
                    diffusers_side(comps, 2, size, stg)  # warm-up: kernels, allocator
                    side.run(2, size, stg)
                save()
                for label, fn in (("diffusers", lambda: diffusers_side(comps, args.steps, size, stg)),
                                  ("omniloop", lambda: side.run(args.steps, size, stg)),
                                  ("diffusers#2", lambda: diffusers_side(comps, args.steps, size, stg)),
                                  ("omniloop#2", lambda: side.run(args.steps, size, stg))):
                    key = label.split("#")[0] + ("-compile" if compiled else "")
                    res.setdefault(key + "_step_times", []).extend(round(x, 4) for x in fn())
                    save()
            for key in [k for k in res if k.endswith("_step_times")]:
                res[key.replace("_step_times", "_step_seconds")] = round(statistics.median(res[key]), 4)
            if device.type == "cuda":
                res["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
            save()
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()

    phase("eager", args.layers, compiled=False)
    print(json.dumps(doc["phases"]["eager"]), flush=True)
    if time.perf_counter() - t0 < args.budget_s:
        phase("compile", args.compile_layers, compiled=True)
        print(json.dumps(doc["phases"]["compile"]), flush=True)
    else:
        doc["phases"]["compile"] = {"skipped": f"device-time budget: {time.perf_counter() - t0:.0f} s used"}
    doc["wall_seconds"] = round(time.perf_counter() - t0, 1)
    save()
    print(out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
