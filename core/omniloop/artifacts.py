"""Typed values that flow along a pipeline's edges.

Each artifact is stamped with ``producer``: the name of the node that wrote it (set by
:meth:`omniloop.loop.RequestState.write`). Graph validation checks that a node's declared read
type matches the producer's declared write type, so these classes are the edge types.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
from attrs import define

if TYPE_CHECKING:  # imported on use: the edge types are read by --help paths (issue 42)
    import torch


@define(kw_only=True)
class Artifact:
    producer: str | None = None

    def describe(self) -> dict[str, Any]:
        """A JSON-safe summary (shapes, dtypes), used by ``--json`` outputs and the server."""
        import torch

        out: dict[str, Any] = {"type": type(self).__name__, "producer": self.producer}
        for f in attrs.fields(type(self)):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                out[f.name] = {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")}
            elif isinstance(v, (int, float, str, bool)) or v is None:
                out[f.name] = v
        return out


@define(kw_only=True)
class VideoFrames(Artifact):
    """uint8 frames ``[T, H, W, 3]`` on the CPU, and the frame rate."""

    frames: torch.Tensor
    fps: float = 16.0


@define(kw_only=True)
class Image(Artifact):
    """uint8 pixels ``[H, W, 3]`` on the CPU."""

    pixels: torch.Tensor


@define(kw_only=True)
class Audio(Artifact):
    """float samples ``[channels, n]`` in [-1, 1] and the sample rate."""

    samples: torch.Tensor
    sample_rate: int


@define(kw_only=True)
class Text(Artifact):
    text: str
    token_ids: list[int] = attrs.Factory(list)


@define(kw_only=True)
class Latents(Artifact):
    """Latents of one modality, e.g. video latents ``[B, C, T, H, W]``."""

    tensor: torch.Tensor
    modality: str = "video"


@define(kw_only=True)
class Embeddings(Artifact):
    """Conditioning embeddings, e.g. text-encoder states ``[B, L, D]``, with optional mask."""

    tensor: torch.Tensor
    mask: torch.Tensor | None = None
    extra: dict[str, Any] = attrs.Factory(dict)


@define(kw_only=True)
class Tensors(Artifact):
    """A named bag of tensors for edges that need no stronger type."""

    values: dict[str, torch.Tensor] = attrs.Factory(dict)


@define(kw_only=True)
class KVRef(Artifact):
    """A reference to a KV cache held by a transport or a cache manager."""

    key: str
    layers: int = 0
    tokens: int = 0


@define(kw_only=True)
class Action(Artifact):
    """Predicted actions of a world model: float ``[T, D]`` on the CPU (``D`` the domain's action
    width) and the embodiment ``domain`` they are in."""

    values: torch.Tensor
    domain: str


@define(kw_only=True)
class Conditioning(Artifact):
    """A family-defined value (validated sizes, resolved defaults) passed between its nodes."""

    values: dict[str, Any] = attrs.Factory(dict)


ARTIFACT_TYPES: tuple[type[Artifact], ...] = (
    VideoFrames, Image, Audio, Text, Latents, Embeddings, Tensors, KVRef, Conditioning, Action,
)
