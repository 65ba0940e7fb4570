"""Weights of a loaded runtime between post-training iterations: update and checksum (omniloop-rl; the
core's ``omniloop.weights`` until omniloop 0.2, issue 34: sleep/wake and the errors stayed there).

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
:class:`~omniloop.weights.WeightUpdateError` naming the field (``source``, ``source.<tensor name>``, ``adapter``,
``version``). Only then are the tensors copied in place (:func:`apply_update`) — a copy onto a
checked tensor of the same shape cannot fail halfway.

**When.** The runtime applies an update at a step boundary with no request in flight: the call
waits until every request that has started its first unit has finished (they finish on the
version they started with); requests that start after the call returns run on the new version.
See :meth:`omniloop.Runtime.update_weights`.

**Checksum.** :func:`checksum` fingerprints the denoiser components' state (names sorted, dtype,
shape, bytes) and the adapters registered through ``update_weights``. Two algorithms:

* ``"mix128"`` (the default): every tensor's bytes are read as 64-bit words **on the tensor's own
  device** and hashed there (:func:`tensor_digest`: two lanes, each the sum mod 2^64 of
  ``mix64(word + mix64(index + lane seed))``, ``mix64`` being SplitMix64's finaliser, a bijection);
  only the 16-byte digests per tensor go to the host, where SHA-256 combines them with the names,
  dtypes and shapes. Integer arithmetic only, so the result is the same on every device and in
  every order of work: a trainer gets the runtime's value from its own copy of the weights with
  ``checksum({"transformer": module})``. Any change of a single 64-bit word always changes it
  (``mix64`` is a bijection); other differences collide with probability about 2^-128 if ``mix64``
  behaves like a random function (a heuristic, not a proof). It is a
  consistency check, not a defence against someone crafting a collision.
* ``"sha256"``: SHA-256 over the bytes themselves, copied to the host — cryptographic, and slow
  for large denoisers (2.8–3.2 s for Wan 1.3B on the H200's host, where ``mix128`` runs on the GPU).

Equal checksums mean equal weights, bit for bit (up to the collision bounds above). The result is
``"<algorithm>:<hex>"``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from omniloop.weights import CHECKSUM_ALGORITHMS, WeightUpdateError


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


_MASK64 = (1 << 64) - 1
#: SplitMix64's finaliser constants and the two lanes' seeds (fixed: they define the checksum)
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_LANE_SEEDS = (0x9E3779B97F4A7C15, 0xD1B54A32D192ED03)
#: words hashed per slab (bounds the temporaries: a few slabs of 8-byte words)
_SLAB = 1 << 22


def _signed(v: int) -> int:
    """A 64-bit pattern as the int64 torch stores."""
    v &= _MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's ``>>`` is arithmetic on signed ints)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 words (wrapping arithmetic): a bijection of 64-bit values."""
    x = x ^ _shr(x, 30)
    x = x * _signed(_MIX1)
    x = x ^ _shr(x, 27)
    x = x * _signed(_MIX2)
    return x ^ _shr(x, 31)


def mix64_int(v: int) -> int:
    """:func:`mix64` of one Python int (the reference the tensor version is tested against)."""
    v &= _MASK64
    v ^= v >> 30
    v = (v * _MIX1) & _MASK64
    v ^= v >> 27
    v = (v * _MIX2) & _MASK64
    return v ^ (v >> 31)


_INDEX_TABLES: dict[tuple[str, int], torch.Tensor] = {}


def _index_table(device: torch.device, lane: int) -> torch.Tensor:
    """``mix64(i + seed)`` for ``i`` in ``[0, _SLAB)`` on ``device`` (cached)."""
    key = (str(device), lane)
    table = _INDEX_TABLES.get(key)
    if table is None:
        idx = torch.arange(_SLAB, dtype=torch.int64, device=device)
        table = _INDEX_TABLES[key] = mix64(idx + _signed(_LANE_SEEDS[lane]))
    return table


