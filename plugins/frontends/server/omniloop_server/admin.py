"""Admin routes for post-training (issue 36): rollouts, weight updates, checksum, sleep/wake.

Off unless the deploy sets ``admin: {token_env: NAME}`` (``omniloop.deploy.AdminConfig``); then
every route needs ``Authorization: Bearer <token>`` with the token from the environment variable
``NAME`` (read when the app is built; an unset or empty variable refuses to start). A missing token
answers 401, a wrong one 403.

* ``POST /v1/rollout/generate`` — body: an omniloop request (the ``OmniRequest`` JSON, e.g. with
  ``rollout`` and ``diffusion.num_outputs``). Answers ``{"samples": [...]}``, one per output:
  ``request_id``, ``status``, ``seed``, ``weight_version``, ``error``, the ``trajectory``
  (``log_probs``, ``sde_mask``, ``sigmas``, ``timesteps`` as lists; ``latents`` as
  ``{"shape", "dtype": "float32", "data_b64"}``, little-endian bytes) and, for images,
  ``image_png_b64``.
* ``POST /v1/weights/update`` — body ``{"version": V, "source": S, "adapter": NAME?}``, ``S`` being
  ``{"safetensors_b64": ...}`` (a safetensors file's bytes) or ``{"file": NAME.safetensors}`` (a
  file in the deploy's ``admin.weights_dir``, named by file name only, never a path). Applied as
  :meth:`omniloop.Runtime.update_weights` (atomic; waits for the requests in flight). A refused
  update answers 422 naming the field (``source.<tensor>``, ``version``, ...), nothing changed.
* ``GET /v1/weights/checksum`` — ``{"checksum", "weight_version"}``; ``?algorithm=sha256`` for the
  host-side SHA-256 instead of the default ``mix128`` (:func:`omniloop_rl.weights.checksum`).
* ``POST /v1/sleep`` / ``POST /v1/wake`` — release / restore the weights' device memory
  (``{"asleep", "bytes_released"}``); requests are refused while asleep.
"""

from __future__ import annotations

import base64
import hmac
import io
import os
import re
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from omniloop.errors import DeployError, RequestError

#: the largest admin body (weights travel inline): 2 GiB
MAX_ADMIN_BODY_BYTES = 2 * 1024**3
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,199}\.safetensors")


def admin_token(deploy: Any) -> str | None:
    """The admin bearer token the deploy configures (None: admin routes off). Raises
    :class:`DeployError` when ``admin`` is set but its variable is unset or empty."""
    admin = deploy.admin
    if admin is None:
        return None
    token = os.environ.get(admin.token_env, "")
    if not token:
        raise DeployError(f"admin.token_env: the environment variable {admin.token_env} is unset or empty; "
                          "the admin routes need its bearer token")
    return token


