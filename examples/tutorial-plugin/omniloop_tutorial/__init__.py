"""omniloop tutorial plugin: a ``step-timer`` observer and a ``block-counter`` block interceptor.

Light on import: the entry point loads :mod:`omniloop_tutorial.plugin`, which imports only small
modules (no torch work, no weights) so discovery stays fast.
"""

from .interceptor import BlockCounter, BlockCounterParams
from .observer import StepTimer, StepTimerConfig

__all__ = ["BlockCounter", "BlockCounterParams", "StepTimer", "StepTimerConfig"]
__version__ = "0.1.0"
