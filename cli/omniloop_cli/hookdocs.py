"""The hook points, read from the live :mod:`omniloop.hookspecs` (for ``omniloop hooks``).

``render_markdown()`` produces ``docs/hooks.md`` (``omniloop hooks --markdown > docs/hooks.md``);
``tests/core/test_hooks_documented.py`` checks that every hook appears there with its exact
signature, so the reference cannot drift from the code.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from attrs import define

_SINCE = re.compile(r"Since:\s*(\d+(?:\.\d+)*)")


@define(frozen=True)
class HookPoint:
    name: str
    kind: str  # "registration" | "event"
    signature: str  # e.g. "omniloop_register_families(register: Any) -> None"
    since: str | None
    summary: str
    doc: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "kind": self.kind, "signature": self.signature,
            "since": self.since, "summary": self.summary, "doc": self.doc,
        }


def signature_of(fn: Any) -> str:
    """``name(args) -> ret`` exactly as :func:`inspect.signature` renders it (annotations evaluated)."""
    return f"{fn.__name__}{inspect.signature(fn, eval_str=True)}"


def hook_points() -> list[HookPoint]:
    from omniloop import hookspecs

    out: list[HookPoint] = []
    for kind, names in (("registration", hookspecs.REGISTRATION_HOOKS), ("event", hookspecs.OBSERVER_EVENTS)):
        for name in names:
            fn = getattr(hookspecs, name)
            doc = inspect.getdoc(fn) or ""
            m = _SINCE.search(doc)
            out.append(HookPoint(
                name=name, kind=kind, signature=signature_of(fn), since=m.group(1) if m else None,
                summary=_summary(doc), doc=doc,
            ))
    return out


def _summary(doc: str) -> str:
    """The first sentence of the docstring's first paragraph, with RST literals as plain backticks."""
    para = " ".join(doc.split("\n\n")[0].split())
    m = re.search(r"\.(\s|$)", para)
    first = para[: m.start() + 1] if m else para
    return first.replace("``", "`")


def undeclared_hooks() -> list[str]:
    """Hookspecs that are in neither REGISTRATION_HOOKS nor OBSERVER_EVENTS (should be none)."""
    from omniloop import hookspecs

    listed = set(hookspecs.REGISTRATION_HOOKS) | set(hookspecs.OBSERVER_EVENTS)
    return sorted(
        n for n, v in vars(hookspecs).items()
        if n.startswith("omniloop_") and callable(v) and n not in listed
    )


def render_markdown() -> str:
    from omniloop import hookspecs

    lines = [
        "# Hooks reference",
        "",
        "<!-- Generated from omniloop/hookspecs.py by `omniloop hooks --markdown > docs/hooks.md`.",
        "     tests/core/test_hooks_documented.py fails when a hook is missing here or its signature",
        "     differs: regenerate this file in the same change that touches a hook. -->",
        "",
        f"Hook-API version: **{hookspecs.HOOK_API_VERSION}**. A plugin declares the range it supports with",
        "`OMNILOOP_HOOK_API = \">=1.0,<2\"` in the module its entry point names; outside that range it",
        "is refused with a message saying what it needs. Hooks grow, they never break: new arguments",
        "arrive in minor versions (an implementation may accept fewer arguments than the spec),",
        "removals only in a major version after a minor one that warns. See CONTRIBUTING.md.",
        "",
        "Implement a hook with the `omniloop.hookspecs.hookimpl` decorator and the exact hook name;",
        "take only the arguments you need.",
        "",
    ]
    sections = {
        "registration": (
            "Registration hooks",
            "Called once when a deployment loads (and `omniloop_register_commands` when the CLI starts), "
            "with a `register` callback the core owns. Fast and offline: no weights, no network.",
        ),
        "event": (
            "Observer events",
            "Read-only. Implemented by observer objects a deploy enables; bound when a pipeline is "
            "built, so an event nobody implements costs nothing.",
        ),
    }
    points = hook_points()
    for kind, (title, intro) in sections.items():
        lines += [f"## {title}", "", intro, ""]
        for hp in points:
            if hp.kind != kind:
                continue
            lines += [
                f"### `{hp.name}`", "",
                "```python", hp.signature, "```", "",
                f"Since: {hp.since or '?'}", "",
                hp.doc, "",
            ]
    return "\n".join(lines).rstrip() + "\n"