def admin_routes(api: Any) -> list[Route]:
    """The admin routes for ``create_app`` (empty unless the deploy enables them)."""
    runtime = api.engine.runtime
    token = admin_token(runtime.deploy)
    if token is None:
        return []
    weights_dir = runtime.deploy.admin.weights_dir
    error = _error

    def auth(request: Request) -> Response | None:
        header = request.headers.get("authorization", "")
        if not header:
            return error(401, "this admin route needs 'Authorization: Bearer <token>'", param="Authorization",
                         code="unauthorized", headers={"WWW-Authenticate": "Bearer"})
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            return error(403, "wrong admin token", param="Authorization", code="forbidden")
        return None

    def admin_only(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """``handler`` behind the bearer-token check (401/403 before it runs)."""

        async def route(request: Request) -> Response:
            denied = auth(request)
            return denied if denied is not None else await handler(request)

        return route

    async def object_body(request: Request, expected: str) -> dict[str, Any]:
        # read in chunks (never re-copied), parsed off the event loop (a large one in a helper process)
        body = await api.read_json(request, MAX_ADMIN_BODY_BYTES, check=False)
        if not isinstance(body, dict):
            raise RequestError("body", f"expected a JSON object {expected}")
        return body

    @admin_only
    async def rollout_generate(request: Request) -> Response:
        try:
            body = await object_body(request, "(an omniloop request)")
            handles = await api.engine.submit_group_async(body, api.state.prepare_pool)
        except Exception as exc:
            return api.translate(exc, None)
        api.state.track(handles)
        outs = [await h.result() for h in handles]
        return JSONResponse({"samples": [_sample(o) for o in outs]})

    @admin_only
    async def weights_update(request: Request) -> Response:
        try:
            body = await object_body(request, "{version, source, adapter?}")
            unknown = sorted(set(body) - {"version", "source", "adapter", "timeout"})
            if unknown:
                raise RequestError(unknown[0], "unknown field (expected version, source, adapter, timeout)")
            version = body.get("version")
            if not isinstance(version, str):
                raise RequestError("version", "a string is required")
            adapter = body.get("adapter")
            if adapter is not None and not isinstance(adapter, str):
                raise RequestError("adapter", "must be a string (an adapter name)")
            timeout = body.get("timeout", 600)
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
                raise RequestError("timeout", "must be a number of seconds in (0, 3600]")
            source, cleanup = _source(body.get("source"), adapter is not None, weights_dir)
        except Exception as exc:
            return api.translate(exc, None)
        from omniloop.weights import WeightUpdateError

        try:
            checksum = await run_in_threadpool(runtime.update_weights, source, version=version, adapter=adapter,
                                               timeout=float(timeout))
        except WeightUpdateError as exc:
            status = 409 if exc.path == "timeout" else 422
            return error(status, exc.message, param=exc.path, code="weights_refused")
        finally:
            if cleanup is not None:
                cleanup()
        return JSONResponse({"weight_version": runtime.weight_version, "checksum": checksum})

    @admin_only
    async def weights_checksum(request: Request) -> Response:
        from omniloop.weights import CHECKSUM_ALGORITHMS, RuntimeAsleep

        unknown = sorted(set(request.query_params) - {"algorithm"})
        if unknown:
            return error(422, "unknown query parameter (expected algorithm)", param=unknown[0], code="invalid_request")
        algorithm = request.query_params.get("algorithm", CHECKSUM_ALGORITHMS[0])
        if algorithm not in CHECKSUM_ALGORITHMS:
            return error(422, f"must be one of {', '.join(CHECKSUM_ALGORITHMS)}", param="algorithm", code="invalid_request")
        try:
            checksum = await run_in_threadpool(runtime.weights_checksum, algorithm)
        except RuntimeAsleep as exc:
            return error(409, str(exc), code="asleep")
        return JSONResponse({"checksum": checksum, "weight_version": runtime.weight_version})

    @admin_only
    async def sleep(request: Request) -> Response:
        released = await run_in_threadpool(runtime.sleep)
        return JSONResponse({"asleep": True, "bytes_released": released})

    @admin_only
    async def wake(request: Request) -> Response:
        await run_in_threadpool(runtime.wake)
        return JSONResponse({"asleep": False})

    return [
        Route("/v1/rollout/generate", rollout_generate, methods=["POST"]),
        Route("/v1/weights/update", weights_update, methods=["POST"]),
        Route("/v1/weights/checksum", weights_checksum, methods=["GET"]),
        Route("/v1/sleep", sleep, methods=["POST"]),
        Route("/v1/wake", wake, methods=["POST"]),
    ]


def _error(status: int, message: str, *, param: str | None = None, code: str | None = None,
           headers: dict[str, str] | None = None) -> Response:
    from .app import error

    kind = "authentication_error" if status in (401, 403) else "invalid_request_error"
    return error(status, message, type_=kind, param=param, code=code, headers=headers)


def _source(source: Any, adapter: bool, weights_dir: str | None) -> tuple[Any, Any]:
    """The update's source for ``Runtime.update_weights`` and a cleanup (a temp file) or None."""
    if not isinstance(source, dict) or len(source) != 1:
        raise RequestError("source", "expected {\"safetensors_b64\": ...} or {\"file\": NAME.safetensors}")
    (key, value), = source.items()
    if key == "file":
        if weights_dir is None:
            raise RequestError("source.file", "this deployment names no admin.weights_dir; send safetensors_b64")
        if not isinstance(value, str) or not _FILE_NAME.fullmatch(value):
            raise RequestError("source.file", "a file name (letters, digits, _ . + = -) ending in .safetensors, no path")
        path = Path(weights_dir) / value
        if not path.is_file():
            raise RequestError("source.file", f"no file {value!r} in the deployment's weights_dir")
        return path, None
    if key != "safetensors_b64":
        raise RequestError(f"source.{key}", "unknown source (expected safetensors_b64 or file)")
    if not isinstance(value, str):
        raise RequestError("source.safetensors_b64", "must be a base64 string")
    try:
        data = base64.b64decode(value, validate=True)
    except ValueError:
        raise RequestError("source.safetensors_b64", "not valid base64") from None
    if adapter:  # adapters are read from a file: one the server names itself
        fd, name = tempfile.mkstemp(prefix="omniloop-adapter-", suffix=".safetensors")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return name, lambda: os.unlink(name)
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(data), None
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise RequestError("source.safetensors_b64", f"not a safetensors file ({str(exc)[:200]})") from None


def _sample(out: Any) -> dict[str, Any]:
    from omniloop.artifacts import Image as ImageArtifact

    row: dict[str, Any] = {
        "request_id": out.request_id, "status": out.status.value, "seed": out.metrics.get("seed"),
        "weight_version": out.metrics.get("weight_version"),
        "error": {"message": out.error.message, "node": out.error.node} if out.error is not None else None,
    }
    tr = out.artifacts.get("trajectory")
    if tr is not None:
        lat = tr.latents.detach().float().contiguous()
        row["trajectory"] = {
            "kind": tr.kind, "noise_level": tr.noise_level,
            "log_probs": tr.log_probs.tolist(), "sde_mask": tr.sde_mask.tolist(), "sigmas": tr.sigmas.tolist(),
            "timesteps": tr.timesteps.tolist(),
            "latents": {"shape": list(lat.shape), "dtype": "float32",
                        "data_b64": base64.b64encode(lat.numpy().astype("<f4").tobytes()).decode("ascii")},
        }
    img = out.artifacts.get("image")
    if isinstance(img, ImageArtifact):
        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(img.pixels.numpy()).save(buf, format="PNG")
        row["image_png_b64"] = base64.b64encode(buf.getvalue()).decode("ascii")
    return row
