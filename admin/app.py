"""The admin REST API of one kvtier deployment: health, status, metrics and cache operations.

`create_app(stack)` returns a FastAPI app bound to a running `kvtier.manager.stack.Stack`; it is
served by uvicorn on a thread of the manager process (`kvtier.admin.server.AdminServer`), so every
handler reads the manager's state directly:

* GET handlers read lock-free snapshots only (`KVCacheManager.stats()`, the supervisor's worker
  table, the storage counters), so polling the admin never delays a scheduler call.
* POST handlers are operations (reset, pause, resume, pin, unpin) that take the manager's lock
  like any scheduler call. They are plain `def` handlers: FastAPI runs them on its thread pool,
  so a reset waiting for transfers never stalls the event loop serving /healthz and /metrics.

Every POST passes one gate (a middleware, so it runs before the body is even parsed):
refused with 503 once the server is shutting down, and with 401 unless it carries
`Authorization: Bearer <admin.token>` when a token is configured (compared in constant time).
Bad bodies get 422 with a one-line `detail` naming the field, plus the full error list.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request, Security
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer
from kvtier.admin.metrics import build_registry
from kvtier.manager.errors import InvalidRequestError, KvtierError, ResetBusyError
from kvtier.manager.stack import Stack
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, StrictInt

TOKEN_ID_MIN = -(2**31)
TOKEN_ID_MAX = 2**31 - 1
MAX_PIN_TOKENS = 1 << 24
"""Upper bound on one pin body's token ids (16 Mi tokens): far above any context length, and a
bound on what one request can make the manager hash under its lock."""

DEFAULT_RESET_TIMEOUT_S = 10.0


class AdminState:
    """What the handlers share besides the stack: the metrics registry, the bearer token (bytes;
    empty means none), whether POSTs are still accepted, and the start time.

    `accepting` only ever goes from True to False (the server is shutting down)."""

    def __init__(self, stack: Stack, token: str) -> None:
        self.stack = stack
        self.token = token.encode()
        self.registry = build_registry(stack)
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
        if not self.token:
            return True
        if not header:
            return False
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(presented.strip().encode(), self.token)


# ---------------------------------------------------------------------------- request bodies

TokenId = Annotated[StrictInt, Field(ge=TOKEN_ID_MIN, le=TOKEN_ID_MAX)]


class ExtraKeyItem(BaseModel):
    """One multimodal item inside the prefix: it occupies tokens [offset, offset + length) and
    its content hash takes part in the keys of the blocks it overlaps (the same triple the
    engine passed to match/commit; a string hash is used as its UTF-8 bytes)."""

    model_config = ConfigDict(extra="forbid")

    offset: StrictInt = Field(ge=0, description="first token of the item")
    length: StrictInt = Field(gt=0, description="tokens the item occupies")
    content_hash: str | StrictInt = Field(description="content hash of the item")

    def as_tuple(self) -> tuple[int, int, str | int]:
        return (self.offset, self.length, self.content_hash)


class PrefixBody(BaseModel):
    """A prefix to pin or unpin: its token ids (and multimodal items, if any)."""

    model_config = ConfigDict(extra="forbid")

    token_ids: list[TokenId] = Field(min_length=1, max_length=MAX_PIN_TOKENS,
                                     description="token ids of the prefix (int32)")
    extra_keys: list[ExtraKeyItem] | None = Field(
        None, description="multimodal items of the prefix, as given to match")

    def extra(self) -> list[tuple[int, int, str | int]] | None:
        return [e.as_tuple() for e in self.extra_keys] if self.extra_keys else None


# ---------------------------------------------------------------------------- the app


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


def create_app(stack: Stack, *, token: str | None = None) -> FastAPI:
    """The admin app of `stack`. `token` overrides the configured admin token (None: use
    `admin.token` from the stack's configuration; "" : no token)."""
    if token is None:
        token = stack.cfg.admin.token.get_secret_value()
    state = AdminState(stack, token)
    app = FastAPI(
        title="kvtier admin",
        version="0.1.0",
        description="Health, status, Prometheus metrics and cache operations of one kvtier "
        "deployment. Every POST needs `Authorization: Bearer <token>` when a token is "
        "configured.",
    )
    app.state.admin = state
    bearer = HTTPBearer(auto_error=False, description="admin.token / KVTIER_ADMIN_TOKEN")
    post_security = [Security(bearer)]

    @app.middleware("http")
    async def gate_posts(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if request.method == "POST":
            if not state.accepting:
                return JSONResponse({"detail": state.refusal}, status_code=503)
            if not state.authorized(request.headers.get("authorization")):
                return JSONResponse(
                    {"detail": "a valid 'Authorization: Bearer <token>' header is required"},
                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = jsonable_encoder(exc.errors(), custom_encoder={Exception: str})
        return JSONResponse({"detail": _one_line(errors), "errors": errors}, status_code=422)

    @app.exception_handler(InvalidRequestError)
    async def invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=422)

    @app.exception_handler(ResetBusyError)
    async def busy(request: Request, exc: ResetBusyError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(KvtierError)
    async def unavailable(request: Request, exc: KvtierError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503)

    # ------------------------------------------------------------------ probes

    @app.get("/healthz", tags=["probes"])
    def healthz() -> JSONResponse:
        """200 while the manager's threads run (liveness); 503 with the reason otherwise."""
        ok, reason = stack.alive()
        return JSONResponse({"alive": ok, "reason": reason}, status_code=200 if ok else 503)

    @app.get("/readyz", tags=["probes"])
    def readyz() -> JSONResponse:
        """200 only while every worker is ready; 503 with the reason otherwise (starting,
        a rank dead or restarting, shutting down)."""
        if not state.accepting:
            return JSONResponse({"ready": False, "reason": state.refusal}, status_code=503)
        ok, reason = stack.ready()
        return JSONResponse({"ready": ok, "reason": reason}, status_code=200 if ok else 503)

    # ------------------------------------------------------------------ reads

    @app.get("/status", tags=["reads"])
    def status() -> dict[str, Any]:
        """Tiers (capacity, free, cached, in use; blocks and bytes), workers (rank, pid, state,
        heartbeat age, tasks in flight), hit rates per tier, paused flag, storage counters and
        the configuration summary (no secrets)."""
        out = stack.status()
        ready, why = stack.ready()
        out["ready"] = {"ready": ready and state.accepting,
                        "reason": why if state.accepting else state.refusal}
        out["uptime_s"] = round(time.monotonic() - state.started_at, 3)
        return out

    @app.get("/metrics", tags=["reads"], response_class=Response)
    def metrics() -> Response:
        """Prometheus text exposition (kvtier_* families and the process collector)."""
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------------ operations

    @app.post("/reset", tags=["operations"], dependencies=post_security)
    def reset(
        storage: Annotated[bool, Query(description="also clear this deployment's storage")]
        = False,
        timeout: Annotated[float, Query(gt=0, le=300, description="seconds to wait for "
                                        "in-flight transfers before giving up (409)")]
        = DEFAULT_RESET_TIMEOUT_S,
    ) -> JSONResponse:
        """Empty the prefix tree and the device and host caches once in-flight transfers have
        finished (requests in flight keep their blocks). 200 with what was cleared; 409 with
        the reason, having cleared nothing, when transfers do not finish within `timeout` or
        storage is asked for on a deployment without a storage tier."""
        if storage and stack.cfg.storage.backend == "none":
            return JSONResponse(
                {"detail": "storage=true but storage.backend = 'none': there is no storage "
                 "tier to clear; nothing was cleared"}, status_code=409)
        stack.require_manager()  # 503 when the stack is not running
        try:
            cleared = stack.reset(storage=storage, timeout=timeout)
        except ResetBusyError:
            raise
        except Exception as e:  # only the storage step fails after the caches were emptied
            return JSONResponse(
                {"detail": "reset incomplete: the device and host caches were cleared but "
                 f"clearing storage failed: {type(e).__name__}: {e}"}, status_code=500)
        return JSONResponse({"cleared": cleared, "storage": storage})

    @app.post("/pause", tags=["operations"], dependencies=post_security)
    def pause() -> dict[str, bool]:
        """Hold every device transfer (e.g. during a weight update); storage I/O goes on."""
        stack.pause()
        return {"paused": True}

    @app.post("/resume", tags=["operations"], dependencies=post_security)
    def resume() -> dict[str, bool]:
        """Let held transfers run again."""
        stack.resume()
        return {"paused": False}

    @app.post("/pin", tags=["operations"], dependencies=post_security)
    def pin(body: PrefixBody) -> dict[str, int]:
        """Keep the cached full blocks of this prefix on the device until unpinned (host-only
        blocks are loaded). The pin stops at the first block that is not cached:
        `pinned_blocks` < `prefix_blocks` says how far it got."""
        m = stack.require_manager()
        n = m.pin(body.token_ids, body.extra())
        return {"pinned_blocks": n, "prefix_blocks": len(body.token_ids) // m.block_size}

    @app.post("/unpin", tags=["operations"], dependencies=post_security)
    def unpin(body: PrefixBody) -> dict[str, int]:
        """Undo one pin of this prefix; returns how many blocks were unpinned."""
        m = stack.require_manager()
        n = m.unpin(body.token_ids, body.extra())
        return {"unpinned_blocks": n, "prefix_blocks": len(body.token_ids) // m.block_size}

    return app
