"""``FamilyCapabilities.audio``: a request's ``audio`` window goes only to a family that makes audio."""

from __future__ import annotations

import pytest

from omniloop.capabilities import FamilyCapabilities
from omniloop.errors import RequestError
from omniloop.runtime import Deployment


def test_audio_is_refused_by_a_family_that_declares_none(toy_runtime_factory):
    assert FamilyCapabilities().audio is False
    rt = toy_runtime_factory()
    assert rt.capabilities.audio is False
    with pytest.raises(RequestError) as err:
        rt.prepare({"task": "t2v", "prompt": "a red fox", "audio": {"seconds": 2.0}})
    assert err.value.path == "audio" and "family 'toy' does not make audio" in str(err.value)
    assert rt.generate({"task": "t2v", "prompt": "a red fox", "diffusion": {"steps": 1}}).ok


def test_the_deployment_refuses_it_before_loading(toy_checkpoint):
    from omniloop.testing import make_manager

    dep = Deployment({"model": {"path": str(toy_checkpoint)}}, manager=make_manager())
    with pytest.raises(RequestError) as err:
        dep.check({"task": "t2v", "prompt": "a red fox", "audio": {"start": 1.0}})
    assert err.value.path == "audio"
