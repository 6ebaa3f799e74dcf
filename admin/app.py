"""The admin REST API of one kvtier deployment: health, status, metrics and cache operations.

`create_app(stack)` returns a FastAPI app bound to a running `kvtier.manager.stack.Stack`; it is
served by uvicorn on a thread of the manager process (`kvtier.admin.server.AdminServer`), so every
handler reads the manager's state directly:

* GET handlers read lock-free snapshots only (`KVCacheManager.stats()`, the supervisor's worker
  table, the storage counters), so polling the admin never delays a scheduler call.
* POST handlers are operations (reset, pause, resume, sleep, wake, pin, unpin) that take the
  manager's lock like any scheduler call. They are plain `def` handlers: FastAPI runs them on
  its thread pool, so a reset waiting for transfers never stalls the event loop serving
  /healthz and /metrics.

Every POST passes one gate (an ASGI middleware, so it runs before the body is parsed): 503 once
the server is shutting down; 401 unless it carries `Authorization: Bearer <token>` (compared in
constant time; only `admin.auth = "none"` lifts this); 413 when its body is larger than
`admin.max_body_bytes` (declared or streamed). A body that passes is parsed and validated:
422 with a one-line `detail` naming the field plus the full error list, whatever the input
(NaN, huge numbers, deep nesting); at most `admin.max_pin_tokens` token ids and
`admin.max_extra_keys` multimodal items per /pin or /unpin. Every status code an endpoint can
answer is in the OpenAPI document, with its body (`tests/test_openapi.py` runs schemathesis).
"""

from __future__ import annotations

import hmac
import json
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer
from kvtier.admin.metrics import build_registry
from kvtier.manager.config import AdminConfig, ConfigError
from kvtier.manager.errors import (
    AsleepError,
    InvalidRequestError,
    KvtierError,
    ResetBusyError,
    TransferTimeoutError,
)
from kvtier.manager.keys import MAX_CONTENT_HASH_BYTES
from kvtier.manager.launcher import WorkerStartError
from kvtier.manager.node.namespaces import STATUS_TENANTS
from kvtier.manager.node.server import NodeServer
from kvtier.manager.node.steering import (
    NamespaceSource,
    OneNamespace,
    SteeredNamespace,
    Steering,
)
from kvtier.manager.stack import Stack
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    StrictInt,
    WithJsonSchema,
    create_model,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

TOKEN_ID_MIN = -(2**31)
TOKEN_ID_MAX = 2**31 - 1
POSITION_MAX = 2**31 - 1
CONTENT_HASH_MAX_CHARS = MAX_CONTENT_HASH_BYTES // 4
"""A string content hash is used as its UTF-8 bytes (at most 4 a character), and the keys
encode a hash of at most 65,535 bytes."""

DEFAULT_RESET_TIMEOUT_S = 10.0
DRAIN_LIMIT_BYTES = 32 << 20
"""A POST refused before its body was read (401, 413, 503) has the rest of its body read and
dropped, up to this many bytes, so the answer reaches a client that sends the whole body
before it reads (issue 27); a larger one is answered and the connection closed."""
STORAGE_CLEAR_MIN_S = 10.0
"""/reset?storage=true: clearing storage gets at least this long, whatever `timeout` (which
bounds the wait for transfers in flight) says."""
INPUT_ECHO_LIMIT = 200
"""A 422's `errors[].input` longer than this (as JSON) is replaced by a short description:
a bad 4 MiB body is not sent back."""


class AdminState:
    """What the handlers share besides the stack: the metrics registry, the bearer token (bytes;
    None: no authentication, `admin.auth = "none"`), whether POSTs are still accepted, and the
    start time.

    `accepting` only ever goes from True to False (the server is shutting down)."""

    def __init__(self, stack: Stack, token: str | None,
                 node: NodeServer | None = None,
                 steered: NamespaceSource | None = None) -> None:
        self.stack = stack
        self.node = node
        self.token = None if token is None else token.encode()
        self.registry = build_registry(stack, node, steered)
        # name -> a section of /status an engine integration adds (the audit's figures)
        self.status_sections: dict[str, Callable[[], Any]] = {}
        self.started_at = time.monotonic()
        self._lock = threading.Lock()
        self.accepting = True
        self.refusal = ""

    def stop_accepting(self, reason: str) -> None:
        """Refuse every POST from now on with 503 and `reason` (GETs keep answering)."""
        with self._lock:
            self.accepting = False
            self.refusal = reason

    def authorized(self, header: str | None) -> bool:
        if self.token is None:
            return True
        if not header:
            return False
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(presented.strip().encode(), self.token)


