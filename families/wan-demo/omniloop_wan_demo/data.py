"""Deprecated (until 0.3): ``omniloop_wan_demo.data`` was split when the demos' training code moved
to ``demos/`` (issue 34).

* the prompt grammar (``COLORS``, ``SHAPES``, ``DIRECTIONS``, ``POSITIONS``, ``prompt_for``,
  ``parse_prompt``, ``vocabulary_words``, ...) is :mod:`omniloop_wan_demo.prompts`;
* the renderer of the training data (``render``, ``sample_params``, ``make_clips``,
  ``render_images``, ``to_uint8_frames``, ...) is ``omniloop_wan_demo_training.render``, in the
  training package ``omniloop-wan-demo-training`` (``demos/wan-demo``; ``make setup`` installs it).

Importing this module warns with a :class:`DeprecationWarning` naming both; every old name still
resolves (the renderer's only where the training package is installed).
"""

from __future__ import annotations

import warnings
from typing import Any

from .prompts import *  # noqa: F403  (the grammar, unchanged)
from .prompts import __all__ as _PROMPT_NAMES

warnings.warn(
    "omniloop_wan_demo.data is deprecated (removed in 0.3): the prompt grammar is omniloop_wan_demo.prompts, "
    "the training-data renderer omniloop_wan_demo_training.render (demos/wan-demo)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = list(_PROMPT_NAMES)


def __getattr__(name: str) -> Any:
    """The renderer's names, from ``omniloop_wan_demo_training.render``."""
    if name.startswith("__"):
        raise AttributeError(name)
    try:
        from omniloop_wan_demo_training import render
    except ImportError as e:
        raise AttributeError(
            f"omniloop_wan_demo.data.{name}: the training-data renderer moved to omniloop_wan_demo_training.render "
            f"(package omniloop-wan-demo-training, demos/wan-demo), which is not installed ({e})"
        ) from None
    try:
        return getattr(render, name)
    except AttributeError:
        raise AttributeError(f"module 'omniloop_wan_demo.data' has no attribute {name!r}") from None
