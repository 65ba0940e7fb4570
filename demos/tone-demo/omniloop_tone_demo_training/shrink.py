"""Drop DiT blocks from a trained tone-demo checkpoint (the start of a fine-tune that fits the
package's size budget).

    python -m omniloop_tone_demo_training.shrink --src CHECKPOINT --out DIR --layers 5

For each block, the v-loss of the checkpoint without it is measured on ``--probe`` clips (fixed
noise and timesteps, :func:`omniloop_tone_demo_training.train.v_loss`'s objective); the blocks whose
removal costs least are dropped, one at a time, until ``--layers`` remain. The result is written in
the shipped form (float16 weights, the compact linear VAE) with ``omniloop.json`` recording what was
dropped; ``train --init DIR`` then fine-tunes it.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

from omniloop_tone_demo.grammar import random_specs, synthesize

from .build import assemble, load_parts, save
from .train import Conditioner, encode, optimizer_step, rotary_for, tok_len


@torch.no_grad()
def probe_loss(parts: dict[str, Any], z: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, t: torch.Tensor,
               n: torch.Tensor) -> float:
    """The v-loss (no CFG dropout) on fixed latents, timesteps and noise."""
    tf = parts["transformer"]
    a, s = torch.cos(t * math.pi / 2).view(-1, 1, 1), torch.sin(t * math.pi / 2).view(-1, 1, 1)
    enc, glob = Conditioner(parts["text_encoder"], parts["projection_model"])(ids, mask)
    pred = tf(a * z + s * n, t, encoder_hidden_states=enc, global_hidden_states=glob,
              rotary_embedding=rotary_for(tf, z.device), return_dict=False)[0]
    return float(torch.nn.functional.mse_loss(pred, a * n - s * z))


def drop_blocks(parts: dict[str, Any], layers: int, z, ids, mask, t, n) -> list[dict[str, Any]]:
    """Drop the cheapest blocks until ``layers`` remain; returns what each drop cost."""
    tf = parts["transformer"]
    log = [{"blocks": len(tf.transformer_blocks), "loss": probe_loss(parts, z, ids, mask, t, n)}]
    while len(tf.transformer_blocks) > layers:
        blocks = list(tf.transformer_blocks)
        costs = []
        for i in range(len(blocks)):
            tf.transformer_blocks = torch.nn.ModuleList(blocks[:i] + blocks[i + 1:])
            costs.append(probe_loss(parts, z, ids, mask, t, n))
        best = min(range(len(blocks)), key=costs.__getitem__)
        tf.transformer_blocks = torch.nn.ModuleList(blocks[:best] + blocks[best + 1:])
        log.append({"dropped": best, "of": len(blocks), "loss": costs[best], "costs": costs})
    tf.register_to_config(num_layers=len(tf.transformer_blocks))
    return log


def distill_block(teacher: dict[str, Any], student_tf, dropped: int, z, ids, mask, *, steps: int, batch: int = 16,
                  lr: float = 5e-4, seed: int = 0) -> list[float]:
    """Local distillation after dropping teacher block ``dropped``: one student block stands for two
    teacher blocks, ``first`` and ``first + 1`` (``dropped`` and the next one; the previous one and
    ``dropped`` when ``dropped`` was the last), and learns to map the teacher's input of the first to
    its output of the second (same text states, rotary embedding, timesteps; a tenth of the rows with
    the unconditional, all-zero text states). Returns the loss log."""
    tf = teacher["transformer"]
    first = dropped if dropped + 1 < len(tf.transformer_blocks) else dropped - 1
    gen = torch.Generator().manual_seed(seed)
    n = z.shape[0]
    t = torch.rand(n, generator=gen).clamp(0.02, 0.98)
    noise = torch.randn(z.shape, generator=gen)
    a, s = torch.cos(t * math.pi / 2).view(-1, 1, 1), torch.sin(t * math.pi / 2).view(-1, 1, 1)
    captured: dict[str, Any] = {}

    def pre(_m, args, kwargs):
        captured["args"], captured["kwargs"] = args, kwargs

    def post(_m, _args, out):
        captured["out"] = out

    h1 = tf.transformer_blocks[first].register_forward_pre_hook(pre, with_kwargs=True)
    h2 = tf.transformer_blocks[first + 1].register_forward_hook(post)
    rows = []
    try:
        with torch.no_grad():
            cond = Conditioner(teacher["text_encoder"], teacher["projection_model"])
            rotary = rotary_for(tf, z.device)
            for i in range(0, n, 16):
                sl = slice(i, i + 16)
                enc, glob = cond(ids[sl], mask[sl])
                drop = (torch.rand(enc.shape[0], generator=gen) < 0.1).view(-1, 1, 1)
                enc = torch.where(drop, torch.zeros_like(enc), enc)
                tf(a[sl] * z[sl] + s[sl] * noise[sl], t[sl], encoder_hidden_states=enc, global_hidden_states=glob,
                   rotary_embedding=rotary, return_dict=False)
                kw = captured["kwargs"]
                rows.append((captured["args"][0] if captured["args"] else kw["hidden_states"],
                             kw.get("encoder_hidden_states"), captured["out"]))
    finally:
        h1.remove()
        h2.remove()
    h_in = torch.cat([r[0] for r in rows])
    enc_all = torch.cat([r[1] for r in rows])
    target = torch.cat([r[2] if torch.is_tensor(r[2]) else r[2][0] for r in rows])
    kw = {k: v for k, v in captured["kwargs"].items() if k not in ("hidden_states", "encoder_hidden_states")}
    block = student_tf.transformer_blocks[first].train().requires_grad_(True)
    opt = torch.optim.AdamW(block.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step in range(steps):
        idx = torch.randint(0, h_in.shape[0], (batch,), generator=gen)
        out = block(h_in[idx], encoder_hidden_states=enc_all[idx], **kw)
        out = out if torch.is_tensor(out) else out[0]
        loss = torch.nn.functional.mse_loss(out, target[idx])
        losses.append(optimizer_step(opt, loss))
        if step % 50 == 0:
            print(f"distill step {step} loss {loss.item():.5f}", flush=True)
    block.eval().requires_grad_(False)
    return losses


def distill_model(teacher: dict[str, Any], student: dict[str, Any], z, ids, mask, *, steps: int, batch: int = 8,
                  lr: float = 1e-4, seed: int = 1) -> list[float]:
    """End-to-end distillation: the student's DiT (every block) learns the teacher's v-prediction on
    noised latents of ``z`` (random timesteps, a tenth unconditional); text encoder and projection
    are the teacher's and stay fixed. Returns the loss log."""
    gen = torch.Generator().manual_seed(seed)
    cond = Conditioner(teacher["text_encoder"], teacher["projection_model"])
    tf_t, tf_s = teacher["transformer"], student["transformer"]
    rotary = rotary_for(tf_t, z.device)
    tf_s.train().requires_grad_(True)
    opt = torch.optim.AdamW(tf_s.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step in range(steps):
        idx = torch.randint(0, z.shape[0], (batch,), generator=gen)
        t = torch.rand(batch, generator=gen).clamp(0.02, 0.98)
        n = torch.randn((batch, *z.shape[1:]), generator=gen)
        a, s = torch.cos(t * math.pi / 2).view(-1, 1, 1), torch.sin(t * math.pi / 2).view(-1, 1, 1)
        x = a * z[idx] + s * n
        with torch.no_grad():
            enc, glob = cond(ids[idx], mask[idx])
            drop = (torch.rand(batch, generator=gen) < 0.1).view(-1, 1, 1)
            enc = torch.where(drop, torch.zeros_like(enc), enc)
            target = tf_t(x, t, encoder_hidden_states=enc, global_hidden_states=glob, rotary_embedding=rotary,
                          return_dict=False)[0]
        pred = tf_s(x, t, encoder_hidden_states=enc, global_hidden_states=glob, rotary_embedding=rotary,
                    return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(pred, target)
        losses.append(optimizer_step(opt, loss, clip=tf_s.parameters()))
        if step % 25 == 0:
            print(f"distill-model step {step} loss {losses[-1]:.5f}", flush=True)
    tf_s.eval().requires_grad_(False)
    return losses


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", required=True, type=Path, help="a tone-demo checkpoint folder")
    ap.add_argument("--out", required=True, type=Path, help="where the shrunk checkpoint folder goes")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--probe", type=int, default=64, help="clips the loss is measured on")
    ap.add_argument("--distill-steps", type=int, default=0,
                    help="after dropping one block: local distillation steps of the block that takes its place")
    ap.add_argument("--distill-clips", type=int, default=128)
    ap.add_argument("--distill-model-steps", type=int, default=0,
                    help="then end-to-end distillation steps of the whole student DiT on the teacher's output")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    parts = load_parts(a.src)
    for k in ("vae", "text_encoder", "projection_model", "transformer"):
        parts[k].eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(11)
    specs = random_specs(a.probe, gen)
    z = encode(parts["vae"], synthesize(specs, gen=gen))
    tok = parts["tokenizer"]([s.prompt for s in specs], padding="max_length", max_length=tok_len(parts),
                             truncation=True, return_tensors="pt")
    t = torch.rand(a.probe, generator=gen).clamp(0.02, 0.98)
    n = torch.randn(z.shape, generator=gen)
    teacher = load_parts(a.src) if a.distill_steps else None
    log = drop_blocks(parts, a.layers, z, tok.input_ids, tok.attention_mask, t, n)
    print(json.dumps(log, indent=1))
    if a.distill_steps:
        if len(log) != 2:
            raise SystemExit("--distill-steps needs exactly one dropped block")
        for k in ("vae", "text_encoder", "projection_model", "transformer"):
            teacher[k].eval().requires_grad_(False)
        dspecs = random_specs(a.distill_clips, gen)
        dz = encode(parts["vae"], synthesize(dspecs, gen=gen))
        dtok = parts["tokenizer"]([s.prompt for s in dspecs], padding="max_length", max_length=tok_len(parts),
                                  truncation=True, return_tensors="pt")
        losses = distill_block(teacher, parts["transformer"], log[1]["dropped"], dz, dtok.input_ids,
                               dtok.attention_mask, steps=a.distill_steps)
        log.append({"distilled_steps": a.distill_steps, "first_loss": losses[0], "last_loss": losses[-1],
                    "probe_loss": probe_loss(parts, z, tok.input_ids, tok.attention_mask, t, n)})
        print(json.dumps(log[-1]), flush=True)
        if a.distill_model_steps:
            losses = distill_model(teacher, parts, dz, dtok.input_ids, dtok.attention_mask, steps=a.distill_model_steps)
            log.append({"distilled_model_steps": a.distill_model_steps, "first_loss": losses[0],
                        "last_loss": losses[-1], "probe_loss": probe_loss(parts, z, tok.input_ids, tok.attention_mask, t, n)})
            print(json.dumps(log[-1]), flush=True)
    meta = json.loads((a.src / "omniloop.json").read_text())
    training = dict(meta.get("training") or {})
    training["history"] = [*training.get("history", []), {"phase": "shrink", "from": str(a.src), "log": log}]
    training.pop("scores", None)  # the scores were the unshrunk model's
    meta["training"] = training
    save(assemble(parts), a.out, meta, store=torch.float16, compact_vae=True)


if __name__ == "__main__":
    main()
