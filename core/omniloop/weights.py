"""Weights of a loaded runtime between post-training iterations: update, checksum, sleep/wake.

:meth:`omniloop.Runtime.update_weights` takes one of

* a ``{name: tensor}`` mapping of denoiser weights (names as the denoiser's ``state_dict`` has
  them — ``blocks.0.attn1.to_q.weight`` for the ``transformer`` component, or prefixed
  ``transformer_2.blocks...`` for another denoiser component);
* a safetensors file, or a folder of them (a diffusers ``transformer/`` folder, sharded or not),
  holding such names;
* with ``adapter=NAME``: a LoRA adapter (diffusers/PEFT file or folder, the family's other layouts
  converted) registered under ``NAME`` — requests then name it in ``adapters`` like a deploy one.

**Atomic.** Everything is read and checked before anything changes (:func:`plan_update`): every
name must be a parameter or buffer of a denoiser component, every shape equal, every value finite,
the dtype a floating one (cast to the parameter's dtype); the first problem raises one
:class:`WeightUpdateError` naming the field (``source``, ``source.<tensor name>``, ``adapter``,
``version``). Only then are the tensors copied in place (:func:`apply_update`) — a copy onto a
checked tensor of the same shape cannot fail halfway.

**When.** The runtime applies an update at a step boundary with no request in flight: the call
waits until every request that has started its first unit has finished (they finish on the
version they started with); requests that start after the call returns run on the new version.
See :meth:`omniloop.Runtime.update_weights`.

**Checksum.** :func:`checksum` is a SHA-256 over the denoiser components' state (names sorted,
dtype, shape, bytes) and the adapters registered through ``update_weights``: equal checksums mean
equal weights, bit for bit.

**Sleep/wake.** :class:`Sleeper` moves every parameter and buffer of every module component off
the device (``sleep``: kept in host memory, the device tensors released, the CUDA cache emptied)
and back (``wake``), restoring the values bit for bit.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .errors import OmniloopError

#: a weight version is a short identifier (it lands in every output's metrics)
VERSION_PATTERN = r"[A-Za-z0-9_][A-Za-z0-9_.:@+=-]{0,127}"


class WeightUpdateError(OmniloopError):
    """An update that was refused; ``path`` names the field. Nothing was changed."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}")


class RuntimeAsleep(OmniloopError):
    """The runtime's weights are released (``Runtime.sleep``); ``wake()`` it first."""


def denoiser_components(components: Mapping[str, Any]) -> dict[str, torch.nn.Module]:
    """The denoiser components an update may target: the ``transformer*`` modules."""
    return {n: c for n, c in components.items() if n.startswith("transformer") and isinstance(c, torch.nn.Module)}


def read_source(source: Any) -> dict[str, torch.Tensor]:
    """The tensors of ``source`` (a mapping, a safetensors file or a folder of them)."""
    if isinstance(source, Mapping):
        out: dict[str, torch.Tensor] = {}
        for k, v in source.items():
            if not isinstance(k, str):
                raise WeightUpdateError("source", f"tensor names are strings, got {type(k).__name__}")
            if not isinstance(v, torch.Tensor):
                raise WeightUpdateError(f"source.{k}", f"expected a tensor, got {type(v).__name__}")
            out[k] = v
        return out
    if not isinstance(source, (str, os.PathLike)):
        raise WeightUpdateError("source", f"expected a safetensors file or folder, or a {{name: tensor}} mapping, got {type(source).__name__}")
    path = Path(source)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightUpdateError("source", f"{path} holds no .safetensors file")
    elif path.is_file():
        files = [path]
    else:
        raise WeightUpdateError("source", f"{path} does not exist")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    out = {}
    for f in files:
        try:
            tensors = load_file(str(f))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise WeightUpdateError("source", f"{f.name}: not a readable safetensors file ({exc})") from None
        for k, v in tensors.items():
            if k in out:
                raise WeightUpdateError(f"source.{k}", f"is in two files of {path}")
            out[k] = v
    return out


