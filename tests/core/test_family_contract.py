"""The family contract (issue 34): a family declares what it can do in one frozen
``FamilyCapabilities``, checked when it registers; nobody probes a family object with ``getattr``.

* The source check walks every package's Python with ``ast`` and fails on a ``getattr``/``hasattr``
  whose object is family-ish (its expression names a ``family``/``fam``) or whose attribute is one
  of the contract's names (the old optional attributes, the optional methods, ``capabilities``).
  The one exemption is ``omniloop/capabilities.py``: registration checks the declaration against
  the object there, and the deprecation shim converts old-style families.
* Registration refuses a declaration the family cannot serve, with one line naming the field.
* Old-style families (attributes instead of ``capabilities``) still work for one release, with a
  ``FamilyDeprecationWarning``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import attrs
import pytest

from omniloop.capabilities import (
    LEGACY_ATTRIBUTES,
    OPTIONAL_METHODS,
    FamilyCapabilities,
    FamilyDeprecationWarning,
    OffloadSupport,
    ParallelSupport,
    Rollout,
    capabilities_of,
)
from omniloop.errors import DeployError, RequestError
from omniloop.request import TaskType
from omniloop.testing import ToyFamily, make_manager, plugin_of, toy_runtime

ROOT = Path(__file__).resolve().parents[2]
#: package sources: the core, the CLI, every plugin, family (the kit among them), observer and
#: interceptor, the demos' training code, the benchmarks and the examples
SOURCE_GLOBS = ("core/omniloop/**/*.py", "cli/*/**/*.py", "plugins/*/omniloop_*/**/*.py", "plugins/*/*/omniloop_*/**/*.py",
                "families/*/omniloop_*/**/*.py", "observers/*/omniloop_*/**/*.py",
                "interceptors/*/omniloop_*/**/*.py", "demos/*/omniloop_*/**/*.py", "bench/**/*.py", "examples/**/*.py")
EXEMPT = {"core/omniloop/capabilities.py"}
CONTRACT_NAMES = frozenset({*LEGACY_ATTRIBUTES, *OPTIONAL_METHODS, "capabilities"})
FAMILY_ISH = re.compile(r"(^|[._])(family|families|fam)($|[._\[])", re.IGNORECASE)


def capability_probes(source: str) -> list[tuple[int, str]]:
    """``(line, expression)`` of every ``getattr``/``hasattr`` call that probes a family: the object
    expression is family-ish (``family``, ``self.family``, ``rt.family``, ``fam``) or the attribute
    looked up is a contract name (``adapter_support``, ``resolve``, ``capabilities``, ...)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2):
            continue
        obj, name = node.args[0], node.args[1]
        attr = name.value if isinstance(name, ast.Constant) and isinstance(name.value, str) else None
        if FAMILY_ISH.search(ast.unparse(obj)) or attr in CONTRACT_NAMES:
            out.append((node.lineno, ast.unparse(node)))
    return out


def test_the_probe_finder_finds_probes() -> None:
    found = capability_probes(
        "getattr(family, 'x', None)\ngetattr(self.family, 'inspect')\nhasattr(rt.family, 'y')\n"
        "getattr(obj, 'adapter_support', None)\ngetattr(fam, 'z')\ngetattr(m, 'resolve')\n"
        "getattr(torch, 'float32')\ngetattr(module, 'weight')\ngetattr(familiar, 'x')\n"
    )
    assert [line for line, _ in found] == [1, 2, 3, 4, 5, 6]


def test_no_family_is_probed_with_getattr() -> None:
    files = sorted({p for g in SOURCE_GLOBS for p in ROOT.glob(g)})
    assert len(files) > 100  # the globs match the tree
    # every family package is read, the kit the diffusers-format families stand on among them
    scanned = {p.relative_to(ROOT).parts[:2] for p in files if p.relative_to(ROOT).parts[0] == "families"}
    packages = {("families", d.name) for d in (ROOT / "families").iterdir() if any(d.glob("omniloop_*/__init__.py"))}
    assert ("families", "kit") in packages and packages <= scanned, sorted(packages - scanned)
    probes = [f"{p.relative_to(ROOT)}:{line}: {expr}" for p in files
              if str(p.relative_to(ROOT)) not in EXEMPT
              for line, expr in capability_probes(p.read_text(encoding="utf-8"))]
    assert not probes, "read FamilyCapabilities instead of probing a family:\n" + "\n".join(probes)


