"""An LTX-2 checkpoint (diffusers' ``LTX2Pipeline`` folder): its layout, the check of every file
before any weight is read, and loading each component by the class ``model_index.json`` names.

The kit's readers (:mod:`omniloop_kit.checkpoint`) do the work; what is LTX-2's own is that three
components are diffusers models that are not named ``transformer`` / ``vae`` (``audio_vae``,
``connectors``, ``vocoder``), and two of them come from the pipeline module itself
(``["ltx2", "LTX2TextConnectors"]``, ``["ltx2", "LTX2Vocoder"]``). A checkpoint with a
``duration_head`` (LTX-2.5's predicted length) is refused: omniloop always takes
``diffusion.frames`` (default 121, diffusers' default without the head), so it would not
do what diffusers does. ``prompt_enhancer`` / ``processor`` are not loaded (prompt enhancement is
not offered).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omniloop.errors import CheckpointError
from omniloop_kit import checkpoint as ck
from omniloop_kit.checkpoints import DIFFUSERS_WEIGHTS, TRANSFORMERS_WEIGHTS, model_folder, read_json

#: the components loaded, in the order they are loaded
COMPONENTS = ("transformer", "vae", "audio_vae", "vocoder", "connectors", "text_encoder", "tokenizer", "scheduler")
LAYOUT = ck.Layout(what="an LTX-2 checkpoint", pipelines=("LTX2Pipeline",),
                   transformer_class="LTX2VideoTransformer3DModel", required=COMPONENTS,
                   optional=("duration_head", "prompt_enhancer", "processor"), check_classes=False)
#: the libraries a component may come from
LIBRARIES = {"text_encoder": ("transformers",), "tokenizer": ("transformers",), "connectors": ("ltx2", "diffusers"),
             "vocoder": ("ltx2", "diffusers")}


def component_class(index: dict[str, Any], root: Path, name: str) -> Any:
    """The class ``model_index.json`` names for ``name``, from the library it may come from."""
    where = f"{root / 'model_index.json'}: component {name!r}"
    lib, cls = ck.declared(index, name) or ("", "")
    allowed = LIBRARIES.get(name, ("diffusers",))
    if lib not in allowed:
        raise CheckpointError(f"{where} must come from {' or '.join(allowed)}, not {lib!r}")
    if lib == "ltx2":
        import diffusers.pipelines.ltx2 as module

        found = getattr(module, cls, None) if cls.isidentifier() else None
        if not isinstance(found, type):
            raise CheckpointError(f"{where}: diffusers.pipelines.ltx2 has no class {cls!r}")
        return found
    return ck.library_class(lib, cls, where)


def check_checkpoint(root: Path) -> tuple[dict[str, Any], list[str], dict[str, dict[str, Any]]]:
    """Every file checked, no tensor loaded: the index and its classes, each folder's config and
    weight files (a truncated file caught from its header), the tokenizer, the scheduler config,
    the transformer class. Returns the index, the components present and the configs."""
    index, present = ck.read_index(root, LAYOUT)
    if "duration_head" in present:
        raise CheckpointError(f"{root / 'model_index.json'}: component 'duration_head' (a predicted video length) "
                              "is not supported: omniloop takes diffusion.frames")
    configs: dict[str, dict[str, Any]] = {}
    for name in COMPONENTS:
        component_class(index, root, name)
        folder = root / name
        if name == "tokenizer":
            ck.check_tokenizer(folder, LAYOUT.tokenizer_files)
        elif name == "scheduler":
            configs[name] = read_json(folder / "scheduler_config.json", "scheduler config")
        else:
            stem = TRANSFORMERS_WEIGHTS if name == "text_encoder" else DIFFUSERS_WEIGHTS
            configs[name] = model_folder(folder, name, stem, allow_bin=LAYOUT.allow_bin)
    found = configs["transformer"].get("_class_name")
    if found != LAYOUT.transformer_class:
        raise CheckpointError(f"{root / 'transformer' / 'config.json'}: expected an {LAYOUT.transformer_class}, "
                              f"found {found!r}")
    audio, tf = configs["audio_vae"], configs["transformer"]
    packed = int(audio.get("latent_channels", 8)) * (int(audio.get("mel_bins", 64)) // 4)
    if int(tf.get("audio_in_channels", 128)) != packed:
        raise CheckpointError(f"{root / 'transformer' / 'config.json'}: audio_in_channels "
                              f"{tf.get('audio_in_channels')} does not fit the audio VAE's latents "
                              f"({audio.get('latent_channels')} channels x {int(audio.get('mel_bins', 64)) // 4} mel bins)")
    return index, list(COMPONENTS), configs


def load_component(index: dict[str, Any], root: Path, name: str, *, device: Any, dtype: Any) -> Any:
    """One component by its declared class (local files only; the tokenizer and scheduler as the kit loads them)."""
    if name == "scheduler":
        return ck.load_scheduler(root / name, (ck.declared(index, name) or ("", ""))[1])
    cls = component_class(index, root, name)
    if name == "tokenizer":
        return ck.load_tokenizer(root / name, cls)
    return ck.load_pretrained(cls, root / name, device=device, dtype=dtype)


__all__ = ["COMPONENTS", "LAYOUT", "check_checkpoint", "component_class", "load_component"]
