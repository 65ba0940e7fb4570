"""``omniloop generate`` without ``--task``: the model's own prompt-only task.

The task is still declared, never inferred from the inputs: when ``--task`` is omitted the CLI
declares the first of :data:`PREFERRED` that the deployment's checkpoint supports (known without
its weights: ``Deployment.supported_tasks``, i.e. the family's config-only view), so a video model
gets ``t2v`` as before, an image-only model (flux-demo) gets ``t2i``, an audio-only model
(Stable Audio) ``t2a`` and a text model (Qwen) ``reason``. When the deployment
cannot be resolved here (no ``--model``, a bad deploy, a composed deploy) the answer is ``t2v``
and the usual checks report the problem exactly as they did before.

A checkpoint whose ``omniloop.json`` declares its ``tasks`` (the demo models: ``omniloop.limits``)
answers without its family: only the model-preset hook is called and no family (nor torch) is
imported, so a flag that does not fit the task (``--image`` on a t2v model) is refused at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: prompt-only tasks in order of preference
PREFERRED = ("t2v", "t2i", "t2a", "reason")
FALLBACK = "t2v"


def default_task(deploy_file: str | None, model: str | None, device: str | None, dtype: str | None,
                 manager: Any) -> str:
    """The task ``omniloop generate`` declares when ``--task`` is not given."""
    if deploy_file is None and model is None:
        return FALLBACK
    try:
        from .generate import build_deploy

        deploy = build_deploy(deploy_file, model, device, dtype)
        if deploy.pipeline is not None or deploy.models:  # a composed deploy: its composition's task
            return FALLBACK
        declared = _declared_tasks(deploy, manager)
        if declared is not None:
            return next((t for t in PREFERRED if t in declared), FALLBACK)
        from omniloop.runtime import Deployment

        supported = {t.value for t in Deployment(deploy, manager=manager).supported_tasks}
    except Exception:  # reported by the regular path, in its usual order
        return FALLBACK
    return next((t for t in PREFERRED if t in supported), FALLBACK)


def declared_checkpoint(deploy: Any, manager: Any) -> Path | None:
    """The deploy's checkpoint folder, found without its family (a preset through the model-preset
    hook alone, or the path), or None (a family override, an unknown preset: the family answers)."""
    m = deploy.model
    if m.family:
        return None
    if m.preset:
        preset = manager.registered("omniloop_register_model_presets").presets.get(m.preset)
        return None if preset is None else Path(preset.path())
    return Path(m.path) if m.path else None


def _declared_tasks(deploy: Any, manager: Any) -> frozenset[str] | None:
    """The tasks the deploy's checkpoint declares in its ``omniloop.json`` (None: not declared, or
    the preset is unknown or its family is overridden: the family answers)."""
    from omniloop.limits import declared_tasks

    path = declared_checkpoint(deploy, manager)
    return None if path is None else declared_tasks(path)


def check_declared_limits(deploy: Any, request: Any, manager: Any) -> None:
    """A request value outside the range the checkpoint's ``omniloop.json`` refuses (``limits``,
    :mod:`omniloop.limits`) is refused here, before the family (and torch) is imported, with the
    message ``Deployment.check`` gives (``diffusion.height: 2048 is outside what model 'wan-demo'
    supports: ...``). Anything this cannot read is left to ``Deployment.check``."""
    from omniloop.errors import OmniloopError, RequestError
    from omniloop.limits import declared, outside

    try:
        path = declared_checkpoint(deploy, manager)
        limits = declared(path) if path is not None else None
    except OmniloopError:  # a preset without weights, a malformed declaration: reported by the usual checks
        return
    if limits is None or limits.enforce != "refuse":
        return
    name = repr(deploy.model.preset) if deploy.model.preset else str(path)
    d = request.diffusion
    for field, msg in outside(limits, {"steps": d.steps, "frames": d.frames, "height": d.height, "width": d.width}, name):
        raise RequestError(field, msg)
