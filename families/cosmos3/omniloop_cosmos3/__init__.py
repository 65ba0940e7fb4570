"""omniloop-cosmos3: the Cosmos 3 omni family for omniloop (mixture-of-transformers over packed
sequences; text-to-video, ``t2v``).

* :class:`omniloop_cosmos3.family.Cosmos3Family` — registered as family ``cosmos3``
* :mod:`omniloop_cosmos3.transformer` — the transformer's und / gen pathways over a packed layout
* :func:`omniloop_cosmos3.tiny.build_tiny_checkpoint` — tiny same-architecture checkpoints for tests
"""

from __future__ import annotations

from omniloop_kit.lazy import lazy_exports

__version__ = "0.1.0"

# lazy: importing the package must not import torch/diffusers
__getattr__ = lazy_exports(__name__, {"Cosmos3Family": ".family", "build_tiny_checkpoint": ".tiny"})


__all__ = ["Cosmos3Family", "__version__", "build_tiny_checkpoint"]
