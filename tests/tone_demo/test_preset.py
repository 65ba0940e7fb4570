"""The ``tone-demo`` preset: family ``stable-audio``; without its weights one clear error."""

from __future__ import annotations

import pytest
from click.testing import CliRunner


def test_preset_is_registered_for_the_stable_audio_family():
    from omniloop.plugins import default_manager

    preset = default_manager().registry().presets["tone-demo"]
    assert preset.family == "stable-audio"


def test_missing_weights_are_one_clear_error(monkeypatch, tmp_path):
    from omniloop.errors import DeployError
    from omniloop_tone_demo import checkpoint_path, plugin

    monkeypatch.setattr(checkpoint_path, "checkpoint_dir", lambda: tmp_path / "checkpoint")
    monkeypatch.setattr(plugin, "checkpoint_dir", lambda: tmp_path / "checkpoint")
    with pytest.raises(DeployError, match=r"tone-demo weights are not installed .*gpu_train\.sh"):
        plugin.preset_path()


def test_eval_adherence_refuses_a_folder_that_is_no_tone_checkpoint(tmp_path):
    from omniloop_tone_demo.cli import main

    res = CliRunner().invoke(main, ["adherence", "--model", str(tmp_path)])
    assert res.exit_code == 2 and "not a tone-demo checkpoint" in res.output
    res = CliRunner().invoke(main, ["adherence", "--model", str(tmp_path / "nope")])
    assert res.exit_code == 2 and "not a checkpoint folder" in res.output


def test_wan_demo_options_are_refused_for_an_audio_model(tmp_path):
    import json

    from omniloop_wan_demo import cli as wan_cli

    (tmp_path / "omniloop.json").write_text(json.dumps({"adherence": {"kind": "audio"}}))
    res = CliRunner().invoke(wan_cli.main, ["eval", "adherence", "--model", str(tmp_path), "--rollout", "causal"])
    assert res.exit_code == 2 and "audio model" in res.output
    res = CliRunner().invoke(wan_cli.main, ["eval", "adherence", "--model", str(tmp_path)])
    assert res.exit_code == 2 and "not a tone-demo checkpoint" in res.output
