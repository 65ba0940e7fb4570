"""Reading a diffusers-format Cosmos 3 omni checkpoint (omniloop-kit's layout checks and loading).

Layout (what a ``Cosmos3OmniPipeline`` ``save_pretrained`` writes)::

    model_index.json     _class_name Cosmos3OmniPipeline; [library, class] per component;
                         enable_safety_checker, default_use_system_prompt, use_native_flow_schedule
    transformer/         Cosmos3OmniTransformer (config.json + diffusion_pytorch_model*.safetensors)
    text_tokenizer/      the chat tokenizer (Qwen-style; <|vision_start|> starts generation)
    vae/                 AutoencoderKLWan (latents_mean / latents_std normalise its latents)
    scheduler/           UniPCMultistepScheduler (flow sigmas)
    sound_tokenizer/     optional: Cosmos3AVAEAudioTokenizer (sound generation)
    safety_checker       optional, never loaded here (cosmos_guardrail; not shipped)
    omniloop.json        optional: omniloop defaults for this checkpoint (tiny checkpoints write it)

:func:`check_checkpoint` checks every file before any weight is read; every problem is one
:class:`omniloop.errors.CheckpointError` naming the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omniloop.errors import CheckpointError
from omniloop_kit import checkpoint as kit

PIPELINES = ("Cosmos3OmniPipeline",)
REQUIRED = ("transformer", "text_tokenizer", "vae", "scheduler")
OPTIONAL = ("sound_tokenizer",)
LAYOUT = kit.Layout(what="a Cosmos 3 omni checkpoint", pipelines=PIPELINES,
                    transformer_class="Cosmos3OmniTransformer", required=REQUIRED, optional=OPTIONAL,
                    kinds={"text_tokenizer": "tokenizer", "sound_tokenizer": "diffusers"}, allow_bin=False)


def consistency(root: Path, index: dict[str, Any], configs: dict[str, dict[str, Any]]) -> None:
    """The transformer's latent channels are the VAE's; a sound tokenizer needs a sound transformer."""
    tf, vae = configs["transformer"], configs["vae"]
    tf_path = root / "transformer" / "config.json"
    if int(tf.get("latent_channel", 48)) != int(vae.get("z_dim", 16)):
        raise CheckpointError(f"{tf_path}: latent_channel={tf.get('latent_channel', 48)} but the VAE's "
                              f"z_dim is {vae.get('z_dim', 16)} ({root / 'vae' / 'config.json'})")
    p = int(tf.get("latent_patch_size", 2))
    if int(tf.get("patch_latent_dim", 192)) != p * p * int(tf.get("latent_channel", 48)):
        raise CheckpointError(f"{tf_path}: patch_latent_dim must be latent_patch_size² x latent_channel")
    if "sound_tokenizer" in configs and not tf.get("sound_gen", False):
        raise CheckpointError(f"{tf_path}: the checkpoint ships a sound tokenizer but sound_gen is false")


def check_checkpoint(root: Path) -> tuple[dict[str, Any], list[str]]:
    index, present, _ = kit.check_checkpoint(root, LAYOUT, consistency)
    return index, present


def load_component(index: dict[str, Any], root: Path, name: str, *, device: Any, dtype: Any) -> Any:
    return kit.load_component(index, root, name, device=device, dtype=dtype, layout=LAYOUT)


__all__ = ["LAYOUT", "OPTIONAL", "PIPELINES", "REQUIRED", "check_checkpoint", "consistency", "load_component"]
