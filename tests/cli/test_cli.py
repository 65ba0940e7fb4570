"""The ``omniloop`` command, driven in-process with click's CliRunner.

Every test passes an isolated plugin manager as the click context object
(``runner.invoke(cli, args, obj=manager)``): core + the toy family + an inline serial scheduler,
plus whatever in-test plugins it adds. Nothing is discovered from the environment.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import click
import pytest
from click.testing import CliRunner, Result

from omniloop.hookspecs import HOOK_API_VERSION, OBSERVER_EVENTS, REGISTRATION_HOOKS, hookimpl
from omniloop.testing import PassThroughSteps, component_plugin, make_manager
from omniloop_cli import cli


def invoke(args: list[str], manager: Any = None, **kw: Any) -> Result:
    return CliRunner().invoke(cli, args, obj=manager if manager is not None else make_manager(), **kw)


def one_error_line(res: Result) -> str:
    """The CLI's error contract: exactly one line on stderr, starting with ``error:``, no traceback."""
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.output
    return lines[0]


# --------------------------------------------------------------------------------------------
# in-test plugins
# --------------------------------------------------------------------------------------------


@attrs.define(frozen=True)
class CounterParams:
    scale: float = attrs.field(default=1.0, metadata={"ge": 0.0})


class CountingStepInterceptor(PassThroughSteps):
    """Passes every forward through, counting them per (request, branch)."""

    name = "counter"

    def open(self, step: Any, loop: Any, params: Any = None) -> dict[str, int]:
        return {"forwards": 0}

    def forward(self, step: Any, state: Any, inputs: Any, compute: Any) -> Any:
        state["forwards"] += 1
        return compute()

    def metrics(self, state: Any) -> dict[str, Any]:
        return dict(state)


def counter_plugin() -> Any:
    return component_plugin("counter", "step_interceptor", CountingStepInterceptor, params_schema=CounterParams)


class FailingInterceptor(CountingStepInterceptor):
    name = "fails"

    def forward(self, step: Any, state: Any, inputs: Any, compute: Any) -> Any:
        if step.step_index == 1:
            raise RuntimeError("kernel exploded")
        return compute()


def failing_plugin() -> Any:
    return component_plugin("fails", "step_interceptor", FailingInterceptor)


class CommandsPlugin:
    """Adds an ``omniloop parity ...`` group, like the parity observer package does."""

    OMNILOOP_HOOK_API = ">=1.0,<2"

    @hookimpl
    def omniloop_register_commands(self, cli: Any) -> None:
        @cli.group("parity")
        def parity() -> None:
            """Parity tools (test plugin)."""

        @parity.command("hello")
        @click.pass_obj
        def hello(manager: Any) -> None:
            click.echo(f"hello from parity; manager has {len(manager.records)} plugins")

        @cli.command("explode")
        def explode() -> None:
            raise RuntimeError("boom")


class BrokenCommandsPlugin:
    OMNILOOP_HOOK_API = ">=1.0,<2"

    @hookimpl
    def omniloop_register_commands(self, cli: Any) -> None:
        raise ValueError("cannot build my commands")


class BrokenRegistrationPlugin:
    OMNILOOP_HOOK_API = ">=1.0,<2"

    @hookimpl
    def omniloop_register_families(self, register: Any) -> None:
        raise RuntimeError("registration exploded")


class FutureApiPlugin:
    OMNILOOP_HOOK_API = ">=9"


@pytest.fixture
def cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


# --------------------------------------------------------------------------------------------
# plugins / hooks
# --------------------------------------------------------------------------------------------


