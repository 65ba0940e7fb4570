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
from .train import Conditioner, encode, rotary_for, tok_len


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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", required=True, type=Path, help="a tone-demo checkpoint folder")
    ap.add_argument("--out", required=True, type=Path, help="where the shrunk checkpoint folder goes")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--probe", type=int, default=64, help="clips the loss is measured on")
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
    log = drop_blocks(parts, a.layers, z, tok.input_ids, tok.attention_mask, t, n)
    print(json.dumps(log, indent=1))
    meta = json.loads((a.src / "omniloop.json").read_text())
    training = dict(meta.get("training") or {})
    training["history"] = [*training.get("history", []), {"phase": "shrink", "from": str(a.src), "log": log}]
    training.pop("scores", None)  # the scores were the unshrunk model's
    meta["training"] = training
    save(assemble(parts), a.out, meta, store=torch.float16, compact_vae=True)


if __name__ == "__main__":
    main()
