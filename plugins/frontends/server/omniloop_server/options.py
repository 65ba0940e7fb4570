"""``ServerOptions``: the deploy's ``server:`` section — what one client may ask of ``omniloop serve``.

Every limit here is checked before work proportional to the input: the body size as it streams in
(per endpoint), then prompt characters, messages and parts, and an input image's pixel count from
its header (never decoded first). Request preparation (mapping, tokenising, image decoding,
resolve) runs in :attr:`ServerOptions.prepare_threads` worker threads, never on the event loop.

::

    server:
      max_prompt_chars: 32768        # one prompt / negative prompt / message / text part
      max_text_chars: 262144         # all the text of one request
      max_body_bytes: 33554432       # POST /v1/videos, /v1/images/* (a base64 image is a field)
      max_text_body_bytes: 4194304   # POST /v1/chat/completions, /v1/completions
      max_image_pixels: null         # null: 4 x limits.max_height x limits.max_width, at most 2**25
      prepare_threads: 2
      json_process_bytes: 1048576    # a JSON body this large or larger is parsed in a helper
                                     # process (json.loads holds the GIL); null: always in a thread
      max_connections: 512           # HTTP connections and WebSockets at once (uvicorn's
                                     # limit_concurrency; 503 beyond); keep it below `ulimit -n`
      max_connections_per_client: 64 # HTTP connections from one client address
      keep_alive_timeout_s: 5        # an idle keep-alive connection is closed after this
      header_timeout_s: 10           # a connection whose request headers are not complete by then
      body_timeout_s: 30             # a request body that stalls this long between chunks: 408
      ws_start_timeout_s: 10         # a WebSocket that sends no start message by then is closed
      ws_idle_timeout_s: 300         # a WebSocket idle between requests is closed (its session freed)
      max_sessions: 3                # causal sessions kept by WebSockets at once (the KV pool keeps
                                     # room for one-off streams beyond them)
      max_sessions_per_client: 2     # ... per client address
      session_kv_share: 0.25         # the share of the KV pool one session may grow to (then a
                                     # continue is refused and the session closed)
      retry_after_s: 5               # the retry hint of a refusal for lack of room
      kv_full: refuse                # a request whose KV blocks are not free now: refuse (429 with
                                     # Retry-After / a WebSocket error with retry_after_s) or queue
      max_request_cost: null         # step-forward-pixels one request may cost (null: no limit)
      max_inflight_cost: null        # ... all admitted, unfinished requests together (429 beyond)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from attrs import define, field

from omniloop.errors import OmniloopError, RequestError
from omniloop.schema import structure_deploy_section

#: the largest input image whatever the deployment's limits (Pillow refuses at ~179 M pixels only)
MAX_IMAGE_PIXELS = 2**25


@define(frozen=True)
class ServerOptions:
    max_prompt_chars: int = field(default=32_768, metadata={"ge": 1})
    max_text_chars: int = field(default=262_144, metadata={"ge": 1})
    max_body_bytes: int = field(default=32 * 1024 * 1024, metadata={"ge": 1024})
    max_text_body_bytes: int = field(default=4 * 1024 * 1024, metadata={"ge": 1024})
    max_image_pixels: int | None = field(default=None, metadata={"ge": 1, "le": MAX_IMAGE_PIXELS})
    prepare_threads: int = field(default=2, metadata={"ge": 1, "le": 64})
    #: a JSON body of at least this many bytes is parsed in a helper process, not a thread:
    #: json.loads keeps the GIL for the whole body (a 30 MB body stalled the event loop for
    #: 100+ ms); None: every body in a preparation thread
    json_process_bytes: int | None = field(default=1024 * 1024, metadata={"ge": 1})
    max_connections: int = field(default=512, metadata={"ge": 1})
    max_connections_per_client: int = field(default=64, metadata={"ge": 1})
    keep_alive_timeout_s: float = field(default=5.0, metadata={"gt": 0.0, "le": 3600.0})
    header_timeout_s: float = field(default=10.0, metadata={"gt": 0.0, "le": 3600.0})
    #: a request body whose next chunk does not arrive within this many seconds is answered 408 and
    #: its connection closed (a half-sent body never holds a connection for long)
    body_timeout_s: float = field(default=30.0, metadata={"gt": 0.0, "le": 3600.0})
    ws_start_timeout_s: float = field(default=10.0, metadata={"gt": 0.0, "le": 3600.0})
    ws_idle_timeout_s: float = field(default=300.0, metadata={"gt": 0.0, "le": 86400.0})
    max_sessions: int = field(default=3, metadata={"ge": 0})
    max_sessions_per_client: int = field(default=2, metadata={"ge": 0})
    #: the share of a causal KV pool one kept session may hold: a continue beyond it is refused
    #: (and the session closed), so sessions never take the room of one-off streams
    session_kv_share: float = field(default=0.25, metadata={"gt": 0.0, "le": 1.0})
    retry_after_s: int = field(default=5, metadata={"ge": 1, "le": 3600})
    #: a request whose KV reservation (a causal stream's slabs, a text sequence's blocks) does not
    #: fit the pool's free blocks when it is prepared: "refuse" answers 429 with a Retry-After
    #: (kept sessions may hold the pool for minutes: a queued request would wait silently), "queue"
    #: lets the step scheduler hold it until blocks are freed
    kv_full: Literal["refuse", "queue"] = "refuse"
    #: the most one request may cost, in step-forward-pixels (its resolved workload: steps x
    #: forwards per step x frames x height x width; a text request: its max tokens); None: no limit
    max_request_cost: int | None = field(default=None, metadata={"ge": 1})
    #: the most all admitted, unfinished requests may cost together (step-forward-pixels): a request
    #: that would exceed it is answered 429 with Retry-After (one request alone is always admitted,
    #: so nothing under max_request_cost waits forever); None: no limit
    max_inflight_cost: int | None = field(default=None, metadata={"ge": 1})

    def image_pixels(self, limits: Any) -> int:
        """The pixel cap of an input image: the option, else four output images of the largest size."""
        if self.max_image_pixels is not None:
            return self.max_image_pixels
        try:
            cap = 4 * int(limits.max_height) * int(limits.max_width)
        except (AttributeError, TypeError, ValueError):
            cap = MAX_IMAGE_PIXELS
        return min(cap, MAX_IMAGE_PIXELS)


def parse_server_options(raw: Mapping[str, Any] | ServerOptions | None) -> ServerOptions:
    return structure_deploy_section(ServerOptions, raw, "server")


def request_cost(execution: Any) -> int | None:
    """A prepared request's cost from its family's resolved workload (None: the family predicts none)."""
    resolved = getattr(execution, "resolved", None)
    fn = getattr(resolved, "workload", None)
    if not callable(fn):
        return None
    w = fn()
    return int(w.steps) * int(w.branches) * int(w.pixels)


def cost_check(limit: int | None) -> Any:
    """``check(execution)`` for :meth:`AsyncEngine.submit_async`: refuses a request costing more than ``limit``."""
    if limit is None:
        return None

    def check(execution: Any) -> None:
        cost = request_cost(execution)
        if cost is not None and cost > limit:
            w = execution.resolved.workload()
            raise RequestError("diffusion.steps", f"this request costs {cost} step-forward-pixels ({w.steps} steps x "
                                                  f"{w.branches} forward(s) x {w.pixels} output pixels), more than this "
                                                  f"server takes ({limit}; deploy server.max_request_cost): ask for fewer "
                                                  "steps, frames or pixels")

    return check


class NoRoom(OmniloopError):
    """Not enough room now for a request (``code``: ``kv_cache_full`` — its KV blocks, ``server_busy``
    — the in-flight cost budget): the client may retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: int, code: str = "kv_cache_full") -> None:
        super().__init__(message)
        self.message, self.retry_after_s, self.code = message, retry_after_s, code