# ---------------------------------------------------------------------------- request bodies



def _integral(value: object) -> object:
    """A JSON number without a fractional part (71.0) is an integer, as JSON Schema says;
    anything else is left for StrictInt to judge (strings, booleans and 1.5 are refused)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


JsonInt = Annotated[StrictInt, BeforeValidator(_integral)]
# Field before the validator: the other order loses the bounds from the JSON schema.
TokenId = Annotated[StrictInt, Field(ge=TOKEN_ID_MIN, le=TOKEN_ID_MAX),
                    BeforeValidator(_integral)]


def _content_hash(value: object) -> str | int:
    """One check with one message (a union type would report a failure per member)."""
    value = _integral(value)
    if isinstance(value, str):
        if not value:
            raise ValueError("a string content_hash must not be empty")
        if len(value) > CONTENT_HASH_MAX_CHARS:
            raise ValueError(f"a string content_hash may have at most {CONTENT_HASH_MAX_CHARS} "
                             f"characters, not {len(value)}")
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError("an integer content_hash must be >= 0")
        return value
    raise ValueError("content_hash must be a string or an integer")


ContentHash = Annotated[
    str | int,
    PlainValidator(_content_hash),
    WithJsonSchema({"anyOf": [
        {"type": "string", "minLength": 1, "maxLength": CONTENT_HASH_MAX_CHARS},
        {"type": "integer", "minimum": 0},
    ]}),
]


class ExtraKeyItem(BaseModel):
    """One multimodal item inside the prefix: it occupies tokens [offset, offset + length) and
    its content hash takes part in the keys of the blocks it overlaps (the same triple the
    engine passed to match/commit; a string hash is used as its UTF-8 bytes)."""

    model_config = ConfigDict(extra="forbid")

    offset: JsonInt = Field(ge=0, le=POSITION_MAX, description="first token of the item")
    length: JsonInt = Field(gt=0, le=POSITION_MAX, description="tokens the item occupies")
    content_hash: ContentHash = Field(
        description="content hash of the item: a non-empty string (at most "
        f"{CONTENT_HASH_MAX_CHARS} characters) or a non-negative integer")

    def as_tuple(self) -> tuple[int, int, str | int]:
        return (self.offset, self.length, self.content_hash)


class PrefixBody(BaseModel):
    """A prefix to pin or unpin: its token ids (and multimodal items, if any). The served
    model is `prefix_body(limits)`, this class with the configured list lengths."""

    model_config = ConfigDict(extra="forbid")

    token_ids: list[TokenId] = Field(min_length=1, description="token ids of the prefix (int32)")
    extra_keys: list[ExtraKeyItem] | None = Field(
        None, description="multimodal items of the prefix, as given to match")

    def extra(self) -> list[tuple[int, int, str | int]] | None:
        return [e.as_tuple() for e in self.extra_keys] if self.extra_keys else None


def prefix_body(limits: AdminConfig) -> type[PrefixBody]:
    """PrefixBody bounded by `admin.max_pin_tokens` and `admin.max_extra_keys` (so the
    OpenAPI document shows the bounds and validation enforces them with a 422)."""
    return create_model(
        "PrefixBody",
        __base__=PrefixBody,
        __doc__=PrefixBody.__doc__,
        token_ids=(list[TokenId], Field(
            min_length=1, max_length=limits.max_pin_tokens,
            description=f"token ids of the prefix (int32), at most {limits.max_pin_tokens} "
            "(admin.max_pin_tokens)")),
        extra_keys=(list[ExtraKeyItem] | None, Field(
            None, max_length=limits.max_extra_keys,
            description="multimodal items of the prefix, as given to match; at most "
            f"{limits.max_extra_keys} (admin.max_extra_keys)")),
    )


# ---------------------------------------------------------------------------- response bodies


class ErrorBody(BaseModel):
    """Why a request was refused, in one line."""

    detail: str


class ValidationErrorBody(BaseModel):
    """A bad body or query parameter: `detail` names the field(s) in one line, `errors` lists
    each problem (loc, msg, type, and the offending input when it is short)."""

    detail: str
    errors: list[dict[str, Any]]


class Health(BaseModel):
    alive: bool
    reason: str


class Readiness(BaseModel):
    ready: bool
    reason: str


class ResetResult(BaseModel):
    cleared: dict[str, int] = Field(description="what was cleared: tree nodes, device and host "
                                    "blocks, and storage pages with storage=true (once the "
                                    "storage clear is done)")
    storage: bool
    storage_clear: Literal["done", "running"] | None = Field(
        None, description="with storage=true: `done`, or `running` (202) when clearing storage "
        "outlasted the wait and goes on in the background (`storage.clears_running` in "
        "/status counts it until it is done)")
    namespaces: dict[str, dict[str, Any]] | None = Field(
        None, description="`kvtier serve` with its node socket: per namespace, what was "
        "cleared of the host tier its attached engines share (or the error that left it)")


class Paused(BaseModel):
    paused: bool


class SleepResult(BaseModel):
    asleep: bool
    cleared: dict[str, int] = Field(description="tree nodes, device and host blocks cleared; "
                                    "requests and transfer tasks cancelled")


class WakeResult(BaseModel):
    asleep: bool
    device_blocks: int = Field(description="device blocks per rank now")
    host_blocks: int = Field(description="host blocks per rank now")


class PinResult(BaseModel):
    pinned_blocks: int
    prefix_blocks: int


class UnpinResult(BaseModel):
    unpinned_blocks: int
    prefix_blocks: int


def _error(description: str, model: type[BaseModel] = ErrorBody,
           headers: Mapping[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description, "model": model}
    if headers:
        out["headers"] = dict(headers)
    return out


UNAUTHORIZED = _error(
    "no valid `Authorization: Bearer <token>` header (checked before the body is read)",
    headers={"WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}})
POST_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _error("the body cannot be parsed (JSON nested too deeply, a number too long)"),
    401: UNAUTHORIZED,
    413: _error("the body is larger than admin.max_body_bytes"),
    409: _error("the deployment is asleep (POST /wake first), or for /sleep and /wake: "
                "already asleep / not asleep"),
    422: _error("a bad body or query parameter", ValidationErrorBody),
    503: _error("kvtier is shutting down, or the stack is not running"),
}


# ---------------------------------------------------------------------------- JSON of anything


def json_safe(value: Any, depth: int = 0) -> Any:
    """`value` as something `json.dumps(allow_nan=False)` accepts: non-finite floats and
    unknown objects become strings, bytes are decoded, nesting is cut at 32 levels."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if depth >= 32:
        return "..."
    if isinstance(value, Mapping):
        return {str(k): json_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v, depth + 1) for v in value]
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def _echo(value: Any) -> Any:
    """An offending input as a 422 shows it: itself when short, else what it is."""
    safe = json_safe(value)
    try:
        text = json.dumps(safe)
    except (TypeError, ValueError, RecursionError):
        return f"<{type(value).__name__}>"
    if len(text) <= INPUT_ECHO_LIMIT:
        return safe
    if isinstance(value, str):
        return f"<string of {len(value)} characters>"
    if isinstance(value, list | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    return f"<{type(value).__name__}>"


def _errors(errors: Any) -> list[dict[str, Any]]:
    out = []
    for err in errors:
        item = {k: json_safe(v) for k, v in dict(err).items() if k not in ("input", "url")}
        if "input" in err:
            item["input"] = _echo(err["input"])
        out.append(item)
    return out


def _one_line(errors: list[dict[str, Any]]) -> str:
    parts = []
    for err in errors:
        where = ".".join(str(p) for p in err.get("loc", ()))
        msg = str(err.get("msg", "invalid"))
        cause = (err.get("ctx") or {}).get("error")
        if err.get("type") == "json_invalid" and cause:
            msg = f"{msg}: {cause}"
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts) or "invalid request"


