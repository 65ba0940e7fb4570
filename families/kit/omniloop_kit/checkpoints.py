"""Checking a diffusers-format checkpoint on disk, family-independent and without loading a tensor
(omniloop-kit; it was ``omniloop.checkpoints`` before omniloop 0.2: issue 34).

A diffusers-format checkpoint is a folder with ``model_index.json`` (``_class_name`` plus one
``[library, class]`` entry per component) and one sub-folder per component: a ``config.json``
(or ``scheduler_config.json``) and weight files, ``<stem>.safetensors`` or shards listed in
``<stem>.safetensors.index.json``. The model families (``omniloop_wan``, ``omniloop_flux``,
``omniloop_sd3``) decide *which* components they need and how their configs must fit together;
the helpers here do the parts every family shares:

- :func:`resolve_root`: a checkpoint folder or a Hugging Face cache folder → the folder holding
  ``model_index.json``;
- :func:`peek_json`, :func:`looks_like`: cheap, never-raising detection of a family's checkpoint;
- :func:`read_json`, :func:`read_model_index`, :func:`component_folder`: read a JSON object,
  the index, a component's folder;
- :func:`model_folder`: a model component's config and checked weight files;
- :func:`weight_files`, :func:`check_safetensors`: the weight files of a component, each checked
  from its safetensors header (a file cut short is caught before any load);
- :func:`weight_version`: a cheap identity of the weights (names, sizes, modification times).

A family's checkpoint as a whole — which components it needs, of what kind, loading them — is
:mod:`omniloop_kit.checkpoint` (singular: a family's ``Layout``, built on these readers).

Every problem raises one :class:`omniloop.errors.CheckpointError` whose message starts with the
file (or folder) at fault. Only JSON and the safetensors header format are read here: no
diffusers, transformers or torch import.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omniloop.errors import CheckpointError

#: file stem of a diffusers model's weights (``diffusion_pytorch_model.safetensors``)
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model"
#: file stem of a transformers model's weights (``model.safetensors``)
TRANSFORMERS_WEIGHTS = "model"
#: the longest safetensors JSON header accepted (the format's own readers refuse more than 100 MB)
MAX_HEADER_BYTES = 100_000_000

__all__ = [
    "DIFFUSERS_WEIGHTS",
    "MAX_HEADER_BYTES",
    "TRANSFORMERS_WEIGHTS",
    "check_safetensors",
    "component_folder",
    "looks_like",
    "model_folder",
    "peek_json",
    "read_json",
    "read_model_index",
    "resolve_root",
    "weight_files",
    "weight_version",
]


def resolve_root(path: str | Path) -> Path:
    """The folder holding ``model_index.json``.

    ``path`` itself, or — for a Hugging Face cache folder (``models--Org--Name``) — the snapshot
    its ``refs/main`` points at, else its only snapshot. Anything else comes back unchanged (the
    check that follows names what is missing).
    """
    root = Path(path).expanduser()
    if (root / "model_index.json").exists() or not (root / "snapshots").is_dir():
        return root
    ref = root / "refs" / "main"
    if ref.is_file():
        snap = root / "snapshots" / ref.read_text().strip()
        if snap.is_dir():
            return snap
    snaps = sorted(p for p in (root / "snapshots").iterdir() if p.is_dir())
    return snaps[0] if len(snaps) == 1 else root


def peek_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when it is missing, unreadable or not an object (never raises)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def looks_like(
    path: str | Path,
    pipelines: tuple[str, ...],
    transformer_class: str,
    accept: Callable[[Path, dict[str, Any], dict[str, Any]], bool] | None = None,
) -> bool:
    """Cheap detection of a family's checkpoint (never raises): ``model_index.json`` names one of
    ``pipelines``; or — a checkpoint saved by another pipeline class — ``transformer/config.json``
    names ``transformer_class`` and ``accept(root, index, transformer_config)`` (when given) agrees."""
    try:
        root = resolve_root(path)
    except OSError:
        return False
    index = peek_json(root / "model_index.json")
    if index is None:
        return False
    if index.get("_class_name") in pipelines:
        return True
    tf = peek_json(root / "transformer" / "config.json")
    if tf is None or tf.get("_class_name") != transformer_class:
        return False
    try:
        return accept is None or bool(accept(root, index, tf))
    except (OSError, ValueError, TypeError):
        return False


def read_json(path: Path, what: str) -> dict[str, Any]:
    """Parse the JSON object in ``path``; ``what`` names the file in the error (``"vae config"``).

    Raises ``CheckpointError`` for a missing file (a dangling link is called an incomplete
    download), a file that is not UTF-8 JSON, or JSON that is not an object.
    """
    if not path.exists():
        if path.is_symlink():
            raise CheckpointError(f"{path}: {what} is a link to a missing file (incomplete download?)")
        raise CheckpointError(f"{path}: {what} is missing")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} must be a JSON object, not {type(data).__name__}")
    return data


def read_model_index(root: Path) -> dict[str, Any]:
    """The parsed ``model_index.json`` of the checkpoint folder ``root`` (which must exist)."""
    if not root.is_dir():
        raise CheckpointError(f"{root}: checkpoint folder does not exist")
    return read_json(root / "model_index.json", "model_index.json")


def component_folder(root: Path, name: str) -> Path:
    """``root / name``, which must be a folder (the index declares the component ``name``)."""
    folder = root / name
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: folder of component {name!r} is missing")
    return folder


def model_folder(folder: Path, name: str, stem: str, *, allow_bin: bool = True) -> dict[str, Any]:
    """Check a model component's folder: its ``config.json`` (returned, parsed) and its weight
    files (:func:`weight_files` with ``stem``: :data:`DIFFUSERS_WEIGHTS` or :data:`TRANSFORMERS_WEIGHTS`)."""
    config = read_json(folder / "config.json", f"{name} config")
    weight_files(folder, stem, allow_bin=allow_bin)
    return config


def weight_files(folder: Path, stem: str, *, allow_bin: bool = True) -> list[Path]:
    """The weight files of one component, sharded or not, each checked by :func:`check_safetensors`.

    ``<stem>.safetensors`` if present, else the shards ``<stem>.safetensors.index.json`` lists (by
    plain file name: a shard name with a path separator or a leading dot is refused), else — when
    ``allow_bin`` — any ``*.bin`` files (not checked: pickles have no header to read).
    """
    single = folder / f"{stem}.safetensors"
    index = folder / f"{stem}.safetensors.index.json"
    if single.exists() or single.is_symlink():
        check_safetensors(single)
        return [single]
    if index.exists() or index.is_symlink():
        data = read_json(index, "weight index")
        wmap = data.get("weight_map")
        if not isinstance(wmap, dict) or not wmap:
            raise CheckpointError(f"{index}: weight index has no weight_map")
        shards = []
        for s in sorted(set(wmap.values()), key=str):
            if not isinstance(s, str) or "/" in s or "\\" in s or s.startswith("."):
                raise CheckpointError(f"{index}: weight_map names an invalid shard {s!r}")
            shards.append(folder / s)
        for shard in shards:
            check_safetensors(shard)
        return shards
    if allow_bin:
        bins = sorted(folder.glob("*.bin"))
        if bins:
            return bins
    raise CheckpointError(f"{folder}: no weights ({stem}.safetensors or {stem}.safetensors.index.json)")


def check_safetensors(path: Path) -> dict[str, Any]:
    """Read a safetensors file's header and check that the file holds every byte it declares.

    The format: 8 bytes little-endian header length ``n``, ``n`` bytes of JSON (tensor name →
    ``dtype``, ``shape``, ``data_offsets``; optional ``__metadata__``), then the data. Returns
    the parsed header; raises ``CheckpointError`` for a missing file, an implausible or cut-short
    header, an unreadable header, a malformed entry, or data shorter than the offsets declare.
    """
    if not path.exists():
        raise CheckpointError(
            f"{path}: weight file is missing" + (" (a link to a missing blob: incomplete download?)" if path.is_symlink() else "")
        )
    size = path.stat().st_size
    try:
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: weight file is truncated ({size} bytes, no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: not a safetensors file (header length {n} is not plausible)")
            if n > size - 8:
                raise CheckpointError(
                    f"{path}: weight file is truncated ({size} bytes, shorter than its {n}-byte header); re-download it"
                )
            header = json.loads(fh.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: safetensors header is unreadable ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    end = 0
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        try:
            end = max(end, int(meta["data_offsets"][1]))
        except (KeyError, TypeError, ValueError, IndexError):
            raise CheckpointError(f"{path}: safetensors header entry {key!r} is malformed") from None
    if 8 + n + end > size:
        raise CheckpointError(
            f"{path}: weight file is truncated ({size} bytes, the header declares {8 + n + end}); re-download it"
        )
    return header


def weight_version(root: Path, components: list[str] | tuple[str, ...]) -> str:
    """A cheap identity of the weights: names, sizes and modification times of the
    ``.safetensors`` / ``.bin`` / ``.json`` files in each component folder (16 hex digits)."""
    h = hashlib.sha256()
    for name in components:
        for f in sorted((root / name).glob("*")):
            if f.suffix in (".safetensors", ".bin", ".json"):
                st = f.stat()
                h.update(f"{name}/{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]
