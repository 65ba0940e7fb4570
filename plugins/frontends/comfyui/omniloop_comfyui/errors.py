"""Errors in ComfyUI's own shapes (what its ``POST /prompt`` answers with a 400).

A graph that cannot be compiled raises :class:`WorkflowError`; its :meth:`~WorkflowError.body` is

* ``{"error": {"type", "message", "details", "extra_info"}, "node_errors": {}}`` for a problem of
  the whole prompt (``invalid_prompt``, ``prompt_no_outputs``, ``missing_node_type`` — an unknown
  node class, its id in ``extra_info.node_id`` as ComfyUI answers);
* ``{"error": {"type": "prompt_outputs_failed_validation", ...}, "node_errors": {node_id:
  {"errors": [{"type", "message", "details", "extra_info": {"input_name", ...}}], "class_type",
  "dependent_outputs"}}}`` for problems of nodes (every node's problems, not only the first).

Client values echoed in messages are cut short (:func:`show`).
"""

from __future__ import annotations

from typing import Any

MAX_SHOWN = 80


def show(value: Any, limit: int = MAX_SHOWN) -> str:
    """A client value for a message: repr, valid UTF-8, at most ``limit`` characters."""
    text = repr(value).encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def node_error(type_: str, message: str, *, input_name: str | None = None, details: str = "",
               **extra: Any) -> dict[str, Any]:
    """One entry of ``node_errors[id].errors`` (ComfyUI's shape)."""
    info: dict[str, Any] = dict(extra)
    if input_name is not None:
        info.setdefault("input_name", input_name)
    return {"type": type_, "message": message, "details": details or (input_name or ""), "extra_info": info}


class WorkflowError(Exception):
    """A workflow that cannot be compiled, with ComfyUI's error body."""

    def __init__(self, type_: str, message: str, *, details: str = "", extra_info: dict[str, Any] | None = None,
                 node_errors: dict[str, dict[str, Any]] | None = None) -> None:
        self.type = type_
        self.message = message
        self.details = details
        self.extra_info = dict(extra_info or {})
        self.node_errors = dict(node_errors or {})
        super().__init__(self.summary())

    @classmethod
    def from_nodes(cls, node_errors: dict[str, dict[str, Any]]) -> WorkflowError:
        return cls("prompt_outputs_failed_validation", "Prompt outputs failed validation", node_errors=node_errors)

    def body(self) -> dict[str, Any]:
        return {"error": {"type": self.type, "message": self.message, "details": self.details,
                          "extra_info": self.extra_info}, "node_errors": self.node_errors}

    def lines(self) -> list[str]:
        """One line per problem: ``node 5 (KSampler) input 'steps': message``."""
        if not self.node_errors:
            return [f"{self.message}" + (f" ({self.details})" if self.details else "")]
        out = []
        for nid, entry in self.node_errors.items():
            for e in entry.get("errors", []):
                where = f"node {nid} ({entry.get('class_type')})"
                name = (e.get("extra_info") or {}).get("input_name")
                out.append(f"{where}" + (f" input {name!r}" if name else "") + f": {e['message']}")
        return out

    def summary(self) -> str:
        lines = self.lines()
        return lines[0] + (f" (and {len(lines) - 1} more)" if len(lines) > 1 else "")
