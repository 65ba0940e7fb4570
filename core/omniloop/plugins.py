"""Plugin discovery (stevedore) and hook calls (pluggy).

* Discovery is failure-isolated per plugin: a package that fails to import, declares an
  unsupported hook-API range, or raises inside a registration hook is listed with its error and
  never breaks discovery or any CLI command. "Raises" means any ``BaseException`` but
  ``KeyboardInterrupt``: a plugin calling ``sys.exit()`` at import or in a hook is a failed
  plugin, not the end of the process (Ctrl-C still stops everything).
* Strictness is for what a deploy names: a plugin the deploy config enables but that failed to
  load is a hard :class:`PluginError` naming the entry point and the cause.
* Registration goes through a ``register`` callback the core owns; a second provider of the same
  name is refused with a message naming both providers.
* ``OMNILOOP_TRACE_HOOKS=1`` prints every hook call with its arguments and results to stderr.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import sys
import types
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import pluggy
from attrs import define

from . import builtin, hookspecs
from . import family as specs  # the spec types the registration hooks take
from .capabilities import declare as declare_capabilities
from .errors import HookDeprecationWarning as HookDeprecationWarning  # re-exported (its old home)
from .errors import PluginError

GROUP = "omniloop.plugins"


# --------------------------------------------------------------------------------------------
# Hook-API version ranges: ">=1.0,<2", "==1.0", ">=1.0"
# --------------------------------------------------------------------------------------------

_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*(\d+(?:\.\d+)*)\s*$")


def _vtuple(v: str) -> tuple[int, ...]:
    parts = tuple(int(x) for x in v.split("."))
    return parts + (0,) * (3 - len(parts))


def api_supported(spec: str, version: str = hookspecs.HOOK_API_VERSION) -> bool:
    """Whether ``version`` satisfies a range like ``">=1.0,<2"``. Raises ValueError if malformed."""
    v = _vtuple(version)
    for clause in spec.split(","):
        m = _CLAUSE.match(clause)
        if not m:
            raise ValueError(f"malformed hook-API range {spec!r} (expected e.g. '>=1.0,<2')")
        op, bound = m.group(1), _vtuple(m.group(2))
        ok = {
            ">=": v >= bound, "<=": v <= bound, "==": v == bound,
            "!=": v != bound, ">": v > bound, "<": v < bound,
        }[op]
        if not ok:
            return False
    return True


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


@define
class PluginRecord:
    """One discovered plugin, whether it loaded or not."""

    name: str
    target: str
    distribution: str | None = None
    version: str | None = None
    hook_api: str | None = None
    status: str = "ok"  # ok | failed | refused
    error: str | None = None
    provides: dict[str, list[str]] = attrs.Factory(dict)
    obj: Any = attrs.field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def as_dict(self) -> dict[str, Any]:
        """Every field but the loaded object, JSON-able (``omniloop plugins --json``)."""
        return attrs.asdict(self, filter=lambda a, _: a.name != "obj")


@define
class Registry:
    """Everything the registration hooks registered, by kind and name."""

    families: dict[str, Any] = attrs.Factory(dict)
    presets: dict[str, specs.ModelPreset] = attrs.Factory(dict)
    policies: dict[str, specs.PolicySpec] = attrs.Factory(dict)
    interceptors: dict[str, specs.PluginComponentSpec] = attrs.Factory(dict)
    observers: dict[str, specs.PluginComponentSpec] = attrs.Factory(dict)
    schedulers: dict[str, specs.SchedulerSpec] = attrs.Factory(dict)
    transports: dict[str, specs.TransportSpec] = attrs.Factory(dict)
    attention_backends: dict[str, specs.AttentionBackendSpec] = attrs.Factory(dict)
    #: the deploy's ``linear_precision`` values beyond the built-in ``dtype``
    linear_precisions: dict[str, specs.LinearPrecisionSpec] = attrs.Factory(dict)
    #: loaders of deploys a single-process runtime does not run (``omniloop.runtime.ROUTED``)
    runtime_loaders: dict[str, specs.RuntimeLoaderSpec] = attrs.Factory(dict)
    #: load-time mechanisms by the deploy field they serve (``omniloop.runtime.MECHANISMS``)
    mechanisms: dict[str, specs.MechanismSpec] = attrs.Factory(dict)
    #: flags plugins add to ``omniloop generate``, by flag name
    run_options: dict[str, specs.RunOptionSpec] = attrs.Factory(dict)
    #: (kind, name) -> plugin that registered it
    providers: dict[tuple[str, str], str] = attrs.Factory(dict)

    def component(self, name: str) -> specs.PluginComponentSpec | None:
        return self.interceptors.get(name) or self.observers.get(name)


_KINDS: dict[str, tuple[str, str, type | tuple[type, ...] | None]] = {
    # hook name -> (registry attribute, display kind, expected type)
    "omniloop_register_families": ("families", "family", None),
    "omniloop_register_model_presets": ("presets", "preset", specs.ModelPreset),
    "omniloop_register_policies": ("policies", "policy", specs.PolicySpec),
    "omniloop_register_interceptors": ("interceptors", "interceptor", specs.PluginComponentSpec),
    "omniloop_register_observers": ("observers", "observer", specs.PluginComponentSpec),
    "omniloop_register_schedulers": ("schedulers", "scheduler", specs.SchedulerSpec),
    "omniloop_register_transports": ("transports", "transport", specs.TransportSpec),
    "omniloop_register_attention_backends": ("attention_backends", "attention_backend", specs.AttentionBackendSpec),
    "omniloop_register_linear_precisions": ("linear_precisions", "linear_precision", specs.LinearPrecisionSpec),
    "omniloop_register_runtime_loaders": ("runtime_loaders", "runtime_loader", specs.RuntimeLoaderSpec),
    "omniloop_register_mechanisms": ("mechanisms", "mechanism", specs.MechanismSpec),
    "omniloop_register_run_options": ("run_options", "run_option", specs.RunOptionSpec),
}


class _ImportFailure(Exception):
    """Carries a BaseException an entry point raised while importing through stevedore, which
    re-raises everything but ``Exception`` (and ``AssertionError``) and so would end discovery."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _describe(exc: BaseException) -> str:
    exc = exc.cause if isinstance(exc, _ImportFailure) else exc
    text = str(exc)
    if isinstance(exc, SystemExit):
        text = f"the plugin called sys.exit({exc.code!r})" if exc.code is not None else "the plugin called sys.exit()"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _trace_enabled() -> bool:
    return os.environ.get("OMNILOOP_TRACE_HOOKS", "") not in ("", "0", "false", "no")