def test_plugins_json_lists_core_and_toy() -> None:
    res = invoke(["plugins", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["hook_api_version"] == HOOK_API_VERSION
    by_name = {p["name"]: p for p in doc["plugins"]}
    assert by_name["core"]["status"] == "ok"
    assert by_name["core"]["distribution"] == "omniloop"
    assert by_name["core"]["provides"]["attention_backend"] == ["sdpa"]
    assert by_name["toy"]["provides"]["family"] == ["toy"]


def test_plugins_table_shows_what_each_registers() -> None:
    res = invoke(["plugins"])
    assert res.exit_code == 0, res.output
    assert "core" in res.stdout and "sdpa" in res.stdout and "toy" in res.stdout


def test_plugins_lists_broken_plugins_with_their_error_and_exits_0() -> None:
    manager = make_manager(
        ("future", FutureApiPlugin()), ("bad-registration", BrokenRegistrationPlugin()),
        ("bad-commands", BrokenCommandsPlugin()),
    )
    res = invoke(["plugins", "--json"], manager)
    assert res.exit_code == 0, res.output
    by_name = {p["name"]: p for p in json.loads(res.stdout)["plugins"]}
    assert by_name["future"]["status"] == "refused"
    assert ">=9" in by_name["future"]["error"]
    assert by_name["bad-registration"]["status"] == "failed"
    assert "registration exploded" in by_name["bad-registration"]["error"]
    assert by_name["bad-commands"]["status"] == "failed"
    assert "cannot build my commands" in by_name["bad-commands"]["error"]
    assert by_name["toy"]["status"] == "ok"
    table = invoke(["plugins"], manager)
    assert table.exit_code == 0 and "refused" in table.stdout and "failed" in table.stdout


def test_hooks_json_lists_every_hook_with_signature_and_version() -> None:
    res = invoke(["hooks", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["hook_api_version"] == HOOK_API_VERSION
    names = [h["name"] for h in doc["hooks"]]
    assert names == [*REGISTRATION_HOOKS, *OBSERVER_EVENTS]
    fam = doc["hooks"][0]
    assert fam["signature"] == (
        "omniloop_register_families(register: collections.abc.Callable[[omniloop.family.Family], None]) -> None"
    )  # typed hooks (issue 15): the signature carries the real types
    since = {h["name"]: h["since"] for h in doc["hooks"]}
    assert since["omniloop_register_run_options"] == "1.1"  # added in hook API 1.1 (issue 15)
    assert since["omniloop_register_linear_precisions"] == "1.2"  # added in hook API 1.2 (issue 19)
    assert since["omniloop_register_runtime_loaders"] == "1.3"  # added in hook API 1.3 (issue 34)
    assert since["omniloop_register_mechanisms"] == "1.4"  # added in hook API 1.4 (issue 34)
    later = ("omniloop_register_run_options", "omniloop_register_linear_precisions", "omniloop_register_runtime_loaders",
             "omniloop_register_mechanisms")
    assert all(v == "1.0" for k, v in since.items() if k not in later)
    assert all(h["summary"] for h in doc["hooks"])


def test_hooks_table() -> None:
    res = invoke(["hooks"])
    assert res.exit_code == 0, res.output
    assert "omniloop_step_end" in res.stdout and HOOK_API_VERSION in res.stdout


# --------------------------------------------------------------------------------------------
# plugin subcommands
# --------------------------------------------------------------------------------------------


def test_plugin_subcommand_group_appears_and_runs() -> None:
    manager = make_manager(("parity-tools", CommandsPlugin()))
    helptext = invoke(["--help"], manager)
    assert helptext.exit_code == 0 and "parity" in helptext.stdout
    res = invoke(["parity", "hello"], manager)
    assert res.exit_code == 0, res.output
    assert "hello from parity" in res.stdout


def test_plugin_commands_do_not_leak_between_managers() -> None:
    invoke(["--help"], make_manager(("parity-tools", CommandsPlugin())))
    res = invoke(["--help"])
    assert "parity" not in res.stdout


def test_a_plugin_whose_command_hook_fails_breaks_nothing() -> None:
    manager = make_manager(("bad-commands", BrokenCommandsPlugin()), ("parity-tools", CommandsPlugin()))
    assert invoke(["--help"], manager).exit_code == 0
    assert invoke(["parity", "hello"], manager).exit_code == 0
    assert invoke(["generate", "--help"], manager).exit_code == 0


def test_unexpected_errors_are_one_line_exit_1_and_traceback_with_debug(monkeypatch: pytest.MonkeyPatch) -> None:
    manager = make_manager(("parity-tools", CommandsPlugin()))
    res = invoke(["explode"], manager)
    assert res.exit_code == 1
    assert "RuntimeError: boom" in one_error_line(res)
    res = invoke(["--debug", "explode"], manager)
    assert isinstance(res.exception, RuntimeError)
    monkeypatch.setenv("OMNILOOP_DEBUG", "1")
    assert isinstance(invoke(["explode"], manager).exception, RuntimeError)


# --------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------


def test_generate_writes_an_mp4_under_out_by_default(cwd: Path, toy_checkpoint: Path) -> None:
    res = invoke(["generate", "a blue square moving right", "--model", str(toy_checkpoint), "--steps", "3", "--seed", "7"])
    assert res.exit_code == 0, res.output
    videos = list((cwd / "out").glob("*.mp4"))
    assert len(videos) == 1 and videos[0].stat().st_size > 0
    assert f"wrote out/{videos[0].name}" in res.stdout
    assert "completed" in res.stdout and "3 steps" in res.stdout and "seed 7" in res.stdout
    assert "denoise" in res.stderr  # the progress display, per node
    assert not list((cwd / "out").glob("*.latents.pt"))


def test_generate_json_prints_output_metadata(cwd: Path, toy_checkpoint: Path) -> None:
    res = invoke([
        "generate", "a red fox", "--model", str(toy_checkpoint), "--steps", "2", "--frames", "2",
        "--height", "8", "--width", "12", "--seed", "1", "--out", "clips/fox.mp4", "--json",
    ])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["status"] == "completed"
    assert doc["output_path"] == "clips/fox.mp4" and (cwd / "clips" / "fox.mp4").is_file()
    assert doc["artifacts"]["video"]["frames"]["shape"] == [2, 8, 12, 3]
    assert doc["metrics"]["steps"] == 2 and doc["metrics"]["seed"] == 1
    assert doc["compute"] == {"dtype": "float32", "attention_backend": "sdpa", "linear_precision": "dtype",
                              "compile": False}


def test_summary_names_compute_settings_that_differ_from_the_defaults() -> None:
    """A run on FP8 linears (or another attention backend, or compiled) says so in its summary;
    a default run prints no compute line."""
    import io
    import types

    from rich.console import Console

    from omniloop_cli.output import compute_settings, summarize

    out = types.SimpleNamespace(metrics={"total_seconds": 1.0, "steps": 2}, status=types.SimpleNamespace(value="completed"),
                                ok=True, artifacts={})
    deploy = types.SimpleNamespace(dtype="bfloat16", attention_backend="cudnn-fp8", linear_precision="fp8", compile=True)
    for settings, line in [
        (compute_settings(types.SimpleNamespace(deploy=deploy)), "compute: attention cudnn-fp8 · linears fp8 · compile"),
        ({"dtype": "float32", "attention_backend": "sdpa", "linear_precision": "dtype", "compile": False}, None),
        (compute_settings(types.SimpleNamespace(deploy=types.SimpleNamespace(
            dtype="bfloat16", attention_backend="sdpa", linear_precision="fp8", compile=False,
            linear_precision_options={"keep": ["*.to_v", "*.add_v_proj"]}))),
         "compute: linears fp8 keep=[*.to_v, *.add_v_proj]"),
    ]:
        buf = io.StringIO()
        summarize(Console(file=buf, width=200), out, {}, 0.5, settings)
        text = buf.getvalue()
        assert (line in text) if line else ("compute:" not in text), text


def test_generate_same_seed_same_video(cwd: Path, toy_checkpoint: Path) -> None:
    for name in ("a.mp4", "b.mp4"):
        assert invoke(["generate", "x", "--model", str(toy_checkpoint), "--seed", "3", "--out", name]).exit_code == 0
    assert (cwd / "a.mp4").read_bytes() == (cwd / "b.mp4").read_bytes()


def test_generate_t2i_writes_a_png_and_latents(cwd: Path, toy_checkpoint: Path) -> None:
    res = invoke([
        "generate", "a cat", "--model", str(toy_checkpoint), "--task", "t2i", "--frames", "1",
        "--return-latents", "--json",
    ])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    out = Path(doc["output_path"])
    assert out.suffix == ".png" and out.parent.name == "out" and (cwd / out).is_file()
    assert (cwd / doc["files"]["latents"]).is_file()


def test_generate_with_deploy_file_and_plugin_params(cwd: Path, toy_checkpoint: Path) -> None:
    deploy = cwd / "deploy.yaml"
    deploy.write_text(f"model: {{path: {toy_checkpoint}}}\nplugins:\n  counter: {{}}\n")
    manager = make_manager(("counter", counter_plugin()))
    res = invoke([
        "generate", "a fox", "--deploy", str(deploy), "--steps", "3", "--guidance", "1.0",
        "--plugin-param", "counter.scale=2", "--json",
    ], manager)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["metrics"]["plugins"]["counter"]["cond"] == {"forwards": 3}
    human = invoke(["generate", "a fox", "--deploy", str(deploy), "--steps", "2"], manager)
    assert human.exit_code == 0 and "plugin counter" in human.stdout and "forwards=2" in human.stdout


def test_a_request_that_fails_while_running_exits_1_naming_node_and_step(cwd: Path, toy_checkpoint: Path) -> None:
    deploy = cwd / "deploy.json"
    deploy.write_text(json.dumps({"model": {"path": str(toy_checkpoint)}, "plugins": {"fails": {}}}))
    res = invoke(["generate", "x", "--deploy", str(deploy), "--steps", "3", "--json"], make_manager(("fails", failing_plugin())))
    assert res.exit_code == 1
    doc = json.loads(res.stdout)
    assert doc["status"] == "failed" and doc["output_path"] is None
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]  # after the progress display
    assert len(errors) == 1 and "Traceback" not in res.stderr
    assert "failed in node 'denoise' at step 1" in errors[0] and "kernel exploded" in errors[0]
    assert not (cwd / "out").exists()


def test_model_flag_overrides_the_deploy_file(cwd: Path, toy_checkpoint: Path) -> None:
    deploy = cwd / "deploy.json"
    deploy.write_text(json.dumps({"model": {"preset": "does-not-exist"}, "dtype": "float32"}))
    res = invoke(["generate", "x", "--deploy", str(deploy), "--model", str(toy_checkpoint), "--steps", "1"])
    assert res.exit_code == 0, res.output


# --------------------------------------------------------------------------------------------
# bad input: exit 2, one line naming the field, before any compute
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        (["--steps", "-1"], "diffusion.steps"),
        (["--steps", "abc"], "diffusion.steps"),
        (["--steps", "2.5"], "diffusion.steps"),
        (["--guidance", "lots"], "diffusion.guidance_scale"),
        (["--seed", "-3"], "diffusion.seed"),
        (["--task", "t9v"], "task"),
        (["--task", "i2v"], "task"),  # a real task the toy family does not do
        (["--plugin-param", "cache-dit.Fn=8"], "plugin_params.cache-dit"),  # not enabled
        (["--height", "15"], "diffusion.height"),  # the family's own check
        (["--steps", "100000"], "diffusion.steps"),  # deploy limit
    ],
)
def test_bad_requests_exit_2_with_one_line_naming_the_field(
    cwd: Path, toy_checkpoint: Path, extra: list[str], field: str
) -> None:
    res = invoke(["generate", "x", "--model", str(toy_checkpoint), *extra])
    assert res.exit_code == 2, res.output
    assert one_error_line(res).startswith(f"error: {field}: ")
    assert not (cwd / "out").exists()


def test_unknown_key_for_an_enabled_plugin_names_the_field(cwd: Path, toy_checkpoint: Path) -> None:
    deploy = cwd / "deploy.toml"
    deploy.write_text(f'[model]\npath = "{toy_checkpoint}"\n[plugins.counter]\n')
    manager = make_manager(("counter", counter_plugin()))
    res = invoke(["generate", "x", "--deploy", str(deploy), "--plugin-param", "counter.bogus=1"], manager)
    assert res.exit_code == 2
    assert one_error_line(res).startswith("error: plugin_params.counter.bogus: unknown key")
    res = invoke(["generate", "x", "--deploy", str(deploy), "--plugin-param", "counter.scale=\"big\""], manager)
    assert res.exit_code == 2
    assert one_error_line(res).startswith("error: plugin_params.counter.scale: ")


def test_request_is_validated_before_the_model_is_loaded(cwd: Path) -> None:
    res = invoke(["generate", "x", "--model", "./no/such/checkpoint", "--steps", "0"])
    assert res.exit_code == 2
    assert one_error_line(res).startswith("error: diffusion.steps: ")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "./no/such/checkpoint"], "model.path"),
        (["--model", "no-such-preset"], "unknown model preset 'no-such-preset'"),
        (["--model", "{ck}", "--dtype", "float64"], "dtype"),
        (["--model", "{ck}", "--device", "cuda:7"] , "device"),
        (["--model", "{ck}", "--out", "x.gif"], "--out"),
        (["--model", "{ck}", "--out", "x.png"], "--out"),  # a t2v request makes a video
        (["--model", "{ck}", "--plugin-param", "nodot=1"], "--plugin-param"),
        (["--model", "{ck}", "--bogus-flag"], "--bogus-flag"),
        (["--model", "{ck}", "--image", "no/such/image.png"], "--image"),
        ([], "--model"),
    ],
)
def test_bad_flags_and_deployments_exit_2_with_one_line(
    cwd: Path, toy_checkpoint: Path, args: list[str], needle: str
) -> None:
    args = [a.replace("{ck}", str(toy_checkpoint)) for a in args]
    res = invoke(["generate", "x", *args])
    assert res.exit_code == 2, res.output
    assert needle in one_error_line(res)


