"""Reading a diffusers-format checkpoint a family declares by its :class:`Layout`: find it, check it
(before any weight is read), load its components, and read what its configs say about its limits.

A family names its layout once — its pipeline classes, its transformer class, the components it
needs and may have, and what kind each one is::

    LAYOUT = Layout(what="a FLUX.1 checkpoint", pipelines=("FluxPipeline",),
                    transformer_class="FluxTransformer2DModel",
                    required=("transformer", "vae", "text_encoder", "tokenizer", "scheduler"))

and gets :func:`looks_like` (cheap detection), :func:`check_checkpoint` (the index, every component's
folder, config, weight files and tokenizer files, the transformer class; a family adds how its
configs must fit together), :func:`load_component` (by the class ``model_index.json`` names, local
files only; :func:`load_diffusers_weights`: a diffusers model built on the meta device and its
weights assigned, each checked by name and shape), :func:`read_extra` (the checkpoint's ``omniloop.json``) and :func:`sample_size_limits`
(a real checkpoint's trained size, issue 42). Every problem is one
:class:`~omniloop.errors.CheckpointError` whose message starts with the file at fault.

Two modules, two levels: :mod:`omniloop_kit.checkpoints` (plural) reads the diffusers *format* —
JSON files, the index, a component's weight files and their safetensors headers — knowing nothing
of a family; this module reads a *family's* checkpoint through its :class:`Layout` and builds on
those readers (``resolve_root`` and ``weight_version`` are re-exported from there unchanged).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from attrs import define, field

from omniloop.errors import CheckpointError
from omniloop_kit import checkpoints
from omniloop_kit.checkpoints import (
    DIFFUSERS_WEIGHTS,
    TRANSFORMERS_WEIGHTS,
    component_folder,
    model_folder,
    peek_json,
    read_json,
    read_model_index,
    resolve_root,
    weight_files,
    weight_version,
)

#: what a component is, by its usual name (a layout may say otherwise in ``kinds``)
KIND_OF = {"transformer": "diffusers", "transformer_2": "diffusers", "vae": "diffusers", "scheduler": "scheduler",
           "image_processor": "image_processor"}
#: the library each kind of component comes from
LIBRARY = {"diffusers": "diffusers", "transformers": "transformers", "tokenizer": "transformers",
           "scheduler": "diffusers", "image_processor": "transformers"}
#: files one of which a tokenizer folder must hold (what transformers' tokenizer classes read)
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "spiece.model", "tokenizer.model", "vocab.txt")


def kind_of(name: str) -> str:
    """``diffusers`` / ``transformers`` (a model), ``tokenizer``, ``scheduler``, ``image_processor``."""
    if name in KIND_OF:
        return KIND_OF[name]
    return "tokenizer" if name.startswith("tokenizer") else "transformers"


@define(frozen=True)
class Layout:
    """A family's diffusers-format checkpoint: ``what`` it is called in messages ("a Wan
    checkpoint"), the ``pipelines`` classes and ``transformer_class`` that detect it, the
    ``required`` and ``optional`` components, ``tokenizer_files`` (one of which a tokenizer folder
    holds), ``check_classes`` (the classes ``model_index.json`` names must exist in the library
    their kind comes from), ``allow_bin`` (pickled ``.bin`` weights accepted), ``accept``
    (``looks_like``'s judge of a checkpoint saved by another pipeline class) and ``kinds`` (the
    kind of a component its name does not tell: Cosmos 3's ``text_tokenizer`` is a tokenizer,
    its ``sound_tokenizer`` a diffusers model)."""

    what: str
    pipelines: tuple[str, ...] = field(converter=tuple)
    transformer_class: str
    required: tuple[str, ...] = field(converter=tuple)
    optional: tuple[str, ...] = field(default=(), converter=tuple)
    tokenizer_files: tuple[str, ...] = field(default=TOKENIZER_FILES, converter=tuple)
    check_classes: bool = True
    allow_bin: bool = True
    accept: Callable[[Path, dict[str, Any], dict[str, Any]], bool] | None = None
    kinds: Mapping[str, str] = field(factory=dict)

    def kind(self, name: str) -> str:
        """The component's kind: ``kinds``' word for it, else :func:`kind_of` its name."""
        return self.kinds.get(name) or kind_of(name)

    def components_in(self, index: Mapping[str, Any]) -> list[str]:
        """The components ``index`` declares (``[library, class]`` with a class), in layout order."""
        return [n for n in self.required + self.optional if declared(index, n) is not None]


def declared(index: Mapping[str, Any], name: str) -> tuple[str, str] | None:
    """``(library, class)`` of a component the index declares; None when absent or ``[null, null]``."""
    entry = index.get(name)
    if isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[1]:
        return str(entry[0]), str(entry[1])
    return None


def looks_like(path: str | Path, layout: Layout) -> bool:
    """Cheap detection (never raises): reads ``model_index.json`` and ``transformer/config.json`` only."""
    return checkpoints.looks_like(path, layout.pipelines, layout.transformer_class, layout.accept)


def library_class(lib: str, name: str, where: str) -> Any:
    """The class ``name`` of the library ``lib`` (``diffusers`` or ``transformers``)."""
    cls = getattr(importlib.import_module(lib), name, None) if name.isidentifier() else None
    if cls is None or not isinstance(cls, type):
        raise CheckpointError(f"{where}: {lib} has no class {name!r}")
    return cls


def read_index(root: Path, layout: Layout) -> tuple[dict[str, Any], list[str]]:
    """The parsed ``model_index.json`` and the components it declares: every required one, each
    from the library its kind comes from and (``check_classes``) a class that library has."""
    index_path = root / "model_index.json"
    index = read_model_index(root)
    present = layout.components_in(index)
    for name in layout.required:
        if name not in present:
            raise CheckpointError(f"{index_path}: component {name!r} is not declared ({layout.what} needs "
                                  + ", ".join(layout.required) + ")")
    if layout.check_classes:
        for name in present:
            lib, cls = declared(index, name) or ("", "")
            want = LIBRARY[layout.kind(name)]
            if lib != want:
                raise CheckpointError(f"{index_path}: component {name!r} must come from {want}, not {lib!r}")
            library_class(lib, cls, f"{index_path}: component {name!r}")
    return index, present


def check_tokenizer(folder: Path, files: tuple[str, ...] = TOKENIZER_FILES) -> None:
    """A tokenizer folder holds one of ``files``; its JSON files parse; a BPE ``vocab.json`` has its ``merges.txt``."""
    if not any((folder / f).exists() for f in files):
        have = f"neither {files[0]} nor {files[1]}" if len(files) == 2 else "none of " + ", ".join(files)
        raise CheckpointError(f"{folder}: tokenizer has {have}")
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json"):
        if (folder / f).exists() or (folder / f).is_symlink():
            read_json(folder / f, f"tokenizer file {f}" if f != "tokenizer.json" else "tokenizer file")
    if not (folder / "tokenizer.json").exists() and (folder / "vocab.json").exists() and not (folder / "merges.txt").exists():
        raise CheckpointError(f"{folder / 'merges.txt'}: a BPE tokenizer with vocab.json needs merges.txt (missing)")


def check_folders(root: Path, layout: Layout, present: list[str]) -> dict[str, dict[str, Any]]:
    """Every declared component's folder: config and weight files (a truncated safetensors file is
    caught from its header), tokenizer files, scheduler and processor configs; the transformers'
    class. Returns the parsed configs by component (models and scheduler)."""
    configs: dict[str, dict[str, Any]] = {}
    for name in present:
        folder = component_folder(root, name)
        kind = layout.kind(name)
        if kind in ("diffusers", "transformers"):
            stem = DIFFUSERS_WEIGHTS if kind == "diffusers" else TRANSFORMERS_WEIGHTS
            configs[name] = model_folder(folder, name, stem, allow_bin=layout.allow_bin)
            found = configs[name].get("_class_name", layout.transformer_class)
            if name.startswith("transformer") and found != layout.transformer_class:
                article = "an" if layout.transformer_class[0] in "AEIOUS" else "a"
                raise CheckpointError(f"{folder / 'config.json'}: expected {article} {layout.transformer_class}, "
                                      f"found {found!r}")
        elif kind == "tokenizer":
            check_tokenizer(folder, layout.tokenizer_files)
        elif kind == "scheduler":
            configs[name] = read_json(folder / "scheduler_config.json", "scheduler config")
        else:
            read_json(folder / "preprocessor_config.json", "image processor config")
    return configs


def check_checkpoint(root: Path, layout: Layout,
                     consistency: Callable[[Path, dict[str, Any], dict[str, dict[str, Any]]], None] | None = None,
                     ) -> tuple[dict[str, Any], list[str], dict[str, dict[str, Any]]]:
    """:func:`read_index`, :func:`check_folders`, then the family's ``consistency(root, index,
    configs)`` (how its configs must fit together); no tensor is loaded. Returns the index, the
    components present and their configs."""
    index, present = read_index(root, layout)
    configs = check_folders(root, layout, present)
    if consistency is not None:
        consistency(root, index, configs)
    return index, present, configs


def read_extra(root: Path) -> dict[str, Any]:
    """The checkpoint's ``omniloop.json`` (its variant, defaults, limits), ``{}`` when it has none."""
    path = root / "omniloop.json"
    return read_json(path, "omniloop.json") if path.exists() else {}


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Hide transformers' and diffusers' per-load progress bars and info logs (restored afterwards)."""
    from diffusers.utils import logging as dlog
    from transformers.utils import logging as tlog

    was_t, was_d = tlog.is_progress_bar_enabled(), dlog.is_progress_bar_enabled()
    level = dlog.get_verbosity()
    tlog.disable_progress_bar()
    dlog.disable_progress_bar()
    dlog.set_verbosity_error()
    try:
        yield
    finally:
        if was_t:
            tlog.enable_progress_bar()
        if was_d:
            dlog.enable_progress_bar()
        dlog.set_verbosity(level)


def load_scheduler(folder: Path, class_name: str | None = None) -> Any:
    """The scheduler *template* (each request's sampler builds its own instance from its config):
    the class its config names, else ``class_name`` (the index's)."""
    import diffusers

    config = read_json(folder / "scheduler_config.json", "scheduler config")
    name = str(config.get("_class_name") or class_name or "")
    cls = getattr(diffusers, name, None) if name.isidentifier() else None
    if cls is None or not hasattr(cls, "from_config"):
        raise CheckpointError(f"{folder / 'scheduler_config.json'}: unknown scheduler class {name!r}")
    try:
        return cls.from_config(config)
    except Exception as exc:
        raise CheckpointError(f"{folder / 'scheduler_config.json'}: cannot build {name} ({exc})") from None


def load_pretrained(cls: Any, folder: Path, *, device: Any, dtype: Any) -> Any:
    """A diffusers or transformers model from ``folder`` (local files only), on ``device`` in eval
    mode without gradients. Weights its files lack (left on the meta device) and every load error
    are one ``CheckpointError`` naming the folder."""
    try:
        with quiet():
            if cls.__module__.startswith("transformers"):
                try:
                    model = cls.from_pretrained(str(folder), dtype=dtype, local_files_only=True)
                except TypeError:  # transformers < 4.56 spells it torch_dtype
                    model = cls.from_pretrained(str(folder), torch_dtype=dtype, local_files_only=True)
            else:
                model = cls.from_pretrained(str(folder), torch_dtype=dtype, local_files_only=True)
        empty = [n for n, p in model.named_parameters() if p.is_meta]
        if empty:  # diffusers warns, does not raise
            raise CheckpointError(f"{folder}: cannot load {cls.__name__}: {len(empty)} weight(s) missing from its files "
                                  f"(config and weights disagree?), e.g. {', '.join(empty[:3])}")
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{folder}: cannot load {cls.__name__} ({type(exc).__name__}: {exc})") from None
    return model.to(device).eval().requires_grad_(False)


def load_tokenizer(folder: Path, cls: Any = None) -> Any:
    """A tokenizer (``cls``, default transformers' ``AutoTokenizer``) from ``folder``, local files only."""
    if cls is None:
        from transformers import AutoTokenizer as cls
    try:
        with quiet():
            return cls.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:
        raise CheckpointError(f"{folder}: cannot load {cls.__name__} ({type(exc).__name__}: {exc})") from None


def load_component(index: Mapping[str, Any], root: Path, name: str, *, device: Any, dtype: Any,
                   layout: Layout | None = None) -> Any:
    """One component by the class ``model_index.json`` names for it (local files only; its kind
    from ``layout`` when given)."""
    entry = declared(index, name)
    if entry is None:
        raise CheckpointError(f"{root / 'model_index.json'}: component {name!r} is not declared")
    folder = root / name
    kind = layout.kind(name) if layout is not None else kind_of(name)
    if kind == "scheduler":
        return load_scheduler(folder, entry[1])
    cls = library_class(entry[0], entry[1], f"{root / 'model_index.json'}: component {name!r}")
    if kind == "tokenizer":
        return load_tokenizer(folder, cls)
    if kind == "image_processor":
        return load_tokenizer(folder, cls)  # from_pretrained of a processor class, the same way
    return load_pretrained(cls, folder, device=device, dtype=dtype)


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """Build modules without allocating or initialising parameters (they go to ``meta``).

    Buffers are built normally (rotary tables computed in ``__init__``, as Wan's are). The weights are
    then assigned from the checkpoint. Process-wide while active: load from one thread at a time.
    """
    import torch

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


def read_state_dict(files: list[Path]) -> dict[str, Any]:
    """Every tensor of ``files`` (safetensors or pickled ``.bin``) on the CPU; an unreadable file is
    one ``CheckpointError`` naming it."""
    import torch
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for f in files:
        try:
            if f.suffix == ".safetensors":
                state.update(load_file(str(f), device="cpu"))
            else:
                state.update(torch.load(f, map_location="cpu", weights_only=True))
        except Exception as exc:
            raise CheckpointError(f"{f}: cannot read weights ({type(exc).__name__}: {exc})") from None
    return state


def load_diffusers_weights(cls: Any, folder: Path, *, device: Any, dtype: Any) -> Any:
    """Load a diffusers model (Wan's ``WanTransformer3DModel`` / ``AutoencoderKLWan``) from ``folder``:
    built on the meta device (:func:`empty_parameters`), then its checkpoint weights assigned.

    Equivalent to ``cls.from_pretrained(folder, torch_dtype=dtype)`` — modules listed in
    ``cls._keep_in_fp32_modules`` stay float32 — but needs no ``accelerate`` and turns every
    problem (a missing, unexpected or misshapen weight) into a ``CheckpointError`` naming the file.
    """
    import torch

    config_path = folder / "config.json"
    config = read_json(config_path, f"{folder.name} config")
    files = weight_files(folder, DIFFUSERS_WEIGHTS)
    # like diffusers: buffers built in __init__ take the requested dtype as the default dtype
    default_dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with empty_parameters():
            model = cls.from_config(config)
    except Exception as exc:
        raise CheckpointError(f"{config_path}: cannot build {cls.__name__} from it ({exc})") from None
    finally:
        torch.set_default_dtype(default_dtype)
    state = read_state_dict(files)
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


# --------------------------------------------------------------------------------------------
# What a real checkpoint's configs say about its range (issue 42)
# --------------------------------------------------------------------------------------------


def sample_size_limits(root: Path | None, *, height: int | None, width: int | None, frames: int | None = None,
                       source: str) -> Any:
    """The range a real checkpoint was trained for, from its configs' sample sizes: a ``warn``
    :class:`omniloop.limits.ModelLimits` (a request above it runs, bounded by the deploy's limits,
    with one warning naming the field). None for a checkpoint with its own ``omniloop.json`` (a
    shipped or tiny checkpoint: what it declares there is the whole declaration) or no size."""
    from omniloop.limits import ModelLimits

    if root is None or (root / "omniloop.json").exists() or not (height or width or frames):
        return None
    sizes = "x".join(str(v) for v in (frames, height, width) if v)
    return ModelLimits(max_height=height, max_width=width, max_frames=frames, enforce="warn",
                       note=f"trained at up to {sizes} ({source})")


def config_of(root: Path, component: str) -> dict[str, Any]:
    """A component's ``config.json`` for a cheap look (``{}`` when missing or not JSON)."""
    return peek_json(root / component / "config.json") or {}


__all__ = [
    "LIBRARY", "TOKENIZER_FILES", "Layout", "check_checkpoint", "check_folders", "check_tokenizer", "config_of",
    "declared", "empty_parameters", "kind_of", "library_class", "load_component", "load_diffusers_weights",
    "load_pretrained", "load_scheduler", "load_tokenizer", "looks_like", "quiet", "read_extra", "read_index",
    "read_state_dict", "resolve_root", "sample_size_limits", "weight_version",
]
