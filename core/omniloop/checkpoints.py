"""Reading a ``.safetensors`` file into CPU tensors with one error naming the path (LoRA files,
parity recordings). The diffusers-format checkpoint checks that were here are omniloop-kit"s
``omniloop_kit.checkpoints`` since omniloop 0.2 (issue 34: the core holds only what every deployment
uses); importing one of them from here raises an ImportError naming the new import."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import CheckpointError
from .lazy import moved

__getattr__ = moved(__name__, dict.fromkeys((
    "DIFFUSERS_WEIGHTS", "MAX_HEADER_BYTES", "TRANSFORMERS_WEIGHTS", "check_safetensors", "component_folder", "looks_like",
    "model_folder", "peek_json", "read_json", "read_model_index", "resolve_root", "weight_files", "weight_version",
), "omniloop_kit.checkpoints"))


def read_safetensors(path: str | Path, error: type[Exception] = CheckpointError) -> tuple[dict[str, Any], dict[str, str]]:
    """(tensors by name, the header"s string metadata) of a ``.safetensors`` file, on the CPU; a
    file safetensors cannot read raises one ``error`` naming the path (LoRA files, parity
    recordings)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise error(f"{path}: not a readable safetensors file ({exc})") from None
    return tensors, meta


def metadata_json(meta: dict[str, str], key: str, path: str | Path, error: type[Exception] = CheckpointError,
                  *, what: str | None = None) -> dict[str, Any] | None:
    """The JSON object stored as ``meta[key]`` in a safetensors header (``read_safetensors``'s
    metadata), or None where the key is absent or empty; text that is not a JSON object raises
    one ``error`` naming the path and ``what`` (default: the key)."""
    raw = meta.get(key)
    if not raw:
        return None
    what = what or key
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise error(f"{path}: {what} is not JSON ({exc})") from None
    if not isinstance(parsed, dict):
        raise error(f"{path}: {what} is not a JSON object")
    return parsed