def kv_room_check(opts: ServerOptions) -> Any:
    """``check(execution)``: a request whose KV reservation does not fit its pool's free blocks now
    raises :class:`NoRoom` (``server.kv_full: refuse``); None with ``kv_full: queue``. A request
    larger than the whole pool is left to the family's own refusal (retrying would not help)."""
    if opts.kv_full == "queue":
        return None
    from omniloop_scheduler.pool import execution_kv_demand

    def check(execution: Any) -> None:
        demand = execution_kv_demand(execution)
        if demand is None:
            return
        pool, blocks, _ = demand
        free, total = int(pool.free_blocks), int(getattr(pool, "num_blocks", blocks))
        if free < blocks <= total:
            raise NoRoom(f"no room in the KV cache now: this request needs {blocks} blocks of "
                         f"{getattr(pool, 'name', 'the pool')!r}, {free} of {total} are free (held by running "
                         f"requests and kept sessions); retry after {opts.retry_after_s} s", opts.retry_after_s)

    return check


def admission_check(*checks: Any) -> Any:
    """One ``check(execution)`` running each of ``checks`` that is not None (None when none is)."""
    active = [c for c in checks if c is not None]
    if not active:
        return None

    def check(execution: Any) -> None:
        for c in active:
            c(execution)

    return check


