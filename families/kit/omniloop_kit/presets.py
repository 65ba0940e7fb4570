"""A model preset's checkpoint folder shipped as package data: the folder, or one clear
:class:`~omniloop.errors.DeployError` saying why its weights cannot be used yet (omniloop-kit).

The demo packages (``omniloop-flux-demo``, ``omniloop-wan-demo``) ship presets whose weights are
trained and installed after the package; until then a deploy naming the preset is refused, before
anything loads, with a line naming the first missing file and how to make it::

    def checkpoint_missing(folder=None):
        return weights_missing("flux-demo", folder or checkpoint_dir(), REQUIRED_FILES, "train them with ...")

    PRESET = ModelPreset(name="flux-demo", family="flux",
                         path=preset_folder("flux-demo", lambda: checkpoint_dir(), lambda: checkpoint_missing()), ...)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from omniloop.errors import DeployError


def weights_missing(
    name: str, folder: Path, needed: Sequence[str], how: str, *, present: Callable[[Path], bool] = Path.is_file
) -> str | None:
    """Why ``name``'s weights in ``folder`` cannot be used (``None`` when they can): the first of
    ``needed`` (paths relative to ``folder``) that is not ``present``, how many more are missing,
    then ``how`` (how to train and install them). ``present`` is :meth:`Path.is_file` unless the
    list names folders or links (then :meth:`Path.exists`)."""
    missing = [n for n in needed if not present(folder / n)]
    if not missing:
        return None
    more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
    return f"the {name} weights are not installed ({folder.name}/{missing[0]} is missing{more}); {how}"


def preset_folder(
    preset: str, folder: Callable[[], Path], missing: Callable[..., str | None], *, built: bool = False
) -> Callable[[], Path]:
    """A :class:`~omniloop.family.ModelPreset` ``path``: ``folder()``, or one
    ``DeployError("model: preset '<preset>': <why>")`` while ``missing()`` says why not.

    ``built``: ``folder()`` makes the folder on first use (e.g. in a cache), so it runs first and
    ``missing(that folder)`` checks what it made; an ``OSError`` while making it (a cache that is
    not writable) is the one ``DeployError`` too."""

    def path() -> Path:
        where = None
        if built:
            try:
                where = folder()
            except OSError as e:
                raise DeployError(f"model: preset {preset!r}: {e}") from None
        why = missing(where) if built else missing()
        if why is not None:
            raise DeployError(f"model: preset {preset!r}: {why}")
        return where if where is not None else folder()

    path.__name__ = path.__qualname__ = f"preset_path_{preset.replace('-', '_')}"
    path.__doc__ = f"The {preset!r} folder; one clear DeployError until its weights are installed."
    return path


__all__ = ["preset_folder", "weights_missing"]
