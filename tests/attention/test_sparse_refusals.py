"""sparse-tile never computes dense attention under its name: a deployment that would not hand it
the self-attention token grid is refused at load (``omniloop.placement.check_attention_grid``),
one line naming the reason — Ulysses ``parallel.sp > 1``, Wan's causal rollout, a family that
passes no grid. The bidirectional, one-process Wan deploy still loads (and its forward does get
the grid: tests/attention/test_sparse.py::test_wan_tiny_runs_end_to_end)."""

from __future__ import annotations

import pytest

from omniloop.errors import DeployError
from omniloop.runtime import Deployment
from omniloop.testing import make_manager
from omniloop_attention import plugin


@pytest.fixture(scope="module")
def wan_ckpt(tmp_path_factory):
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from omniloop_wan.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-wan-sparse-refusals"))


def _wan_manager():
    import omniloop_parallel.plugin as parallel_plugin  # parallel deploys: its runtime loader checks them
    import omniloop_wan.plugin as wan_plugin

    return make_manager(("wan", wan_plugin), ("attention", plugin), ("parallel", parallel_plugin), toy=False)


def _refused(deploy, manager) -> str:
    with pytest.raises(DeployError) as info:
        Deployment(deploy, manager=manager)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


SPARSE = {"attention_backend": "sparse-tile", "attention_options": {"density": 0.3}}


def test_one_process_bidirectional_wan_loads(wan_ckpt):
    d = Deployment({"model": {"path": str(wan_ckpt)}, **SPARSE}, manager=_wan_manager())
    assert d.attention.name == "sparse-tile" and d.attention.fn.density == 0.3


def test_refused_under_ulysses_sequence_parallel(wan_ckpt):
    msg = _refused({"model": {"path": str(wan_ckpt)}, "parallel": {"sp": 2}, **SPARSE}, _wan_manager())
    assert msg == ("attention_backend: 'sparse-tile' needs each self-attention call's token grid, and "
                   "parallel.sp=2 (Ulysses) passes none: it would compute dense attention; "
                   "use parallel.sp: 1 or another backend")


def test_cfg_parallel_alone_is_not_refused(wan_ckpt):
    """parallel.cfg splits the guidance branches, not the tokens: each rank's forward gets its grid."""
    d = Deployment({"model": {"path": str(wan_ckpt)}, "parallel": {"cfg": 2}, **SPARSE}, manager=_wan_manager())
    assert d.deploy.parallel.world_size == 2


def test_refused_with_the_causal_rollout(wan_ckpt):
    msg = _refused({"model": {"path": str(wan_ckpt)}, "options": {"rollout": "causal"}, **SPARSE}, _wan_manager())
    assert msg.startswith("attention_backend: 'sparse-tile' needs each self-attention call's token grid, and "
                          "options.rollout: causal (chunk attention) passes none")


def test_refused_for_a_family_that_passes_no_grid(toy_checkpoint):
    msg = _refused({"model": {"path": str(toy_checkpoint)}, **SPARSE}, make_manager(("attention", plugin)))
    assert msg == ("attention_backend: 'sparse-tile' needs each self-attention call's token grid, and family "
                   "'toy' passes none: it would compute dense attention; use another backend")


def test_backends_without_a_grid_are_not_affected(wan_ckpt, toy_checkpoint):
    Deployment({"model": {"path": str(toy_checkpoint)}, "attention_backend": "sdpa-math"},
               manager=make_manager(("attention", plugin)))
    for extra in ({"parallel": {"sp": 2}}, {"options": {"rollout": "causal"}}):
        Deployment({"model": {"path": str(wan_ckpt)}, "attention_backend": "sdpa-math", **extra}, manager=_wan_manager())