def tensor_words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (row-major) as int64 words, zero-padded to a multiple of 8 bytes, on its device."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-raw.numel()) % 8
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    return raw.view(torch.int64)


def tensor_digest(t: torch.Tensor) -> tuple[int, int]:
    """The ``mix128`` digest of one tensor's bytes, computed on its device: per lane ``l``, the sum
    mod 2^64 over words ``w_i`` of ``mix64(w_i + mix64(i mod S + seed_l) + mix64(i div S + seed_l))``
    (``S`` the slab size). Returns the two lanes as unsigned ints."""
    words = tensor_words(t)
    if words.device.type == "cpu":
        try:
            return _digest_host(words)
        except ImportError:  # no numpy: the same arithmetic in torch
            pass
    return _digest_torch(words)


def _digest_torch(words: torch.Tensor) -> tuple[int, int]:
    """:func:`tensor_digest` with torch int64 ops on the words' device (wrapping arithmetic)."""
    lanes = []
    for lane in range(2):
        table = _index_table(words.device, lane)
        total = torch.zeros((), dtype=torch.int64, device=words.device)
        for slab, start in enumerate(range(0, words.numel(), _SLAB)):
            chunk = words[start:start + _SLAB]
            offset = _signed(mix64_int(slab + _LANE_SEEDS[lane]))
            total = total + mix64(chunk + table[: chunk.numel()] + offset).sum()
        lanes.append(int(total.item()) & _MASK64)
    return lanes[0], lanes[1]


def _digest_host(words: torch.Tensor) -> tuple[int, int]:
    """:func:`tensor_digest` of host words with numpy's uint64 (native wrapping and logical shifts,
    in place: ~4x torch's int64 ops on a CPU); the same value."""
    import numpy as np

    w = words.numpy().view(np.uint64)
    m1, m2 = np.uint64(_MIX1), np.uint64(_MIX2)
    s30, s27, s31 = np.uint64(30), np.uint64(27), np.uint64(31)
    lanes = []
    for lane in range(2):
        table = _index_table(torch.device("cpu"), lane).numpy().view(np.uint64)
        total = 0
        for slab, start in enumerate(range(0, w.size, _SLAB)):
            x = w[start:start + _SLAB] + table[: min(_SLAB, w.size - start)]
            x += np.uint64(mix64_int(slab + _LANE_SEEDS[lane]))
            x ^= x >> s30
            x *= m1
            x ^= x >> s27
            x *= m2
            x ^= x >> s31
            total += int(x.sum(dtype=np.uint64))
        lanes.append(total & _MASK64)
    return lanes[0], lanes[1]


def checksum(components: Mapping[str, Any], extra: Sequence[tuple[str, Any]] = (), *,
             algorithm: str = "mix128") -> str:
    """The fingerprint (``"<algorithm>:<hex>"``) of the denoiser's weights and ``extra``: what
    installed mechanisms add (``Mechanism.checksum_items``: the registered LoRA adapters' tensors
    ``(name, tensor)`` and text ``("", text)``), in order (see the module docs for the two algorithms)."""
    if algorithm not in CHECKSUM_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(CHECKSUM_ALGORITHMS)}, got {algorithm!r}")
    h = hashlib.sha256()

    def add(name: str, t: torch.Tensor) -> None:
        t = t.detach()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        if not t.numel():
            return
        if algorithm == "sha256":
            h.update(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            a, b = tensor_digest(t)
            h.update(a.to_bytes(8, "little") + b.to_bytes(8, "little"))

    for comp, module in sorted(denoiser_components(components).items()):
        for key, t in sorted(module.state_dict().items()):
            add(f"{comp}.{key}", t)
    for name, value in extra:
        if isinstance(value, str):
            h.update(value.encode())
        else:
            add(name, value)
    return f"{algorithm}:{h.hexdigest()}"


__all__ = ["apply_update", "checksum", "denoiser_components", "mix64", "plan_update", "read_source", "tensor_digest"]