# -- every shipped family declares ----------------------------------------------------------------


@pytest.mark.parametrize("module", ["omniloop.testing.toy", "omniloop_wan.family", "omniloop_flux.family",
                                    "omniloop_sd3.family", "omniloop_qwen.family"])
def test_every_shipped_family_declares_its_capabilities(module: str) -> None:
    import importlib
    import warnings

    mod = pytest.importorskip(module)
    families = [v for v in vars(mod).values()
                if isinstance(v, type) and v.__module__ == mod.__name__ and "capabilities" in vars(v)]
    assert families, f"{module} declares no family"
    for cls in families:
        assert isinstance(cls.capabilities, FamilyCapabilities)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FamilyDeprecationWarning)
            importlib.import_module("omniloop.capabilities").validate(cls(), cls.capabilities)


def test_every_installed_family_declares_its_capabilities() -> None:
    """Every family an installed plugin registers (entry points, as ``omniloop`` finds them)
    declares one ``FamilyCapabilities`` that registration accepts, with no old-style attribute."""
    import warnings

    from omniloop.plugins import PluginManager

    with warnings.catch_warnings():
        warnings.simplefilter("error", FamilyDeprecationWarning)
        pm = PluginManager()
        reg = pm.registry()
    failed = [r.error for r in pm.records.values() if r.status == "failed" and "family" in str(r.error)]
    assert not failed, failed
    assert {"wan", "flux", "sd3"} <= set(reg.families), sorted(reg.families)
    for name, family in reg.families.items():
        assert isinstance(family.capabilities, FamilyCapabilities), name
        assert not [a for a in LEGACY_ATTRIBUTES if a in dir(family)], name


# -- registration refuses what a family cannot serve ----------------------------------------------


def _register(family: Any) -> Any:
    pm = make_manager(("bad", plugin_of(families=[family])), toy=False)
    reg = pm.registry()
    return pm.records["bad"], reg


def _toy_with(**caps: Any) -> Any:
    fam = ToyFamily()
    fam.capabilities = attrs.evolve(ToyFamily.capabilities, **caps)
    return fam


class _T2AWithoutAudio(ToyFamily):
    tasks = frozenset({*ToyFamily.tasks, TaskType.T2A})


class _NoInspect(ToyFamily):
    capabilities = attrs.evolve(ToyFamily.capabilities, inspect=False)


@pytest.mark.parametrize(("family", "message"), [
    (_toy_with(supported_tasks=True), "capabilities.supported_tasks is declared but the family defines no supported_tasks()"),
    (_NoInspect(), "capabilities.inspect: the family defines inspect() but does not declare it"),
    (_toy_with(parallel=ParallelSupport(axes={"sp"})), "capabilities.parallel: 'sp' needs attention_heads(path)"),
    (_toy_with(parallel=ParallelSupport(axes={"tp"})), "capabilities.parallel.axes: 'tp' is not a parallel axis"),
    (_toy_with(parallel=ParallelSupport(axes={"cfg"}, limits={"sp": 2})), "capabilities.parallel.limits.sp: not a declared axis"),
    (_toy_with(block_interceptors=False, parallel=ParallelSupport(axes={"cfg"}, block_interceptors=True)),
     "capabilities.parallel.block_interceptors"),
    (_toy_with(offload=OffloadSupport(components={})), "capabilities.offload names no components"),
    (_toy_with(rollouts=(Rollout("a"), Rollout("a"))), "capabilities.rollouts: expected Rollout records with distinct names"),
    (_toy_with(rollouts=(Rollout("a", returns_latents=False),)), "capabilities.returns_latents must equal"),
    (_toy_with(attention_grid="dense"), "capabilities.attention_grid: expected a callable"),
    (_toy_with(weight_update_refusal="no"), "capabilities.weight_update_refusal: expected a callable"),
    (_toy_with(audio=True, audio_tasks={"t2a"}), "capabilities.audio_tasks: 't2a' is not one of the family's tasks (t2i, t2v)"),
    (_toy_with(audio_tasks={"t2v"}), "capabilities.audio_tasks: the family declares audio=False"),
    (_T2AWithoutAudio(), "capabilities.audio: the family does t2a, so it makes audio: declare audio=True"),
])
def test_registration_refuses_a_declaration_the_family_cannot_serve(family: Any, message: str) -> None:
    rec, reg = _register(family)
    assert rec.status == "failed" and "toy" not in reg.families
    assert message in rec.error and "\n" not in rec.error


