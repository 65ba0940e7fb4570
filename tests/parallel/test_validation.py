"""parallel: {sp, cfg} is checked before any weight loads: one DeployError line naming the field."""

from __future__ import annotations

import os

import pytest

import omniloop_parallel.plugin as parallel_plugin
from omniloop.errors import DeployError
from omniloop.runtime import Deployment, Runtime
from omniloop.testing import build_toy_checkpoint, make_manager
from omniloop_parallel.testing import wan_manager


def deploy(path, **parallel):
    return {"model": {"path": str(path)}, "parallel": parallel}


def refused(d, manager=None) -> str:
    with pytest.raises(DeployError) as info:
        Deployment(d, manager=manager or wan_manager())
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_world_one_and_valid_layouts_pass(wan_ckpt):
    assert Deployment(deploy(wan_ckpt), manager=wan_manager()).deploy.parallel.world_size == 1
    for par in ({"cfg": 2}, {"sp": 2}):
        d = Deployment(deploy(wan_ckpt, **par), manager=wan_manager())
        assert d.deploy.parallel.world_size == 2


def test_sp_must_divide_the_heads(wan_ckpt):
    # the tiny transformer has 2 attention heads (the 1.3B: 12, the 14B: 40)
    msg = refused(deploy(wan_ckpt, sp=3))
    assert msg.startswith("parallel.sp: 3 does not divide the transformer's 2 attention heads")


def test_cfg_at_most_the_guidance_branches(wan_ckpt):
    assert refused(deploy(wan_ckpt, cfg=3)).startswith("parallel.cfg: 3 is more than family 'wan' can use (at most 2)")


def test_enough_cores_message(wan_ckpt, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert refused(deploy(wan_ckpt, cfg=2)) == "parallel: {sp: 1, cfg: 2} needs 2 processes, this machine has 1 CPU cores"


def test_family_declares_its_axes(tmp_path):
    toy = build_toy_checkpoint(tmp_path / "toy")
    msg = refused({"model": {"path": str(toy)}, "parallel": {"cfg": 2}}, manager=make_manager(("parallel", parallel_plugin)))
    assert msg == "parallel.cfg: family 'toy' does not support 'cfg' parallelism (it supports: none)"


def test_schema_errors_name_the_field():
    from omniloop.deploy import load_deploy

    with pytest.raises(DeployError, match=r"parallel\.sp: must be >= 1, got 0"):
        load_deploy({"parallel": {"sp": 0}})
    with pytest.raises(DeployError, match=r"parallel\.tp: unknown key"):
        load_deploy({"parallel": {"tp": 2}})


def test_single_process_runtime_refuses_a_world_above_one(wan_ckpt):
    # before any weight is read: the layout needs the pool
    with pytest.raises(DeployError, match=r"runs in 2 processes: load it through omniloop-parallel's worker pool"):
        Runtime(deploy(wan_ckpt, cfg=2), manager=wan_manager())


def test_block_interceptors_need_a_family_that_binds_them(wan_ckpt):
    import torch

    from omniloop.capabilities import FamilyCapabilities, ParallelSupport
    from omniloop.deploy import load_deploy
    from omniloop_parallel.checks import check_parallel

    class Family:  # supports cfg, but does not bind block interceptors to its groups
        name = "plain"
        capabilities = FamilyCapabilities(parallel=ParallelSupport(axes=frozenset({"cfg"})))

    d = load_deploy({"parallel": {"cfg": 2}})
    with pytest.raises(DeployError, match=r"^plugins\.blk: block interceptors do not run under parallel"):
        check_parallel(d, Family(), wan_ckpt, torch.device("cpu"), ("blk",))
    check_parallel(d, Family(), wan_ckpt, torch.device("cpu"), ())
    # Wan binds them (to its sp group): accepted before load
    Deployment({"model": {"path": str(wan_ckpt)}, "parallel": {"sp": 2}, "plugins": {"cache-dit": {}}})
