"""Every hook is documented in docs/hooks.md with its exact signature (datasette's test_docs way).

When this fails after a hook changed: regenerate the reference with
``omniloop hooks --markdown > docs/hooks.md`` in the same change.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from omniloop import hookspecs

DOCS = Path(__file__).resolve().parents[2] / "docs" / "hooks.md"


def all_hookspecs() -> list[str]:
    """Every function in omniloop.hookspecs marked with the hookspec marker."""
    marker = f"{hookspecs.PROJECT}_spec"
    return sorted(n for n, v in vars(hookspecs).items() if callable(v) and hasattr(v, marker))


def signature(name: str) -> str:
    return f"{name}{inspect.signature(getattr(hookspecs, name), eval_str=True)}"


@pytest.fixture(scope="module")
def reference() -> str:
    return DOCS.read_text(encoding="utf-8")


def test_the_hook_lists_cover_every_hookspec() -> None:
    assert sorted([*hookspecs.REGISTRATION_HOOKS, *hookspecs.OBSERVER_EVENTS]) == all_hookspecs()


@pytest.mark.parametrize("name", all_hookspecs())
def test_hook_is_documented_with_its_exact_signature(name: str, reference: str) -> None:
    assert f"### `{name}`" in reference, f"{name} has no section in docs/hooks.md"
    assert f"\n{signature(name)}\n" in reference, (
        f"docs/hooks.md does not show the current signature {signature(name)!r}; "
        "regenerate it: omniloop hooks --markdown > docs/hooks.md"
    )


@pytest.mark.parametrize("name", all_hookspecs())
def test_hook_docstring_says_since_which_version(name: str) -> None:
    doc = inspect.getdoc(getattr(hookspecs, name)) or ""
    m = re.search(r"Since:\s*(\d+(?:\.\d+)*)", doc)
    assert m, f"{name}'s docstring does not say 'Since: <hook-API version>'"
    since = tuple(int(x) for x in m.group(1).split("."))
    current = tuple(int(x) for x in hookspecs.HOOK_API_VERSION.split("."))
    assert since <= current


def test_reference_states_the_current_hook_api_version(reference: str) -> None:
    assert f"Hook-API version: **{hookspecs.HOOK_API_VERSION}**" in reference
