"""Write the README's preview: the shipped ``flux-demo`` preset through ``omniloop.Runtime`` on the
CPU at its defaults (20 steps, no CFG, 64x64), one image per prompt, seed 0, in a 2 x 4 grid
upscaled 2x (nearest); prints what wan-demo's detector reads in each image.

    python demos/flux-demo/scripts/preview.py OUT.png
"""

from __future__ import annotations

import sys
from pathlib import Path

PROMPTS = (
    "a red star at the top left", "a green circle at the top", "a blue triangle at the top right",
    "a yellow square at the left", "a cyan star at the center", "a magenta circle at the right",
    "a red triangle at the bottom left", "a blue square at the bottom right",
)
COLS, SCALE, GAP = 4, 2, 4


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].endswith(".png"):
        print("usage: python demos/flux-demo/scripts/preview.py OUT.png", file=sys.stderr)
        return 2
    from PIL import Image

    from omniloop import Runtime
    from omniloop_wan_demo.evaluate import detect_image

    rt = Runtime.from_model("flux-demo", device="cpu", dtype="float32")
    tile = 64 * SCALE
    rows = (len(PROMPTS) + COLS - 1) // COLS
    grid = Image.new("RGB", (COLS * tile + (COLS - 1) * GAP, rows * tile + (rows - 1) * GAP), "white")
    for i, prompt in enumerate(PROMPTS):
        px = rt.generate({"task": "t2i", "prompt": prompt, "diffusion": {"seed": 0}}).artifacts["image"].pixels
        d = detect_image(px.numpy())
        print(f"{prompt!r}: detected {d.color} {d.shape} at the {d.position}")
        img = Image.fromarray(px.numpy()).resize((tile, tile), Image.Resampling.NEAREST)
        grid.paste(img, ((i % COLS) * (tile + GAP), (i // COLS) * (tile + GAP)))
    Path(argv[0]).parent.mkdir(parents=True, exist_ok=True)
    grid.save(argv[0], optimize=True)
    print(f"wrote {argv[0]} ({Path(argv[0]).stat().st_size / 1e3:.0f} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
