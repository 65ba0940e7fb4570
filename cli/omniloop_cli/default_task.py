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


def _declared_tasks(deploy: Any, manager: Any) -> frozenset[str] | None:
    """The tasks the deploy's checkpoint declares in its ``omniloop.json`` (None: not declared, or
    the preset is unknown or its family is overridden: the family answers)."""
    from pathlib import Path

    from omniloop.limits import declared_tasks

    m = deploy.model
    if m.family:
        return None
    if m.preset:
        preset = manager.registered("omniloop_register_model_presets").presets.get(m.preset)
        if preset is None:
            return None
        path = Path(preset.path())
    elif m.path:
        path = Path(m.path)
    else:
        return None
    return declared_tasks(path)