# ---------------------------------------------------------------------------- the POST gate


def _json_bytes(status: int, detail: str, extra: Mapping[str, str] | None = None,
                close: bool = False) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (extra or {}).items()]
    if close:
        headers.append((b"connection", b"close"))
    return status, headers, body


class PostGate:
    """ASGI middleware in front of every POST: shutting down (503), not authorized (401), body
    larger than `max_body_bytes` (413, by Content-Length before reading, or while reading a
    chunked body; the connection is then closed so the rest is never read). A body that
    passes is read here and handed on whole."""

    def __init__(self, app: ASGIApp, state: AdminState, max_body_bytes: int) -> None:
        self.app = app
        self.state = state
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        limit = self.max_body_bytes
        declared = headers.get("content-length", "")
        # Issue 27: an answer given before the body was read, followed by a close with the
        # body unread, reached a client still sending (Python's urllib) as a connection
        # reset. The rest of such a body is read and dropped first, up to DRAIN_LIMIT_BYTES
        # (and within admin.request_timeout_s); a client that waits for 100-continue has
        # sent nothing and is answered at once.
        drain = (headers.get("expect", "").lower() != "100-continue"
                 and not (declared.isdigit() and int(declared) > DRAIN_LIMIT_BYTES))
        if not self.state.accepting:
            await self._answer(send, *_json_bytes(503, self.state.refusal),
                               receive=receive if drain else None)
            return
        if not self.state.authorized(headers.get("authorization")):
            await self._answer(send, *_json_bytes(
                401, "a valid 'Authorization: Bearer <token>' header is required",
                {"WWW-Authenticate": "Bearer"}), receive=receive if drain else None)
            return
        if declared.isdigit() and int(declared) > limit:
            await self._answer(send, *self._too_large(int(declared)),
                               receive=receive if drain else None)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left; nothing to answer
            body += message.get("body", b"")
            if len(body) > limit:
                more = message.get("more_body", False)
                await self._answer(send, *self._too_large(None),
                                   receive=receive if drain and more else None,
                                   read=len(body))
                return
            if not message.get("more_body", False):
                break
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self, declared: int | None) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        size = (f"{declared} bytes" if declared is not None
                else f"more than {self.max_body_bytes} bytes")
        return _json_bytes(413, f"the body has {size}; admin.max_body_bytes = "
                           f"{self.max_body_bytes}", close=True)

    @staticmethod
    async def _answer(send: Send, status: int, headers: list[tuple[bytes, bytes]],
                      body: bytes, *, receive: Receive | None = None, read: int = 0) -> None:
        """Send the answer; with `receive`, first read and drop the rest of the request's
        body (`read` bytes of it were read already), as long as it stays within
        DRAIN_LIMIT_BYTES."""
        while receive is not None and read <= DRAIN_LIMIT_BYTES:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left; nothing to answer
            read += len(message.get("body", b""))
            if not message.get("more_body", False):
                break
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