def _trace(msg: str) -> None:
    print(f"[omniloop hooks] {msg}", file=sys.stderr, flush=True)


def new_pluggy_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    if _trace_enabled():
        pm.trace.root.setwriter(lambda s: _trace(s.rstrip()))
        pm.enable_tracing()
    return pm


# --------------------------------------------------------------------------------------------
# The manager
# --------------------------------------------------------------------------------------------


class PluginManager:
    """Discovers ``omniloop.plugins`` entry points and builds the registry.

    ``PluginManager(discover=False)`` starts empty (tests register in-process plugins with
    :meth:`add`); the default discovers installed packages once, lazily.
    """

    def __init__(self, *, discover: bool = True, group: str = GROUP) -> None:
        self.group = group
        self.records: dict[str, PluginRecord] = {}
        self.pm = new_pluggy_manager()
        self._discovered = not discover
        self._registry: Registry | None = None
        self._partial: Registry | None = None  # filled hook by hook (registered), then by registry()
        self._filled: set[str] = set()
        self.add("core", builtin, distribution="omniloop")

    # -- discovery -------------------------------------------------------------------------
    def discover(self) -> list[PluginRecord]:
        if not self._discovered:
            self._discovered = True
            self._discover_entry_points()
        return list(self.records.values())

    def _discover_entry_points(self) -> None:
        from stevedore import ExtensionManager

        dists = _entry_point_distributions(self.group)
        failures: dict[str, BaseException] = {}

        def on_fail(_mgr: Any, ep: Any, exc: BaseException) -> None:
            failures[ep.name] = exc
            dist = dists.get((ep.name, ep.value))
            self.records[ep.name] = PluginRecord(
                name=ep.name, target=ep.value, distribution=dist[0] if dist else None,
                version=dist[1] if dist else None, status="failed",
                error=f"import failed (plugin {ep.name!r}, {ep.value}): {_describe(exc)}",
            )

        base: Any = ExtensionManager  # generic only in recent stevedore releases

        class IsolatingManager(base):  # type: ignore[misc]
            def _load_one_plugin(self, ep: Any, *args: Any, **kwargs: Any) -> Any:
                try:
                    return super()._load_one_plugin(ep, *args, **kwargs)
                except KeyboardInterrupt:
                    raise
                except BaseException as exc:  # SystemExit, AssertionError, ...: this plugin failed
                    raise _ImportFailure(exc) from exc

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mgr = IsolatingManager(
                namespace=self.group, invoke_on_load=False, on_load_failure_callback=on_fail,
                propagate_map_exceptions=False,
            )
        for ext in sorted(mgr.extensions, key=lambda e: e.name):
            dist = dists.get((ext.name, ext.entry_point.value))
            self.add(
                ext.name, ext.plugin, target=ext.entry_point.value,
                distribution=dist[0] if dist else None, version=dist[1] if dist else None,
            )

    def add(
        self, name: str, obj: Any, *, target: str | None = None,
        distribution: str | None = None, version: str | None = None,
    ) -> PluginRecord:
        """Register one plugin object (a module or an instance holding hookimpls)."""
        target = target or str(getattr(obj, "__name__", type(obj).__name__))
        rec = PluginRecord(name=name, target=target, distribution=distribution, version=version, obj=obj)
        if name in self.records and self.records[name].ok:
            other = self.records[name]
            rec.status, rec.error = "failed", (
                f"duplicate plugin name {name!r}: provided by {other.distribution or other.target} "
                f"and {distribution or target}"
            )
            self.records[f"{name} ({target})"] = rec
            return rec
        self.records[name] = rec
        api = getattr(obj, "OMNILOOP_HOOK_API", None)
        rec.hook_api = api
        if api is None:
            rec.status, rec.error = "refused", (
                f"plugin {name!r} does not declare OMNILOOP_HOOK_API (e.g. '>=1.0,<2'); "
                f"this omniloop provides hook API {hookspecs.HOOK_API_VERSION}"
            )
            return rec
        try:
            supported = api_supported(str(api))
        except ValueError as exc:
            rec.status, rec.error = "refused", f"plugin {name!r}: {exc}"
            return rec
        if not supported:
            rec.status, rec.error = "refused", (
                f"plugin {name!r} needs hook API {api}, but this omniloop provides "
                f"{hookspecs.HOOK_API_VERSION}; install a version of {distribution or name} built for it"
            )
            return rec
        try:
            self.pm.register(_renamed_hooks(obj, name), name=name)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # pluggy validation: wrong hook names or arguments
            rec.status, rec.error = "failed", f"hook validation failed: {_describe(exc)}"
        self._registry, self._partial, self._filled = None, None, set()
        return rec

    def remove(self, name: str) -> None:
        rec = self.records.pop(name, None)
        if rec is not None and self.pm.has_plugin(name):
            self.pm.unregister(name=name)
        self._registry, self._partial, self._filled = None, None, set()

    # -- registration hooks ----------------------------------------------------------------
    def registry(self) -> Registry:
        """Call every registration hook once (per plugin, failure-isolated) and collect results."""
        if self._registry is None:
            self._registry = self._fill(*_KINDS)
        return self._registry

    def registered(self, hook_name: str) -> Registry:
        """The registry with only ``hook_name`` called (e.g. ``omniloop_register_run_options``), the
        other tables empty until :meth:`registry` fills them (into the same object, each hook still
        called once). For callers that must stay cheap: ``omniloop generate`` reads its plugin flags
        this way, so parsing a command line does not import every family (and torch). A plugin
        whose later hook fails keeps what an earlier call of this one registered."""
        return self._registry if self._registry is not None else self._fill(hook_name)

    def _fill(self, *hook_names: str) -> Registry:
        self.discover()
        reg = self._partial = self._partial if self._partial is not None else Registry()
        for hook_name in [h for h in _KINDS if h in hook_names and h not in self._filled]:
            self._filled.add(hook_name)
            attr, kind, expected = _KINDS[hook_name]
            caller = getattr(self.pm.hook, hook_name)
            for impl in caller.get_hookimpls():  # registration order
                rec = self.records.get(impl.plugin_name)
                if rec is None or not rec.ok:
                    continue
                self._call_registration(rec, impl, reg, attr, kind, expected)
        return reg

    def _call_registration(
        self, rec: PluginRecord, impl: Any, reg: Registry, attr: str, kind: str, expected: Any
    ) -> None:
        table: dict[str, Any] = getattr(reg, attr)
        added: list[str] = []

        def register(item: Any) -> None:
            if expected is not None and not isinstance(item, expected):
                raise PluginError(f"plugin {rec.name!r} registered a {type(item).__name__} as a {kind}")
            item_name = getattr(item, "name", None)
            if not isinstance(item_name, str) or not item_name:
                raise PluginError(f"plugin {rec.name!r} registered a {kind} without a name")
            if kind == "family":  # the family contract: its declared capabilities, checked once here
                _check_rollout_support(declare_capabilities(item), item_name)
            if item_name in table:
                first = reg.providers[(kind, item_name)]
                raise PluginError(
                    f"{kind} {item_name!r} is registered twice: by plugin {first!r} "
                    f"({self._where(first)}) and by plugin {rec.name!r} ({self._where(rec.name)})"
                )
            table[item_name] = item
            reg.providers[(kind, item_name)] = rec.name
            added.append(item_name)

        if _trace_enabled():
            _trace(f"{impl.function.__qualname__}(register) from plugin {rec.name!r}")
        try:
            impl.function(register=register)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # SystemExit included: one failed plugin, not the end
            for n in added:  # roll back what this plugin registered under this hook
                table.pop(n, None)
                reg.providers.pop((kind, n), None)
            rec.status = "failed"
            rec.error = f"{impl.function.__name__} failed (plugin {rec.name!r}): {_describe(exc)}"
            return
        if added:
            rec.provides.setdefault(kind, []).extend(added)
            if _trace_enabled():
                _trace(f"  -> {kind}: {', '.join(added)}")

    def _where(self, plugin: str) -> str:
        r = self.records.get(plugin)
        return (r.distribution or r.target) if r else plugin

    def register_commands(self, cli: Any) -> None:
        """Let every healthy plugin add CLI subcommands; a plugin that fails is marked failed."""
        self.discover()
        caller = self.pm.hook.omniloop_register_commands
        for impl in caller.get_hookimpls():
            rec = self.records.get(impl.plugin_name)
            if rec is None or not rec.ok:
                continue
            try:
                impl.function(cli=cli)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:
                rec.status = "failed"
                rec.error = f"omniloop_register_commands failed (plugin {rec.name!r}): {_describe(exc)}"

    def require(self, name: str, what: str) -> None:
        """Raise a clear PluginError if the entry point ``name`` failed; used for deploy-named plugins."""
        self.discover()
        for rec in self.records.values():
            if rec.name == name and not rec.ok:
                raise PluginError(
                    f"{what} {name!r} is named by the deploy config but its plugin failed to load "
                    f"(entry point {rec.name} = {rec.target}): {rec.error}"
                )

    def failed(self) -> list[PluginRecord]:
        return [r for r in self.records.values() if not r.ok]


