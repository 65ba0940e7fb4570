"""omniloop-kit's policy menu: the deploy's ``policies:`` validated by a schema class, refused
(one line naming the key and the family) where a family does not take it."""

from __future__ import annotations

from typing import Any

import pytest

from omniloop.deploy import load_deploy
from omniloop.errors import DeployError
from omniloop_kit.policies import DeployPolicies, cached_menu, deploy_policies


def _options(**policies: Any) -> dict[str, Any]:
    return {"deploy": load_deploy({"policies": policies})}


def test_the_deploy_block_is_structured_by_its_schema() -> None:
    got = deploy_policies(_options(sampler="unipc", samplers=["dpmpp"], cfg_options={"interval": {"start": 0.1}}), "wan")
    assert got == DeployPolicies(sampler="unipc", samplers=("dpmpp",), cfg_options={"interval": {"start": 0.1}})
    assert deploy_policies({}, "wan") == DeployPolicies()


@pytest.mark.parametrize(("policies", "message"), [
    ({"samplr": "unipc"}, r"^policies\.samplr: unknown key"),
    ({"sampler": 3}, r"^policies\.sampler: "),
    ({"samplers": "unipc"}, r"^policies\.samplers"),
    ({"sampler_options": {"unipc": 1}}, r"^policies\.sampler_options\.unipc"),
])
def test_bad_blocks_are_one_line_naming_the_key(policies: dict[str, Any], message: str) -> None:
    with pytest.raises(DeployError, match=message) as info:
        deploy_policies(_options(**policies), "wan")
    assert "\n" not in str(info.value)


def test_a_family_that_takes_no_policies_refuses_them() -> None:
    with pytest.raises(DeployError, match=r"^policies\.sampler: family 'flux' does not take this deploy policy \(it takes: none\)$"):
        deploy_policies(_options(sampler="unipc"), "flux", keys=())


def test_the_menu_is_built_once_per_model_and_key() -> None:
    from omniloop.family import LoadedModel

    model = LoadedModel(family="x", path=None, components={})
    built: list[int] = []

    def build() -> object:
        built.append(1)
        return object()

    assert cached_menu(model, build) is cached_menu(model, build) and len(built) == 1
    other = LoadedModel(family="x", path=None, components={})
    assert cached_menu(other, build, key="t2i") is cached_menu(other, build, key="t2i")
    assert cached_menu(other, build, key="i2i") is not cached_menu(other, build, key="t2i") and len(built) == 3


def test_flux_refuses_a_policies_block(tmp_path) -> None:
    pytest.importorskip("omniloop_flux")
    import omniloop_flux.plugin as flux_plugin
    from omniloop.runtime import Runtime
    from omniloop.testing import make_manager
    from omniloop_flux.tiny import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(tmp_path / "flux")
    with pytest.raises(DeployError, match=r"^policies\.cfg: family 'flux' does not take this deploy policy"):
        Runtime.from_model(ckpt, manager=make_manager(("flux", flux_plugin), toy=False), policies={"cfg": "classic"})
