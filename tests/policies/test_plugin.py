"""The ``policies`` entry point registers every policy through the core plugin manager."""

from __future__ import annotations

from importlib.metadata import entry_points

import omniloop_policies.plugin as plugin
from omniloop.family import PolicySpec
from omniloop.plugins import PluginManager
from omniloop_policies import DenoiseParams, FlowEulerSampler, PolicyMenu
from omniloop_policies.testing import WAN_UNIPC_CONFIG

EXPECTED = {
    "flow-euler": "sampler",
    "unipc": "sampler",
    "dpmpp": "sampler",
    "few-step": "sampler",
    "classic": "cfg",
    "batched": "cfg",
    "embedded": "cfg",
    "interval": "cfg",
    "per-modality": "cfg",
    "adaptive-gate": "cfg",
    "guider": "cfg",
    "constant": "shift",
    "resolution": "shift",
    "single": "router",
    "boundary": "router",
    "precision": "precision",
}


def test_entry_point_is_declared_in_the_plugin_group():
    eps = {ep.name: ep.value for ep in entry_points(group="omniloop.plugins")}
    assert eps["policies"] == "omniloop_policies.plugin"
    assert plugin.OMNILOOP_HOOK_API == ">=1.0,<2"


def test_the_core_manager_registers_every_policy():
    mgr = PluginManager(discover=False)
    rec = mgr.add("policies", plugin, distribution="omniloop-policies")
    assert rec.ok, rec.error
    reg = mgr.registry()
    got = {name: spec.kind for name, spec in reg.policies.items() if reg.providers[("policy", name)] == "policies"}
    assert got == EXPECTED
    assert all(isinstance(s, PolicySpec) and s.description for s in reg.policies.values())
    assert reg.policies["unipc"].params_schema is DenoiseParams


def test_discovery_finds_the_installed_package():
    mgr = PluginManager()
    mgr.discover()
    assert mgr.records["policies"].ok, mgr.records["policies"].error
    assert "unipc" in mgr.registry().policies


def test_registration_does_not_import_diffusers():
    import subprocess
    import sys

    code = (
        "import sys, omniloop_policies.plugin as p; specs=[]; p.omniloop_register_policies(specs.append); "
        "assert len(specs) == 16; print('diffusers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_a_menu_builds_from_the_core_registry():
    mgr = PluginManager(discover=False)
    mgr.add("policies", plugin)
    menu = PolicyMenu.build(WAN_UNIPC_CONFIG, registry=mgr.registry().policies, samplers=["flow-euler"])
    assert isinstance(menu.samplers["flow-euler"], FlowEulerSampler)
    assert menu.default_sampler == "unipc"  # from the checkpoint's scheduler class
