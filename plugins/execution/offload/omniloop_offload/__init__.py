"""omniloop-offload: deploy ``offload: model | sequential`` — a family's components (and, streamed,
their blocks) kept in host memory and moved to the GPU as the pipeline's nodes run. Moved out of the
core, where it was ``omniloop.offload`` (issue 34: the core holds what every deployment uses); the
runtime installs it through the mechanism :mod:`omniloop_offload.plugin` registers.
:mod:`omniloop_offload.offload` holds the code and its full description.
"""

from __future__ import annotations

from omniloop.lazy import lazy_exports

_EXPORTS = {"offload": ("MODES", "CudaStreams", "Mover", "OffloadedStage", "Offloader", "PoisonMover", "check_offload",
                        "family_blocks", "install", "storage_device", "wrap_pipeline")}
__all__ = sorted(n for names in _EXPORTS.values() for n in names)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
