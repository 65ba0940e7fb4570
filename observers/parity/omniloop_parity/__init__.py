"""omniloop-parity: the ParityAligner observer.

* Record: enable ``plugins: {parity: {...}}`` (see :class:`ParityConfig`) or call :func:`record`.
* Compare: :func:`compare` two :class:`Recording` objects or files → :class:`ParityResult`.
* Replay: :func:`replay` a recording's request and compare.
* Tests: :func:`omniloop_parity.testing.assert_matches_golden`.
"""

from __future__ import annotations

from .compare import ParityResult, TapComparison, TapTolerance, Tolerances, compare
from .config import ParityConfig, ParityError
from .recorder import ParityRecorder
from .recording import FORMAT, Recording, TapEntry
from .run import record, recorder_of, replay, runtime_with_parity, with_parity

__version__ = "0.1.0"

__all__ = [
    "FORMAT",
    "ParityConfig",
    "ParityError",
    "ParityRecorder",
    "ParityResult",
    "Recording",
    "TapComparison",
    "TapEntry",
    "TapTolerance",
    "Tolerances",
    "compare",
    "record",
    "recorder_of",
    "replay",
    "runtime_with_parity",
    "with_parity",
]