def test_a_bad_deploy_file_names_the_file_and_field(cwd: Path, toy_checkpoint: Path) -> None:
    deploy = cwd / "deploy.yaml"
    deploy.write_text(f"model: {{path: {toy_checkpoint}}}\nschedulr: serial\n")
    res = invoke(["generate", "x", "--deploy", str(deploy)])
    assert res.exit_code == 2
    line = one_error_line(res)
    assert "deploy.yaml" in line and "schedulr" in line


def test_a_deploy_naming_an_unknown_plugin_is_a_clear_error(cwd: Path, toy_checkpoint: Path) -> None:
    deploy = cwd / "deploy.json"
    deploy.write_text(json.dumps({"model": {"path": str(toy_checkpoint)}, "plugins": {"nope": {}}}))
    res = invoke(["generate", "x", "--deploy", str(deploy)])
    assert res.exit_code == 2
    assert "plugins.nope" in one_error_line(res)


def test_docs_hooks_md_is_what_hooks_markdown_prints() -> None:
    """docs/hooks.md is generated; regenerate with ``omniloop hooks --markdown > docs/hooks.md``."""
    docs = Path(__file__).resolve().parents[2] / "docs" / "hooks.md"
    res = invoke(["hooks", "--markdown"])
    assert res.exit_code == 0
    assert res.stdout == docs.read_text(encoding="utf-8")


