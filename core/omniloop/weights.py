"""Weights of a loaded runtime between post-training iterations: the errors, the version, sleep/wake.

Reading and checking an update (``Runtime.update_weights``) and the checksum
(``Runtime.weights_checksum``) are the omniloop-rl package (``omniloop_rl.weights``, through the
``weights`` mechanism it registers). :class:`Sleeper` moves every parameter and buffer of every
module component off the device (``sleep``: kept in host memory, the device tensors released, the
CUDA cache emptied) and back (``wake``), restoring the values bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .errors import OmniloopError
from .lazy import moved

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


#: the checksum algorithms (``Runtime.weights_checksum``; computed by omniloop-rl); the first is the default
CHECKSUM_ALGORITHMS = ("mix128", "sha256")
#: moved to omniloop-rl (``omniloop_rl.weights``) in omniloop 0.2 (issue 34)
__getattr__ = moved(__name__, dict.fromkeys(("apply_update", "checksum", "denoiser_components", "mix64", "plan_update",
                                             "read_source", "tensor_digest", "tensor_words", "mix64_int"), "omniloop_rl.weights"))


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



__all__ = ["CHECKSUM_ALGORITHMS", "RuntimeAsleep", "Sleeper", "WeightUpdateError", "check_version"]
