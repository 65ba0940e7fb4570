"""Reading a diffusers-format Wan checkpoint from disk: find it, check it, load it.

Nothing is downloaded: every load is ``local_files_only``. Every problem with the files on disk —
a missing folder, a config that is not JSON, a weight file cut short, a tensor of the wrong shape —
becomes one :class:`omniloop.errors.CheckpointError` that names the file and what is wrong.

Layout (what Wan-AI's ``*-Diffusers`` repositories ship)::

    model_index.json          _class_name WanPipeline | WanImageToVideoPipeline, boundary_ratio, expand_timesteps
    transformer/              config.json + diffusion_pytorch_model*.safetensors (sharded: *.index.json)
    transformer_2/            Wan2.2 A14B: the low-noise expert
    vae/                      AutoencoderKLWan
    text_encoder/             UMT5EncoderModel (transformers)
    tokenizer/                tokenizer.json and/or spiece.model
    scheduler/                scheduler_config.json
    image_encoder/, image_processor/   Wan2.1 I2V: CLIP vision model and its processor
    omniloop.json             optional: omniloop defaults for this checkpoint (tiny checkpoints write it)

A Hugging Face cache folder (``models--Org--Name``, or its ``snapshots/<hash>``) works too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from omniloop.errors import CheckpointError
from omniloop_kit import checkpoint as kit
from omniloop_kit.checkpoint import load_tokenizer as load_tokenizer  # re-exported (family.py: ck.load_tokenizer)
from omniloop_kit.checkpoints import DIFFUSERS_WEIGHTS, TRANSFORMERS_WEIGHTS, model_folder, read_json, weight_files
from omniloop_kit.checkpoints import resolve_root as resolve_root  # re-exported (family.py: ck.resolve_root)
from omniloop_kit.checkpoints import weight_version as weight_version  # re-exported (family.py: ck.weight_version)

REQUIRED = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
OPTIONAL = ("transformer_2", "image_encoder", "image_processor")
WAN_PIPELINES = ("WanPipeline", "WanImageToVideoPipeline")
#: the components are loaded by fixed classes (not the index's), so the index's classes are not checked
LAYOUT = kit.Layout(what="a Wan checkpoint", pipelines=WAN_PIPELINES, transformer_class="WanTransformer3DModel",
                    required=REQUIRED, optional=OPTIONAL, tokenizer_files=("tokenizer.json", "spiece.model"),
                    check_classes=False)


def check_checkpoint(root: Path) -> dict[str, Any]:
    """Validate the layout (omniloop-kit) and Wan2.2's ``boundary_ratio``; return the parsed
    ``model_index.json``. No tensor is loaded."""
    index, present = kit.read_index(root, LAYOUT)
    br = index.get("boundary_ratio")
    if br is not None:
        if not isinstance(br, (int, float)) or not 0.0 < float(br) < 1.0:
            raise CheckpointError(f"{root / 'model_index.json'}: boundary_ratio must be a number in (0, 1), not {br!r}")
        if "transformer_2" not in present:
            raise CheckpointError(f"{root / 'model_index.json'}: boundary_ratio is set but no transformer_2 is declared")
    kit.check_folders(root, LAYOUT, present)
    return index


def limits(path: Path) -> Any:
    """A real checkpoint's trained size (issue 42, ``capabilities.checkpoint_limits``): Wan's
    configs carry no sample size, so its kind's (read from the configs) model-card size
    (``omniloop_wan.defaults``: frames, and the longer side for either side), a ``warn``
    declaration; None for a checkpoint with an ``omniloop.json``."""
    from omniloop_kit.checkpoints import peek_json

    from .defaults import DEFAULTS, model_kind

    root = resolve_root(path)
    kind = model_kind(peek_json(root / "model_index.json") or {}, kit.config_of(root, "transformer"),
                      kit.config_of(root, "vae"))
    d = DEFAULTS.get(kind)
    if d is None:
        return None
    side = max(d["height"], d["width"])
    return kit.sample_size_limits(root, height=side, width=side, frames=d["frames"], source=f"the {kind} model card")


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _empty_parameters() -> Iterator[None]:
    """Build modules without allocating or initialising parameters (they go to ``meta``).

    Buffers are built normally (Wan's rotary tables are computed in ``__init__``). The weights are
    then assigned from the checkpoint. Process-wide while active: load from one thread at a time.
    """
    original = torch.nn.Module.register_parameter
    init_names = [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")]
    saved_init = {n: getattr(torch.nn.init, n) for n in init_names}

    def register_parameter(self: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(self, name, param)
        if param is not None:
            p = self._parameters[name]
            self._parameters[name] = torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    def no_init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return tensor

    torch.nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    for n in init_names:
        setattr(torch.nn.init, n, no_init)
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]
        for n, fn in saved_init.items():
            setattr(torch.nn.init, n, fn)


def _read_state_dict(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            if f.suffix == ".safetensors":
                state.update(load_file(str(f), device="cpu"))
            else:
                state.update(torch.load(f, map_location="cpu", weights_only=True))
        except Exception as exc:
            raise CheckpointError(f"{f}: cannot read weights ({type(exc).__name__}: {exc})") from None
    return state


def load_diffusers_model(cls: Any, folder: Path, *, device: torch.device, dtype: torch.dtype) -> Any:
    """Load a diffusers model (``WanTransformer3DModel`` / ``AutoencoderKLWan``) from ``folder``.

    Equivalent to ``cls.from_pretrained(folder, torch_dtype=dtype)`` — modules listed in
    ``cls._keep_in_fp32_modules`` stay float32 — but needs no ``accelerate`` and turns every
    problem into a ``CheckpointError`` naming the file.
    """
    config_path = folder / "config.json"
    config = read_json(config_path, f"{folder.name} config")
    files = weight_files(folder, DIFFUSERS_WEIGHTS)
    # like diffusers: buffers built in __init__ take the requested dtype as the default dtype
    default_dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with _empty_parameters():
            model = cls.from_config(config)
    except Exception as exc:
        raise CheckpointError(f"{config_path}: cannot build {cls.__name__} from it ({exc})") from None
    finally:
        torch.set_default_dtype(default_dtype)
    state = _read_state_dict(files)
    ignore = tuple(getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or ())
    expected = dict(model.named_parameters())
    expected.update({k: v for k, v in model.named_buffers() if k in model.state_dict()})
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(k for k in set(state) - set(expected) if not any(p in k for p in ignore))
    where = files[0] if len(files) == 1 else folder
    if missing:
        raise CheckpointError(
            f"{where}: {len(missing)} weight(s) of {cls.__name__} missing, e.g. {', '.join(missing[:3])}"
        )
    if unexpected:
        raise CheckpointError(
            f"{where}: {len(unexpected)} unexpected weight(s) for {cls.__name__} "
            f"(config and weights disagree?), e.g. {', '.join(unexpected[:3])}"
        )
    for key, tensor in state.items():
        if key in expected and tuple(tensor.shape) != tuple(expected[key].shape):
            raise CheckpointError(
                f"{where}: weight {key!r} has shape {list(tensor.shape)}, {config_path.name} implies "
                f"{list(expected[key].shape)}"
            )
    state = {k: v for k, v in state.items() if k in expected}
    model.load_state_dict(state, strict=True, assign=True)
    keep = list(getattr(cls, "_keep_in_fp32_modules", None) or [])
    for name, param in model.named_parameters():
        keep32 = any(m in name.split(".") for m in keep)
        target = torch.float32 if (keep32 and dtype != torch.float32) else dtype
        module_name, _, pname = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        module._parameters[pname] = torch.nn.Parameter(param.data.to(device=device, dtype=target), requires_grad=False)
    for name, buf in list(model.named_buffers()):
        module_name, _, bname = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        module._buffers[bname] = buf.to(device=device)
    model.eval()
    return model


def load_transformers_model(cls: Any, folder: Path, *, device: torch.device, dtype: torch.dtype) -> Any:
    """Load a transformers model from ``folder`` (local files only), errors as ``CheckpointError``."""
    model_folder(folder, folder.name, TRANSFORMERS_WEIGHTS)
    return kit.load_pretrained(cls, folder, device=device, dtype=dtype)


def load_image_processor(folder: Path) -> Any:
    from transformers import CLIPImageProcessor

    return kit.load_tokenizer(folder, CLIPImageProcessor)


def load_scheduler(folder: Path, class_name: str | None) -> Any:
    """The scheduler *template*: each request builds its own instance from its config."""
    return kit.load_scheduler(folder, class_name or "UniPCMultistepScheduler")
