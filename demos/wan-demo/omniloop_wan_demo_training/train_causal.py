"""Train a block-causal variant of wan-demo (``wan-demo-causal``) from the shipped wan-demo weights.

What the causal rollout does at inference (``omniloop_wan.causal``, ``rollout: causal``): the
video is made ``chunk_frames`` latent frames at a time; a chunk is denoised by a few flow-Euler
steps while attending to itself and to the **clean** keys/values of the earlier chunks, which were
computed once by a forward of the finished chunk at timestep 0 that itself attended to the
chunks before it.

Training reproduces exactly that attention graph in one forward (teacher forcing, with
diffusion-forcing noise levels):

* a training sequence is ``[clean copy of the clip | noisy copy of the clip]`` (``2F`` latent
  frames); both copies sit at the same RoPE frame positions ``0..F-1``;
* every chunk ``i`` of the noisy copy has its **own** noise level ``s_i`` (``x_t = (1-s) x0 +
  s·noise``, target ``noise - x0``, timestep ``1000 s``; ``s`` logit-normal shifted by the
  scheduler's flow shift, as ``train_dit``), so one clip gives one sample per chunk;
* the clean copy runs at timestep 0 (the rollout's ``context_timestep``);
* attention mask (:func:`teacher_forcing_mask`): clean chunk ``j`` sees clean chunks ``<= j``
  (what the rollout's context forward sees); noisy chunk ``i`` sees clean chunks ``< i`` and itself
  (what a denoising step sees); nothing sees a noisy chunk but itself. The loss is on the noisy
  copy only. ``tests/demos/wan_demo/test_train_causal.py`` checks that this forward's prediction for a
  noisy chunk equals the cached :func:`omniloop_wan.causal.chunk_forward` with the clean slabs.

The gradient also flows through the clean copy (it produces the keys/values the noisy chunks
read), as it does at inference. The VAE and the text encoder are frozen (the causal checkpoint
shares wan-demo's); the transformer starts from wan-demo's shipped EMA weights; its EMA is what is
saved. The prompt is dropped to ``""`` ``cfg_drop`` of the time so causal CFG keeps working.

    # GPU (from the repo root; see families/wan-demo/README.md for the exact session command)
    python -m omniloop_wan_demo_training.train_causal --out $OUT/causal --budget-s 240
    # CPU check of the whole script (a few steps, tiny batch; what the fast test runs)
    python -m omniloop_wan_demo_training.train_causal --out /tmp/causal-smoke --smoke

Writes ``--out``: a diffusers-format ``WanPipeline`` folder whose own files are ``transformer/``
(``config.json`` + fp16 ``diffusion_pytorch_model.safetensors``, same layout as wan-demo) and
``omniloop.json`` (the variant and its ``rollout_options``); ``vae``, ``text_encoder``,
``tokenizer``, ``scheduler`` and ``model_index.json`` are links to the source's (frozen, shared),
so the folder loads as it is; plus ``train_causal.json`` (recipe, log, timings, and a quick
adherence check of the causal rollout unless ``--no-eval``). Four files travel back from a GPU
machine. ``--ship DIR`` installs ``DIR``'s ``transformer/`` + ``omniloop.json`` as the package's
``checkpoint_causal/`` (:func:`ship`), where the shared parts are committed links to wan-demo's.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from omniloop_wan_demo.checkpoint_path import (
    CAUSAL_ROLLOUT_OPTIONS,
    CAUSAL_SHARED,
    causal_checkpoint_dir,
    checkpoint_dir,
)

from .common import FLOW_SHIFT, encode_tokens, optimizer_step, sample_batch, schedule_lr, tokenize
from .render import all_prompts
from .train_dit import EMA, encode_dataset, sample_sigmas

PROMPTS = all_prompts()

#: the rollout settings written to the checkpoint's ``omniloop.json`` (the preset reads them)
ROLLOUT_OPTIONS: dict[str, Any] = dict(CAUSAL_ROLLOUT_OPTIONS)

def teacher_forcing_mask(n_chunks: int, chunk_tokens: int) -> torch.Tensor:
    """``[2S, 2S]`` bool attention mask (True = may attend) over ``[clean chunks | noisy chunks]``,
    ``S = n_chunks * chunk_tokens``: clean ``j`` sees clean ``<= j``; noisy ``i`` sees clean
    ``< i`` and noisy ``i``."""
    if n_chunks < 1 or chunk_tokens < 1:
        raise ValueError(f"teacher_forcing_mask: needs >= 1 chunk of >= 1 token, got {n_chunks} x {chunk_tokens}")
    i = torch.arange(n_chunks)[:, None]
    j = torch.arange(n_chunks)[None, :]
    clean_clean = j <= i
    noisy_clean = j < i
    noisy_noisy = j == i
    top = torch.cat([clean_clean, torch.zeros(n_chunks, n_chunks, dtype=torch.bool)], dim=1)
    bottom = torch.cat([noisy_clean, noisy_noisy], dim=1)
    chunk_mask = torch.cat([top, bottom], dim=0)
    return chunk_mask.repeat_interleave(chunk_tokens, 0).repeat_interleave(chunk_tokens, 1)


def teacher_forcing_forward(transformer: Any, x0: torch.Tensor, xt: torch.Tensor, sigmas: torch.Tensor,
                            text: torch.Tensor, chunk_frames: int, mask: torch.Tensor | None = None,
                            context_timestep: float = 0.0) -> torch.Tensor:
    """The flow prediction for the noisy copy ``xt`` ``[B, C, F, H, W]`` (chunk ``i`` at noise
    level ``sigmas[:, i]``), every chunk attending to the clean ``x0`` chunks before it.

    One :func:`omniloop_wan.causal.model.masked_forward` over ``[x0 | xt]`` with
    :func:`teacher_forcing_mask` and per-token timesteps."""
    from omniloop_wan.causal.model import masked_forward

    b, _c, frames, h, w = x0.shape
    if frames % chunk_frames:
        raise ValueError(f"teacher forcing: {frames} latent frames are not whole chunks of {chunk_frames}")
    n_chunks = frames // chunk_frames
    _, ph, pw = transformer.config.patch_size
    per_frame = (h // ph) * (w // pw)
    tokens = chunk_frames * per_frame
    if sigmas.shape != (b, n_chunks):
        raise ValueError(f"teacher forcing: sigmas must be [batch, chunks] = [{b}, {n_chunks}], got {list(sigmas.shape)}")
    if mask is None:
        mask = teacher_forcing_mask(n_chunks, tokens).to(x0.device)
    seq = torch.cat([x0, xt], dim=2)
    t_clean = torch.full((b, n_chunks * tokens), float(context_timestep), device=x0.device, dtype=sigmas.dtype)
    t_noisy = (sigmas * 1000.0).repeat_interleave(tokens, dim=1)
    ts = torch.cat([t_clean, t_noisy], dim=1)
    positions = list(range(frames)) * 2
    out = masked_forward(transformer, seq, ts, text, mask, positions=positions)
    return out[:, :, frames:]


def load_source(src: Path, device: str) -> dict[str, Any]:
    """wan-demo's components (fp32): trainable transformer, frozen VAE / text encoder, tokenizer."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5EncoderModel

    vae = AutoencoderKLWan.from_pretrained(str(src / "vae"), torch_dtype=torch.float32).to(device).eval().requires_grad_(False)
    te = UMT5EncoderModel.from_pretrained(str(src / "text_encoder"), torch_dtype=torch.float32).to(device).eval().requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(str(src / "tokenizer"))
    tf = WanTransformer3DModel.from_pretrained(str(src / "transformer"), torch_dtype=torch.float32).to(device)
    return {"vae": vae, "text_encoder": te, "tokenizer": tok, "transformer": tf}


