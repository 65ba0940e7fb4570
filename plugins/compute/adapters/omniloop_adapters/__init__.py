"""omniloop-adapters: LoRA adapters a deploy declares (``adapters: {NAME: PATH}``), requests choose
(``adapters: [{name, scale}]``) and the runtime applies unfused per request, or fuses
(``adapter_fuse``). Moved out of the core, where it was ``omniloop.adapters`` (issue 34: the core holds
what every deployment uses); the runtime installs it through the mechanism
:mod:`omniloop_adapters.plugin` registers. :mod:`omniloop_adapters.lora` holds the code and its full
description; a family declares support with ``omniloop.capabilities.AdapterSupport``.
"""

from __future__ import annotations

from omniloop.lazy import lazy_exports

_EXPORTS = {"lora": ("MAX_PER_REQUEST", "NAME_PATTERN", "ActiveSet", "AdapterBank", "AdapterFormatError",
                     "AdapterSupport", "LoadedAdapter", "LoraLayer", "activate", "adapter_file", "batch_key_of",
                     "check_compile_mode", "check_declared", "check_request", "current", "hooked", "load_adapter",
                     "parse_layers", "read_file", "unknown_keys_error")}
__all__ = sorted(n for names in _EXPORTS.values() for n in names)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
