"""Loading a diffusers-format pipeline folder's components by the classes its ``model_index.json``
names (local files only), each failure one :class:`omniloop.errors.CheckpointError` naming the file.

The pieces every diffusers-format family needs once its layout is checked:

* :func:`declared` — ``(library, class)`` of a component the index declares (None: absent or
  ``[null, null]``);
* :func:`component_class` — that class, looked up in the library it names: ``diffusers``,
  ``transformers``, or a diffusers pipeline module (``["stable_audio", "StableAudioProjectionModel"]``
  is ``diffusers.pipelines.stable_audio``'s class, as diffusers itself resolves it);
* :func:`load_model`, :func:`load_tokenizer`, :func:`load_scheduler` — ``from_pretrained`` /
  ``from_config`` with the library's progress bars hidden.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from omniloop.errors import CheckpointError

from .checkpoint import quiet  # one way to hide the libraries' progress bars (omniloop_kit.checkpoint)

#: libraries a component may come from (besides a diffusers pipeline module)
LIBRARIES = ("diffusers", "transformers")


def declared(index: dict[str, Any], name: str) -> tuple[str, str] | None:
    """``(library, class)`` of a component the index declares, None when absent or ``[null, null]``."""
    entry = index.get(name)
    if isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[0] and entry[1]:
        return str(entry[0]), str(entry[1])
    return None


def component_class(index: dict[str, Any], name: str, index_path: Path,
                    pipeline_modules: Sequence[str] = ()) -> Any:
    """The class ``model_index.json`` names for ``name``, looked up in the library it names
    (``pipeline_modules``: the diffusers pipeline modules a family accepts as a library)."""
    entry = declared(index, name)
    if entry is None:
        raise CheckpointError(f"{index_path}: component {name!r} is not declared")
    library, cls_name = entry
    if library in LIBRARIES:
        module_name = library
    elif library in pipeline_modules:
        module_name = f"diffusers.pipelines.{library}"
    else:
        known = ", ".join((*LIBRARIES, *pipeline_modules))
        raise CheckpointError(f"{index_path}: component {name!r} comes from library {library!r}; only {known} are loaded")
    module = importlib.import_module(module_name)
    cls = getattr(module, cls_name, None) if cls_name.isidentifier() else None
    if cls is None or not hasattr(cls, "from_pretrained" if name != "scheduler" else "from_config"):
        raise CheckpointError(f"{index_path}: component {name!r}: {library} has no loadable class {cls_name!r}")
    return cls


def load_model(cls: Any, folder: Path, *, device: torch.device, dtype: torch.dtype) -> Any:
    """A diffusers or transformers model from ``folder`` (local files only), in eval mode without grads."""
    try:
        with quiet():
            try:
                model = cls.from_pretrained(str(folder), dtype=dtype, local_files_only=True)
            except TypeError:  # older transformers / diffusers spell it torch_dtype
                model = cls.from_pretrained(str(folder), torch_dtype=dtype, local_files_only=True)
    except Exception as exc:
        raise CheckpointError(f"{folder}: cannot load {cls.__name__} ({type(exc).__name__}: {exc})") from None
    return model.to(device).eval().requires_grad_(False)


def load_tokenizer(cls: Any, folder: Path) -> Any:
    try:
        with quiet():
            return cls.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:
        raise CheckpointError(f"{folder}: cannot load {cls.__name__} ({type(exc).__name__}: {exc})") from None


def load_scheduler(cls: Any, config: dict[str, Any], path: Path) -> Any:
    """The scheduler *template* from its parsed config (``path`` names the file in errors): each
    request builds its own instance from its config."""
    try:
        return cls.from_config(config)
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot build {cls.__name__} ({exc})") from None


__all__ = ["LIBRARIES", "component_class", "declared", "load_model", "load_scheduler", "load_tokenizer", "quiet"]
