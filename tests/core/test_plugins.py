"""Plugin manager: isolation at discovery, strictness at deploy, versioned hook API, duplicates."""

import pytest

from omniloop.deploy import load_deploy
from omniloop.errors import DeployError, PluginError
from omniloop.family import PolicySpec
from omniloop.hookspecs import HOOK_API_VERSION, hookimpl
from omniloop.plugins import api_supported
from omniloop.runtime import Runtime
from omniloop.testing import make_manager


class PolicyPlugin:
    OMNILOOP_HOOK_API = ">=1.0,<2"

    def __init__(self, name="euler"):
        self.policy = name

    @hookimpl
    def omniloop_register_policies(self, register):
        register(PolicySpec(name=self.policy, kind="sampler", factory=object))


class ExplodingPlugin:
    OMNILOOP_HOOK_API = ">=1.0,<2"

    @hookimpl
    def omniloop_register_policies(self, register):
        register(PolicySpec(name="half", kind="sampler", factory=object))
        raise RuntimeError("boom during registration")


class FuturePlugin:
    OMNILOOP_HOOK_API = ">=9.0"

    @hookimpl
    def omniloop_register_policies(self, register):
        register(PolicySpec(name="future", kind="sampler", factory=object))


class UndeclaredPlugin:
    @hookimpl
    def omniloop_register_policies(self, register):
        pass


@pytest.mark.parametrize("spec, ok", [
    (">=1.0,<2", True), ("==1.0", True), (">=1.1", False), ("<1", False), (">=0.9,!=1.0", False),
])
def test_api_ranges(spec, ok):
    assert api_supported(spec, "1.0") is ok


def test_malformed_range_is_refused_with_message():
    pm = make_manager()
    bad = type("Bad", (), {"OMNILOOP_HOOK_API": "about one"})()
    rec = pm.add("bad", bad)
    assert rec.status == "refused" and "malformed hook-API range" in rec.error


def test_plugin_outside_hook_api_range_is_refused_saying_what_it_needs():
    pm = make_manager(("future", FuturePlugin()), ("undeclared", UndeclaredPlugin()))
    reg = pm.registry()
    assert "future" not in reg.policies
    rec = pm.records["future"]
    assert rec.status == "refused" and ">=9.0" in rec.error and f"provides {HOOK_API_VERSION}" in rec.error
    assert "does not declare OMNILOOP_HOOK_API" in pm.records["undeclared"].error


def test_registration_failure_is_isolated_and_rolled_back():
    pm = make_manager(("exploding", ExplodingPlugin()), ("good", PolicyPlugin()))
    reg = pm.registry()
    assert "euler" in reg.policies and "half" not in reg.policies
    assert pm.records["exploding"].status == "failed"
    assert "boom during registration" in pm.records["exploding"].error
    assert pm.records["good"].provides == {"policy": ["euler"]}


def test_duplicate_registration_names_both_providers():
    pm = make_manager(("first", PolicyPlugin("euler")), ("second", PolicyPlugin("euler")))
    pm.registry()
    err = pm.records["second"].error
    assert "registered twice" in err and "'first'" in err and "'second'" in err


def test_deploy_naming_a_failed_plugin_is_a_hard_error(toy_checkpoint):
    class BrokenObserverPlugin:
        OMNILOOP_HOOK_API = ">=1.0,<2"

        @hookimpl
        def omniloop_register_observers(self, register):
            raise ImportError("missing dependency foo")

    pm = make_manager(("watch", BrokenObserverPlugin()))
    deploy = load_deploy({"model": {"path": str(toy_checkpoint)}, "plugins": {"watch": {}}})
    with pytest.raises(PluginError, match=r"'watch' is named by the deploy config.*missing dependency foo"):
        Runtime(deploy, manager=pm)


def test_unknown_plugin_in_deploy_lists_the_available(toy_checkpoint):
    deploy = load_deploy({"model": {"path": str(toy_checkpoint)}, "plugins": {"nope": {}}})
    with pytest.raises(DeployError, match=r"plugins.nope: no installed interceptor or observer"):
        Runtime(deploy, manager=make_manager())


def test_trace_hooks_env_prints_calls(monkeypatch, capsys):
    monkeypatch.setenv("OMNILOOP_TRACE_HOOKS", "1")
    pm = make_manager(("good", PolicyPlugin()))
    pm.registry()
    err = capsys.readouterr().err
    assert "[omniloop hooks]" in err and "omniloop_register_policies" in err and "euler" in err


# --------------------------------------------------------------------------------------------
# BaseException isolation (issue 14): sys.exit() in a plugin is a failed plugin, not the end
# --------------------------------------------------------------------------------------------


class ExitingRegistrationPlugin:
    OMNILOOP_HOOK_API = ">=1.0,<2"

    @hookimpl
    def omniloop_register_policies(self, register):
        register(PolicySpec(name="half-exit", kind="sampler", factory=object))
        raise SystemExit(3)


class InterruptedPlugin:
    OMNILOOP_HOOK_API = ">=1.0,<2"

    @hookimpl
    def omniloop_register_policies(self, register):
        raise KeyboardInterrupt


