"""omniloop-stable-audio: the Stable Audio family for omniloop (text-to-audio, ``t2a``).

* :class:`omniloop_stable_audio.family.StableAudioFamily` — registered as family ``stable-audio``
* :func:`omniloop_stable_audio.transformer.dit_forward` — the DiT's outer forward, blocks through ``run_blocks``
* :func:`omniloop_stable_audio.tiny.build_tiny_checkpoint` — tiny same-architecture checkpoints for tests
"""

from __future__ import annotations

from omniloop_kit.lazy import lazy_exports

__version__ = "0.1.0"

# lazy: importing the package must not import torch/diffusers
__getattr__ = lazy_exports(__name__, {"StableAudioFamily": ".family", "build_tiny_checkpoint": ".tiny"})


__all__ = ["StableAudioFamily", "__version__", "build_tiny_checkpoint"]
