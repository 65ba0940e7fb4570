"""omniloop-flux: the FLUX.1 family for omniloop (text-to-image, image-to-image).

* :class:`omniloop_flux.family.FluxFamily` — registered as family ``flux`` by :mod:`omniloop_flux.plugin`
* :func:`omniloop_flux.transformer.flux_forward` — the transformer's outer forward, blocks through ``run_blocks``
* :func:`omniloop_flux.tiny.build_tiny_checkpoint` — tiny same-architecture checkpoints for tests
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:  # lazy: importing the package must not import torch/diffusers
    if name == "FluxFamily":
        from .family import FluxFamily

        return FluxFamily
    if name == "build_tiny_checkpoint":
        from .tiny import build_tiny_checkpoint

        return build_tiny_checkpoint
    raise AttributeError(name)


__all__ = ["FluxFamily", "__version__", "build_tiny_checkpoint"]
