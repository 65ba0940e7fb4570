"""Deploy ``linear_precision``: the precision of the denoiser's linear layers.

``dtype`` (default): every linear computes in the deploy's dtype. ``fp8``: the linears inside the
denoiser's transformer blocks run as e4m3 GEMMs (omniloop-quant, ``plugins/quant``) — faster on
GPUs with FP8 tensor cores (CUDA capability >= 8.9), distribution-altering, so ``exact: true``
requests are refused. The core only calls the package: :func:`check` before any weight loads,
:func:`apply` right after the family loaded its components, :func:`check_request` per request.
"""

from __future__ import annotations

from typing import Any

from .errors import DeployError, RequestError


def _quant() -> Any:
    try:
        import omniloop_quant
    except ImportError:
        raise DeployError("linear_precision: 'fp8' needs omniloop-quant: pip install -e plugins/quant") from None
    return omniloop_quant


def check(deploy: Any, family: Any, device: Any, dtype: Any) -> None:
    """One :class:`DeployError` when the deploy's ``linear_precision`` cannot run here."""
    if deploy.linear_precision != "dtype":
        _quant().check_deploy(deploy, family, device, dtype)


def apply(model: Any, family: Any, deploy: Any) -> dict[str, Any] | None:
    """Apply ``linear_precision`` to a loaded model (in place); its report, or None for ``dtype``."""
    if deploy.linear_precision == "dtype":
        return None
    report: dict[str, Any] | None = _quant().apply(model, family, deploy)
    return report


def check_request(req: Any, deploy: Any) -> None:
    """Exact requests cannot run on linears whose precision alters outputs."""
    if req.exact and deploy.linear_precision != "dtype":
        raise RequestError("exact", f"linear_precision {deploy.linear_precision!r} alters outputs; exact requests "
                                    "cannot use it (deploy linear_precision: dtype)")
