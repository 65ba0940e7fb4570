"""Deploy ``options.cuda_graphs: true`` (the whole DiT forward of a step replayed as one CUDA graph)
and ``options.noise_prefetch``.

The CUDA-graph mechanism is omniloop-kit's (:mod:`omniloop_kit.graphs`, shared with SD3 and
FLUX.1); this module keeps the names the family used and the noise-prefetch option. At Stable
Audio Open's size a compiled step is bound by the host (regional compile + graphs: 2.67x over
diffusers + compile on its step, ``bench/results/stable_audio_gpu-sao-47s-cg-h200-*``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omniloop.errors import DeployError
from omniloop_kit.graphs import graph_option, graphs_enabled, replay


def prefetch_option(options: Mapping[str, Any]) -> bool:
    """The checked ``options.noise_prefetch`` (false when absent)."""
    value = options.get("noise_prefetch", False)
    if not isinstance(value, bool):
        raise DeployError(f"options.noise_prefetch: expected true or false, got {value!r}")
    return value


__all__ = ["graph_option", "graphs_enabled", "prefetch_option", "replay"]
