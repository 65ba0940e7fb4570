"""Fine-tune only the VAE's decoder (encoder frozen), so a DiT trained on the encoder's latents stays valid.

Why: wan-demo v2's first GPU session (2026-12-01) fine-tuned the whole v1 VAE for 150 s and the
DiT on its latents; colour and direction reached 100 % but shape stayed at the VAE's own
reconstruction accuracy (48 %: squares, triangles and stars decoded as rounded blobs). The DiT's
samples can only be as sharp as the decoder. Training the decoder alone — the encoder, its
``quant_conv`` and so the latent space untouched — can run beside the DiT's training on the same
latents (two processes on one GPU), and the two halves are joined afterwards with
``--join``. The loss is v2's: MSE weighted on object pixels, their outline and frame 0, on
posterior samples (the decoder also sees latents a little off the encoder's mode, as a DiT's are).

GPU (``$OUT`` gets ``vae.tar``: the ``vae/`` folder in fp16 with the original config, and
``vae_decoder.json``)::

    python -m omniloop_wan_demo_training.vae_decoder --from .ckpt/v2-run1 --out $OUT --seconds 400

Join (CPU): ``python -m omniloop_wan_demo_training.vae_decoder --join PIPELINE_DIR --vae-tar vae.tar``
replaces ``PIPELINE_DIR/vae`` by the fine-tuned one (after checking the encoder weights match).
"""

from __future__ import annotations

import argparse
import json
import math
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ENCODER_PREFIXES = ("encoder.", "quant_conv.")


def _pipeline_dir(src: Path) -> Path:
    from .common import untar

    if (src / "pipeline" / "vae").is_dir():
        return src / "pipeline"
    if (src / "vae").is_dir():
        return src
    if (src / "pipeline.tar").is_file():
        untar(src / "pipeline.tar", src)
        return src / "pipeline"
    raise SystemExit(f"--from {src}: no pipeline/, vae/ or pipeline.tar there")


