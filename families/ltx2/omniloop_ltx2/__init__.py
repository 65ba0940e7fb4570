"""omniloop-ltx2: the LTX-2 family for omniloop (text- and image-to-video with a sound track, ``t2v`` / ``i2v``).

* :class:`omniloop_ltx2.family.LTX2Family` — registered as family ``ltx2``
* :class:`omniloop_ltx2.denoise.Denoise` — one step of both latent streams per guidance pass call
* :func:`omniloop_ltx2.tiny.build_tiny_checkpoint` — tiny same-architecture checkpoints for tests
"""

from __future__ import annotations

from omniloop_kit.lazy import lazy_exports

__version__ = "0.1.0"

# lazy: importing the package must not import torch/diffusers
__getattr__ = lazy_exports(__name__, {"LTX2Family": ".family", "build_tiny_checkpoint": ".tiny"})


__all__ = ["LTX2Family", "__version__", "build_tiny_checkpoint"]