def test_capabilities_and_an_old_attribute_together_are_refused() -> None:
    class Both(ToyFamily):
        offload_components = {"transformer": "blocks"}  # noqa: RUF012 (the old spelling)

    rec, _ = _register(Both())
    assert rec.status == "failed"
    assert "declares capabilities and the old attribute 'offload_components'" in rec.error


def test_capabilities_must_be_the_declaration_type() -> None:
    fam = ToyFamily()
    fam.capabilities = {"block_interceptors": True}  # type: ignore[assignment]
    rec, _ = _register(fam)
    assert "capabilities must be an omniloop.capabilities.FamilyCapabilities, not dict" in rec.error


# -- the deprecation shim: old-style families keep working for one release -------------------------


class OldStyleToy:
    """The toy family written the pre-0.2 way: optional attributes, no ``capabilities``."""

    name = "toy"
    tasks = ToyFamily.tasks
    supports_block_interceptors = True
    offload_components = {"transformer": "blocks", "text_encoder": None}  # noqa: RUF012
    parallel_axes = frozenset({"cfg"})

    def __init__(self) -> None:
        self._toy = ToyFamily()
        for m in ("detect", "load", "build_pipeline", "validate_request", "inspect", "resolve", "task_defaults"):
            setattr(self, m, getattr(self._toy, m))


def test_an_old_style_family_is_converted_with_a_warning(toy_checkpoint: Path) -> None:
    from omniloop.runtime import Runtime, deploy_for_model

    pm = make_manager(("old", plugin_of(families=[OldStyleToy()])), toy=False)
    with pytest.warns(FamilyDeprecationWarning, match="declare capabilities = omniloop.capabilities.FamilyCapabilities"):
        fam = pm.registry().families["toy"]
    caps = capabilities_of(fam)
    assert caps.block_interceptors and caps.offload is not None and dict(caps.offload.components)["transformer"] == "blocks"
    assert caps.parallel is not None and caps.parallel.axes == {"cfg"}
    assert caps.inspect and caps.resolve and caps.task_defaults and not caps.supported_tasks
    rt = Runtime(deploy_for_model(toy_checkpoint), manager=pm)
    out = rt.generate({"task": "t2v", "prompt": "a fox", "diffusion": {"steps": 2, "seed": 0}})
    assert out.ok


# -- nothing silently ignored: options and outputs the family does not serve -----------------------


def test_an_option_the_family_does_not_read_is_refused(toy_checkpoint: Path) -> None:
    from omniloop.runtime import Deployment, deploy_for_model

    pm = make_manager(("fam", plugin_of(families=[_toy_with(options=frozenset({"vae_dtype"}))])), toy=False)
    with pytest.raises(DeployError, match=r"^options\.rolout: family 'toy' does not read this option \(it reads: vae_dtype\)$"):
        Deployment(deploy_for_model(toy_checkpoint, options={"rolout": "causal"}), manager=pm)
    Deployment(deploy_for_model(toy_checkpoint, options={"vae_dtype": "float32"}), manager=pm)


def test_a_rollout_the_family_does_not_have_is_refused(toy_checkpoint: Path) -> None:
    with pytest.raises(DeployError, match=r"^options\.rollout: family 'toy' has a single rollout and takes no options\.rollout"):
        toy_runtime(toy_checkpoint, options={"rollout": "causal"})


def test_outputs_the_family_does_not_produce_are_refused_before_compute(toy_checkpoint: Path) -> None:
    rt = toy_runtime(toy_checkpoint)
    with pytest.raises(RequestError) as err:
        rt.prepare({"task": "t2v", "prompt": "x", "outputs": {"stream_partial": True}})
    assert err.value.path == "outputs.stream_partial" and "family 'toy' emits no partial outputs" in str(err.value)
    assert rt.prepare({"task": "t2v", "prompt": "x", "outputs": {"return_latents": True}}).request.outputs.return_latents