def test_generate_profile_prints_a_table_and_writes_json(cwd: Path, toy_checkpoint: Path) -> None:
    from omniloop_profiler import plugin as profiler_plugin

    res = invoke(["generate", "a red fox", "--model", str(toy_checkpoint), "--steps", "3", "--profile", "--out", "fox.mp4"],
                 make_manager(("profiler", profiler_plugin)))
    assert res.exit_code == 0, res.output
    assert "denoise" in res.stdout and "steps" in res.stdout
    report = json.loads((cwd / "fox.profile.json").read_text())
    assert report["status"] == "completed" and report["step_summary"]["denoise"]["count"] == 3


def test_generate_profile_without_the_profiler_says_what_to_install(cwd: Path, toy_checkpoint: Path) -> None:
    res = invoke(["generate", "x", "--model", str(toy_checkpoint), "--profile"])
    assert res.exit_code == 2
    assert "pip install omniloop-profiler" in one_error_line(res)


# --------------------------------------------------------------------------------------------
# issue 14: refused before loading, Ctrl-C, image files
# --------------------------------------------------------------------------------------------


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading the toy model fails the test: what is checked here must be checked before."""
    from omniloop.testing import ToyFamily

    def load(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(ToyFamily, "load", load)


@pytest.mark.parametrize(
    ("extra", "prompt", "field"),
    [
        (["--steps", "100000"], "x", "diffusion.steps"),  # over the deploy's limit
        (["--height", "7"], "x", "diffusion.height"),  # the family's check, on the inspected config
        ([], "", "inputs"),  # empty prompt
        ([], "   ", "inputs"),
        (["--guidance", "NaN"], "x", "diffusion.guidance_scale"),
        (["--guidance", "Infinity"], "x", "diffusion.guidance_scale"),
        (["--fps", "1e-300"], "x", "diffusion.fps"),
        (["--seed", "9" * 5000], "x", "diffusion.seed"),
        (["--task", "i2v"], "x", "task"),
    ],
)
def test_request_checks_that_need_no_weights_run_before_loading(
    cwd: Path, toy_checkpoint: Path, no_weights: None, extra: list[str], prompt: str, field: str
) -> None:
    res = invoke(["generate", prompt, "--model", str(toy_checkpoint), *extra])
    assert res.exit_code == 2, res.output
    line = one_error_line(res)
    assert line.startswith(f"error: {field}: ") and len(line) < 300
    assert not (cwd / "out").exists()


def test_an_unknown_plugin_param_key_is_refused_before_loading(cwd: Path, toy_checkpoint: Path, no_weights: None) -> None:
    deploy = cwd / "deploy.toml"
    deploy.write_text(f'[model]\npath = "{toy_checkpoint}"\n[plugins.counter]\n')
    res = invoke(["generate", "x", "--deploy", str(deploy), "--plugin-param", "counter.bogus=1"],
                 make_manager(("counter", counter_plugin())))
    assert res.exit_code == 2
    assert one_error_line(res).startswith("error: plugin_params.counter.bogus: unknown key")


@pytest.mark.parametrize("out", ["/proc/nope/x.mp4", "/proc/x.mp4", "{ck}/toy.pt/x.mp4", "/proc/nope/"])
def test_an_unwritable_out_fails_before_loading(cwd: Path, toy_checkpoint: Path, no_weights: None, out: str) -> None:
    res = invoke(["generate", "x", "--model", str(toy_checkpoint), "--out", out.replace("{ck}", str(toy_checkpoint))])
    assert res.exit_code == 2, res.output
    assert "--out" in one_error_line(res)
    assert not [p for p in cwd.iterdir() if p.name != toy_checkpoint.name], "nothing is left behind"


def test_an_unwritable_out_folder_fails_before_loading(cwd: Path, toy_checkpoint: Path, no_weights: None) -> None:
    import os

    if os.geteuid() == 0:
        pytest.skip("root can write into a read-only folder")
    ro = cwd / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        res = invoke(["generate", "x", "--model", str(toy_checkpoint), "--out", str(ro / "sub" / "x.mp4")])
    finally:
        ro.chmod(0o700)
    assert res.exit_code == 2 and "--out" in one_error_line(res)


class InterruptingInterceptor(CountingStepInterceptor):
    name = "ctrl-c"

    def forward(self, step: Any, state: Any, inputs: Any, compute: Any) -> Any:
        raise KeyboardInterrupt


def interrupting_plugin() -> Any:
    return component_plugin("ctrl-c", "step_interceptor", InterruptingInterceptor)


def test_ctrl_c_exits_130_and_writes_nothing(cwd: Path, toy_checkpoint: Path) -> None:
    deploy = cwd / "deploy.json"
    deploy.write_text(json.dumps({"model": {"path": str(toy_checkpoint)}, "plugins": {"ctrl-c": {}}}))
    res = invoke(["generate", "x", "--deploy", str(deploy), "--out", "clip.mp4"], make_manager(("ctrl-c", interrupting_plugin())))
    assert res.exit_code == 130, res.output
    assert "interrupted" in res.stderr and "Traceback" not in res.output
    assert not (cwd / "clip.mp4").exists()


class ToImage:
    def forward(self, ctx: Any, state: Any) -> None:
        from omniloop.artifacts import Image, VideoFrames

        state.write("image", Image(pixels=state.read("video", VideoFrames).frames[0]), ctx.node.name)


class ImageToyPlugin:
    """The toy family as an image family: its t2i output is an ``Image`` artifact."""

    OMNILOOP_HOOK_API = ">=1.0,<2"

    @hookimpl
    def omniloop_register_families(self, register: Any) -> None:
        import attrs as _attrs

        from omniloop.artifacts import Image, VideoFrames
        from omniloop.graph import Node
        from omniloop.request import TaskType
        from omniloop.testing import ToyFamily

        class ImageToyFamily(ToyFamily):
            name = "toy-image"
            tasks = frozenset({TaskType.T2I})

            def build_pipeline(self, model: Any, task: Any, options: Any) -> Any:
                spec = super().build_pipeline(model, task, options)
                nodes = (*spec.nodes, Node("to_image", ToImage(), reads={"video": VideoFrames}, writes={"image": Image}))
                return _attrs.evolve(spec, nodes=nodes, outputs={"image": "image"})

        register(ImageToyFamily())


@pytest.mark.parametrize("suffix", [".png", ".webp"])
def test_an_image_output_is_written_as_an_image_file(cwd: Path, toy_checkpoint: Path, suffix: str) -> None:
    import numpy as np
    from PIL import Image as PILImage

    deploy = cwd / "deploy.json"
    deploy.write_text(json.dumps({"model": {"path": str(toy_checkpoint), "family": "toy-image"}}))
    manager = make_manager(("toy-image", ImageToyPlugin()))
    res = invoke(["generate", "a cat", "--deploy", str(deploy), "--task", "t2i", "--seed", "3",
                  "--out", f"cat{suffix}", "--json"], manager)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["artifacts"]["image"]["type"] == "Image" and doc["output_path"] == f"cat{suffix}"
    with PILImage.open(cwd / f"cat{suffix}") as img:
        assert img.format == {".png": "PNG", ".webp": "WEBP"}[suffix]
        pixels = np.asarray(img.convert("RGB"))
    assert list(pixels.shape) == doc["artifacts"]["image"]["pixels"]["shape"]
    default = invoke(["generate", "a cat", "--deploy", str(deploy), "--task", "t2i", "--seed", "3", "--json"], manager)
    out = Path(json.loads(default.stdout)["output_path"])
    assert out.suffix == ".png" and out.parent.name == "out"
    with PILImage.open(cwd / out) as png:
        assert (np.asarray(png.convert("RGB")) == pixels).all()  # webp is written lossless


def test_a_video_cannot_go_to_a_webp(cwd: Path, toy_checkpoint: Path) -> None:
    res = invoke(["generate", "x", "--model", str(toy_checkpoint), "--out", "x.webp"])
    assert res.exit_code == 2 and "--out" in one_error_line(res)


def test_ctrl_c_while_plugins_are_discovered_exits_130(monkeypatch: pytest.MonkeyPatch) -> None:
    manager = make_manager()

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(manager, "register_commands", interrupted)
    res = invoke(["no-such-command"], manager)
    assert res.exit_code == 130 and "interrupted" in res.stderr
