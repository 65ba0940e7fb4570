"""Stored references (goldens) that hold on any x86-64 CPU.

A golden is a set of tensors recorded once and committed. On CPU, torch's float32 kernels are
chosen by instruction set at run time — ATen's vectorised kernels by ``ATEN_CPU_CAPABILITY``
(DEFAULT / AVX2 / AVX512), oneDNN's by the CPU's ISA (capped by ``ONEDNN_MAX_CPU_ISA``), MKL's by
the CPU model — and kernels of different widths sum in different orders and use different
``exp``/``tanh`` approximations. So a golden replays *bit for bit* only where it was recorded; on
another CPU it differs by float32 round-off (a few units of ``2**-23`` relative to the tensor's
magnitude, amplified by the model's depth and by classifier-free guidance).

The rule this module supports:

* record :func:`cpu_fingerprint` with the golden (:func:`stamp_fingerprint` writes it into the
  safetensors metadata under :data:`FINGERPRINT_KEY`);
* when :func:`fingerprint_differences` between the golden's and this process's fingerprint is
  empty, compare bit for bit (``torch.equal``);
* otherwise compare with a tolerance stated in the test in units of float32 round-off:
  :func:`roundoff_atol` gives ``ulps * 2**-23 * max|reference|`` for a float tensor, and one
  quantisation level for an integer tensor (a uint8 video frame: a float a little off a rounding
  boundary can round to the neighbouring level, never further). :func:`level_flip_fraction` says
  how many integer elements moved, so a test can bound that too.

A golden without a fingerprint (written by another tool) counts as recorded on an unknown CPU:
it is always compared with the tolerance. The fingerprint errs on the side of "different" (every
setting that can change a CPU kernel is in it), which only costs bit-exactness, never a false
failure. Reading and writing the metadata needs the ``safetensors`` package (imported lazily).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

FINGERPRINT_KEY = "omniloop_cpu_fingerprint"
FLOAT32_EPS = 2.0**-23  # the spacing of float32 numbers in [1, 2): one unit in the last place at 1.0

# CPU flags (Linux /proc/cpuinfo names) that select a different torch / oneDNN / MKL / numpy kernel
_ISA_FLAGS = (
    "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni",
    "avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
    "asimd", "sve", "sve2",  # aarch64, for completeness
)  # fmt: skip
# environment settings that cap or pin the kernels each library picks (ATEN_CPU_CAPABILITY is not
# here: the capability ATen actually uses is, as "aten_cpu_capability")
_ISA_ENV = (
    "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_DEFAULT_FPMATH_MODE",
    "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "MKL_DEBUG_CPU_TYPE", "NPY_DISABLE_CPU_FEATURES", "NPY_ENABLE_CPU_FEATURES",
)  # fmt: skip


def _cpuinfo() -> tuple[str, list[str]]:
    """(vendor and model name, ISA flags) of the first CPU, from /proc/cpuinfo where there is one."""
    model, flags = "", []
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return platform.processor() or "unknown", []
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    model = " ".join(v for v in (fields.get("vendor_id"), fields.get("model name")) if v) or platform.processor()
    have = set((fields.get("flags") or fields.get("features") or "").split())
    flags = [f for f in _ISA_FLAGS if f in have]
    return model or "unknown", flags


def _cache_sizes() -> str:
    """The first CPU's caches, e.g. ``L1d 32K L1i 32K L2 512K L3 32768K`` (oneDNN and MKL block their
    GEMMs by cache size, so two CPUs of one ISA can still sum in different orders); "" when unknown."""
    out = []
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind, size = ((index / f).read_text().strip() for f in ("level", "type", "size"))
        except OSError:
            continue
        suffix = {"Data": "d", "Instruction": "i"}.get(kind, "")
        out.append(f"L{level}{suffix} {size}")
    return " ".join(out)


def cpu_fingerprint() -> dict[str, str]:
    """What decides which float32 CPU kernels this process runs, as strings.

    The CPU (vendor, model, ISA flags, cache sizes), ATen's CPU capability, the environment settings that cap
    oneDNN / MKL / numpy, torch's version (which pins its oneDNN and MKL), numpy's, the C library,
    Python, and torch's intra-op thread count (reductions are split per thread).
    """
    model, flags = _cpuinfo()
    fp = {
        "machine": platform.machine(),
        "cpu": model,
        "cpu_flags": " ".join(flags),
        "cpu_caches": _cache_sizes(),
        "aten_cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "torch": torch.__version__,
        "torch_threads": str(torch.get_num_threads()),
        "libc": " ".join(platform.libc_ver()).strip(),
        "python": platform.python_version(),
    }
    try:
        import numpy

        fp["numpy"] = numpy.__version__
    except ImportError:
        fp["numpy"] = "absent"
    for name in _ISA_ENV:
        fp[f"env:{name}"] = os.environ.get(name, "")
    return fp


def fingerprint_differences(recorded: Mapping[str, str] | None, current: Mapping[str, str] | None = None) -> list[str]:
    """Why a golden recorded under ``recorded`` may not replay bit for bit here; [] when it may.

    ``current`` defaults to :func:`cpu_fingerprint`. ``recorded`` None (no fingerprint stored)
    gives one reason saying so.
    """
    if recorded is None:
        return ["the golden has no CPU fingerprint (recorded on an unknown CPU)"]
    now = cpu_fingerprint() if current is None else current
    return [
        f"{k}: {recorded.get(k, '<unset>')!r} when recorded, {now.get(k, '<unset>')!r} here"
        for k in sorted(set(recorded) | set(now))
        if recorded.get(k) != now.get(k)
    ]


def read_fingerprint(path: str | os.PathLike[str]) -> dict[str, str] | None:
    """The CPU fingerprint stored in a safetensors file's metadata, or None when it has none."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get(FINGERPRINT_KEY)
    if raw is None:
        return None
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: {FINGERPRINT_KEY} metadata is not a JSON object")
    return {str(k): str(v) for k, v in data.items()}


