"""omniloop's Wan family against diffusers' ``WanPipeline``, side by side in one process (GPU).

Wan2.1 T2V 1.3B architecture with random weights (timing does not depend on the values): the
1.3B transformer, the real VAE config, a UMT5-XXL-sized text encoder, UniPC with flow shift 3.
Both sides share the very same modules. 480x832, 81 frames, CFG 5.0, bf16 (VAE float32).

Runs are interleaved (diffusers, omniloop, diffusers, ...) after a warm-up of each; every time is
taken with ``torch.cuda.synchronize()`` on both ends. Reported per side:

* ``s_per_step``: median seconds of one denoise step (two transformer forwards + CFG + solver),
  steps 1..N-1 of every run (step 0 also holds the loop's set-up);
* ``s_end_to_end``: median seconds from prompt to frames (text encode, denoise, VAE decode): for
  diffusers up to its ``output_type="np"`` float frames, for omniloop up to its uint8 ``video``;

and the ratios omniloop / diffusers (target: <= 1.00). Also checks that both produce the same
frames (same seed, same CPU-generator noise).

    python bench/wan_vs_diffusers.py [--steps 10] [--repeats 3]    # writes bench/results/wan_vs_diffusers-<date>.json
    python bench/wan_vs_diffusers.py --smoke --no-write              # toy sizes on a CPU: checks the script
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ (also when loaded by file path)
from _repo_paths import add_repo_packages

add_repo_packages()

HERE = Path(__file__).resolve().parent

CFG_13B = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)
UMT5_XXL = dict(
    vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
    dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
)
PROMPT = "a red fox jumps over the lazy dog in the snow, close up shot"
NEGATIVE = "blurry, low quality, static"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


SMOKE_TF = dict(CFG_13B, num_attention_heads=2, attention_head_dim=12, text_dim=32, ffn_dim=32, num_layers=2)
SMOKE_TE = dict(UMT5_XXL, vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
SMOKE_VAE = dict(base_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1)


def build_components(device: torch.device, dtype: torch.dtype, smoke: bool = False) -> dict[str, Any]:
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

    from omniloop_wan.tiny import _scheduler_config, build_tokenizer

    torch.manual_seed(0)
    with torch.device(device):
        tf = WanTransformer3DModel(**(SMOKE_TF if smoke else CFG_13B)).to(dtype).eval().requires_grad_(False)
        vae = AutoencoderKLWan(**(SMOKE_VAE if smoke else {})).to(torch.float32).eval().requires_grad_(False)
        te = UMT5EncoderModel(UMT5Config(**(SMOKE_TE if smoke else UMT5_XXL))).to(dtype).eval().requires_grad_(False)
    tok_dir = Path(tempfile.mkdtemp()) / "tokenizer"
    build_tokenizer(tok_dir)
    _, sched_cfg = _scheduler_config("t2v", "unipc")
    return {
        "transformer": tf, "vae": vae, "text_encoder": te,
        "tokenizer": AutoTokenizer.from_pretrained(str(tok_dir)),
        "scheduler": UniPCMultistepScheduler.from_config(sched_cfg),
    }


class DiffusersSide:
    name = "diffusers"

    def __init__(self, comps: dict[str, Any]) -> None:
        self.comps = comps

    def run(self, steps: int, seed: int, size: tuple[int, int, int]) -> tuple[float, list[float], torch.Tensor]:
        from diffusers import WanPipeline

        c = self.comps
        pipe = WanPipeline(tokenizer=c["tokenizer"], text_encoder=c["text_encoder"], vae=c["vae"],
                           scheduler=type(c["scheduler"]).from_config(c["scheduler"].config), transformer=c["transformer"])
        pipe.set_progress_bar_config(disable=True)
        marks: list[float] = []

        def on_step(_pipe: Any, i: int, t: Any, kw: dict[str, Any]) -> dict[str, Any]:
            sync()
            marks.append(time.perf_counter())
            return {}

        frames_n, h, w = size
        sync()
        t0 = time.perf_counter()
        out = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, height=h, width=w, num_frames=frames_n,
                   num_inference_steps=steps, guidance_scale=5.0, generator=torch.Generator("cpu").manual_seed(seed),
                   output_type="np", callback_on_step_end=on_step)
        sync()
        total = time.perf_counter() - t0  # to diffusers' own output (float numpy), before our uint8 conversion
        frames = torch.from_numpy((out.frames[0] * 255).round().astype("uint8"))
        return total, [b - a for a, b in itertools.pairwise(marks)], frames


class OmniloopSide:
    name = "omniloop"

    def __init__(self, comps: dict[str, Any], device: torch.device, dtype: torch.dtype) -> None:
        from omniloop.execution import BuiltPipeline
        from omniloop.request import TaskType
        from omniloop_wan.family import WanFamily

        fam = WanFamily()
        self.model = fam.from_components(comps, device=device, dtype=dtype)
        spec = fam.build_pipeline(self.model, TaskType.T2V, {})
        self.built = BuiltPipeline(spec=spec, components=comps, device=device, dtype=dtype)

    def run(self, steps: int, seed: int, size: tuple[int, int, int]) -> tuple[float, list[float], torch.Tensor]:
        from omniloop.execution import Execution
        from omniloop.schema import request_from_dict

        frames_n, h, w = size
        req = request_from_dict({
            "task": "t2v",
            "inputs": [{"type": "text", "text": PROMPT}, {"type": "text", "text": NEGATIVE, "role": "negative_prompt"}],
            "diffusion": {"steps": steps, "guidance_scale": 5.0, "seed": seed, "height": h, "width": w, "frames": frames_n},
        })
        sync()
        t0 = time.perf_counter()
        ex = Execution(self.built, req)
        marks: list[float] = []
        while not ex.done:
            node = ex.current_node
            ex.advance()
            if node is not None and node.name == "denoise":
                sync()
                marks.append(time.perf_counter())
        sync()
        total = time.perf_counter() - t0
        out = ex.output
        assert out.ok, out.error
        return total, [b - a for a, b in itertools.pairwise(marks)], out.artifacts["video"].frames


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--frames", type=int, default=81)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--out", default=os.environ.get("RESULTS_DIR", str(HERE / "results")))
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="toy sizes, to check the script on a CPU")
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    size = (args.frames, args.height, args.width)
    t_build = time.perf_counter()
    if args.smoke:
        size = (9, 32, 32)
    comps = build_components(device, dtype, smoke=args.smoke)
    print(f"built components in {time.perf_counter() - t_build:.1f} s", flush=True)
    sides = [DiffusersSide(comps), OmniloopSide(comps, device, dtype)]

    with torch.no_grad():
        for side in sides:  # warm-up: kernels, allocator, cuDNN plans
            side.run(2, 0, size)
        totals: dict[str, list[float]] = {s.name: [] for s in sides}
        steps: dict[str, list[float]] = {s.name: [] for s in sides}
        frames: dict[str, torch.Tensor] = {}
        for rep in range(args.repeats):
            for side in (sides if rep % 2 == 0 else sides[::-1]):
                total, per_step, fr = side.run(args.steps, 42, size)
                totals[side.name].append(total)
                steps[side.name].extend(per_step)
                frames[side.name] = fr
                print(json.dumps({"side": side.name, "rep": rep, "s_total": round(total, 3),
                                  "s_per_step_median": round(statistics.median(per_step), 4)}), flush=True)

    result: dict[str, Any] = {}
    for name in totals:
        result[name] = {
            "s_per_step": round(statistics.median(steps[name]), 4),
            "s_per_step_min": round(min(steps[name]), 4),
            "s_end_to_end": round(statistics.median(totals[name]), 3),
            "runs": len(totals[name]),
        }
    ratio_step = result["omniloop"]["s_per_step"] / result["diffusers"]["s_per_step"]
    ratio_e2e = result["omniloop"]["s_end_to_end"] / result["diffusers"]["s_end_to_end"]
    same = torch.equal(frames["omniloop"], frames["diffusers"])
    record = {
        "bench": "wan_vs_diffusers",
        "command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "date": dt.date.today().isoformat(),
        "machine": {
            "platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torch_threads": torch.get_num_threads(),
        },
        "setup": {"model": "Wan2.1 T2V 1.3B architecture, random weights", "text_encoder": "UMT5-XXL size, random",
                  "dtype": "bfloat16 (VAE float32)", "frames": size[0], "height": size[1], "width": size[2],
                  "steps": args.steps, "guidance_scale": 5.0, "scheduler": "UniPC flow shift 3", "repeats": args.repeats},
        "results": result,
        "ratio_s_per_step": round(ratio_step, 4),
        "ratio_end_to_end": round(ratio_e2e, 4),
        "frames_equal": same,
    }
    try:
        import diffusers
        import transformers

        record["machine"]["diffusers"] = diffusers.__version__
        record["machine"]["transformers"] = transformers.__version__
    except ImportError:
        pass
    print(json.dumps(record, indent=1), flush=True)
    if not args.no_write:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"wan_vs_diffusers-{record['date']}.json"
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