def _check_rollout_support(caps: Any, family: str) -> None:
    support = caps.rollout_support
    if support is None:
        return
    from .rl import RolloutSupport  # rl imports torch: only for a family that declares rollouts
    if not isinstance(support, RolloutSupport) or not support.nodes:
        raise PluginError(f"family {family!r}: capabilities.rollout_support: expected an omniloop.rl.RolloutSupport "
                          "naming its loop nodes")


def _renamed_hooks(obj: Any, plugin: str) -> Any:
    """``obj``, or a namespace registering its implementations of renamed hooks under their new
    names (warning :class:`HookDeprecationWarning` once per hook) — see ``hookspecs.RENAMED_HOOKS``."""
    renamed = {old: new for old, new in hookspecs.RENAMED_HOOKS.items()
               if getattr(getattr(obj, old, None), f"{hookspecs.PROJECT}_impl", None) is not None}
    if not renamed:
        return obj
    ns = types.SimpleNamespace()
    for attr in dir(obj):
        fn = getattr(obj, attr, None)
        if getattr(fn, f"{hookspecs.PROJECT}_impl", None) is not None:
            setattr(ns, renamed.get(attr, attr), fn)
    for old, new in renamed.items():
        warnings.warn(
            f"plugin {plugin!r} implements hook {old!r}, renamed {new!r} in hook API "
            f"{hookspecs.HOOK_API_VERSION}; the old name is removed in the next major version",
            HookDeprecationWarning, stacklevel=3,
        )
    return ns


def _entry_point_distributions(group: str) -> dict[tuple[str, str], tuple[str, str]]:
    out: dict[tuple[str, str], tuple[str, str]] = {}
    for dist in md.distributions():
        try:
            eps: Iterable[Any] = dist.entry_points
            name = dist.metadata["Name"]
        except Exception:
            continue
        for ep in eps:
            if ep.group == group:
                out[(ep.name, ep.value)] = (name, dist.version)
    return out


_default: PluginManager | None = None


def default_manager() -> PluginManager:
    """The process-wide manager over installed packages (discovered lazily, once)."""
    global _default
    if _default is None:
        _default = PluginManager()
    return _default


Register = Callable[[Any], None]
