"""Entry point ``trace`` (group ``omniloop.plugins``): the activation-trace observer."""

from __future__ import annotations

from omniloop.family import PluginComponentSpec
from omniloop.hookspecs import registering

from . import ActivationTrace, TraceConfig

OMNILOOP_HOOK_API = ">=1.0,<2"

SPEC = PluginComponentSpec(name="trace", kind="observer", factory=lambda config: ActivationTrace(config),
                           config_schema=TraceConfig,
                           description="per-tap and per-module mean/std/absmax appended as JSONL")

omniloop_register_observers = registering(SPEC)
