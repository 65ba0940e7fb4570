"""omniloop.deploy.check_in_process: what an in-process engine (serve, the Dynamo worker) refuses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from omniloop.deploy import check_in_process, load_deploy
from omniloop.errors import DeployError


def test_plain_and_placement_deploys_pass():
    check_in_process(load_deploy({"model": {"path": "x"}}), "omniloop serve")
    check_in_process(load_deploy({"model": {"path": "x"}, "placement": {"vae": {"devices": ["cpu"]}}}), "omniloop serve")


def test_parallel_and_composed_deploys_are_refused_naming_the_front_end():
    with pytest.raises(DeployError, match=r"^parallel: the omniloop Dynamo worker cannot serve a parallel deploy \(sp 2, cfg 1\)"):
        check_in_process(load_deploy({"model": {"path": "x"}, "parallel": {"sp": 2}}), "the omniloop Dynamo worker")
    composed = {"pipeline": "prompt-upsample", "models": {"upsampler": {"path": "a"}, "video": {"path": "b"}}}
    with pytest.raises(DeployError, match=r"^pipeline: omniloop serve cannot serve a composed deploy"):
        check_in_process(load_deploy(composed), "omniloop serve")


def test_dynamo_worker_refuses_a_parallel_deploy_before_loading(tmp_path):
    pytest.importorskip("omniloop_dynamo")
    from omniloop_dynamo.worker import OmniloopDynamoWorker, WorkerOptions

    deploy = tmp_path / "deploy.json"
    deploy.write_text('{"model": {"path": "does-not-exist"}, "parallel": {"cfg": 2}}')
    fake = SimpleNamespace(options=WorkerOptions(deploy=str(deploy)))
    with pytest.raises(DeployError, match="Dynamo worker cannot serve a parallel deploy"):
        OmniloopDynamoWorker._load_runtime(fake)  # type: ignore[arg-type]
