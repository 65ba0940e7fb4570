"""Deploy ``linear_precision``: how the denoiser's linear layers compute.

``dtype`` (the default, built in): every linear computes in the deploy's dtype. Any other name is a
:class:`~omniloop.family.LinearPrecisionSpec` a plugin registered through
``omniloop_register_linear_precisions`` (omniloop-quant registers ``fp8``: e4m3 GEMMs in the
transformer blocks). The runtime calls :func:`resolve` at load (before any weight is read),
:func:`apply` right after the family loaded its components, and :func:`check_request` per request.
The deploy's ``linear_precision_options`` are the precision's own (its ``options_schema``; omniloop-quant's
``fp8``: ``keep``, the block linears left in the deploy's dtype), checked in :func:`resolve`.
"""

from __future__ import annotations

from typing import Any

from .errors import DeployError, RequestError
from .family import LinearPrecisionSpec
from .schema import structure_params

#: the built-in precision: the deploy's own dtype
BUILTIN = "dtype"


def resolve(deployment: Any) -> LinearPrecisionSpec | None:
    """The deploy's precision spec (None for ``dtype``), after its own ``check`` passed; one
    :class:`DeployError` for an unknown name or a precision that cannot run in this deployment."""
    deploy = deployment.deploy
    name = deploy.linear_precision
    options = dict(getattr(deploy, "linear_precision_options", None) or {})
    if name == BUILTIN:
        if options:
            raise DeployError(f"linear_precision_options: given for linear_precision: {BUILTIN}, which takes none "
                              f"(got {sorted(options)}); name the precision they are for")
        return None
    spec: LinearPrecisionSpec | None = deployment.registry.linear_precisions.get(name)
    if spec is None:
        deployment.plugins.require(name, "linear precision")
        known = ", ".join([BUILTIN, *sorted(deployment.registry.linear_precisions)])
        hint = " (fp8 comes with omniloop-quant: pip install -e plugins/compute/quant)" if name == "fp8" else ""
        raise DeployError(f"linear_precision: unknown value {name!r} (available: {known}){hint}")
    check_options(spec, options)
    spec.check(deploy, deployment.family, deployment.device, deployment.dtype)
    return spec


def check_options(spec: LinearPrecisionSpec, options: dict[str, Any]) -> Any:
    """The deploy's ``linear_precision_options`` validated against ``spec.options_schema`` (None when
    it has none and none were given); one :class:`DeployError` naming the bad field."""
    if spec.options_schema is None:
        if options:
            raise DeployError(f"linear_precision_options: linear_precision {spec.name!r} takes no options, "
                              f"got {sorted(options)}")
        return None
    try:
        return structure_params(spec.options_schema, options, "linear_precision_options")
    except RequestError as exc:
        raise DeployError(f"deploy config: {exc}") from None


def apply(spec: LinearPrecisionSpec | None, model: Any, family: Any, deploy: Any) -> dict[str, Any] | None:
    """Convert a loaded model in place; the precision's report, or None for ``dtype``."""
    return None if spec is None else spec.apply(model, family, deploy)


def check_request(req: Any, spec: LinearPrecisionSpec | None) -> None:
    """Exact requests cannot run on linears whose precision alters outputs."""
    if req.exact and spec is not None and spec.distribution_altering:
        raise RequestError("exact", f"linear_precision {spec.name!r} alters outputs; exact requests cannot use it "
                                    "(deploy linear_precision: dtype)")
