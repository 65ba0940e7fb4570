"""omniloop_kit.presets: a shipped preset's folder, or one clear DeployError naming what is missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from omniloop.errors import DeployError
from omniloop_kit.presets import preset_folder, weights_missing


def test_weights_missing_names_the_first_missing_file_and_how_many_more(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint"
    (folder / "vae").mkdir(parents=True)
    (folder / "a.json").write_text("{}")
    why = weights_missing("demo", folder, ("a.json", "b.json", "vae", "c.json"), "train them with X")
    assert why == "the demo weights are not installed (checkpoint/b.json is missing and 2 more); train them with X"
    # a folder counts only with present=Path.exists
    why = weights_missing("demo", folder, ("a.json", "vae", "c.json"), "how", present=Path.exists)
    assert why == "the demo weights are not installed (checkpoint/c.json is missing); how"
    assert weights_missing("demo", folder, ("a.json", "vae"), "how", present=Path.exists) is None


def test_preset_folder_is_the_folder_or_one_deploy_error(tmp_path: Path) -> None:
    state: dict[str, str | None] = {"why": "the demo weights are not installed"}
    path = preset_folder("my-demo", lambda: tmp_path, lambda: state["why"])
    with pytest.raises(DeployError) as e:
        path()
    assert str(e.value) == "model: preset 'my-demo': the demo weights are not installed"
    state["why"] = None
    assert path() == tmp_path
    assert path.__name__ == "preset_path_my_demo"
