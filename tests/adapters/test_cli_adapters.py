"""``omniloop generate --adapter NAME[=SCALE]`` and ``omniloop adapters`` on a tiny Wan deployment."""

from __future__ import annotations

import json
from typing import Any

import torch
from click.testing import CliRunner, Result

import omniloop_adapters.plugin as adapters_plugin
import omniloop_wan.plugin as wan_plugin
from omniloop.runtime import Runtime
from omniloop.testing import make_manager
from omniloop_cli import cli


def invoke(args: list[str]) -> Result:
    return CliRunner().invoke(cli, args, obj=make_manager(("wan", wan_plugin), ("adapters", adapters_plugin), toy=False))


def one_error_line(res: Result, *fragments: str) -> None:
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def deploy_file(tmp_path: Any, wan_setup: dict[str, Any]) -> str:
    path = tmp_path / "deploy.json"
    path.write_text(json.dumps({"model": {"path": str(wan_setup["ckpt"])},
                                "adapters": {"a": str(wan_setup["a"]), "b": str(wan_setup["b"])}}))
    return str(path)


def test_generate_with_adapters_equals_the_python_api(wan_setup, tmp_path):
    dep = deploy_file(tmp_path, wan_setup)
    flags = ["--steps", "2", "--seed", "5", "--frames", "5", "--height", "32", "--width", "32"]
    res = invoke(["generate", "a red fox", "--deploy", dep, *flags, "--adapter", "a=0.8", "--adapter", "b",
                  "--return-latents", "--out", str(tmp_path / "o.mp4")])
    assert res.exit_code == 0, res.output
    got = torch.load(tmp_path / "o.latents.pt")
    rt = Runtime.from_deploy(dep, manager=make_manager(("wan", wan_plugin), ("adapters", adapters_plugin), toy=False))
    out = rt.generate({"task": "t2v", "prompt": "a red fox", "outputs": {"return_latents": True},
                       "diffusion": {"steps": 2, "seed": 5, "frames": 5, "height": 32, "width": 32},
                       "adapters": [{"name": "a", "scale": 0.8}, {"name": "b", "scale": 1.0}]})
    want = out.artifacts["latents"].tensor
    assert torch.equal(got if isinstance(got, torch.Tensor) else got["latents"], want)


def test_generate_refuses_undeclared_adapters_before_loading(wan_setup, tmp_path):
    dep = deploy_file(tmp_path, wan_setup)
    one_error_line(invoke(["generate", "x", "--deploy", dep, "--adapter", "zzz"]), "adapters.0.name", "'zzz'", "declares: a, b")
    one_error_line(invoke(["generate", "x", "--deploy", dep, "--adapter", "a=lots"]), "--adapter a", "number")
    one_error_line(invoke(["generate", "x", "--deploy", dep, "--adapter", "a=nan"]), "finite")
    one_error_line(invoke(["generate", "x", "--deploy", dep, "--adapter", "../etc=1"]), "adapters.0.name")


def test_adapters_command_lists_the_deployment(wan_setup, tmp_path):
    dep = deploy_file(tmp_path, wan_setup)
    res = invoke(["adapters", "--deploy", dep, "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["adapters"]
    assert [r["name"] for r in rows] == ["a", "b"] and rows[1]["path"] == str(wan_setup["b"])
    res = invoke(["adapters", "--deploy", dep, "--load", "--json"])
    rows = json.loads(res.stdout)["adapters"]
    assert rows[0]["rank"] == 4 and rows[1]["rank"] == 2 and rows[0]["layout"] == "diffusers"
    res = invoke(["adapters", "--deploy", dep])
    assert res.exit_code == 0 and res.stdout.splitlines()[0].startswith("a\t")
