"""LoRA adapters: declared by the deploy, chosen per request, applied unfused (issue 17).
omniloop-adapters; the core's ``omniloop.adapters`` until omniloop 0.2 (issue 34). The family's
declaration (:class:`~omniloop.capabilities.AdapterSupport`) is part of the core's family contract.

A deployment declares the adapters it may use (``adapters: {NAME: PATH}``); a request names some
of them with a scale each (``adapters: [{name, scale}, ...]``). Nothing here ever reads a path a
client sent: requests carry names, which are looked up in the deploy's table.

**Application (unfused, the default).** Every linear an adapter targets gets one forward hook
(installed once per module at load, shared by every adapter and every runtime using the module).
The hook adds ``Σ scale · (alpha / r) · B(A(x))`` to the base output, for the adapters *active in
the current call*, in the order the request listed them — the same ops in the same order as
PEFT's ``LoraLayer.forward`` (``result + lora_B(lora_A(x)) * scaling``, ``scaling = weight *
lora_alpha / r``). The base weights are never touched.

**Which adapters are active** is a :class:`contextvars.ContextVar` set by the execution around
each unit it runs (:func:`activate`): it belongs to one call on one thread, never to the model,
so two requests with different adapter sets stepped alternately — or on two threads — each see
their own set. A batched step runs several requests in one forward, so the execution puts the
adapter set in its ``batch_key`` (:func:`batch_key_of`): a batch never mixes sets.

**Compiled blocks.** Under ``torch.compile`` the hook calls one opaque custom op
(``omniloop::lora_apply``) that reads the active set at run time, so switching adapters between
requests does not recompile. What does trigger one: installing the hooks (deploy load; the first
hook in a process also turns on dynamo's module-hook guards and, if something was compiled
before, drops dynamo's compiled code once, see :func:`_guard_hooks`) — never an adapter switch or a
scale change. CUDA-graph compile
modes (``reduce-overhead``, ``max-autotune``) would replay the kernels of one adapter set, so
they are refused with unfused adapters (:func:`check_compile_mode`).

**Fusing** (deploy ``adapter_fuse: {NAME: SCALE}``, one adapter only): ``W += scale·alpha/r·B@A``
once at load; the deployment then *is* the adapted model and requests cannot choose adapters.

**Formats.** diffusers/PEFT files as ``save_lora_weights`` writes them (``<component>.<module>.
lora_A.weight`` / ``lora_B.weight``, ``lora_adapter_metadata`` for ``lora_alpha``,
``alpha_pattern``, ``rank_pattern``, ``use_rslora``); other layouts (kohya, ComfyUI) through the
family's :class:`AdapterSupport.convert`, which names the keys it does not know. Alpha/rank
scaling as diffusers applies it: a per-module ``alpha`` (metadata or ``.alpha`` keys) over the
module's rank; none given means ``alpha = r`` (scale 1).

**Loading.** Every declared adapter is read and checked against the loaded model at deploy load
(unknown module, wrong shape, unknown key: one :class:`DeployError` naming the file and key). At
most ``limits.max_adapters`` stay in memory (least recently used first out); an evicted one is read
again on its next use. An execution keeps the adapters it started with until it ends.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import math
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from attrs import define, field

from omniloop.capabilities import AdapterFormatError, AdapterSupport, capabilities_of, unknown_keys_error
from omniloop.errors import DeployError, RequestError
from omniloop.family import Mechanism, RequestScope

#: adapter names (deploy keys, request names): identifiers, never paths
NAME_PATTERN = r"[A-Za-z0-9_][A-Za-z0-9_.:@+=-]{0,63}"
_NAME_RE = re.compile(NAME_PATTERN)
#: how many adapters one request may stack
MAX_PER_REQUEST = 8
#: the file a folder holds when diffusers wrote it
DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"
METADATA_KEY = "lora_adapter_metadata"

_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


# --------------------------------------------------------------------------------------------
# Loaded adapters
# --------------------------------------------------------------------------------------------


@define(frozen=True)
class LoraLayer:
    """One targeted linear: ``down`` ``[r, in]``, ``up`` ``[out, r]``, ``alpha`` (scaling = alpha / r)."""

    down: torch.Tensor
    up: torch.Tensor
    alpha: float
    rslora: bool = False

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    def scaling(self, scale: float) -> float:
        # PEFT's set_scale: weight * lora_alpha / r (or / sqrt(r) with rsLoRA), in that order
        return scale * self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


_UIDS = itertools.count(1)


@define(eq=False)
class LoadedAdapter:
    """An adapter read and matched against a loaded model: its layers by module (``id(module)``)."""

    name: str
    path: Path
    layout: str
    layers: dict[int, LoraLayer]
    targets: dict[str, int]  # "<component>.<module>" -> id(module)
    uid: int = field(factory=lambda: next(_UIDS))

    @property
    def rank(self) -> int:
        return max((la.rank for la in self.layers.values()), default=0)

    @property
    def nbytes(self) -> int:
        return sum(la.down.nbytes + la.up.nbytes for la in self.layers.values())


#: what one call runs with: (adapter, scale) in the request's order
ActiveSet = tuple[tuple[LoadedAdapter, float], ...]

_ACTIVE: contextvars.ContextVar[ActiveSet] = contextvars.ContextVar("omniloop_active_adapters", default=())


@contextlib.contextmanager
def activate(active: ActiveSet | None) -> Iterator[None]:
    """Run the body with ``active`` as the adapter set of this call (this thread/context only)."""
    token = _ACTIVE.set(tuple(active or ()))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def current() -> ActiveSet:
    """The adapter set active in this call (empty outside :func:`activate`)."""
    return _ACTIVE.get()


def batch_key_of(active: ActiveSet | None) -> Hashable:
    """What a batch key must include so that a batched step never mixes adapter sets."""
    return tuple((ad.name, ad.uid, scale) for ad, scale in (active or ()))


def _apply(site: int, x: torch.Tensor, out: torch.Tensor, active: ActiveSet) -> torch.Tensor:
    for ad, scale in active:
        layer = ad.layers.get(site)
        if layer is None:
            continue
        h = x.to(layer.down.dtype) if x.dtype != layer.down.dtype else x
        out = out + torch.nn.functional.linear(torch.nn.functional.linear(h, layer.down), layer.up) * layer.scaling(scale)
    return out


@torch.library.custom_op("omniloop::lora_apply", mutates_args=())
def _lora_apply_op(x: torch.Tensor, out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The compiled path's hook body: reads the active set when it runs, not when it is traced.

    The module is found from its ``weight`` (a graph input), not from a constant baked into the
    graph: every block's linears then trace to the same graph, so dynamo compiles a block class
    once, not once per block."""
    active = _ACTIVE.get()
    site = _site_of(weight) if active else None
    res = _apply(site, x, out, active) if site is not None else out
    return res.clone() if res is out else res


