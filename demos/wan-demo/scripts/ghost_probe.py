"""Probe the duplicate objects wan-demo v2 still draws at some seeds (CPU; issue 22's "no ghosts").

    # the clips a GPU eval found with a ghost in >= 8 of 17 frames, re-run through the omniloop
    # runtime with each sampler setting; prints one JSON line per setting
    OMP_NUM_THREADS=2 python demos/wan-demo/scripts/ghost_probe.py settings \\
        --from bench/results/adherence-wan-demo-v2-gpu-2026-12-02.json [--only base,g1]

    # autoguidance (Karras et al. 2024: v = v_weak + w (v_good - v_weak), both on the prompt) with
    # an earlier, weaker checkpoint as the weak model -- here session E's, from git -- against the
    # shipped model's CFG, on the same clips plus a seed-0 control set; flow Euler, 20 steps, shift 3
    git archive 7f0d963 families/wan-demo/omniloop_wan_demo/checkpoint | tar -x -C /tmp/ckE
    OMP_NUM_THREADS=2 python demos/wan-demo/scripts/ghost_probe.py autoguide \
        --from bench/results/adherence-wan-demo-v2-gpu-2026-12-02.json \
        --weak /tmp/ckE/families/wan-demo/omniloop_wan_demo/checkpoint --runs cfg:3,auto:2,auto:3

    # UniPC's x0 prediction at steps 0,1,2,3,4,6,8,12,19 of one prompt at two seeds (diffusers
    # WanPipeline, 20 steps, guidance 3), decoded: frames 4 and 12 of each, one row pair per seed
    OMP_NUM_THREADS=2 python demos/wan-demo/scripts/ghost_probe.py x0 "a blue circle moving down" 1 0 x0.png

The 2026-12-02 finding (bench/results/adherence-wan-demo-v2-gpu-2026-12-02.json): the x0
prediction at the first step (sigma 1.0) already holds two objects for a seed that ends with a
duplicate, and no deterministic sampler setting below removes most of them; autoguidance with
session E's weights as the weak model removes a third of them (33 -> 20 at w 3). What did remove
them is stochastic sampling, the preset's default since session J (evaluated on the GPU by
``training.v2 --eval-v2 ...@euler-sde``: bench/results/adherence-wan-demo-v2-sde-gpu-2026-12-02.json).
The settings here stay relative to the earlier default, UniPC at guidance 3 and shift 3.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

#: request overrides per setting (``diffusion`` keys and ``node_params.denoise`` keys)
SETTINGS: dict[str, dict] = {
    "base": {},
    "g1": {"diffusion": {"guidance_scale": 1.0}},
    "g5": {"diffusion": {"guidance_scale": 5.0}},
    "interval-0.2-1": {"denoise": {"cfg": "interval", "cfg_window": [0.2, 1.0]}},
    "interval-0-0.5": {"denoise": {"cfg": "interval", "cfg_window": [0.0, 0.5]}},
    "shift6": {"denoise": {"shift": 6.0}},
    "shift1.5": {"denoise": {"shift": 1.5}},
    "flow-euler": {"denoise": {"sampler": "flow-euler"}},
    "dpmpp": {"denoise": {"sampler": "dpmpp"}},
    "steps50": {"diffusion": {"steps": 50}},
}
X0_STEPS = (0, 1, 2, 3, 4, 6, 8, 12, 19)


def duplicate_clips(results: dict) -> list[tuple[str, int]]:
    """(prompt, seed) of the per-clip records (``clips_v2_at_20_*``) with a ghost in >= 8 frames."""
    for key, clips in results.items():
        if key.startswith("clips_v2_at_20"):
            return [(c["p"], int(c["s"])) for c in clips if c.get("g", 0) >= 8]
    raise SystemExit("--from: no clips_v2_at_20_* per-clip table in that results file")


def tally(name: str, rows: list[tuple[int, bool]], seconds: float, **extra) -> None:
    """One JSON line: clips with a ghost / a duplicate (ghost in >= 8 frames) / right attributes."""
    print(json.dumps({"setting": name, **extra, "clips": len(rows), "with_a_ghost": sum(g > 0 for g, _ in rows),
                      "duplicates (ghost in >= 8 frames)": sum(g >= 8 for g, _ in rows),
                      "colour_shape_direction_right": sum(ok for _, ok in rows), "seconds": round(seconds, 1)}), flush=True)


def verdict(frames: np.ndarray, prompt: str) -> tuple[int, bool]:
    from omniloop_wan_demo.evaluate import detect
    from omniloop_wan_demo.prompts import parse_prompt

    d = detect(frames)
    return d.ghost_frames, (d.color, d.shape, d.direction) == parse_prompt(prompt)


def settings(a: argparse.Namespace) -> None:
    from omniloop import Runtime

    names = a.only.split(",") if a.only else list(SETTINGS)
    bad = [n for n in names if n not in SETTINGS]
    if bad:
        raise SystemExit(f"--only: unknown setting {bad[0]!r} (known: {', '.join(SETTINGS)})")
    with open(a.src) as f:
        clips = duplicate_clips(json.load(f))
    # the settings are relative to the preset's default until session J -- UniPC, guidance 3, the
    # scheduler config's shift 3 -- and flow-euler is the deterministic one (the preset's
    # stochastic_sampling option is turned off for this deployment)
    rt = Runtime.from_model("wan-demo", policies={"sampler": "unipc",
                                                  "sampler_options": {"flow-euler": {"stochastic_sampling": False}}})
    for name in names:
        over, t0, rows = SETTINGS[name], time.perf_counter(), []
        for prompt, seed in clips:
            req: dict = {"task": "t2v", "prompt": prompt,
                         "diffusion": {"seed": seed, "steps": 20, "guidance_scale": 3.0, "shift": 3.0, **over.get("diffusion", {})}}
            if "denoise" in over:
                req["node_params"] = {"denoise": over["denoise"]}
            out = rt.generate(req)
            if not out.ok:
                raise SystemExit(f"{name}: {out.error}")
            rows.append(verdict(np.asarray(out.artifacts["video"].frames), prompt))
        tally(name, rows, time.perf_counter() - t0)


def autoguide(a: argparse.Namespace) -> None:
    import torch
    from diffusers import WanPipeline, WanTransformer3DModel
    from diffusers.utils.torch_utils import randn_tensor
    from transformers import UMT5EncoderModel

    from omniloop_wan_demo.checkpoint_path import checkpoint_dir

    runs = []
    for item in a.runs.split(","):
        mode, _, w = item.partition(":")
        if mode not in ("cfg", "auto") or not w:
            raise SystemExit(f"--runs: {item!r} is not cfg:W or auto:W")
        runs.append((mode, float(w)))
    with open(a.src) as f:
        clips = duplicate_clips(json.load(f))
    control = [(p, 0) for p in sorted({p for p, _ in clips})]  # the same prompts at seed 0 (clean there)
    pipe = WanPipeline.from_pretrained(str(checkpoint_dir()), torch_dtype=torch.float32)
    weak = WanTransformer3DModel.from_pretrained(f"{a.weak}/transformer", torch_dtype=torch.float32).eval()
    weak_te = UMT5EncoderModel.from_pretrained(f"{a.weak}/text_encoder", torch_dtype=torch.float32).eval()
    vae = pipe.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)

    @torch.no_grad()
    def embed(te, prompt: str) -> torch.Tensor:  # as WanPipeline: the real tokens, zero-padded to 512
        ids = pipe.tokenizer([prompt], padding="max_length", max_length=512, truncation=True, return_tensors="pt")
        h = te(ids.input_ids, ids.attention_mask).last_hidden_state
        h[:, int(ids.attention_mask.sum()):] = 0
        return h

    @torch.no_grad()
    def sample(prompt: str, seed: int, mode: str, w: float, steps: int = 20, shift: float = 3.0) -> np.ndarray:
        x = randn_tensor((1, 16, 5, 16, 16), generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32)
        s = torch.linspace(1, 0, steps + 1)
        s = shift * s / (1 + (shift - 1) * s)
        good_c = embed(pipe.text_encoder, prompt)
        other, other_e = (pipe.transformer, embed(pipe.text_encoder, "")) if mode == "cfg" else (weak, embed(weak_te, prompt))
        for i in range(steps):
            t = (s[i] * 1000).expand(1)
            vc = pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=good_c, return_dict=False)[0]
            vo = other(hidden_states=x, timestep=t, encoder_hidden_states=other_e, return_dict=False)[0]
            x = x + (s[i + 1] - s[i]) * (vo + w * (vc - vo))
        video = vae.decode(x * std + mean, return_dict=False)[0]
        return ((video[0].clamp(-1, 1) + 1) / 2 * 255).round().to(torch.uint8).permute(1, 2, 3, 0).numpy()

    for mode, w in runs:
        for name, todo in (("duplicate clips", clips), ("seed-0 control", control)):
            t0 = time.perf_counter()
            tally(f"{mode}:{w:g}", [verdict(sample(p, sd, mode, w), p) for p, sd in todo], time.perf_counter() - t0, set=name)


def x0(a: argparse.Namespace) -> None:
    import torch
    from diffusers import WanPipeline
    from PIL import Image

    from omniloop_wan_demo.checkpoint_path import checkpoint_dir

    pipe = WanPipeline.from_pretrained(a.checkpoint or str(checkpoint_dir()), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    vae = pipe.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    rows = []
    for seed in a.seeds:
        preds: list[torch.Tensor] = []

        def keep(p, i, t, kw, preds=preds):
            preds.append(p.scheduler.model_outputs[-1].detach().clone())  # UniPC keeps its x0 predictions
            return kw

        pipe(prompt=a.prompt, negative_prompt="", num_inference_steps=20, guidance_scale=3.0, height=64, width=64,
             num_frames=17, generator=torch.Generator("cpu").manual_seed(seed), output_type="np", callback_on_step_end=keep)
        cols = []
        for i in X0_STEPS:
            with torch.no_grad():
                v = vae.decode(preds[i] / inv_std + mean, return_dict=False)[0]
            fr = ((v[0].clamp(-1, 1) + 1) / 2).permute(1, 2, 3, 0).numpy()
            cols.append(np.concatenate([fr[4], fr[12]], axis=0))
        rows.append(np.concatenate(cols, axis=1))
    img = (np.concatenate(rows, axis=0) * 255).round().astype(np.uint8)
    Image.fromarray(img).save(a.out)
    print(f"wrote {a.out}: columns = steps {list(X0_STEPS)}, rows = frames 4 / 12 of seeds {a.seeds}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("settings", help="re-run a GPU eval's duplicate clips under each sampler setting")
    s.add_argument("--from", dest="src", required=True, help="a results JSON with a clips_v2_at_20_* table")
    s.add_argument("--only", help=f"comma list of {', '.join(SETTINGS)}")
    g = sub.add_parser("autoguide", help="autoguidance with a weaker checkpoint vs CFG, on a GPU eval's duplicate clips")
    g.add_argument("--from", dest="src", required=True, help="a results JSON with a clips_v2_at_20_* table")
    g.add_argument("--weak", required=True, help="a wan-demo pipeline folder (transformer/, text_encoder/) to guide away from")
    g.add_argument("--runs", default="cfg:3,auto:2,auto:3", help="comma list of cfg:W (the shipped model's CFG) / auto:W")
    x = sub.add_parser("x0", help="decoded x0 predictions along one sampling run")
    x.add_argument("prompt")
    x.add_argument("seeds", type=int, nargs="+")
    x.add_argument("out")
    x.add_argument("--checkpoint", help="a diffusers pipeline folder (default: the shipped wan-demo)")
    a = ap.parse_args(argv)
    if a.cmd == "x0" and not a.out.endswith(".png"):
        ap.error(f"x0: OUT must be a .png file, got {a.out!r}")
    {"settings": settings, "autoguide": autoguide, "x0": x0}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