def finetune_decoder(vae, *, seconds: float, batch: int, lr: float, seed: int, device: str, check_every: float,
                     max_steps: int | None = None, n_check: int = 128, trail_weight: float = 0.0) -> dict[str, Any]:
    """Train ``vae``'s decoder and ``post_quant_conv`` for ``seconds`` (or ``max_steps``) on fresh
    clips; held-out checks (:func:`~.v2.recon_report`: detector accuracy incl. ghost-free clips,
    PSNR) every ``check_every`` seconds, outside the budget. ``trail_weight`` adds that weight on
    the object's path away from the object (:func:`~.v2.loss_weights`). Returns the log; ``vae``
    ends fp16-rounded, as it ships."""
    from .render import render, sample_params
    from .train_vae import lr_at
    from .v2 import loss_weights, recon_report

    vae.to(device)
    for name, p in vae.named_parameters():
        p.requires_grad_(not name.startswith(ENCODER_PREFIXES))
    params = [p for p in vae.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=1e-4, fused=device.startswith("cuda"))
    gen = torch.Generator(device).manual_seed(seed + 5)
    amp = device.startswith("cuda")
    info: dict[str, Any] = {"batch": batch, "lr": lr, "trail_weight": trail_weight, "trained": "decoder + post_quant_conv",
                            "log": [], "checks": []}
    rep = recon_report(vae.eval(), n=n_check, device=device)
    info["checks"].append({**rep, "step": 0})
    print("vae-dec check", json.dumps(info["checks"][-1]), flush=True)
    t0 = last = time.perf_counter()
    step = 0
    while True:
        el = time.perf_counter() - t0
        if el >= seconds or (max_steps is not None and step >= max_steps):
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, el / seconds if max_steps is None else step / max_steps, lr, warmup=30)
        p = sample_params(batch, (seed + 23) * 1_000_003 + step)
        x, cov = render(p, device=device, return_mask=True)
        x = x * 2 - 1
        w = loss_weights(cov, object_weight=20.0, edge_weight=30.0, frame0_weight=3.0, trail_weight=trail_weight)
        vae.train()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            z = vae.encode(x).latent_dist.sample(generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            xr = vae.decode(z.float()).sample
        err = (xr.float() - x) ** 2
        loss = (err * w).mean() / w.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            rec = {"step": step, "t": round(time.perf_counter() - t0, 1), "loss": round(float(loss), 6),
                   "mse": round(float(err.mean()), 6)}
            info["log"].append(rec)
            print("vae-dec", json.dumps(rec), flush=True)
        if check_every and time.perf_counter() - last >= check_every and time.perf_counter() - t0 < seconds:
            tc = time.perf_counter()
            rep = recon_report(vae.eval(), n=n_check, device=device)
            info["checks"].append({**rep, "step": step})
            print("vae-dec check", json.dumps(info["checks"][-1]), flush=True)
            t0 += time.perf_counter() - tc
            last = time.perf_counter()
    info["seconds"] = round(time.perf_counter() - t0, 1)
    vae = vae.half().float().eval()
    rep = recon_report(vae, n=n_check, device=device)
    info["final"] = {**rep, "step": step, "fp16_rounded": True}
    info["steps"] = step
    print("vae-dec final", json.dumps(info["final"]), flush=True)
    if step and not math.isfinite(float(loss.detach())):
        raise SystemExit("vae-dec: loss is not finite")
    return info


def join(pipeline: Path, vae_tar: Path) -> Path:
    """Replace ``pipeline/vae`` by the decoder-tuned VAE in ``vae_tar`` (its encoder must be the same)."""
    import shutil

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(vae_tar) as t:
            t.extractall(tmp, filter="data")
        new = Path(tmp) / "vae"
        for what, weights in (("PIPELINE_DIR", pipeline / "vae"), ("--vae-tar", new)):
            if not (weights / "diffusion_pytorch_model.safetensors").is_file():
                raise SystemExit(f"--join: {what} has no vae/diffusion_pytorch_model.safetensors")
        old_sd = load_file(str(pipeline / "vae" / "diffusion_pytorch_model.safetensors"))
        new_sd = load_file(str(new / "diffusion_pytorch_model.safetensors"))
        for k, v in old_sd.items():
            if k.startswith(ENCODER_PREFIXES) and (k not in new_sd or not torch.equal(v, new_sd[k])):
                raise SystemExit(f"--join: encoder weight {k} differs: {vae_tar} was not tuned from {pipeline}'s VAE")
        shutil.rmtree(pipeline / "vae")
        shutil.copytree(new, pipeline / "vae")
    return pipeline


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m omniloop_wan_demo_training.vae_decoder", description=__doc__.split("\n")[0])
    ap.add_argument("--from", dest="src", help="a v2 session folder (pipeline.tar or pipeline/)")
    ap.add_argument("--out")
    ap.add_argument("--seconds", type=float, default=400)
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-every", type=float, default=60)
    ap.add_argument("--trail-weight", type=float, default=0.0,
                    help="extra loss weight on the object's path away from the object, where decoder trails "
                         "(ghosts) appear; sessions B and C ran with 0")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="two steps, 4 check clips (CPU test)")
    ap.add_argument("--join", metavar="PIPELINE_DIR")
    ap.add_argument("--vae-tar")
    a = ap.parse_args(argv)
    if a.join:
        if not a.vae_tar:
            ap.error("--join needs --vae-tar")
        if not Path(a.vae_tar).is_file():
            ap.error(f"--vae-tar {a.vae_tar}: no such file")
        print(join(Path(a.join), Path(a.vae_tar)))
        return 0
    if not a.src or not a.out:
        ap.error("--from and --out are required (or --join)")
    for name in ("seconds", "lr"):
        v = getattr(a, name)
        if not math.isfinite(v) or v <= 0:
            ap.error(f"--{name} must be a finite number > 0, got {v}")
    if not math.isfinite(a.trail_weight) or a.trail_weight < 0:
        ap.error(f"--trail-weight must be a finite number >= 0, got {a.trail_weight}")
    if a.batch < 1:
        ap.error(f"--batch must be >= 1, got {a.batch}")
    from diffusers import AutoencoderKLWan

    pipe = _pipeline_dir(Path(a.src))
    vae = AutoencoderKLWan.from_pretrained(str(pipe / "vae"), torch_dtype=torch.float32)
    info = finetune_decoder(vae, seconds=a.seconds, batch=2 if a.smoke else a.batch, lr=a.lr, seed=a.seed,
                            device=a.device, check_every=0 if a.smoke else a.check_every,
                            max_steps=2 if a.smoke else None, n_check=4 if a.smoke else 128,
                            trail_weight=a.trail_weight)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        vae.half().save_pretrained(str(Path(tmp) / "vae"))
        with tarfile.open(out / "vae.tar", "w") as t:
            t.add(str(Path(tmp) / "vae"), arcname="vae")
    (out / "vae_decoder.json").write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
