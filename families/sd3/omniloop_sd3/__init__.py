"""omniloop-sd3: the Stable Diffusion 3 / 3.5 family for omniloop.

* :class:`omniloop_sd3.family.SD3Family` — registered as family ``sd3`` by :mod:`omniloop_sd3.plugin`
* :func:`omniloop_sd3.transformer.sd3_forward` — the transformer's outer forward, joint blocks through ``run_blocks``
* :func:`omniloop_sd3.tiny.build_tiny_checkpoint` — tiny same-architecture checkpoints for tests
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:  # lazy: importing the package must not import torch/diffusers
    if name == "SD3Family":
        from .family import SD3Family

        return SD3Family
    if name == "build_tiny_checkpoint":
        from .tiny import build_tiny_checkpoint

        return build_tiny_checkpoint
    raise AttributeError(name)


__all__ = ["SD3Family", "__version__", "build_tiny_checkpoint"]
