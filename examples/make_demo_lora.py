"""Make a small LoRA adapter for a demo model and a deploy file that declares it, to try LoRA.

    python examples/make_demo_lora.py out/lora                      # for wan-demo
    python examples/make_demo_lora.py out/lora --model flux-demo     # for flux-demo
    omniloop adapters --deploy out/lora/deploy.yaml                  # what the deploy declares
    omniloop generate "a red circle moving up" --deploy out/lora/deploy.yaml --adapter demo=1.0 --seed 0
    omniloop generate "a red circle moving up" --deploy out/lora/deploy.yaml --seed 0     # without it

The adapter is *random* (rank 4 on the attention projections, written by diffusers' own LoRA
saving path through PEFT): it changes the output visibly but teaches the model nothing. It shows
the plumbing — a deploy declares adapters by name, a request picks them (``--adapter NAME=SCALE``,
stacked in order), the runtime applies them without touching the base weights — on a CPU in
seconds. A trained adapter (a diffusers, kohya or ComfyUI ``.safetensors`` file for a real Wan,
FLUX.1 or SD3 checkpoint) is declared the same way. Needs ``pip install peft``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

TARGETS = {"wan": ["to_q", "to_k", "to_v", "to_out.0"], "flux": ["to_q", "to_k", "to_v", "to_out.0"]}


def make(out: Path, model: str = "wan-demo", rank: int = 4, seed: int = 0, std: float = 0.3) -> Path:
    """Write ``out/demo.safetensors`` and ``out/deploy.yaml``; returns the deploy file."""
    import torch
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from omniloop.plugins import default_manager

    preset = default_manager().registry().presets.get(model)
    if preset is None or preset.family not in TARGETS:
        raise SystemExit(f"--model: expected a wan or flux demo preset (wan-demo, wan-demo-fast, flux-demo), got {model!r}")
    if preset.family == "wan":
        from diffusers import WanPipeline as Pipe
        from diffusers import WanTransformer3DModel as Transformer
    else:
        from diffusers import FluxPipeline as Pipe  # type: ignore[assignment]
        from diffusers import FluxTransformer2DModel as Transformer  # type: ignore[assignment]
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tf = Transformer.from_pretrained(Path(preset.path()) / "transformer")
        cfg = LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS[preset.family], init_lora_weights=False)
        tf.add_adapter(cfg, adapter_name="demo")
        with torch.no_grad():
            for name, p in tf.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, std)
        layers = get_peft_model_state_dict(tf, adapter_name="demo")
    Pipe.save_lora_weights(out, transformer_lora_layers=layers, weight_name="demo.safetensors")
    deploy = out / "deploy.yaml"
    deploy.write_text(
        f"# written by examples/make_demo_lora.py: {model} with one declared LoRA adapter\n"
        f"model: {{preset: {model}}}\ndevice: cpu\ndtype: float32\n"
        f"adapters: {{demo: {(out / 'demo.safetensors').resolve()}}}\n", encoding="utf-8")
    return deploy


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="folder for demo.safetensors and deploy.yaml")
    ap.add_argument("--model", default="wan-demo", help="wan-demo (default), wan-demo-fast or flux-demo")
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    deploy = make(args.out, args.model, args.rank, args.seed)
    prompt = "a red star at the top left" if "flux" in args.model else "a red circle moving up"
    print(f"wrote {args.out / 'demo.safetensors'} and {deploy}")
    print(f'try: omniloop generate "{prompt}" --deploy {deploy} --adapter demo=1.0 --seed 0')
    return 0


if __name__ == "__main__":
    sys.exit(main())
