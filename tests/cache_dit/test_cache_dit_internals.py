"""Fails loudly when the cache-dit internals we drive move or change shape.

omniloop-cache-dit calls cache-dit's internal context manager directly (see
``omniloop_cache_dit/_cachedit.py``). If one of these tests fails after a cache-dit upgrade, the
adapter must be re-verified against the new release (and the pin moved) — do not just relax the
test. Each test names the fact it guards.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
from pathlib import Path

import pytest
import torch

cache_dit = pytest.importorskip("cache_dit")

from omniloop_cache_dit import _cachedit  # noqa: E402

INTERNAL_MODULES = {
    "cache_dit.caching.cache_contexts.cache_manager": ["CachedContextManager", "ContextNotExistError"],
    "cache_dit.caching.cache_contexts.cache_context": ["CachedContext"],
    "cache_dit.caching.cache_contexts.cache_config": ["DBCacheConfig", "BasicCacheConfig", "ExtraCacheConfig"],
    "cache_dit.caching.cache_contexts.calibrators": ["TaylorSeerCalibratorConfig", "CalibratorConfig", "Calibrator"],
    "cache_dit.caching.cache_contexts.calibrators.taylorseer": ["TaylorSeerCalibrator"],
    # the reference path our equivalence tests compare against
    "cache_dit.caching.cache_blocks.pattern_base": ["CachedBlocks_Pattern_Base"],
}


def _params(fn: object) -> list[tuple[str, object]]:
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    return [(p.name, p.kind) for p in sig.parameters.values()]


def test_installed_cache_dit_is_the_pinned_release() -> None:
    assert cache_dit.__version__ == _cachedit.PINNED_VERSION == "1.5.3"
    assert importlib.metadata.version("cache-dit") == "1.5.3"
    _cachedit.check_version()


def test_distribution_pins_cache_dit_exactly() -> None:
    reqs = importlib.metadata.requires("omniloop-cache-dit") or []
    assert any(re.fullmatch(r"cache-dit\s*==\s*1\.5\.3", r.split(";")[0].strip()) for r in reqs), reqs


@pytest.mark.parametrize("module, names", INTERNAL_MODULES.items(), ids=list(INTERNAL_MODULES))
def test_internal_import_paths(module: str, names: list[str]) -> None:
    mod = importlib.import_module(module)
    for name in names:
        assert hasattr(mod, name), f"{module}.{name} moved"


def test_old_module_names_are_gone_as_the_notes_say() -> None:
    for old in ("cache_dit.cache_factory", "cache_dit.parallelism"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)


def test_manager_methods_we_call_exist() -> None:
    mgr = _cachedit.CachedContextManager
    missing = [m for m in _cachedit.MANAGER_METHODS if not callable(getattr(mgr, m, None))]
    assert not missing, f"CachedContextManager lost: {missing}"


def test_manager_method_signatures() -> None:
    M = _cachedit.CachedContextManager
    P, K = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
    assert _params(M.__init__) == [("self", P), ("name", P), ("persistent_context", P)]
    assert _params(M.similarity) == [
        ("self", P),
        ("t1", P),
        ("t2", P),
        ("threshold", K),
        ("parallelized", K),
        ("prefix", K),
    ]
    assert _params(M.can_cache) == [
        ("self", P),
        ("states_tensor", P),
        ("parallelized", P),
        ("threshold", P),
        ("prefix", P),
    ]
    assert _params(M.apply_cache) == [
        ("self", P),
        ("hidden_states", P),
        ("encoder_hidden_states", P),
        ("prefix", P),
        ("encoder_prefix", P),
    ]
    assert _params(M.set_Fn_buffer) == [("self", P), ("buffer", P), ("prefix", P)]
    assert _params(M.set_Bn_buffer) == [("self", P), ("buffer", P), ("prefix", P)]
    assert _params(M.enter_context) == [("self", P), ("cached_context", P)]
    assert _params(M.remove_context) == [("self", P), ("cached_context", P)]
    for name in (
        "mark_step_begin",
        "add_cached_step",
        "is_cache_residual",
        "get_current_step",
        "get_current_step_residual_diff",
        "get_important_condition_threshold",
    ):
        assert _params(getattr(M, name)) == [("self", P)], name


def test_context_and_config_fields() -> None:
    import dataclasses

    ctx_fields = {f.name for f in dataclasses.fields(_cachedit.CachedContext)}
    assert {"name", "cache_config", "calibrator_config", "extra_cache_config", "buffers"} <= ctx_fields
    cfg_fields = {f.name for f in dataclasses.fields(_cachedit.DBCacheConfig)}
    assert {
        "Fn_compute_blocks",
        "Bn_compute_blocks",
        "residual_diff_threshold",
        "max_warmup_steps",
        "max_cached_steps",
        "max_continuous_cached_steps",
        "enable_separate_cfg",
        "num_inference_steps",
    } <= cfg_fields
    cal_fields = {f.name for f in dataclasses.fields(_cachedit.TaylorSeerCalibratorConfig)}
    assert {"enable_calibrator", "enable_encoder_calibrator", "calibrator_cache_type", "taylorseer_order"} <= cal_fields


def _mgr_with_context(**cfg: object) -> _cachedit.CachedContextManager:
    mgr = _cachedit.CachedContextManager(name="t")
    mgr.new_context(name="c", cache_config=_cachedit.DBCacheConfig(enable_separate_cfg=False, **cfg))
    return mgr


def test_enter_context_selects_without_refresh() -> None:
    """We rely on enter_context never re-creating a context (set_context may, past num_inference_steps)."""
    mgr = _mgr_with_context(num_inference_steps=1, max_warmup_steps=0)
    ctx = mgr.get_context("c")
    for _ in range(3):
        with mgr.enter_context("c"):
            mgr.mark_step_begin()
    assert mgr.get_context("c") is ctx and ctx.get_current_step() == 2
    assert mgr.get_context() is None  # restored


def test_prefix_routing_on_the_bn_substring() -> None:
    mgr = _mgr_with_context()
    with mgr.enter_context("c"):
        mgr.mark_step_begin()
        mgr.set_Fn_buffer(torch.ones(2), prefix=_cachedit.FN_PREFIX)
        mgr.set_Bn_buffer(torch.full((2,), 2.0), prefix=_cachedit.BN_RESIDUAL_PREFIX)
        ctx = mgr.get_context()
        assert set(ctx.buffers) == {f"{_cachedit.FN_PREFIX}_buffer", f"{_cachedit.BN_RESIDUAL_PREFIX}_buffer"}
        assert mgr.is_cache_residual()
        out, enc = mgr.apply_cache(torch.zeros(2), None, prefix=_cachedit.BN_RESIDUAL_PREFIX)
        assert enc is None and torch.equal(out, torch.full((2,), 2.0))


def test_similarity_is_relative_l1_of_the_fn_residual() -> None:
    mgr = _mgr_with_context(residual_diff_threshold=0.3, max_warmup_steps=0)
    prev, cur = torch.tensor([1.0, -1.0, 2.0, -2.0]), torch.tensor([1.1, -1.1, 2.2, -2.2])
    with mgr.enter_context("c"):
        mgr.mark_step_begin()
        assert not mgr.can_cache(prev, prefix=_cachedit.FN_PREFIX)  # no reference yet
        mgr.set_Fn_buffer(prev, prefix=_cachedit.FN_PREFIX)
        mgr.mark_step_begin()
        assert mgr.can_cache(cur, prefix=_cachedit.FN_PREFIX)
        diff = mgr.get_current_step_residual_diff()
    assert diff == pytest.approx(((prev - cur).abs().mean() / prev.abs().mean()).item())


def test_library_wrapper_sequence_is_what_we_replicate() -> None:
    """CachedBlocks_Pattern_Base.forward: Fn → mark_step_begin → can_cache → apply_cache | (set_Fn_buffer,
    Mn, set_Bn_buffer) → Bn. The Wan equivalence tests check this behaviourally; this checks the order."""
    from cache_dit.caching.cache_blocks.pattern_base import CachedBlocks_Pattern_Base

    src = inspect.getsource(CachedBlocks_Pattern_Base.forward)
    order = [
        "call_Fn_blocks",
        "mark_step_begin",
        "can_cache",
        "add_cached_step",
        "apply_cache",
        "call_Bn_blocks",
        "set_Fn_buffer",
        "call_Mn_blocks",
        "set_Bn_buffer",
        "call_Bn_blocks",
    ]
    pos, at = [], 0
    for name in order:
        at = src.index(name, at)
        pos.append(at)
    assert pos == sorted(pos)


def test_manager_methods_are_compiler_disabled() -> None:
    """The notes: compile the blocks, not the wrapper (the manager's methods are torch.compiler.disable'd)."""
    for name in ("mark_step_begin", "can_cache", "apply_cache", "set_Fn_buffer", "set_Bn_buffer", "similarity"):
        fn = getattr(_cachedit.CachedContextManager, name)
        assert getattr(fn, "_torchdynamo_disable", False), name
    from omniloop_cache_dit.manager import OmniloopContextManager

    assert getattr(OmniloopContextManager.similarity, "_torchdynamo_disable", False)


def test_adapter_module_does_not_reach_past_its_binding_module() -> None:
    """Only _cachedit.py imports cache_dit; everything else goes through it."""
    pkg = Path(_cachedit.__file__).parent
    offenders = [
        p.name
        for p in pkg.glob("*.py")
        if p.name != "_cachedit.py" and re.search(r"^\s*(from|import)\s+cache_dit\b", p.read_text(), re.M)
    ]
    assert offenders == []