@torch.no_grad()
def prompt_table(text_encoder: Any, tokenizer: Any, device: str, pad_to: int = 512) -> torch.Tensor:
    """``[len(PROMPTS) + 1, pad_to, D]``: every prompt's embeddings (last row: ``""``), zero-padded
    as the Wan family's text encoder does (the frozen encoder runs once)."""
    ids, mask = tokenize(tokenizer, [*PROMPTS, ""])
    return encode_tokens(text_encoder, ids.to(device), mask.to(device), pad_to).float()


def train_causal(
    *,
    src: Path,
    out: Path,
    budget_s: float = 240.0,
    max_steps: int | None = None,
    batch: int = 128,
    lr: float = 2e-4,
    n_clips: int = 32768,
    encode_seconds: float = 45.0,
    chunk_frames: int = 1,
    cfg_drop: float = 0.1,
    shift: float = FLOW_SHIFT,
    ema_decay: float = 0.999,
    warmup: int = 50,
    decay_frac: float = 0.2,
    seed: int = 0,
    device: str = "cuda",
    log_every: int = 50,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Fine-tune wan-demo's transformer block-causally for ``budget_s`` seconds of training
    (encoding the data set is not counted; it is capped by ``encode_seconds``). Returns
    ``(components, info)`` with the EMA transformer as ``components["transformer"]``."""
    torch.manual_seed(seed)
    cuda = device.startswith("cuda")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    comps = load_source(src, device)
    vae, tf = comps["vae"], comps["transformer"]
    info: dict[str, Any] = {"log": [], "source": str(src)}

    t_enc = time.perf_counter()
    lat, pid = encode_dataset(vae, n=n_clips, seed=seed + 23, device=device, batch=min(256, n_clips),
                              max_seconds=encode_seconds)
    mean = torch.tensor(list(vae.config.latents_mean), device=device).view(1, -1, 1, 1, 1)
    std = torch.tensor(list(vae.config.latents_std), device=device).view(1, -1, 1, 1, 1)
    lat = (lat - mean) / std  # the shipped VAE's statistics (the pipeline de-normalizes with them)
    info["encode_seconds"] = round(time.perf_counter() - t_enc, 1)
    info["n_clips"] = int(lat.shape[0])
    frames = lat.shape[2]
    if frames % chunk_frames:
        raise ValueError(f"chunk_frames: {frames} latent frames are not whole chunks of {chunk_frames}")
    n_chunks = frames // chunk_frames
    _, ph, pw = tf.config.patch_size
    tokens = chunk_frames * (lat.shape[3] // ph) * (lat.shape[4] // pw)
    mask = teacher_forcing_mask(n_chunks, tokens).to(device)
    print(f"causal: {lat.shape[0]} latents in {info['encode_seconds']}s; {n_chunks} chunks x {tokens} tokens", flush=True)

    table = prompt_table(comps["text_encoder"], comps["tokenizer"], device)
    uncond = len(PROMPTS)
    tf.train()
    ema = EMA({"transformer": tf}, ema_decay)
    params = [p for p in tf.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.01)
    gen = torch.Generator(device).manual_seed(seed + 4242)

    t0 = time.perf_counter()
    step = 0
    run_loss = torch.zeros((), device=device)
    run_n = 0
    while True:
        el = time.perf_counter() - t0
        if el >= budget_s or (max_steps is not None and step >= max_steps):
            break
        schedule_lr(opt, lr, step=step, elapsed=el, budget_s=budget_s, max_steps=max_steps, warmup=warmup,
                    decay_frac=decay_frac)
        x0, p, pad_to = sample_batch(lat, pid, batch, uncond=uncond, cfg_drop=cfg_drop, gen=gen, device=device)
        emb = table[p][:, :pad_to]
        s = sample_sigmas(batch * n_chunks, mode="logit_normal", shift=shift, device=device, gen=gen).view(batch, n_chunks)
        noise = torch.randn(x0.shape, device=device, generator=gen)
        sb = s.repeat_interleave(chunk_frames, dim=1).view(batch, 1, frames, 1, 1)
        xt = (1 - sb) * x0 + sb * noise
        target = noise - x0
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            pred = teacher_forcing_forward(tf, x0, xt, s, emb, chunk_frames, mask)
        loss = torch.nn.functional.mse_loss(pred.float(), target)
        optimizer_step(opt, params, loss, ema, step)
        run_loss += loss.detach()
        run_n += 1
        step += 1
        if step % log_every == 0 or step == 1:
            rec = {"step": step, "t": round(time.perf_counter() - t0, 1), "lr": opt.param_groups[0]["lr"],
                   "loss": round(float(run_loss) / run_n, 5)}
            run_loss.zero_()
            run_n = 0
            info["log"].append(rec)
            print("causal", json.dumps(rec), flush=True)
    info["steps"] = step
    info["seconds"] = round(time.perf_counter() - t0, 1)
    info["recipe"] = dict(method="teacher forcing on clean context + per-chunk (diffusion-forcing) noise levels",
                          batch=batch, lr=lr, cfg_drop=cfg_drop, shift=shift, timestep_sampling="logit_normal",
                          ema_decay=ema_decay, warmup=warmup, decay_frac=decay_frac, n_clips=info["n_clips"],
                          chunk_frames=chunk_frames, chunks=n_chunks, tokens_per_chunk=tokens,
                          frozen=["vae", "text_encoder"], init="wan-demo transformer (shipped EMA weights)")
    comps["transformer"] = ema.shadow["transformer"]
    comps["raw_transformer"] = tf.eval()
    return comps, info


#: request defaults of the bidirectional source that a causal rollout does not use (its sampler is
#: the chunk engine's flow-Euler with ``rollout_options.shift``): not copied into a causal checkpoint
BIDIRECTIONAL_DEFAULTS = ("sampler", "sampler_options", "shift")


def causal_meta(base: dict[str, Any], rollout_options: dict[str, Any], training: dict[str, Any]) -> dict[str, Any]:
    """A causal checkpoint's ``omniloop.json`` from its source's (``base``): the source's request
    defaults less :data:`BIDIRECTIONAL_DEFAULTS`, with ``steps`` (per chunk) and ``guidance_scale``
    (the causal CFG scale) from ``rollout_options``; the source's ``limits``, ``tasks`` and
    ``vocabulary``; ``rollout: causal``, the options and ``training``."""
    ro = dict(rollout_options)
    defaults = {k: v for k, v in base.get("defaults", {}).items() if k not in BIDIRECTIONAL_DEFAULTS}
    defaults.update(steps=ro["steps"], guidance_scale=ro["guidance_scale"])
    meta: dict[str, Any] = {"variant": "wan-demo-causal", "defaults": defaults, "rollout": "causal",
                            "rollout_options": ro, "training": training}
    for key in ("limits", "tasks", "vocabulary"):
        if key in base:
            meta[key] = copy.deepcopy(base[key])
    lim = meta.get("limits")
    if isinstance(lim, dict) and isinstance(lim.get("max_frames"), int) and "note" in lim:
        # Wan's VAE: 4 video frames per latent frame after the first
        chunks = ((lim["max_frames"] - 1) // 4 + 1) // int(ro["chunk_frames"])
        size = "one-latent-frame" if ro["chunk_frames"] == 1 else f"{ro['chunk_frames']}-latent-frame"
        lim["note"] = f"{lim['note']} ({chunks} {size} chunks)"
    return meta


def save_checkpoint(comps: dict[str, Any], src: Path, out: Path, info: dict[str, Any],
                    rollout_options: dict[str, Any] | None = None) -> Path:
    """``out``: a diffusers folder whose own files are ``transformer/`` (fp16) and ``omniloop.json``;
    the shared, frozen components (``vae``, ``text_encoder``, ``tokenizer``, ``scheduler``,
    ``model_index.json``) are links to ``src``'s, so the folder loads as it is here while only the
    new files travel back from a GPU machine (a file-count-limited transfer leaves links out)."""

    out.mkdir(parents=True, exist_ok=True)
    for name in CAUSAL_SHARED:
        link = out / name
        if link.is_symlink() or link.is_file():
            link.unlink()
        elif link.is_dir():
            shutil.rmtree(link)
        link.symlink_to((src / name).resolve())
    tdir = out / "transformer"
    if tdir.exists():
        shutil.rmtree(tdir)
    copy.deepcopy(comps["transformer"]).to("cpu", torch.float16).save_pretrained(str(tdir), safe_serialization=True)
    base = json.loads((src / "omniloop.json").read_text()) if (src / "omniloop.json").exists() else {}
    training = {"steps": info.get("steps"), "seconds": info.get("seconds"), "recipe": info.get("recipe"),
                "from": "wan-demo", "from_trained_steps": base.get("training", {}).get("trained_steps")}
    meta = causal_meta(base, dict(rollout_options or ROLLOUT_OPTIONS), training)
    (out / "omniloop.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return out


def ship(trained: Path, dest: Path | None = None) -> Path:
    """Install a trained folder as the package's ``checkpoint_causal/``: its ``transformer/`` and
    ``omniloop.json`` are copied; ``vae``/``text_encoder``/``tokenizer``/``scheduler`` and
    ``model_index.json`` are checked to be wan-demo's (byte-identical) and not duplicated — the
    package folder points at wan-demo's through relative links."""
    dest = dest or causal_checkpoint_dir()
    src = checkpoint_dir()
    for name in CAUSAL_SHARED:  # absent (left behind by the transfer) is fine; present must be wan-demo's
        got = trained / name
        files = [got] if got.is_file() else sorted(f for f in got.rglob("*") if f.is_file()) if got.is_dir() else []
        for f in files:
            rel = f.relative_to(trained)
            if not (src / rel).is_file() or (src / rel).read_bytes() != f.read_bytes():
                raise ValueError(f"ship: {rel} differs from wan-demo's; the causal checkpoint must share wan-demo's {name}")
    if not (trained / "transformer" / "diffusion_pytorch_model.safetensors").is_file():
        raise ValueError(f"ship: {trained}/transformer/diffusion_pytorch_model.safetensors is missing")
    dest.mkdir(parents=True, exist_ok=True)
    for name in CAUSAL_SHARED:  # the package's folder has these links committed; a new dest gets them
        link = dest / name
        if link.exists() and not link.is_symlink():
            # copies kept for the student shipped before — v1's parts (training.ship, when wan-demo v2
            # replaced them) or the decoder before 2026-12-05's (ship.ship_decoder): a causal transformer
            # trained now is trained and checked with wan-demo's current VAE / text encoder
            shutil.rmtree(link) if link.is_dir() else link.unlink()
        if not link.exists() and not link.is_symlink():
            link.symlink_to(os.path.relpath(src / name, dest))
    (dest / "transformer").mkdir(exist_ok=True)
    for f in ("transformer/config.json", "transformer/diffusion_pytorch_model.safetensors", "omniloop.json"):
        shutil.copyfile(trained / f, dest / f)
        os.chmod(dest / f, 0o644)  # package data: readable by everyone, whatever the transfer left
    return dest


@torch.no_grad()
def quick_eval(comps: dict[str, Any], device: str, *, prompts: list[str], seeds: list[int],
               rollout_options: dict[str, Any]) -> dict[str, Any]:
    """Adherence of causal rollouts of the in-memory EMA model (``omniloop_wan.causal.CausalWan``
    driven directly: no runtime needed on the training machine)."""
    from omniloop_wan_demo.evaluate import CausalRolloutGenerator, evaluate

    gen = CausalRolloutGenerator(comps, device=device, options=rollout_options)
    ro = rollout_options
    rep = evaluate(gen, prompts=prompts, seeds=seeds, steps=int(ro["steps"]), guidance_scale=float(ro["guidance_scale"]),
                   backend="causal-rollout (CausalWan, in memory)")
    return rep.to_dict(with_clips=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="train wan-demo-causal (see the module docstring)")
    ap.add_argument("--out", help="output folder (the diffusers checkpoint + train_causal.json)")
    ap.add_argument("--from", dest="src", default=None, help="source checkpoint folder (default: the shipped wan-demo)")
    ap.add_argument("--budget-s", type=float, default=240.0, help="training seconds (data encoding not counted)")
    ap.add_argument("--max-steps", type=int)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--n-clips", type=int, default=32768)
    ap.add_argument("--encode-seconds", type=float, default=45.0)
    ap.add_argument("--chunk-frames", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-eval", action="store_true", help="skip the quick causal-rollout adherence check at the end")
    ap.add_argument("--eval-seeds", default="0,1")
    ap.add_argument("--smoke", action="store_true", help="CPU check: 3 steps, batch 2, 8 clips, 2-prompt eval")
    ap.add_argument("--ship", metavar="TRAINED_DIR",
                    help="install TRAINED_DIR's transformer/ + omniloop.json as the package's checkpoint_causal/ and exit")
    a = ap.parse_args(argv)
    if a.ship:
        print(f"installed {ship(Path(a.ship))}")
        return 0
    if not a.out:
        ap.error("--out is required")
    if not a.budget_s > 0 or a.batch < 1 or not a.lr > 0:
        ap.error("--budget-s, --batch and --lr must be positive")
    src = Path(a.src) if a.src else checkpoint_dir()
    out = Path(a.out)
    if a.smoke:
        a.max_steps, a.batch, a.n_clips, a.encode_seconds, a.warmup = a.max_steps or 3, 2, 8, 60.0, 1
    t_start = time.perf_counter()
    comps, info = train_causal(src=src, out=out, budget_s=a.budget_s, max_steps=a.max_steps, batch=a.batch, lr=a.lr,
                               n_clips=a.n_clips, encode_seconds=a.encode_seconds, chunk_frames=a.chunk_frames,
                               warmup=a.warmup, seed=a.seed, device=a.device, log_every=1 if a.smoke else 50)
    ro = dict(ROLLOUT_OPTIONS, chunk_frames=a.chunk_frames)
    info["args"] = vars(a)
    info["device"] = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu"
    info["torch"] = torch.__version__
    save_checkpoint(comps, src, out, info, ro)
    (out / "train_causal.json").write_text(json.dumps(info, indent=1, default=str))
    print(f"saved {out} at {time.perf_counter() - t_start:.1f}s", flush=True)
    if not a.no_eval:
        from omniloop_wan_demo.evaluate import default_prompts

        prompts = default_prompts()[:2] if a.smoke else default_prompts()
        seeds = [0] if a.smoke else [int(s) for s in a.eval_seeds.split(",")]
        evals = {}
        for name, opts in ([("smoke", dict(ro, steps=2))] if a.smoke else [
                ("preset", ro), ("steps8", dict(ro, steps=8)), ("no_cfg", dict(ro, guidance_scale=1.0))]):
            try:
                t1 = time.perf_counter()
                r = quick_eval(comps, a.device, prompts=prompts, seeds=seeds, rollout_options=opts)
                r["rollout_options"] = opts
                r["wall_s"] = round(time.perf_counter() - t1, 1)
                evals[name] = r
                print("eval", name, json.dumps(r["accuracy"]), r["wall_s"], flush=True)
            except Exception as e:  # never lose a trained checkpoint to an evaluation bug
                evals[name] = {"error": f"{type(e).__name__}: {e}"}
                print(f"eval {name} failed: {type(e).__name__}: {e}", flush=True)
        info["eval"] = evals
        (out / "train_causal.json").write_text(json.dumps(info, indent=1, default=str))
    print(f"done in {time.perf_counter() - t_start:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