def _entry_point_package(root, group, name, body):
    """A distribution on ``root`` (dist-info + module) whose entry point in ``group`` runs ``body`` at import."""
    import textwrap

    mod = f"omniloop_test_{name.replace('-', '_')}"
    (root / f"{mod}.py").write_text(textwrap.dedent(body))
    info = root / f"{mod}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {mod.replace('_', '-')}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{name} = {mod}\n")


@pytest.fixture
def exiting_entry_points(tmp_path, monkeypatch):
    """Entry points in a private group: one calls sys.exit at import, one fails an assert, one is healthy."""
    import sys

    group = f"omniloop.test-exit-{tmp_path.name}"
    _entry_point_package(tmp_path, group, "exit-at-import", "import sys\nsys.exit(7)\n")
    _entry_point_package(tmp_path, group, "assert-at-import", "assert False, 'plugin self-check failed'\n")
    _entry_point_package(tmp_path, group, "healthy", """
        from omniloop.family import PolicySpec
        from omniloop.hookspecs import hookimpl

        OMNILOOP_HOOK_API = ">=1.0,<2"

        @hookimpl
        def omniloop_register_policies(register):
            register(PolicySpec(name="healthy-sampler", kind="sampler", factory=object))
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield group
    for name in list(sys.modules):
        if name.startswith("omniloop_test_"):
            del sys.modules[name]


def test_a_plugin_calling_sys_exit_at_import_is_listed_failed_and_named(exiting_entry_points):
    from omniloop.plugins import PluginManager

    manager = PluginManager(group=exiting_entry_points)
    records = {r.name: r for r in manager.discover()}
    bad = records["exit-at-import"]
    assert bad.status == "failed"
    assert "SystemExit" in bad.error and "sys.exit(7)" in bad.error and "exit-at-import" in bad.error
    assert records["assert-at-import"].status == "failed" and "AssertionError" in records["assert-at-import"].error
    assert records["healthy"].ok
    assert "healthy-sampler" in manager.registry().policies


def test_every_cli_command_works_next_to_a_plugin_that_exits(exiting_entry_points):
    from click.testing import CliRunner

    from omniloop.plugins import PluginManager
    from omniloop_cli import cli

    manager = PluginManager(group=exiting_entry_points)
    for args in (["--help"], ["plugins"], ["hooks"], ["generate", "--help"]):
        res = CliRunner().invoke(cli, args, obj=manager)
        assert res.exit_code == 0, (args, res.output)
        assert res.output.strip()
    import json

    listing = json.loads(CliRunner().invoke(cli, ["plugins", "--json"], obj=manager).stdout)
    bad = {p["name"]: p for p in listing["plugins"]}["exit-at-import"]
    assert bad["status"] == "failed" and "sys.exit(7)" in bad["error"]


def test_sys_exit_in_a_register_hook_is_isolated_and_rolled_back():
    manager = make_manager(("exits", ExitingRegistrationPlugin()), ("good", PolicyPlugin()))
    reg = manager.registry()
    rec = manager.records["exits"]
    assert rec.status == "failed" and "SystemExit" in rec.error and "'exits'" in rec.error
    assert "half-exit" not in reg.policies and "euler" in reg.policies


def test_keyboard_interrupt_in_a_plugin_still_stops_the_process():
    manager = make_manager(("ctrl-c", InterruptedPlugin()))
    with pytest.raises(KeyboardInterrupt):
        manager.registry()


class CountingPlugin:
    """Registers a policy and a run option, counting the calls of each hook."""

    OMNILOOP_HOOK_API = ">=1.0,<2"

    def __init__(self):
        self.calls = {"policies": 0, "run_options": 0}

    @hookimpl
    def omniloop_register_policies(self, register):
        self.calls["policies"] += 1
        register(PolicySpec(name="counted", kind="sampler", factory=object))

    @hookimpl
    def omniloop_register_run_options(self, register):
        from omniloop.family import RunOptionSpec

        self.calls["run_options"] += 1
        register(RunOptionSpec(name="counted-flag", enable=lambda deploy, path: deploy))


def test_registered_calls_one_hook_and_registry_fills_the_rest_once():
    """``PluginManager.registered(hook)`` (how ``omniloop generate`` reads its plugin flags without
    importing every family): only that hook runs; ``registry()`` later calls the others, not it again."""
    pm = make_manager()
    plugin = CountingPlugin()
    pm.add("counting", plugin)
    part = pm.registered("omniloop_register_run_options")
    assert list(part.run_options) == ["counted-flag"] and "counted" not in part.policies
    assert plugin.calls == {"policies": 0, "run_options": 1}
    assert pm.registered("omniloop_register_run_options") is part and plugin.calls["run_options"] == 1
    full = pm.registry()
    assert "counted" in full.policies and list(full.run_options) == ["counted-flag"]
    assert plugin.calls == {"policies": 1, "run_options": 1}
    assert pm.registered("omniloop_register_policies") is full  # after registry(): the full one
    assert pm.records["counting"].provides == {"run_option": ["counted-flag"], "policy": ["counted"]}
