"""omniloop plugin entry point (group ``omniloop.plugins``, name ``qwen``): registers the Qwen family.

Registration is cheap and offline: transformers is imported only when a checkpoint loads.
"""

from __future__ import annotations

from typing import Any

from omniloop.hookspecs import hookimpl

OMNILOOP_HOOK_API = ">=1.0,<2"


@hookimpl
def omniloop_register_families(register: Any) -> None:
    from .family import QwenFamily

    register(QwenFamily())


@hookimpl
def omniloop_register_policies(register: Any) -> None:
    """The ``prompt-upsample`` composition (``kind="pipeline"``, see :mod:`omniloop_qwen.upsample`)."""
    from .upsample import SPEC

    register(SPEC)
