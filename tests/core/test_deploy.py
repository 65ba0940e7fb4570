"""Deploy config files: YAML, TOML, JSON; errors name the file and field."""

import json

import pytest

from omniloop.deploy import load_deploy
from omniloop.errors import DeployError


def test_loads_all_three_formats(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps({"model": {"preset": "wan-demo"}, "limits": {"max_steps": 10}}))
    (tmp_path / "d.toml").write_text('[model]\npreset = "wan-demo"\n[limits]\nmax_steps = 10\n')
    (tmp_path / "d.yaml").write_text("model: {preset: wan-demo}\nlimits: {max_steps: 10}\n")
    cfgs = [load_deploy(tmp_path / f"d.{ext}") for ext in ("json", "toml", "yaml")]
    assert cfgs[0] == cfgs[1] == cfgs[2]
    assert cfgs[0].limits.max_steps == 10 and cfgs[0].model.preset == "wan-demo"


@pytest.mark.parametrize("text, words", [
    ("model: {preset: x}\nlimits: {max_stepz: 3}\n", "limits.max_stepz: unknown key"),
    ("dtype: float8\n", "dtype: must be one of"),
    ("limits: {max_steps: 0}\n", "limits.max_steps: must be >= 1"),
    ("plugins: {cache-dit: 3}\n", "plugins"),
    ("model: [1, 2\n", "cannot parse"),
])
def test_bad_deploy_files_name_file_and_field(tmp_path, text, words):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(DeployError) as err:
        load_deploy(f)
    assert str(f) in str(err.value) and words in str(err.value)


def test_missing_and_unknown_type(tmp_path):
    with pytest.raises(DeployError, match="not found"):
        load_deploy(tmp_path / "nope.yaml")
    (tmp_path / "d.ini").write_text("x")
    with pytest.raises(DeployError, match="unknown deploy file type"):
        load_deploy(tmp_path / "d.ini")


def test_deploy_errors_never_echo_a_huge_value():
    from omniloop.runtime import Deployment
    from omniloop.testing import make_manager

    with pytest.raises(DeployError) as err:
        Deployment({"model": {"preset": "p" * (1 << 20)}}, manager=make_manager())
    assert "unknown model preset" in str(err.value) and len(str(err.value)) <= 2000


def test_yaml_alias_expansion_is_bounded(tmp_path) -> None:
    """Issue 43, finding 8: nine nested levels of ten aliases (10**9 values once expanded) are
    refused at once with one message; a deploy using a few anchors still loads."""
    import pytest

    from omniloop.deploy import load_deploy
    from omniloop.errors import DeployError

    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    lines.append("options: {bomb: *a9}")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    with pytest.raises(DeployError, match="aliases are expanded"):  # before: minutes of CPU, then a field error
        load_deploy(bomb)
    ok = tmp_path / "ok.yaml"
    ok.write_text("base: &b {max_steps: 50}\nlimits: *b\nmodel: {path: x}\n")
    with pytest.raises(DeployError, match="base"):  # an unknown top-level key, read normally
        load_deploy(ok)
