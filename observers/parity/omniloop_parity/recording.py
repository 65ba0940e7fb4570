"""A parity recording: named tensors in one safetensors file, a JSON manifest in its metadata.

Keys read like ``step003/cond/noise_pred``, ``step003/cond/blocks.2``, ``step003/latents``,
``final/video``; taps offered outside a loop step are ``<node>/<name>``. When more than one loop
node tapped values the step keys are prefixed by the node (``denoise/step003/...``). The manifest
lists every tap in the order it was recorded — the execution order, which is what "first
divergence" means.

Files are written atomically: to a hidden temporary file in the same folder, flushed, then
``os.replace``-d onto the final name. A run that dies never leaves a file under the final name;
a run that is killed mid-write leaves its temporary file (``.<name>.<8 chars>.tmp``), which the
next write into that folder removes once it is more than an hour old (only names of exactly that
pattern, never a live writer's).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata as md
import json
import os
import platform
import re
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
from attrs import define

from omniloop.checkpoints import metadata_json, read_safetensors
from omniloop_io import media

from .config import ParityError

if TYPE_CHECKING:
    import torch

FORMAT = "omniloop-parity/1"
META_KEY = "omniloop_parity"

_BLOCK_INDEX = re.compile(r"\.(\d+)$")


@define(frozen=True)
class TapEntry:
    """One recorded tensor: where it came from and its key in the file."""

    key: str
    node: str
    name: str
    kind: str  # "tap" | "block" | "final"
    step: int | None = None
    branch: str | None = None
    timestep: float | None = None
    shape: tuple[int, ...] = ()
    dtype: str = ""

    @property
    def block(self) -> int | None:
        """The block index of a block tap (``blocks.7`` → 7)."""
        if self.kind != "block":
            return None
        m = _BLOCK_INDEX.search(self.name)
        return int(m.group(1)) if m else None

    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TapEntry:
        return cls(
            key=str(d["key"]),
            node=str(d["node"]),
            name=str(d["name"]),
            kind=str(d["kind"]),
            step=d.get("step"),
            branch=d.get("branch"),
            timestep=d.get("timestep"),
            shape=tuple(d.get("shape") or ()),
            dtype=str(d.get("dtype") or ""),
        )


def tap_key(node: str, name: str, kind: str, step: int | None, branch: str | None, node_prefix: bool) -> str:
    if kind == "final":
        return f"final/{name}"
    if step is None:
        return f"{node}/{name}"
    parts = [node] if node_prefix else []
    parts.append(f"step{step:03d}")
    if branch:
        parts.append(branch)
    parts.append(name)
    return "/".join(parts)


class Recording:
    """Tensors by key plus the manifest (request, seed, deploy, versions, device, tap list)."""

    def __init__(self, manifest: dict[str, Any], tensors: dict[str, torch.Tensor], path: Path | None = None) -> None:
        self.manifest = manifest
        self.tensors = tensors
        self.path = path
        self.entries: list[TapEntry] = [TapEntry.from_dict(e) for e in manifest.get("taps", [])]
        self._by_key = {e.key: e for e in self.entries}

    # -- access ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def entry(self, key: str) -> TapEntry:
        return self._by_key[key]

    @property
    def keys(self) -> list[str]:
        return [e.key for e in self.entries]

    @property
    def seed(self) -> int | None:
        return self.manifest.get("seed")

    @property
    def request_dict(self) -> dict[str, Any]:
        return dict(self.manifest.get("request") or {})

    def request(self) -> Any:
        """The recorded request as an ``OmniRequest``, with the seed the run actually used."""
        from omniloop.schema import request_from_dict

        req = request_from_dict(self.request_dict)
        if req.diffusion.seed is None and self.seed is not None:
            req = attrs.evolve(req, diffusion=attrs.evolve(req.diffusion, seed=int(self.seed)))
        return req

    @property
    def label(self) -> str:
        return str(self.path) if self.path is not None else f"<recording {self.manifest.get('request_id', '?')}>"

    # -- files ---------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write this recording to ``path`` atomically and return the path."""
        p = Path(path)
        write_atomic(p, self.tensors, {META_KEY: json.dumps(self.manifest, default=str), "format": FORMAT})
        self.path = p
        return p

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Recording:
        p = Path(path)
        if not p.is_file():
            raise ParityError(f"{p}: recording not found")
        tensors, meta = read_safetensors(p, ParityError)
        manifest = metadata_json(meta, META_KEY, p, ParityError, what="the parity manifest")
        if manifest is None:
            raise ParityError(f"{p}: a safetensors file, but not a parity recording (no {META_KEY!r} manifest)")
        if manifest.get("format") != FORMAT:
            raise ParityError(f"{p}: unsupported recording format {str(manifest.get('format'))[:40]!r} (this reads {FORMAT})")
        try:
            rec = cls(manifest, tensors, path=p)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ParityError(f"{p}: the parity manifest's tap list is malformed ({type(exc).__name__}: {exc})") from None
        missing = [k for k in rec.keys if k not in tensors]
        if missing:
            raise ParityError(f"{p}: the manifest lists taps that the file lacks: {', '.join(missing[:5])}")
        return rec


def as_recording(x: Recording | str | os.PathLike[str]) -> Recording:
    return x if isinstance(x, Recording) else Recording.load(x)


#: ``tempfile.mkstemp(prefix=".<name>.", suffix=".tmp")`` names: 8 characters of [a-z0-9_]
_TEMP_NAME = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")
STALE_TEMP_SECONDS = 3600.0


def clean_stale_temp_files(folder: Path, older_than: float = STALE_TEMP_SECONDS) -> list[Path]:
    """Remove temporary files of killed :func:`write_atomic` calls in ``folder``; return them."""
    return media.clean_stale_temp_files(folder, older_than=older_than, pattern=_TEMP_NAME)


def save_file(tensors: dict[str, torch.Tensor], filename: str, metadata: dict[str, str] | None = None) -> None:
    """safetensors' ``save_file``, imported on use (loading the parity plugin imports no torch: issue 42)."""
    from safetensors.torch import save_file as _save

    _save(tensors, filename, metadata=metadata)


def write_atomic(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write a safetensors file so that ``path`` either holds the complete file or is untouched."""
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temp_files(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(dict(tensors), tmp, metadata=metadata)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# --------------------------------------------------------------------------------------------
# Manifest helpers
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def package_versions() -> dict[str, str]:
    """Versions of every installed ``omniloop*`` distribution and of torch / diffusers / safetensors."""
    out: dict[str, str] = {}
    wanted = {"torch", "diffusers", "safetensors", "transformers", "cache-dit"}
    for dist in md.distributions():
        try:
            name = dist.metadata["Name"]
        except Exception:
            continue
        if not name:
            continue
        norm = name.lower().replace("_", "-")
        if norm.startswith("omniloop") or norm in wanted:
            out[norm] = dist.version
    return dict(sorted(out.items()))


def environment() -> dict[str, Any]:
    import torch
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.version.cuda,
        "versions": package_versions(),
    }


def tensor_fields(artifact: Any) -> Iterable[tuple[str, torch.Tensor]]:
    """The tensor-valued fields of an artifact (``VideoFrames.frames``, ``Latents.tensor``, ...)."""
    import torch
    if not attrs.has(type(artifact)):
        return []
    out = []
    for f in attrs.fields(type(artifact)):
        v = getattr(artifact, f.name)
        if isinstance(v, torch.Tensor):
            out.append((f.name, v))
        elif isinstance(v, dict):
            out.extend((f"{f.name}.{k}", t) for k, t in v.items() if isinstance(t, torch.Tensor))
    return out