@_lora_apply_op.register_fake
def _(x: torch.Tensor, out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(out)


def _hook(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor | None:
    """The one forward hook every adapted linear gets (one function object, no per-module state:
    dynamo's hook guards then match across blocks)."""
    if torch.compiler.is_compiling():
        return _lora_apply_op(args[0], output, _weight_of(module))  # type: ignore[no-any-return]
    active = _ACTIVE.get()
    if not active:
        return None  # the base output, untouched
    return _apply(id(module), args[0], output, active)


#: one hook per module, shared by every adapter and runtime: module -> [handle, users]
_HOOKS: weakref.WeakKeyDictionary[torch.nn.Module, list[Any]] = weakref.WeakKeyDictionary()
_HOOKS_LOCK = threading.Lock()
#: a hooked module's weight address -> the module; checked on every hit (a freed module's address
#: can be reused by another's weights) and rebuilt on a miss (weights moved get new addresses)
_SITES: dict[int, weakref.ref[torch.nn.Module]] = {}


def _weight_of(module: torch.nn.Module) -> torch.Tensor:
    weight: torch.Tensor = module.weight  # type: ignore[assignment]
    return weight


def _live_site(ptr: int) -> int | None:
    ref = _SITES.get(ptr)
    m = ref() if ref is not None else None
    if m is None or m not in _HOOKS or _weight_of(m).data_ptr() != ptr:
        return None
    return id(m)


def _site_of(weight: torch.Tensor) -> int | None:
    """The site (``id(module)``) of the hooked module whose weight this is, or None."""
    ptr = weight.data_ptr()
    site = _live_site(ptr)
    if site is None:
        with _HOOKS_LOCK:
            _SITES.clear()
            _SITES.update({_weight_of(m).data_ptr(): weakref.ref(m) for m in list(_HOOKS)})
            site = _live_site(ptr)
    return site


def _guard_hooks() -> None:
    """Make ``torch.compile`` see hooks that come and go, before the first adapter hook goes in.

    Dynamo by default assumes module hooks never change after a module was compiled
    (``torch._dynamo.config.skip_nnmodule_hook_guards``): code compiled before the hooks existed —
    blocks warmed up before an adapter was loaded, or another instance of the same block class
    compiled earlier in the process (the compiled code is shared by the class's ``forward``) —
    would run without them and silently drop the adapter. So the first hook turns those guards
    on and, if anything was compiled already, drops dynamo's compiled code once (those callers recompile
    on their next call, now guarded on their hooks). Adapter switches never touch hooks.
    """
    cfg = torch._dynamo.config
    if not cfg.skip_nnmodule_hook_guards:
        return
    cfg.skip_nnmodule_hook_guards = False
    from torch._dynamo.utils import counters

    if counters["stats"]["unique_graphs"]:
        torch._dynamo.reset_code_caches()  # compiled code only (a full reset() also resets backends)


def _install(module: torch.nn.Module) -> None:
    with _HOOKS_LOCK:
        have = _HOOKS.get(module)
        if have is None:
            _guard_hooks()
            _HOOKS[module] = [module.register_forward_hook(_hook), 1]
        else:
            have[1] += 1


def _uninstall(module: torch.nn.Module) -> None:
    with _HOOKS_LOCK:
        have = _HOOKS.get(module)
        if have is None:
            return
        have[1] -= 1
        if have[1] <= 0:
            have[0].remove()
            del _HOOKS[module]


def hooked(module: torch.nn.Module) -> bool:
    return module in _HOOKS


# --------------------------------------------------------------------------------------------
# Reading files
# --------------------------------------------------------------------------------------------


def adapter_file(path: str | Path) -> Path:
    """The ``.safetensors`` file of a declared adapter: the path itself, or the one in its folder."""
    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix != ".safetensors":
            raise AdapterFormatError(f"{p}: not a .safetensors file")
        return p
    if p.is_dir():
        if (p / DIFFUSERS_FILE).is_file():
            return p / DIFFUSERS_FILE
        files = sorted(p.glob("*.safetensors"))
        if len(files) == 1:
            return files[0]
        if not files:
            raise AdapterFormatError(f"{p}: folder holds no .safetensors file")
        raise AdapterFormatError(f"{p}: folder holds {len(files)} .safetensors files and no {DIFFUSERS_FILE}; name the file")
    raise AdapterFormatError(f"{p}: does not exist")


def read_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, the parsed ``lora_adapter_metadata`` or {}) of a safetensors LoRA file."""
    from omniloop.checkpoints import metadata_json, read_safetensors

    sd, meta = read_safetensors(path, AdapterFormatError)
    return sd, metadata_json(meta, METADATA_KEY, path, AdapterFormatError) or {}


def is_diffusers_layout(sd: Mapping[str, torch.Tensor], components: Sequence[str]) -> bool:
    return bool(sd) and all(k.endswith(_SUFFIXES) and k.split(".", 1)[0] in components for k in sd)


def _pattern_value(patterns: Mapping[str, Any], module: str) -> Any:
    for key, value in patterns.items():
        if module == key or module.endswith("." + key) or re.fullmatch(key, module):
            return value
    return None


def parse_layers(
    sd: Mapping[str, torch.Tensor], metadata: Mapping[str, Any], alphas: Mapping[str, float], components: Sequence[str]
) -> dict[str, tuple[torch.Tensor, torch.Tensor, float | None, bool]]:
    """diffusers-layout tensors -> ``{"<component>.<module>": (down, up, alpha or None, rslora)}``."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    bad = [k for k in sd if not (k.endswith(_SUFFIXES) and k.split(".", 1)[0] in components)]
    if bad:
        raise unknown_keys_error(bad, f"diffusers ({'/'.join(components)}.<module>.lora_A/lora_B.weight)")
    for k, t in sd.items():
        mod, which = k[: -len(".lora_A.weight")], k[-len("lora_A.weight"):-len(".weight")]
        pairs.setdefault(mod, {})[which] = t
    out: dict[str, tuple[torch.Tensor, torch.Tensor, float | None, bool]] = {}
    for mod, pair in sorted(pairs.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            missing = "lora_B" if "lora_A" in pair else "lora_A"
            raise AdapterFormatError(f"{mod}: has no {missing}.weight")
        down, up = pair["lora_A"], pair["lora_B"]
        if down.ndim != 2 or up.ndim != 2 or up.shape[1] != down.shape[0]:
            raise AdapterFormatError(
                f"{mod}: lora_A {tuple(down.shape)} and lora_B {tuple(up.shape)} are not [r, in] and [out, r]"
            )
        comp, local = mod.split(".", 1)
        alpha: float | None = alphas.get(mod)
        if alpha is None and metadata:
            pat = metadata.get(f"{comp}.alpha_pattern") or {}
            alpha = _pattern_value(pat, local) if isinstance(pat, Mapping) else None
            if alpha is None and metadata.get(f"{comp}.lora_alpha") is not None:
                alpha = float(metadata[f"{comp}.lora_alpha"])  # PEFT: one lora_alpha for every module
        rslora = bool(metadata.get(f"{comp}.use_rslora", False)) if metadata else False
        if metadata and metadata.get(f"{comp}.use_dora"):
            raise AdapterFormatError("DoRA adapters (use_dora) are not supported")
        if metadata and metadata.get(f"{comp}.lora_bias"):
            raise AdapterFormatError("LoRA adapters with a bias on lora_B (lora_bias) are not supported")
        if alpha is not None and not math.isfinite(alpha):
            raise AdapterFormatError(f"{mod}: alpha is not finite")
        rank = int(down.shape[0]) if down.ndim == 2 else 1
        if alpha is not None and rank > 0:
            scaling = abs(alpha) / (math.sqrt(rank) if rslora else rank)
            if scaling > MAX_LORA_SCALING:
                raise AdapterFormatError(
                    f"{mod}: alpha {alpha:g} over rank {rank} scales the update by {scaling:g}, more than "
                    f"{MAX_LORA_SCALING:g} (it would saturate every output: a broken or hostile file)")
        out[mod] = (down, up, alpha, rslora)
    return out


#: the largest ``alpha / rank`` accepted (real adapters use 0.5-4; 1e308 turned every image black)
MAX_LORA_SCALING = 1e4


def load_adapter(
    name: str, path: str | Path, components: Mapping[str, torch.nn.Module], support: AdapterSupport,
    *, device: torch.device | None = None, dtype: torch.dtype | None = None,
) -> LoadedAdapter:
    """Read, convert and match one adapter against ``components`` (raises :class:`DeployError`)."""
    where = f"adapters.{name}"
    try:
        file = adapter_file(path)
        sd, metadata = read_file(file)
        if not sd:
            raise AdapterFormatError(f"{file}: holds no tensors")
        alphas: dict[str, float] = {}
        layout = "diffusers"
        if not is_diffusers_layout(sd, support.components):
            if support.convert is None:
                raise unknown_keys_error(
                    [k for k in sd if not (k.endswith(_SUFFIXES) and k.split(".", 1)[0] in support.components)],
                    "diffusers",
                )
            sd, alphas = support.convert(dict(sd))
            layout = "converted"
        parsed = parse_layers(sd, metadata, alphas, support.components)
        for t in sd.values():
            if not torch.isfinite(t).all():
                raise AdapterFormatError("holds non-finite values")
    except AdapterFormatError as exc:
        raise DeployError(f"{where}: {exc}") from None
    layers: dict[int, LoraLayer] = {}
    targets: dict[str, int] = {}
    for mod, (down, up, alpha, rslora) in parsed.items():
        comp, local = mod.split(".", 1)
        root = components.get(comp)
        if root is None:
            raise DeployError(f"{where}: {file}: targets component {comp!r}, which this model does not have")
        try:
            module = root.get_submodule(local)
        except AttributeError:
            raise DeployError(f"{where}: {file}: targets {mod}, which the model does not have") from None
        if not isinstance(module, torch.nn.Linear):
            raise DeployError(f"{where}: {file}: {mod} is a {type(module).__name__}, not a Linear")
        if down.shape[1] != module.in_features or up.shape[0] != module.out_features:
            raise DeployError(
                f"{where}: {file}: {mod}: lora_A {tuple(down.shape)} / lora_B {tuple(up.shape)} do not fit "
                f"a Linear {module.in_features} -> {module.out_features}"
            )
        wdev = module.weight.device if device is None else device
        wdt = module.weight.dtype if dtype is None else dtype
        layers[id(module)] = LoraLayer(
            down=down.to(device=wdev, dtype=wdt).contiguous(), up=up.to(device=wdev, dtype=wdt).contiguous(),
            alpha=float(alpha) if alpha is not None else float(down.shape[0]), rslora=rslora,
        )
        targets[mod] = id(module)
    return LoadedAdapter(name=name, path=file, layout=layout, layers=layers, targets=targets)


# --------------------------------------------------------------------------------------------
# Declared in a deploy, checked in requests
# --------------------------------------------------------------------------------------------


def check_declared(adapters: Mapping[str, str], fuse: Mapping[str, float], family: Any) -> None:
    """Deploy-time checks that need no weights: names, paths, the family's opt-in, ``adapter_fuse``."""
    for name, path in adapters.items():
        if not _NAME_RE.fullmatch(name):
            raise DeployError(f"adapters.{name[:40]}: an adapter name is 1-64 letters, digits or _ . : @ + = -")
        try:
            adapter_file(path)
        except AdapterFormatError as exc:
            raise DeployError(f"adapters.{name}: {exc}") from None
    if adapters and capabilities_of(family).adapters is None:
        raise DeployError(f"adapters: family {family.name!r} does not support LoRA adapters")
    if fuse:
        if len(fuse) != 1 or len(adapters) != 1:
            raise DeployError("adapter_fuse: fusing needs exactly one declared adapter and one adapter_fuse entry")
        (name, scale), = fuse.items()
        if name not in adapters:
            raise DeployError(f"adapter_fuse.{name}: not a declared adapter (declared: {', '.join(adapters)})")
        if not math.isfinite(scale):
            raise DeployError(f"adapter_fuse.{name}: the scale must be a finite number")


def check_request(refs: Sequence[Any], adapters: Mapping[str, str], fuse: Mapping[str, float]) -> None:
    """A request's ``adapters`` against the deploy: declared names only, no repeats, at most
    :data:`MAX_PER_REQUEST`; none at all when the deploy fuses its adapter."""
    if not refs:
        return
    if fuse:
        raise RequestError("adapters", "this deployment fuses its adapter into the weights (adapter_fuse); requests cannot choose adapters")
    if len(refs) > MAX_PER_REQUEST:
        raise RequestError("adapters", f"at most {MAX_PER_REQUEST} adapters per request, got {len(refs)}")
    seen: set[str] = set()
    for i, ref in enumerate(refs):
        if ref.name not in adapters:
            known = ", ".join(sorted(adapters)) or "none"
            raise RequestError(f"adapters.{i}.name", f"unknown adapter {ref.name!r} (this deployment declares: {known})")
        if ref.name in seen:
            raise RequestError(f"adapters.{i}.name", f"adapter {ref.name!r} is named twice")
        seen.add(ref.name)


#: torch.compile modes that capture CUDA graphs: a replay re-runs the kernels recorded for one
#: adapter set, so an unfused switch would be silently ignored
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


def check_compile_mode(options: Mapping[str, Any], fused: bool) -> None:
    """Unfused adapters under a CUDA-graph compile mode or ``options.cuda_graphs`` (omniloop_kit.graphs)
    are refused (fused ones change no control flow)."""
    if not fused and options.get("cuda_graphs") is True:
        raise DeployError(
            "adapters: options.cuda_graphs replays one captured forward, which would apply one adapter set for "
            "every request; drop cuda_graphs or fuse the adapter (adapter_fuse)"
        )
    deploy = options.get("deploy")
    mode = options.get("compile_mode")
    if not fused and bool(getattr(deploy, "compile", False)) and mode in CUDAGRAPH_MODES:
        raise DeployError(
            f"adapters: options.compile_mode {mode!r} captures CUDA graphs, which would replay one adapter set "
            "for every request; use 'max-autotune-no-cudagraphs' or 'default' (or adapter_fuse)"
        )


class AdapterBank(Mechanism):
    """The adapters of one loaded deployment: read and checked at load, at most ``max_loaded`` kept
    (LRU), hooks on every targeted linear; :meth:`active_set` turns a request's refs into the set
    its execution activates."""

    def __init__(
        self, declared: Mapping[str, str], components: Mapping[str, torch.nn.Module], support: AdapterSupport,
        *, max_loaded: int = 16, fuse: Mapping[str, float] | None = None, model: Any = None,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        self.declared = dict(declared)
        self.support = support
        self.components = {n: c for n, c in components.items() if n in support.components and isinstance(c, torch.nn.Module)}
        self.max_loaded = max(1, int(max_loaded))
        self.fuse = dict(fuse or {})
        self._cache: OrderedDict[str, LoadedAdapter] = OrderedDict()
        self._info: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._modules: list[torch.nn.Module] = []
        self._registered: dict[str, LoadedAdapter] = {}
        self.loads = 0
        if support.check is not None and self.declared:
            support.check(model, options or {})
        check_compile_mode(options or {}, bool(self.fuse))
        targeted: dict[int, torch.nn.Module] = {}
        for name in self.declared:  # every file read and checked now; the first max_loaded are kept
            ad = self._read(name)
            self._info[name] = {"path": str(ad.path), "layout": ad.layout, "rank": ad.rank, "modules": len(ad.layers)}
            for mod in ad.targets:
                comp, local = mod.split(".", 1)
                m = self.components[comp].get_submodule(local)
                targeted[id(m)] = m
            if len(self._cache) < self.max_loaded:
                self._cache[name] = ad
        if self.fuse:
            (name, scale), = self.fuse.items()
            self._fuse(self._cache[name], scale)
            return
        for m in targeted.values():
            _install(m)
            self._modules.append(m)

    def _read(self, name: str) -> LoadedAdapter:
        self.loads += 1
        return load_adapter(name, self.declared[name], self.components, self.support)

    def _fuse(self, ad: LoadedAdapter, scale: float) -> None:
        with torch.no_grad():
            for mod, site in ad.targets.items():
                comp, local = mod.split(".", 1)
                weight: torch.Tensor = self.components[comp].get_submodule(local).weight  # type: ignore[assignment]
                layer = ad.layers[site]
                weight.add_((layer.up @ layer.down) * layer.scaling(scale))

    def get(self, name: str) -> LoadedAdapter:
        """The loaded adapter (read again if it was evicted); most recently used last."""
        with self._lock:
            if name in self._registered:
                return self._registered[name]
            ad = self._cache.get(name)
            if ad is not None:
                self._cache.move_to_end(name)
                return ad
            ad = self._read(name)
            self._cache[name] = ad
            while len(self._cache) > self.max_loaded:
                self._cache.popitem(last=False)
            return ad

    def register(self, name: str, path: str, adapter: LoadedAdapter) -> None:
        """Add (or replace) adapter ``name``, already read and checked (``Runtime.update_weights``):
        hooks on the linears it targets; executions that hold the previous adapter of that name keep
        it until they end. Registered adapters stay in memory (they may have no file to re-read)."""
        if self.fuse:
            raise DeployError(f"adapters.{name}: this deployment fuses its adapter; no other can be registered")
        with self._lock:
            for mod in adapter.targets:
                comp, local = mod.split(".", 1)
                m = self.components[comp].get_submodule(local)
                if not any(x is m for x in self._modules):
                    _install(m)
                    self._modules.append(m)
            self.declared[name] = path
            self._registered[name] = adapter
            self._cache.pop(name, None)
            self._info[name] = {"path": path, "layout": adapter.layout, "rank": adapter.rank,
                                "modules": len(adapter.layers), "registered": True}

    @property
    def registered(self) -> dict[str, LoadedAdapter]:
        """The adapters :meth:`register` added, by name."""
        return dict(self._registered)

    def active_set(self, refs: Sequence[Any]) -> ActiveSet:
        if self.fuse:
            return ()
        return tuple((self.get(r.name), float(r.scale)) for r in refs)

    def request_scope(self, request: Any) -> RequestScope | None:
        """The request's LoRA set, activated around each unit of its execution (None: it names none)."""
        active = self.active_set(request.adapters)
        if not active:
            return None
        return RequestScope(key=batch_key_of(active), activate=lambda: activate(active))

    def checksum_items(self) -> list[tuple[str, Any]]:
        """The registered adapters' tensors, for ``Runtime.weights_checksum``."""
        items: list[tuple[str, Any]] = []
        for name, ad in sorted(self._registered.items()):
            for mod in sorted(ad.targets):
                layer = ad.layers[ad.targets[mod]]
                items += [(f"adapter:{name}:{mod}.down", layer.down), (f"adapter:{name}:{mod}.up", layer.up),
                          ("", f"alpha={layer.alpha!r}|rslora={layer.rslora}")]
        return items

    def describe(self) -> list[dict[str, Any]]:
        """One row per declared adapter (what ``omniloop adapters`` and ``/v1/models`` show)."""
        rows = []
        for name in self.declared:
            info = self._info.get(name, {})
            rows.append({"name": name, **info, "loaded": name in self._cache or name in self._registered,
                         "fused": self.fuse.get(name) if name in self.fuse else None})
        return rows

    def close(self) -> None:
        """Remove this bank's hooks (the model runs as if no adapter had been declared)."""
        for m in self._modules:
            _uninstall(m)
        self._modules.clear()


__all__ = [
    "MAX_PER_REQUEST", "NAME_PATTERN", "ActiveSet", "AdapterBank", "AdapterFormatError", "AdapterSupport",
    "LoadedAdapter", "LoraLayer", "activate", "adapter_file", "batch_key_of", "check_declared", "check_request",
    "current", "hooked", "load_adapter", "parse_layers", "read_file", "unknown_keys_error",
]