def stamp_fingerprint(path: str | os.PathLike[str], fingerprint: Mapping[str, str] | None = None) -> dict[str, str]:
    """Store ``fingerprint`` (default: this process's) in a safetensors file's metadata.

    Tensors and the other metadata are kept; the file is rewritten atomically (a temporary file in
    the same folder, then ``os.replace``). Returns the fingerprint written.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    p = Path(path)
    fp = dict(cpu_fingerprint() if fingerprint is None else fingerprint)
    with safe_open(str(p), framework="pt") as f:
        meta = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta[FINGERPRINT_KEY] = json.dumps(fp, sort_keys=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        os.chmod(tmp, p.stat().st_mode & 0o777)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return fp


def roundoff_atol(reference: torch.Tensor, ulps: float) -> float:
    """The absolute tolerance for comparing to ``reference`` computed on another CPU.

    Float tensors: ``ulps * FLOAT32_EPS * max|reference|`` — ``ulps`` units of float32 round-off
    at the tensor's largest magnitude (the test states ``ulps`` and why). Integer tensors (uint8
    video): 1, one quantisation level. Empty or all-zero float tensors: 0.
    """
    if ulps < 0:
        raise ValueError(f"roundoff_atol: ulps must be >= 0, got {ulps!r}")
    if not (reference.is_floating_point() or reference.is_complex()):
        return 1.0
    if reference.numel() == 0:
        return 0.0
    finite = reference.detach().abs().double()
    finite = finite[torch.isfinite(finite)]
    scale = float(finite.max()) if finite.numel() else 0.0
    return ulps * FLOAT32_EPS * scale


def level_flip_fraction(reference: torch.Tensor, other: torch.Tensor) -> float:
    """The fraction of elements of two integer tensors that differ (0.0 for empty tensors)."""
    if reference.shape != other.shape:
        raise ValueError(f"level_flip_fraction: shapes differ, {tuple(reference.shape)} vs {tuple(other.shape)}")
    if reference.numel() == 0:
        return 0.0
    return float((reference != other).sum()) / reference.numel()
