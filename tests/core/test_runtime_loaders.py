"""Runtime loaders (issue 34): ``Runtime.from_deploy`` hands a deploy a single-process runtime does
not run (``omniloop.runtime.ROUTED``) to the loader a plugin registers; the core imports none."""

from __future__ import annotations

from typing import Any

import pytest

from omniloop.errors import DeployError
from omniloop.family import RuntimeLoaderSpec
from omniloop.hookspecs import hookimpl
from omniloop.runtime import Deployment, Runtime, check_request
from omniloop.testing import build_toy_checkpoint, make_manager, toy_request


class _Loader:
    OMNILOOP_HOOK_API = ">=1.3,<2"

    def __init__(self, name: str = "fake", **kw: Any) -> None:
        self.loaded: list[Any] = []
        self.checked: list[Any] = []
        self.spec = RuntimeLoaderSpec(
            name=name, fields=("parallel",), claims=lambda d: d.parallel.world_size > 1,
            load=lambda d, manager=None: self.loaded.append(d) or "the pool",
            check=lambda dep, blocks: self.checked.append(dep.deploy.parallel.cfg), **kw)

    @hookimpl
    def omniloop_register_runtime_loaders(self, register: Any) -> None:
        register(self.spec)


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_toy_checkpoint(tmp_path_factory.mktemp("toy") / "ckpt")


def _deploy(toy: Any, **extra: Any) -> dict[str, Any]:
    return {"model": {"path": str(toy)}, **extra}


def test_a_routed_deploy_without_its_loader_names_the_package(toy: Any) -> None:
    with pytest.raises(DeployError, match=r"^parallel: \{sp: 1, cfg: 2\}: no installed runtime loader runs this "
                                          r"deploy: pip install omniloop-parallel$"):
        Runtime.from_deploy(_deploy(toy, parallel={"cfg": 2}), manager=make_manager())
    with pytest.raises(DeployError, match="pip install omniloop-parallel"):
        Deployment(_deploy(toy, placement={"vae": {"devices": ["cpu"]}}), manager=make_manager())


def test_the_claiming_loader_checks_and_loads(toy: Any) -> None:
    loader = _Loader()
    pm = make_manager(("fake", loader))
    assert Runtime.from_deploy(_deploy(toy, parallel={"cfg": 2}), manager=pm) == "the pool"
    assert len(loader.loaded) == 1 and loader.checked == []  # from_deploy hands it over; the loader checks
    Deployment(_deploy(toy, parallel={"cfg": 2}), manager=pm)
    assert loader.checked == [2]  # the weight-free checks run through the loader's check
    assert check_request(_deploy(toy, parallel={"cfg": 2}), toy_request(steps=2), manager=pm).task.value == "t2v"


def test_a_plain_runtime_of_a_claimed_deploy_is_refused(toy: Any) -> None:
    pm = make_manager(("fake", _Loader()))
    with pytest.raises(DeployError, match=r"^parallel: load this deploy with Runtime.from_deploy \('fake' runtime loader\)"):
        Runtime(_deploy(toy, parallel={"cfg": 2}), manager=pm)
    refusing = _Loader(check_direct=lambda d: (_ for _ in ()).throw(DeployError("parallel: only in my pool")))
    with pytest.raises(DeployError, match=r"^parallel: only in my pool$"):
        Runtime(_deploy(toy, parallel={"cfg": 2}), manager=make_manager(("fake", refusing)))


def test_two_loaders_claiming_one_deploy_are_refused(toy: Any) -> None:
    pm = make_manager(("a", _Loader("a")), ("b", _Loader("b")))
    with pytest.raises(DeployError, match=r"^parallel: several runtime loaders claim this deploy \(a, b\)"):
        Runtime.from_deploy(_deploy(toy, parallel={"cfg": 2}), manager=pm)


def test_a_one_process_deploy_never_asks_a_loader(toy: Any) -> None:
    loader = _Loader()
    rt = Runtime.from_deploy(_deploy(toy), manager=make_manager(("fake", loader)))
    assert isinstance(rt, Runtime) and loader.loaded == [] and loader.checked == []
