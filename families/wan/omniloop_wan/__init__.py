"""omniloop-wan: the Wan2.1 / Wan2.2 family for omniloop.

* :class:`omniloop_wan.family.WanFamily` — registered as family ``wan`` by :mod:`omniloop_wan.plugin`
* :func:`omniloop_wan.transformer.wan_forward` — the transformer's outer forward, blocks through ``run_blocks``
* :func:`omniloop_wan.tiny.build_tiny_checkpoint` — tiny same-architecture checkpoints for tests and demos
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:  # lazy: importing the package must not import torch/diffusers
    if name == "WanFamily":
        from .family import WanFamily

        return WanFamily
    if name == "build_tiny_checkpoint":
        from .tiny import build_tiny_checkpoint

        return build_tiny_checkpoint
    raise AttributeError(name)


__all__ = ["WanFamily", "__version__", "build_tiny_checkpoint"]