# ---------------------------------------------------------------------------- the app


def _typed(handler: Callable[..., Any], **annotations: Any) -> Callable[..., Any]:
    """`handler` with some parameter annotations replaced (FastAPI reads them to build the
    request model): the bounded PrefixBody subclass is only known when the app is built."""
    handler.__annotations__ = {**handler.__annotations__, **annotations}
    return handler


def create_app(stack: Stack, *, token: str | None = None,
               node: NodeServer | None = None, node_only: bool = False,
               steered: SteeredNamespace | None = None) -> FastAPI:
    """The admin app of `stack` (and of the node service `node`: its attached engines and
    namespaces in /status and /metrics, its namespaces emptied by /reset).

    Steering by token ids (`kvtier.admin.steering`) acts on `node`'s namespaces, or on
    `steered`, the one namespace of an embedded kvtier (`stack` keyed, inside an engine);
    with neither, its routes answer a one-line 409.

    `node_only` (`kvtier serve` with a `[node]` section alone): `stack` is never started;
    the probes follow the node service, /status and /reset are the node's, and the
    scheduler-API operations answer 503 (no stack runs).

    `token`: the bearer token every POST must carry. None: as configured, that is no token at
    all with `admin.auth = "none"`, `admin.token` when set, else a random token made now (read
    it from `app.state.admin.token`; `kvtier serve` writes it to the state file). An empty
    string is refused: running without authentication takes `admin.auth = "none"`."""
    limits = stack.cfg.admin
    if token is None:
        configured = limits.token.get_secret_value()
        if limits.auth == "none":
            token_or_none: str | None = None
        else:
            from kvtier.admin.auth import generate_token

            token_or_none = configured or generate_token()
    elif not token:
        raise ValueError("an empty admin token would accept anyone: set admin.auth = 'none' "
                         "to serve without authentication")
    else:
        token_or_none = token
    # the namespaces steered by token ids (issue 36): the node's, or an embedded kvtier's one
    source: NamespaceSource | None = (node.namespaces if node is not None
                                      else None if steered is None else OneNamespace(steered))
    state = AdminState(stack, token_or_none, node, source)
    alone = node_only and node is not None
    app = FastAPI(
        title="kvtier admin",
        version="0.1.0",
        description="Health, status, Prometheus metrics and cache operations of one kvtier "
        "deployment. Every POST needs `Authorization: Bearer <token>` (the configured "
        "admin.token, or the token `kvtier serve` generated and wrote to "
        "$XDG_STATE_HOME/kvtier/<deployment_id>/admin-token) unless admin.auth = \"none\". "
        f"POST bodies are limited to {limits.max_body_bytes} bytes (413).",
    )
    app.state.admin = state
    app.add_middleware(PostGate, state=state, max_body_bytes=limits.max_body_bytes)
    bearer = HTTPBearer(auto_error=False, description="admin.token / KVTIER_ADMIN_TOKEN, or "
                        "the generated token in the state file")
    post_security = [Security(bearer)] if state.token is not None else []
    body_model = prefix_body(limits)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = _errors(exc.errors())
        return JSONResponse({"detail": _one_line(errors), "errors": errors}, status_code=422)

    @app.exception_handler(InvalidRequestError)
    async def invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        detail = " ".join(str(exc).split())
        return JSONResponse({"detail": detail, "errors": [
            {"loc": ["body"], "msg": detail, "type": "value_error"}]}, status_code=422)

    @app.exception_handler(ResetBusyError)
    async def busy(request: Request, exc: ResetBusyError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(AsleepError)
    async def asleep(request: Request, exc: AsleepError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(KvtierError)
    async def unavailable(request: Request, exc: KvtierError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503)

    # ------------------------------------------------------------------ probes

    @app.get("/healthz", tags=["probes"], response_model=Health,
             responses={503: {"model": Health, "description": "a manager thread stopped"}})
    def healthz() -> JSONResponse:
        """200 while the manager's threads run (liveness); 503 with the reason otherwise."""
        ok, reason = (True, "node service only") if alone else stack.alive()
        return JSONResponse({"alive": ok, "reason": reason}, status_code=200 if ok else 503)

    @app.get("/readyz", tags=["probes"], response_model=Readiness,
             responses={503: {"model": Readiness,
                              "description": "a worker is not ready, or shutting down"}})
    def readyz() -> JSONResponse:
        """200 only while every worker is ready; 503 with the reason otherwise (starting,
        a rank dead or restarting, shutting down)."""
        if not state.accepting:
            return JSONResponse({"ready": False, "reason": state.refusal}, status_code=503)
        ok, reason = (True, "node service only") if alone else stack.ready()
        return JSONResponse({"ready": ok, "reason": reason}, status_code=200 if ok else 503)

    # ------------------------------------------------------------------ reads

    @app.get("/status", tags=["reads"],
             responses={503: _error("the stack is not running")})
    def status() -> dict[str, Any]:
        """Tiers (capacity, free, cached, in use; blocks and bytes), workers (rank, pid, state,
        heartbeat age, tasks in flight), hit rates per tier, paused flag, storage counters and
        the configuration summary (no secrets); an embedded kvtier's tenants (`tenants`:
        namespace -> the 32 tenants with the most host blocks, the rest as "(other)")."""
        if alone:
            out: dict[str, Any] = {"node_only": True, "deployment_id": stack.cfg.deployment_id}
            ready, why = True, "node service only"
        else:
            out = stack.status()
            ready, why = stack.ready()
        out["ready"] = {"ready": ready and state.accepting,
                        "reason": why if state.accepting else state.refusal}
        out["uptime_s"] = round(time.monotonic() - state.started_at, 3)
        if node is not None:
            out["node"] = node.status()
        elif steered is not None:  # embedded: its namespace's tenants (the node's are there)
            out["tenants"] = {steered.name: steered.tenant_figures(STATUS_TENANTS)}
        for name, section in list(state.status_sections.items()):
            out[name] = section()
        return out

    @app.get("/metrics", tags=["reads"], response_class=Response, responses={200: {
        "description": "Prometheus text exposition format 0.0.4",
        "content": {"text/plain": {"schema": {"type": "string"}}}}})
    def metrics() -> Response:
        """Prometheus text exposition (kvtier_* families and the process collector)."""
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------------ operations

    @app.post("/reset", tags=["operations"], dependencies=post_security,
              response_model=ResetResult, responses={
                  **POST_RESPONSES,
                  202: {"model": ResetResult, "description": "the caches were cleared; "
                        "clearing storage goes on in the background"},
                  409: _error("transfers did not finish within `timeout` (nothing was "
                              "cleared), storage=true without a storage tier, or the "
                              "deployment is asleep or a sleep or wake is under way"),
                  500: _error("reset incomplete: the caches were cleared but a rank failed "
                              "to clear storage")})
    def reset(
        storage: Annotated[bool, Query(description="also clear this deployment's storage")]
        = False,
        timeout: Annotated[float, Query(gt=0, le=300, description="seconds to wait for "
                                        "in-flight transfers before giving up (409)")]
        = DEFAULT_RESET_TIMEOUT_S,
    ) -> JSONResponse:
        """Empty the prefix tree and the device and host caches once in-flight transfers have
        finished (requests in flight keep their blocks). 200 with what was cleared; 202 when
        clearing storage outlasts the wait (it goes on in the background); 409 with the
        reason, having cleared nothing, when transfers do not finish within `timeout`, storage
        is asked for on a deployment without a storage tier, or a sleep conflicts. With the
        node socket open, every namespace's host tier is emptied too: every attached engine
        then recomputes."""
        if storage and stack.cfg.storage.backend == "none":
            return JSONResponse(
                {"detail": "storage=true but storage.backend = 'none': there is no storage "
                 "tier to clear; nothing was cleared"}, status_code=409)
        if alone and node is not None:  # no stack of its own: every namespace's host tier
            if storage:
                return JSONResponse(
                    {"detail": "storage=true: a node-only service clears no storage; "
                     "nothing was cleared"}, status_code=409)
            return JSONResponse({"cleared": {}, "storage": False, "storage_clear": None,
                                 "namespaces": node.reset()})
        stack.require_manager()  # 503 when the stack is not running
        try:
            cleared = stack.reset(storage=storage, timeout=timeout,
                                  storage_timeout=max(timeout, STORAGE_CLEAR_MIN_S))
        except (ResetBusyError, AsleepError):
            raise
        except Exception as e:  # only the storage step fails after the caches were emptied
            return JSONResponse(
                {"detail": "reset incomplete: the device and host caches were cleared but "
                 f"clearing storage failed: {type(e).__name__}: {e}"}, status_code=500)
        state = cleared.pop("storage_clear", None)
        out: dict[str, Any] = {"cleared": cleared, "storage": storage, "storage_clear": state}
        if node is not None:  # what every attached engine sees: each namespace's host tier
            out["namespaces"] = node.reset()
        return JSONResponse(out, status_code=202 if state == "running" else 200)

    @app.post("/pause", tags=["operations"], dependencies=post_security,
              response_model=Paused, responses=POST_RESPONSES)
    def pause() -> dict[str, bool]:
        """Hold every device transfer (e.g. during a weight update); storage I/O goes on."""
        stack.pause()
        return {"paused": True}

    @app.post("/resume", tags=["operations"], dependencies=post_security,
              response_model=Paused, responses=POST_RESPONSES)
    def resume() -> dict[str, bool]:
        """Let held transfers run again (409 while asleep: POST /wake resumes)."""
        stack.resume()
        return {"paused": False}

    @app.post("/sleep", tags=["operations"], dependencies=post_security,
              response_model=SleepResult, responses={
                  **POST_RESPONSES,
                  409: _error("already asleep; or a rank did not free its pools within "
                              "`timeout` (the deployment is asleep all the same: wake it)")})
    def sleep(
        timeout: Annotated[float, Query(gt=0, le=300, description="seconds every rank has "
                                        "to cancel its tasks and free its pools")] = 30.0,
    ) -> Any:
        """Free the KV pools for a weight update, without waiting for transfers: pause,
        empty the prefix tree, cancel active requests and in-flight transfers (their blocks
        are reclaimed, never served), free every rank's device and host pools. Scheduler
        calls, /reset, /pin, /unpin and /resume answer 409 until POST /wake."""
        stack.require_manager()
        try:
            return {"asleep": True, "cleared": stack.sleep(timeout)}
        except (TransferTimeoutError, WorkerStartError) as e:
            return JSONResponse({"detail": f"asleep, but {e}"}, status_code=409)

    @app.post("/wake", tags=["operations"], dependencies=post_security,
              response_model=WakeResult, responses={
                  **POST_RESPONSES,
                  409: _error("not asleep; pool sizes the configuration refuses or that do "
                              "not fit this machine now (still asleep, nothing changed); or a "
                              "rank could not re-create its pools within `timeout` (still "
                              "asleep: wake again, e.g. smaller)")})
    def wake(
        device_blocks: Annotated[int | None, Query(ge=1, le=2**31 - 1, description="device "
                                 "blocks per rank (default: as now)")] = None,
        host_blocks: Annotated[int | None, Query(ge=0, le=2**31 - 1, description="host "
                               "blocks per rank (default: as now)")] = None,
        timeout: Annotated[float | None, Query(gt=0, le=3600, description="seconds every "
                           "rank has to re-create its pools (default: "
                           "workers.ready_timeout_s)")] = None,
    ) -> JSONResponse:
        """Re-create the pools freed by /sleep, at new sizes when given (checked as at
        start: they must fit this machine), and serve again (resumed, tree status normal)."""
        stack.require_manager()
        try:
            sizes = stack.wake(device_blocks, host_blocks, timeout)
        except (ConfigError, TransferTimeoutError, WorkerStartError) as e:
            return JSONResponse({"detail": f"still asleep: {e}"}, status_code=409)
        return JSONResponse({"asleep": False, **sizes})

    def pin(body: PrefixBody) -> dict[str, int]:
        """Keep the cached full blocks of this prefix on the device until unpinned (host-only
        blocks are loaded). The pin stops at the first block that is not cached:
        `pinned_blocks` < `prefix_blocks` says how far it got."""
        m = stack.require_manager()
        n = m.pin(body.token_ids, body.extra())
        return {"pinned_blocks": n, "prefix_blocks": len(body.token_ids) // m.block_size}

    def unpin(body: PrefixBody) -> dict[str, int]:
        """Undo one pin of this prefix; returns how many blocks were unpinned."""
        m = stack.require_manager()
        n = m.unpin(body.token_ids, body.extra())
        return {"unpinned_blocks": n, "prefix_blocks": len(body.token_ids) // m.block_size}

    app.post("/pin", tags=["operations"], dependencies=post_security, response_model=PinResult,
             responses=POST_RESPONSES)(_typed(pin, body=body_model))
    app.post("/unpin", tags=["operations"], dependencies=post_security,
             response_model=UnpinResult, responses=POST_RESPONSES)(_typed(unpin, body=body_model))
    if source is not None:  # tenants, retention, lookup, warm, clear (issue 36)
        from kvtier.admin.steering import add_steering_routes

        add_steering_routes(app, Steering(source), post_security, POST_RESPONSES,
                            _error("the namespace is not served here (no engine of it "
                                   "attached)"))
    else:
        _steering_needs_a_node(app)
    return app


# The steering routes (kvtier.admin.steering) and their methods: an admin with no keyed
# namespace (a scheduler-API stack's `kvtier serve` without a node) answers them with one
# line instead of a bare 404
STEERING_ROUTES = (("GET", "/tenants"), ("POST", "/tenants/quota"), ("POST", "/lookup"),
                   ("POST", "/retain"), ("POST", "/retain/unpin"), ("POST", "/warm"),
                   ("POST", "/clear"))


def _steering_needs_a_node(app: FastAPI) -> None:
    """Mount STEERING_ROUTES as a 409 whose detail says where they are served (out of the
    OpenAPI document: this admin does not serve them): steering acts on engine blocks by
    token ids, which a scheduler-API stack does not hold (its /pin and /unpin do)."""

    async def needs_a_node(request: Request) -> JSONResponse:
        return JSONResponse({"detail": (
            f"{request.method} {request.url.path}: steering by token ids is served by "
            "`kvtier serve` with engines attached, or by an engine's embedded kvtier; this "
            "admin runs a scheduler-API stack (no engine's namespace; see /pin, /unpin)")},
            status_code=409)

    for method, path in STEERING_ROUTES:
        app.add_api_route(path, needs_a_node, methods=[method], include_in_schema=False)
