"""omniloop-flux: the FLUX.1 family for omniloop (text-to-image, image-to-image).

* :class:`omniloop_flux.family.FluxFamily` — registered as family ``flux`` by :mod:`omniloop_flux.plugin`
* :func:`omniloop_flux.transformer.flux_forward` — the transformer's outer forward, blocks through ``run_blocks``
* :func:`omniloop_flux.tiny.build_tiny_checkpoint` — tiny same-architecture checkpoints for tests
"""

from __future__ import annotations

from omniloop_kit.lazy import lazy_exports

__version__ = "0.1.0"

# lazy: importing the package must not import torch/diffusers
__getattr__ = lazy_exports(__name__, {"FluxFamily": ".family", "build_tiny_checkpoint": ".tiny"})


__all__ = ["FluxFamily", "__version__", "build_tiny_checkpoint"]
