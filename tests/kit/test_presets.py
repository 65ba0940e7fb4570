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


def test_a_built_preset_folder_is_made_first_then_checked(tmp_path: Path) -> None:
    made = tmp_path / "cache" / "demo"
    seen: list[Path | None] = []

    def make() -> Path:
        made.mkdir(parents=True, exist_ok=True)
        return made

    def missing(folder: Path | None) -> str | None:
        seen.append(folder)
        return None if (folder / "w.bin").is_file() else "the demo weights are not installed"  # type: ignore[operator]

    path = preset_folder("my-demo", make, missing, built=True)
    with pytest.raises(DeployError, match=r"^model: preset 'my-demo': the demo weights are not installed$"):
        path()
    (made / "w.bin").write_bytes(b"")
    assert path() == made and seen == [made, made]

    def unwritable() -> Path:
        raise PermissionError("cannot write the demo cache folder /x")

    with pytest.raises(DeployError, match=r"^model: preset 'my-demo': cannot write the demo cache folder /x$"):
        preset_folder("my-demo", unwritable, missing, built=True)()
