"""ComfyUI workflows on omniloop: compile a workflow (API or editor format) to native OmniRequests.

* :func:`compile_workflow` — a workflow (either format) and a :class:`Target` (the served model)
  → :class:`CompiledPrompt` (one native request per sampler chain, and the save nodes fed by it);
  bad graphs raise :class:`WorkflowError` carrying ComfyUI's ``{error, node_errors}`` body.
* :func:`check_workflow` — the per-node coverage report (mapped / ignored / unsupported).
* :mod:`.routes` — ComfyUI's server routes (``/prompt``, ``/history``, ``/view``, ``/ws``, ...),
  mounted on ``omniloop serve`` through the server's ``omniloop.server_routes`` entry points.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omniloop.lazy import lazy_exports

#: public names by defining module, imported on first use (PEP 562): loading the entry point
#: (omniloop_comfyui.plugin: ``omniloop --help``, every ``omniloop generate``) does not import the compiler
_EXPORTS: dict[str, tuple[str, ...]] = {
    "compiler": ("CompiledJob", "CompiledPrompt", "SaveSpec", "Target", "check_workflow", "compile_workflow"),
    "errors": ("WorkflowError",),
    "ui": ("to_api_format",),
}

if TYPE_CHECKING:
    from .compiler import CompiledJob, CompiledPrompt, SaveSpec, Target, check_workflow, compile_workflow
    from .errors import WorkflowError
    from .ui import to_api_format

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

__all__ = [
    "CompiledJob", "CompiledPrompt", "SaveSpec", "Target", "WorkflowError", "check_workflow", "compile_workflow",
    "to_api_format",
]
