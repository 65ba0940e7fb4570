"""The ``weights`` mechanism (``omniloop_register_mechanisms``, hook API 1.4): ``Runtime.update_weights``
reads and checks a denoiser update here (:func:`omniloop_rl.weights.plan_update`) and
``Runtime.weights_checksum`` fingerprints the weights (:func:`omniloop_rl.weights.checksum`).
Imports no torch until a runtime asks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omniloop.family import MechanismSpec
from omniloop.hookspecs import hookimpl

OMNILOOP_HOOK_API = ">=1.4,<2"  # omniloop_register_mechanisms


def _update(runtime: Any, name: str, source: Any) -> Callable[[], None]:
    from .weights import apply_update, plan_update, read_source

    plan = plan_update(runtime.model.components, read_source(source))  # atomic: everything checked first
    return lambda: apply_update(plan)


def _fingerprint(runtime: Any, extra: list[tuple[str, Any]], algorithm: str) -> str:
    from .weights import checksum

    return checksum(runtime.model.components, extra, algorithm=algorithm)


MECHANISM = MechanismSpec(name="weights", update=_update, fingerprint=_fingerprint,
                          description="post-training: update_weights' reader and the weights checksum")


@hookimpl
def omniloop_register_mechanisms(register: Any) -> None:
    register(MECHANISM)
