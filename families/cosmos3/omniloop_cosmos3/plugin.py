"""omniloop plugin entry point (group ``omniloop.plugins``, name ``cosmos3``): registers the family.

Registration is cheap and offline: nothing heavy is imported until a deployment loads a checkpoint.
"""

from __future__ import annotations

from typing import Any

from omniloop.hookspecs import hookimpl

OMNILOOP_HOOK_API = ">=1.0,<2"


@hookimpl
def omniloop_register_families(register: Any) -> None:
    from .family import Cosmos3Family

    register(Cosmos3Family())