class CostBudget:
    """The cost of admitted, unfinished requests against ``server.max_inflight_cost``.

    :meth:`check` (a ``submit_async`` check, in a preparation thread) reserves a request's cost or
    raises :class:`NoRoom`; :meth:`release` gives it back when the request ends or was not queued."""

    def __init__(self, limit: int, retry_after_s: int) -> None:
        import threading

        self.limit, self.retry_after_s = limit, retry_after_s
        self.held: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return sum(self.held.values())

    def check(self, execution: Any) -> None:
        cost = request_cost(execution) or 0
        with self._lock:
            used = sum(self.held.values())
            if self.held and used + cost > self.limit:
                raise NoRoom(f"the server is busy: this request costs {cost} step-forward-pixels and "
                             f"{used} of {self.limit} are in flight (deploy server.max_inflight_cost); "
                             f"retry after {self.retry_after_s} s", self.retry_after_s, "server_busy")
            self.held[execution.request_id] = cost

    def release(self, request_id: str) -> None:
        with self._lock:
            self.held.pop(request_id, None)


def check_texts(requests: list[dict[str, Any]], opts: ServerOptions, origins: Any = None) -> None:
    """Prompt characters, per field and per request, before anything tokenises them."""
    for r in requests:
        total = 0
        fields: list[tuple[str, Any]] = [("prompt", r.get("prompt")), ("negative_prompt", r.get("negative_prompt"))]
        for i, part in enumerate(r.get("inputs") or []):
            if isinstance(part, Mapping) and part.get("type", "text") == "text":
                fields.append((f"inputs.{i}.text", part.get("text")))
        for path, text in fields:
            if not isinstance(text, str):
                continue
            if len(text) > opts.max_prompt_chars:
                raise RequestError(path, f"at most {opts.max_prompt_chars} characters, got {len(text)} "
                                         "(deploy server.max_prompt_chars)")
            total += len(text)
        if total > opts.max_text_chars:
            raise RequestError("inputs", f"at most {opts.max_text_chars} characters of text per request, got {total} "
                                         "(deploy server.max_text_chars)")


#: tasks whose requests take no input image (text to video / image): an image part is refused, not ignored
NO_IMAGE_TASKS = frozenset({"t2v", "t2i"})


def check_image_use(requests: list[dict[str, Any]]) -> None:
    """An input image part in a request whose task reads none (``t2v``, ``t2i``) is refused before
    any work, naming the part — the pipeline would ignore it silently (the CLI refuses ``--image``)."""
    for r in requests:
        task = r.get("task")
        if task not in NO_IMAGE_TASKS:
            continue
        for i, part in enumerate(r.get("inputs") or []):
            if isinstance(part, Mapping) and part.get("type") == "image":
                how = ("send it as input_reference (image to video)" if task == "t2v"
                       else "edit an image with POST /v1/images/edits")
                raise RequestError(f"inputs.{i}", f"a {task} request takes no input image (it would be ignored): "
                                                  f"{how}, or drop the image part")


def check_images(requests: list[dict[str, Any]], max_pixels: int) -> None:
    """Each base64 input image's size read from its header (never decoded here) against ``max_pixels``."""
    import base64
    import binascii

    for r in requests:
        for i, part in enumerate(r.get("inputs") or []):
            if not isinstance(part, Mapping) or part.get("type") != "image" or not isinstance(part.get("data_b64"), str):
                continue
            path = f"inputs.{i}.data_b64"
            try:
                data = base64.b64decode(part["data_b64"], validate=False)
            except (binascii.Error, ValueError):
                continue  # the family's decoder names it
            w, h = image_size(data)
            if w is not None and h is not None and w * h > max_pixels:
                raise RequestError(path, f"input image of {w}x{h} = {w * h} pixels; this server takes at most "
                                         f"{max_pixels} (deploy server.max_image_pixels)")


def image_size(data: bytes) -> tuple[int | None, int | None]:
    """(width, height) from an image's header (Pillow opens lazily: no pixel is decoded)."""
    import io
    import warnings

    try:
        from PIL import Image
    except ImportError:
        return None, None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(data)) as img:
                return int(img.size[0]), int(img.size[1])
    except Image.DecompressionBombError:
        return 1 << 16, 1 << 16  # larger than any cap
    except Exception:
        return None, None  # not an image: the family's decoder refuses it with its message


__all__ = [
    "MAX_IMAGE_PIXELS",
    "CostBudget",
    "NoRoom",
    "ServerOptions",
    "admission_check",
    "check_image_use",
    "check_images",
    "check_texts",
    "cost_check",
    "image_size",
    "kv_room_check",
    "parse_server_options",
    "request_cost",
]
