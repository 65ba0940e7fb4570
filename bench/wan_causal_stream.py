"""Streaming causal Wan (issue 21): time to first chunk and steady frames per second of the chunk
rollout, vs generating the whole clip at once with the same transformer and step count.

Random weights, the Wan2.1 T2V 1.3B transformer architecture (timing does not depend on the
values) and a full-size Wan VAE, ``--dtype`` (bf16 on a GPU), 480×832, 81 frames (21 latent
frames = 7 chunks of 3), a 4-step flow schedule, no CFG, random text states ``[1, 512, 4096]``
(the text encoder runs once per prompt on both sides and is left out).

``stream``  :class:`omniloop_wan.causal.CausalWan`: per chunk 4 forwards over the chunk's 4680
            tokens attending to the cached slabs, one K/V-recording forward, the incremental VAE
            decode; ``first_chunk_s`` is the first chunk's frames ready, ``steady_fps`` the frames
            per second of chunks 2..7
``whole``   4 forwards of the bidirectional transformer over all 21 latent frames, then one VAE
            decode of the clip: its first frame is ready when the whole clip is

Interleaved and repeated; medians. Results go to ``$OUT`` if set, else ``bench/results/``, as
``wan_causal_stream-<date>[-smoke].json`` with the command line and the machine.

    python bench/wan_causal_stream.py                 # H200 (not yet run: written when the device time was spent)
    python bench/wan_causal_stream.py --smoke         # tiny transformer on a CPU: checks the script
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _repo_paths

_repo_paths.add_repo_packages()

from _common import CFG_13B, SMOKE_TF, SMOKE_VAE, command_line, library_versions, machine, sync, video_parser  # noqa: E402


def build(smoke: bool, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    torch.manual_seed(0)
    tf = WanTransformer3DModel(**(SMOKE_TF if smoke else CFG_13B)).eval().to(device, dtype)
    vae = AutoencoderKLWan(**(SMOKE_VAE if smoke else {})).eval().to(device, torch.float32)
    return tf, vae


def run_stream(eng: Any, text: torch.Tensor, chunks: int, seed: int) -> dict[str, Any]:
    stream = eng.open_stream(seed, reserve_chunks=chunks)
    t0 = time.perf_counter()
    marks, frames = [], []
    for out in eng.run(stream, text, chunks):
        sync()
        marks.append(time.perf_counter() - t0)
        frames.append(int(out.video.shape[2]))
    stream.free()
    steady = (marks[-1] - marks[0]) / max(1, sum(frames[1:])) if len(marks) > 1 else None
    return {"first_chunk_s": marks[0], "total_s": marks[-1], "chunk_marks_s": marks, "frames": frames,
            "steady_fps": (1.0 / steady) if steady else None}


@torch.no_grad()
def run_whole(tf: Any, vae: Any, text: torch.Tensor, latent_shape: tuple[int, ...], steps: int, shift: float,
              seed: int) -> dict[str, Any]:
    from omniloop_wan.causal import CausalOptions, StreamingDecoder
    from omniloop_wan.transformer import wan_forward

    dev, dt_ = next(tf.parameters()).device, next(tf.parameters()).dtype
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(latent_shape, generator=g).to(dev, dt_)
    sig = CausalOptions(steps=steps, shift=shift).sigmas()
    t0 = time.perf_counter()
    for s, s_next in itertools.pairwise(sig):
        v = wan_forward(tf, x, torch.full((1,), s * 1000.0, device=dev, dtype=dt_), text)
        x = (x.float() + (s_next - s) * v.float()).to(dt_)
    sync()
    t_denoise = time.perf_counter() - t0
    video = StreamingDecoder(vae).full_decode_reference(x.float())
    sync()
    total = time.perf_counter() - t0
    return {"first_frame_s": total, "total_s": total, "denoise_s": t_denoise, "frames": int(video.shape[2]),
            "fps": video.shape[2] / total}


def main(argv: list[str] | None = None) -> int:
    ap = video_parser(__doc__, steps=4, repeats=3, frames=81, height=480, width=832)
    ap.add_argument("--smoke", action="store_true", help="tiny transformer and VAE on the CPU")
    ap.add_argument("--chunk-frames", type=int, default=3)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None)
    args = ap.parse_args(argv)
    from omniloop_wan.causal import CausalOptions, CausalWan

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    h, w = (32, 32) if args.smoke else (args.height, args.width)
    latent_frames = (args.frames - 1) // 4 + 1
    if latent_frames % args.chunk_frames:
        ap.error(f"--frames {args.frames}: {latent_frames} latent frames are not whole chunks of {args.chunk_frames}")
    chunks = latent_frames // args.chunk_frames
    tf, vae = build(args.smoke, device, dtype)
    text_dim = int(tf.config.text_dim)
    text = torch.randn(1, 512, text_dim, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    opts = CausalOptions(chunk_frames=args.chunk_frames, steps=args.steps, kv_slabs=chunks + 1)
    eng = CausalWan(tf, vae, options=opts, height=h, width=w)
    shape = (1, int(tf.config.in_channels), latent_frames, *eng.latent_hw)

    run_stream(eng, text, 1, seed=0)  # warm-up (kernels, allocator)
    run_whole(tf, vae, text, shape, args.steps, opts.shift, seed=0)
    streams, wholes = [], []
    for r in range(args.repeats):
        order = [0, 1] if r % 2 == 0 else [1, 0]
        for k in order:
            if k == 0:
                streams.append(run_stream(eng, text, chunks, seed=r))
            else:
                wholes.append(run_whole(tf, vae, text, shape, args.steps, opts.shift, seed=r))
    med = statistics.median
    s_first = med(s["first_chunk_s"] for s in streams)
    w_first = med(x["first_frame_s"] for x in wholes)
    record = {
        "bench": "wan_causal_stream", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": command_line("bench/wan_causal_stream.py", sys.argv[1:] if argv is None else argv),
        "machine": machine(threads=torch.get_num_threads()), "libraries": library_versions(),
        "config": {"smoke": args.smoke, "dtype": str(dtype), "height": h, "width": w, "frames": args.frames,
                   "latent_frames": latent_frames, "chunk_frames": args.chunk_frames, "chunks": chunks,
                   "steps": args.steps, "tokens_per_chunk": eng.tokens_per_chunk, "repeats": args.repeats},
        "stream": {"first_chunk_s": s_first, "total_s": med(s["total_s"] for s in streams),
                   "steady_fps": med(s["steady_fps"] for s in streams if s["steady_fps"]) if chunks > 1 else None,
                   "runs": streams},
        "whole": {"first_frame_s": w_first, "total_s": med(x["total_s"] for x in wholes),
                  "fps": med(x["fps"] for x in wholes), "runs": wholes},
        "first_frame_speedup": w_first / s_first,
    }
    out_dir = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"wan_causal_stream-{dt.date.today().isoformat()}{'-smoke' if args.smoke else ''}.json"
    (out_dir / name).write_text(json.dumps(record, indent=2))
    print(json.dumps({k: record[k] for k in ("config", "first_frame_speedup")}, indent=2))
    print(f"stream: first chunk {s_first:.3f} s, steady {record['stream']['steady_fps']} fps; "
          f"whole: first frame {w_first:.3f} s -> {out_dir / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
