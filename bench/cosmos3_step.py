"""Cosmos 3 omni: one denoise step (both CFG branches) of omniloop's cosmos3 family vs diffusers'
``Cosmos3OmniTransformer.forward``, on a randomly initialised transformer.

diffusers runs the whole packed sequence — the text (understanding) prefix and the vision tokens
— through every layer for each branch at every step. omniloop runs the und pathway once per
request and branch (its K/V held in the text-KV pool) and per step only the gen pathway, with the
vision tokens embedded once for both branches. This script times, on one device:

* ``diffusers_step``: two ``Cosmos3OmniTransformer.forward`` calls (cond, uncond), eager, and with
  ``--compile`` the same under ``torch.compile`` of each decoder layer (``compile_repeated_blocks``);
* ``omniloop_step``: the family's step body (``embed_vision`` + ``generate`` per branch), and with
  ``--compile`` the same with the gen layer body under ``torch.compile`` (deploy ``compile: true``);
* ``omniloop_text_once``: the und pathway of both branches (paid once per request);

and checks the predictions agree (bit-exact on CPU float32). Per request of ``--steps`` steps the
saving is ``steps * (diffusers_step - omniloop_step) - omniloop_text_once``.

    python bench/cosmos3_step.py --preset cpu-small --out bench/results
    python bench/cosmos3_step.py --preset cosmos3-480p --device cuda --dtype bfloat16 --compile --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _repo_paths

_repo_paths.add_repo_packages()

import torch  # noqa: E402

#: transformer configs and workloads: text tokens per branch, latent (T, H, W) after the VAE
PRESETS: dict[str, dict[str, Any]] = {
    # a text-heavy CPU size: 240 / 236 text tokens, 3 x 8 x 12 latents (72 vision tokens)
    "cpu-small": {"tf": dict(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=64, num_hidden_layers=4, rope_axes_dim=[16, 8, 8], vocab_size=1024),
                  "text": (240, 236), "latent": (3, 8, 12)},
    # the same model over a 4x longer clip (288 vision tokens): the text's share of the sequence falls
    "cpu-small-long": {"tf": dict(hidden_size=256, intermediate_size=768, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=64, num_hidden_layers=4, rope_axes_dim=[16, 8, 8],
                                  vocab_size=1024),
                       "text": (240, 236), "latent": (12, 8, 12)},
    # Cosmos 3's default transformer (36 layers, 4096 wide, GQA 32/8), 480p (480x832) 5 s at 24 fps:
    # 121 frames -> 31 x 30 x 52 latents (16x VAE, patch 2: 31 x 15 x 26 = 12090 vision tokens)
    "cosmos3-480p": {"tf": dict(), "text": (300, 300), "latent": (31, 30, 52)},
}


def build(preset: dict[str, Any], device: str, dtype: torch.dtype) -> Any:
    from diffusers import Cosmos3OmniTransformer

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: no float32 copy of a 15B model
    try:
        with torch.device(device):
            tf = Cosmos3OmniTransformer(**preset["tf"]).eval()
    finally:
        torch.set_default_dtype(default)
    return tf


def inputs(tf: Any, preset: dict[str, Any], device: str) -> dict[str, Any]:
    """Latents, the timestep and each branch's ids and packed layout (the family's builders)."""
    from omniloop_cosmos3 import transformer as T
    from omniloop_cosmos3.denoise import packed_layout

    g = torch.Generator().manual_seed(1)
    t, h, w = preset["latent"]
    lat = torch.randn(1, tf.config.latent_channel, t, h, w, generator=g).to(device)
    grid = T.patch_grid(tf, tuple(lat.shape))
    branches = {}
    for name, n in zip(("cond", "uncond"), preset["text"], strict=True):
        ids = torch.randint(0, tf.config.vocab_size, (n,), generator=g).to(device)
        layout = packed_layout(tf, n, grid, list(range(t)), 24.0, 4)
        branches[name] = {"ids": ids, "layout": layout}
    return {"latents": lat, "grid": grid, "noisy": torch.arange(t, device=device), "timestep": 700.0,
            "branches": branches}


def diffusers_step(tf: Any, x: dict[str, Any]) -> list[torch.Tensor]:
    out = []
    lat = x["latents"].to(tf.dtype)
    for b in x["branches"].values():
        lay = b["layout"]
        v = lay["vision"]
        n_noisy = v.length
        out.append(tf(input_ids=b["ids"], text_indexes=torch.arange(lay.und_len, device=lat.device),
                      position_ids=lay.position_ids.to(lat.device), und_len=lay.und_len, sequence_length=lay.length,
                      vision_tokens=[lat], vision_token_shapes=[v.grid],
                      vision_sequence_indexes=v.sequence_indexes(lat.device),
                      vision_mse_loss_indexes=v.noisy_indexes(lat.device),
                      vision_timesteps=torch.full((n_noisy,), x["timestep"], device=lat.device),
                      vision_noisy_frame_indexes=[x["noisy"]], return_dict=False)[0][0])
    return out


def text_once(tf: Any, x: dict[str, Any]) -> dict[str, Any]:
    from omniloop_cosmos3 import transformer as T

    kv = {}
    for name, b in x["branches"].items():
        lay = b["layout"]
        cos, sin = T.rotary(tf, lay.position_ids, x["latents"].device, tf.dtype)
        u = lay.und_len
        kv[name] = {"kv": T.understand(tf, b["ids"], (cos[:u], sin[:u])), "rot": (cos[u:], sin[u:])}
    return kv


def omniloop_step(tf: Any, x: dict[str, Any], kv: dict[str, Any], layer_fn: Any = None) -> list[torch.Tensor]:
    from omniloop_cosmos3 import transformer as T

    lat = x["latents"]
    tokens = T.embed_vision(tf, lat.to(tf.dtype), x["grid"], x["noisy"], x["timestep"])
    out = []
    for name, b in x["branches"].items():
        lay = b["layout"]
        gen = tokens.new_zeros((lay.gen_len, tokens.shape[-1]))
        gen[lay.gen_indexes("vision", device=lat.device)] = tokens
        hidden = T.generate(tf, gen, kv[name]["rot"], lambda i, n=name: kv[n]["kv"][i], layer_fn)
        out.append(T.read_vision(tf, hidden, lay.gen_indexes("vision", noisy=True, device=lat.device), x["grid"],
                                 x["noisy"], tuple(lat.shape)))
    return out


def timed(fn: Any, reps: int, device: str) -> tuple[float, Any]:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    got = fn()  # warm-up (and compilation)
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        got = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), got


def main(argv: list[str] | None = None) -> int:
    from _common import command_line, library_versions, machine

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu-small")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=35, help="steps per request for the per-request figure")
    ap.add_argument("--compile", action="store_true", help="also time diffusers with compiled decoder layers")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    preset = PRESETS[args.preset]
    tf = build(preset, args.device, dtype)
    x = inputs(tf, preset, args.device)
    rec: dict[str, Any] = {"bench": "cosmos3_step", "command": command_line("bench/cosmos3_step.py", sys.argv[1:]
                                                                              if argv is None else argv),
                           "machine": machine(**library_versions()), "preset": args.preset, "dtype": args.dtype,
                           "text_tokens": list(preset["text"]),
                           "vision_tokens": x["branches"]["cond"]["layout"]["vision"].length,
                           "layers": tf.config.num_hidden_layers, "hidden": tf.config.hidden_size}
    with torch.no_grad():
        t_ref, ref = timed(lambda: diffusers_step(tf, x), args.reps, args.device)
        t_once, kv = timed(lambda: text_once(tf, x), args.reps, args.device)
        t_ours, ours = timed(lambda: omniloop_step(tf, x, kv), args.reps, args.device)
        rec["bit_exact"] = all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))
        rec["max_abs_diff"] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(ours, ref, strict=True))
        rec.update(diffusers_step_s=round(t_ref, 6), omniloop_step_s=round(t_ours, 6),
                   omniloop_text_once_s=round(t_once, 6), step_speedup=round(t_ref / t_ours, 4))
        per_request_ref = args.steps * t_ref
        per_request_ours = args.steps * t_ours + t_once
        rec["per_request"] = {"steps": args.steps, "diffusers_s": round(per_request_ref, 4),
                              "omniloop_s": round(per_request_ours, 4),
                              "saved_fraction": round(1 - per_request_ours / per_request_ref, 4)}
        path = None
        if args.out is not None:  # written now, and again with the compiled figures
            args.out.mkdir(parents=True, exist_ok=True)
            path = args.out / f"cosmos3-step-{args.preset}-{args.device.split(':')[0]}.json"
            path.write_text(json.dumps(rec, indent=2) + "\n")
        if args.compile:  # omniloop's deploy compile: true (one compiled gen-layer body), then diffusers'
            from omniloop_cosmos3.transformer import gen_layer

            fn = torch.compile(gen_layer, dynamic=False)
            t_oc, _ = timed(lambda: omniloop_step(tf, x, kv, fn), args.reps, args.device)
            rec["omniloop_compiled_step_s"] = round(t_oc, 6)
            tf.compile_repeated_blocks(fullgraph=False)
            t_c, _ = timed(lambda: diffusers_step(tf, x), args.reps, args.device)
            rec["diffusers_compiled_step_s"] = round(t_c, 6)
            rec["omniloop_vs_compiled"] = round(t_c / t_ours, 4)
            rec["omniloop_compiled_vs_compiled"] = round(t_c / t_oc, 4)
    print(json.dumps(rec, indent=2))
    if path is not None:
        path.write_text(json.dumps(rec, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
