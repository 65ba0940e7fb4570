"""omniloop-wan: the Wan2.1 / Wan2.2 family for omniloop.

* :class:`omniloop_wan.family.WanFamily` — registered as family ``wan`` by :mod:`omniloop_wan.plugin`
* :func:`omniloop_wan.transformer.wan_forward` — the transformer's outer forward, blocks through ``run_blocks``
* :func:`omniloop_wan.tiny.build_tiny_checkpoint` — tiny same-architecture checkpoints for tests and demos
"""

from __future__ import annotations

from omniloop_kit.lazy import lazy_exports

__version__ = "0.1.0"

# lazy: importing the package must not import torch/diffusers
__getattr__ = lazy_exports(__name__, {"WanFamily": ".family", "build_tiny_checkpoint": ".tiny"})


__all__ = ["WanFamily", "__version__", "build_tiny_checkpoint"]
