"""Make recordings and replay them: the Python API behind ``omniloop parity record|replay``."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from .compare import ParityResult, Tolerances, compare
from .config import ParityError
from .recorder import ParityRecorder
from .recording import Recording, as_recording

NAME = "parity"

Progress = Callable[[str, int, int], None]  # (node, step, total)


def recorder_of(runtime: Any) -> ParityRecorder | None:
    """The ``parity`` observer object of a runtime, or None when it is not enabled."""
    entry = runtime.components_enabled.get(NAME)
    return entry[1] if entry is not None else None


def parity_options(*, taps: str | None = None, blocks: str | None = None, final: bool = True) -> dict[str, Any]:
    """The deploy ``plugins.parity`` mapping for an in-memory recorder."""
    opts: dict[str, Any] = {"final": final}
    if taps is not None:
        opts["taps"] = taps
    if blocks is not None:
        opts["blocks"] = blocks
    return opts


def with_parity(deploy: Any, **options: Any) -> Any:
    """``deploy`` (a ``DeployConfig`` or a mapping) with the parity observer enabled in memory."""
    from omniloop.deploy import DeployConfig, load_deploy

    cfg: DeployConfig = load_deploy(deploy)
    return attrs.evolve(cfg, plugins={**cfg.plugins, NAME: parity_options(**options)})


def _ensure_plugin(manager: Any) -> None:
    """Make sure ``manager`` knows the parity observer (tests use managers without discovery)."""
    if NAME not in manager.registry().observers:
        from . import plugin

        manager.add(NAME, plugin, distribution="omniloop-parity")


def runtime_with_parity(
    runtime: Any = None,
    *,
    deploy: Any = None,
    plugins: Any = None,
    taps: str | None = None,
    blocks: str | None = None,
) -> Any:
    """A runtime whose ``parity`` observer records in memory with the given taps/blocks.

    Returns ``runtime`` itself when it already records what is asked; otherwise builds a new
    runtime from its deploy (or from ``deploy``) with parity enabled, on the same plugin manager.
    """
    from omniloop.plugins import default_manager
    from omniloop.runtime import Runtime

    if runtime is not None:
        rec = recorder_of(runtime)
        if (
            rec is not None
            and rec.config.out is None
            and rec.config.blocks == blocks
            and (taps is None or rec.config.taps == taps)
        ):
            return runtime
        deploy = runtime.deploy
        plugins = runtime.plugins
    if deploy is None:
        raise ParityError("parity: give a runtime or a deploy config to run")
    manager = plugins or default_manager()
    _ensure_plugin(manager)
    return Runtime(with_parity(deploy, taps=taps, blocks=blocks), manager=manager)


def record(
    runtime: Any,
    request: Any,
    out: str | os.PathLike[str] | None = None,
    *,
    progress: Progress | None = None,
) -> Recording:
    """Run ``request`` on ``runtime`` (which has ``parity`` enabled) and return its recording.

    With ``out`` the recording is also written there (atomically).
    """
    from omniloop.schema import request_from_dict

    rec = recorder_of(runtime)
    if rec is None:
        raise ParityError(
            "parity: the runtime does not have the 'parity' observer enabled "
            "(add plugins: {parity: {}} to its deploy, or use omniloop_parity.runtime_with_parity)"
        )
    rec.bind(runtime)
    req = request if not isinstance(request, Mapping) else request_from_dict(request)
    execution = runtime.prepare(req)
    output = None
    for ev in runtime.scheduler.stream(execution):
        if progress is not None and ev.step is not None and ev.total:
            progress(ev.node or "", ev.step, ev.total)
        if ev.output is not None:
            output = ev.output
    if output is None or not output.ok:
        status = output.status.value if output is not None else "unknown"
        err = f": {output.error.message}" if output is not None and output.error is not None else ""
        rec.errors.pop(execution.request_id, None)
        raise ParityError(f"parity: the run did not complete ({status}{err}); nothing recorded")
    recording = rec.take(execution.request_id)
    if out is not None:
        recording.save(out)
    return recording


def replay(
    recording: Recording | str | os.PathLike[str],
    *,
    runtime: Any = None,
    model: str | None = None,
    deploy: Any = None,
    plugins: Any = None,
    device: str | None = None,
    dtype: str | None = None,
    tolerances: Tolerances | None = None,
    out: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
) -> tuple[ParityResult, Recording]:
    """Run a recording's request again and compare the new run against it.

    The runtime is ``runtime``, else one built from ``deploy`` (a file or mapping), else from
    ``model`` (a preset or path), else from the deploy config stored in the recording.
    """
    ref = as_recording(recording)
    cfg = ref.manifest.get("config") or {}
    taps, blocks = cfg.get("taps"), cfg.get("blocks")
    if runtime is None:
        runtime = runtime_with_parity(
            deploy=replay_deploy(ref, model=model, deploy=deploy, device=device, dtype=dtype),
            plugins=plugins,
            taps=taps,
            blocks=blocks,
        )
    else:
        runtime = runtime_with_parity(runtime, taps=taps, blocks=blocks)
    new = record(runtime, ref.request(), out=out, progress=progress)
    result = compare(ref, new, tolerances)
    if out is None:
        result.b_label = "replay"
    return result, new


def replay_deploy(
    ref: Recording,
    *,
    model: str | None = None,
    deploy: Any = None,
    device: str | None = None,
    dtype: str | None = None,
) -> Any:
    """The deploy config a replay runs under (see :func:`replay`)."""
    from omniloop.deploy import load_deploy

    if deploy is not None:
        cfg = load_deploy(deploy)
        if model is not None:
            cfg = attrs.evolve(cfg, model=attrs.evolve(cfg.model, **model_fields(model)))
    elif model is not None:
        rec_device, rec_dtype = ref.manifest.get("device"), ref.manifest.get("dtype")
        cfg = load_deploy(
            {
                "model": model_fields(model),
                "device": rec_device if rec_device not in (None, "unknown") else "cpu",
                "dtype": rec_dtype if rec_dtype in ("float32", "bfloat16", "float16") else "float32",
            }
        )
    elif ref.manifest.get("deploy"):
        data = dict(ref.manifest["deploy"])
        data["plugins"] = {k: v for k, v in (data.get("plugins") or {}).items() if k != NAME}
        cfg = load_deploy(data)
    else:
        raise ParityError(
            f"{ref.label}: the recording holds no deploy config (it was made by an unbound recorder); "
            "give --model or --deploy"
        )
    changes: dict[str, Any] = {}
    if device is not None:
        changes["device"] = device
    if dtype is not None:
        changes["dtype"] = dtype
    return attrs.evolve(cfg, **changes) if changes else cfg


def model_fields(model: str) -> dict[str, Any]:
    """``{"path": ...}`` or ``{"preset": ...}`` the way ``Runtime.from_model`` reads a model argument."""
    looks_like_path = os.sep in model or model.startswith(".") or Path(model).exists()
    return {"path": model, "preset": None} if looks_like_path else {"preset": model, "path": None}
