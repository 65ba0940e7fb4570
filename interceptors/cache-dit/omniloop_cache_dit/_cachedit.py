"""The one place that touches cache-dit's internals.

We drive cache-dit's DBCache / TaylorSeer math through internal classes, not its public
``enable_cache`` wrapper (which patches ``transformer.forward`` and keeps one context per block
list). Internal names have moved between releases (``cache_factory`` -> ``caching``,
``parallelism`` -> ``distributed``), so the distribution pins cache-dit exactly and
``tests/cache_dit/test_cache_dit_internals.py`` fails loudly when anything listed here moves.

Importing this module imports cache-dit (and diffusers): do it lazily, never from a registration
hook.
"""

from __future__ import annotations

from omniloop.errors import PluginError

#: the exact cache-dit release this adapter was written and verified against
PINNED_VERSION = "1.5.3"

try:
    import cache_dit
    from cache_dit.caching.cache_contexts.cache_config import DBCacheConfig
    from cache_dit.caching.cache_contexts.cache_context import CachedContext
    from cache_dit.caching.cache_contexts.cache_manager import CachedContextManager
    from cache_dit.caching.cache_contexts.calibrators import TaylorSeerCalibratorConfig
except ImportError as exc:  # pragma: no cover - exercised only with a broken install
    raise PluginError(f"omniloop-cache-dit needs cache-dit=={PINNED_VERSION} (its internal classes): {exc}") from exc

#: buffer prefixes. cache-dit routes on the substring "Bn" (Bn buffer and calibrator) versus
#: anything else (Fn buffer); "blocks" is the block-list attribute name its Wan adapter uses, so
#: the buffer keys match what ``cache_dit.enable_cache`` would store for a Wan transformer.
FN_PREFIX = "blocks_Fn_residual"
BN_RESIDUAL_PREFIX = "blocks_Bn_residual"
BN_HIDDEN_PREFIX = "blocks_Bn_hidden_states"

#: what we call on a CachedContextManager (checked by the internals test)
MANAGER_METHODS = (
    "new_context",
    "remove_context",
    "enter_context",
    "get_context",
    "mark_step_begin",
    "can_cache",
    "similarity",
    "add_cached_step",
    "add_residual_diff",
    "apply_cache",
    "set_Fn_buffer",
    "set_Bn_buffer",
    "is_cache_residual",
    "get_current_step",
    "get_current_step_residual_diff",
    "get_important_condition_threshold",
)


def installed_version() -> str:
    return str(getattr(cache_dit, "__version__", "unknown"))


def check_version() -> None:
    """Refuse to run against any cache-dit other than the pinned one."""
    found = installed_version()
    if found != PINNED_VERSION:
        raise PluginError(
            f"omniloop-cache-dit drives cache-dit's internal classes and is verified against "
            f"cache-dit=={PINNED_VERSION} only; found {found}. Install "
            f"'cache-dit=={PINNED_VERSION}' or an omniloop-cache-dit release made for {found}."
        )


__all__ = [
    "BN_HIDDEN_PREFIX",
    "BN_RESIDUAL_PREFIX",
    "FN_PREFIX",
    "MANAGER_METHODS",
    "PINNED_VERSION",
    "CachedContext",
    "CachedContextManager",
    "DBCacheConfig",
    "TaylorSeerCalibratorConfig",
    "check_version",
    "installed_version",
]
