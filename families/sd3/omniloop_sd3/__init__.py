"""omniloop-sd3: the Stable Diffusion 3 / 3.5 family for omniloop.

* :class:`omniloop_sd3.family.SD3Family` — registered as family ``sd3`` by :mod:`omniloop_sd3.plugin`
* :func:`omniloop_sd3.transformer.sd3_forward` — the transformer's outer forward, joint blocks through ``run_blocks``
* :func:`omniloop_sd3.tiny.build_tiny_checkpoint` — tiny same-architecture checkpoints for tests
"""

from __future__ import annotations

from omniloop_kit.lazy import lazy_exports

__version__ = "0.1.0"

# lazy: importing the package must not import torch/diffusers
__getattr__ = lazy_exports(__name__, {"SD3Family": ".family", "build_tiny_checkpoint": ".tiny"})


__all__ = ["SD3Family", "__version__", "build_tiny_checkpoint"]