def plan_update(components: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Check every tensor against the denoiser; return ``(target, new value)`` pairs ready to copy
    (new values already on the target's device and dtype). Raises :class:`WeightUpdateError`."""
    if not tensors:
        raise WeightUpdateError("source", "holds no tensors")
    dens = denoiser_components(components)
    if not dens:
        raise WeightUpdateError("source", "this model has no denoiser component to update")
    states = {n: dict(m.state_dict(keep_vars=True)) for n, m in dens.items()}
    plan: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name in sorted(tensors):
        value = tensors[name]
        comp, _, local = name.partition(".")
        if comp in states and local:
            table, key = states[comp], local
        else:
            table, key = states.get("transformer", {}), name
        target = table.get(key)
        if target is None:
            raise WeightUpdateError(f"source.{name}", "is not a parameter or buffer of the denoiser "
                                    f"(components: {', '.join(sorted(dens))})")
        if tuple(value.shape) != tuple(target.shape):
            raise WeightUpdateError(f"source.{name}", f"shape {list(value.shape)} does not match the model's {list(target.shape)}")
        if value.dtype.is_floating_point != target.dtype.is_floating_point:
            raise WeightUpdateError(f"source.{name}", f"dtype {value.dtype} does not fit the model's {target.dtype}")
        if value.dtype.is_floating_point and not bool(torch.isfinite(value).all()):
            raise WeightUpdateError(f"source.{name}", "holds non-finite values")
        plan.append((target, value.detach().to(device=target.device, dtype=target.dtype)))
    return plan


def apply_update(plan: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for target, value in plan:
            target.data.copy_(value)


def checksum(components: Mapping[str, Any], adapters: Mapping[str, Any] = {}) -> str:
    """SHA-256 (hex) of the denoiser's weights and the registered adapters (see the module docs)."""
    h = hashlib.sha256()

    def add(name: str, t: torch.Tensor) -> None:
        t = t.detach()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        if t.numel():
            h.update(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())

    for comp, module in sorted(denoiser_components(components).items()):
        for key, t in sorted(module.state_dict().items()):
            add(f"{comp}.{key}", t)
    for name in sorted(adapters):
        ad = adapters[name]
        for mod in sorted(ad.targets):
            layer = ad.layers[ad.targets[mod]]
            add(f"adapter:{name}:{mod}.down", layer.down)
            add(f"adapter:{name}:{mod}.up", layer.up)
            h.update(f"alpha={layer.alpha!r}|rslora={layer.rslora}".encode())
    return h.hexdigest()


class Sleeper:
    """Releases and restores the device memory of a model's module components."""

    def __init__(self) -> None:
        self._store: list[tuple[torch.Tensor, torch.Tensor, torch.device]] = []
        self.asleep = False

    def sleep(self, components: Mapping[str, Any]) -> int:
        """Move every parameter and buffer to host memory and release the device copies; the
        bytes released."""
        if self.asleep:
            return 0
        seen: set[int] = set()
        released = 0
        for module in components.values():
            if not isinstance(module, torch.nn.Module):
                continue
            for t in [*module.parameters(), *module.buffers()]:
                if id(t) in seen:
                    continue
                seen.add(id(t))
                data = t.data
                host = data if data.device.type == "cpu" else data.to("cpu")
                self._store.append((t, host, data.device))
                released += data.numel() * data.element_size()
                t.data = torch.empty(0, dtype=data.dtype, device=data.device)
        self.asleep = True
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return released

    def wake(self) -> None:
        if not self.asleep:
            return
        for t, host, device in self._store:
            t.data = host if device.type == "cpu" else host.to(device)
        self._store.clear()
        self.asleep = False


def check_version(version: Any) -> str:
    import re

    if not isinstance(version, str) or not re.fullmatch(VERSION_PATTERN, version):
        raise WeightUpdateError("version", "must be 1-128 letters, digits or _ . : @ + = - (not starting with '.')")
    return version


def finite(x: float) -> bool:
    return math.isfinite(x)


__all__ = [
    "RuntimeAsleep", "Sleeper", "WeightUpdateError", "apply_update", "check_version", "checksum",
    "denoiser_components", "plan_update", "read_source",
]
