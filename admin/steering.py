"""The admin's steering routes (issue 36): tenants, retention, lookup, warm and clear by
token ids (`kvtier.manager.node.steering`) on `kvtier serve`'s namespaces, or on an embedded
kvtier's one namespace (the vLLM instance's `vllm:<digest>`; `namespace` may be omitted
wherever one namespace is served).

Every POST goes through the admin's gate (bearer token, `admin.max_body_bytes`, 503 while
shutting down); a bad body or a refusal (a pin over quota, an unknown namespace, a negative
TTL, too many tokens) is a 422 whose `detail` is one line, and nothing changed; a namespace
no engine attached is a 404.

    GET  /tenants[?namespace=N]     per namespace, per tenant figures (1,024 at most, the
                                    rest summed as "(other)")
    POST /tenants/quota             {namespace?, tenant | null (the default), quota_blocks |
                                     quota_bytes | null}
    POST /lookup                    {namespace?, token_ids, cache_salt?} -> matched tokens per
                                    tier
    POST /retain                    {namespace?, token_ids, cache_salt?, tenant?, retention:
                                     kvtier.retain v1 {pin, ttl_s, priority}}
    POST /retain/unpin              {namespace?, token_ids, cache_salt?}
    POST /warm                      {namespace?, token_ids, cache_salt?}: storage -> host,
                                    poll /lookup
    POST /clear                     {namespace?, tenant | token_ids (+ cache_salt) | all: true,
                                     storage?}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from kvtier.manager.node.steering import MAX_STEER_TOKENS, NamespaceUnknown, Steering
from kvtier.manager.tenants import (
    MAX_TENANT_BYTES,
    PRIORITY_MAX,
    PRIORITY_MIN,
    Retention,
)
from pydantic import BaseModel, ConfigDict, Field

_TOKENS = Field(max_length=MAX_STEER_TOKENS,
                description=f"the prompt's token ids (at most {MAX_STEER_TOKENS}); its full "
                            "blocks are named as the engines name them")
_SALT = Field(None, max_length=MAX_TENANT_BYTES,
              description="vLLM's cache_salt of the request (the tenant): part of the first "
                          "block's hash")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RetainV1(_Strict):
    """The `kvtier.retain` v1 payload (also the `data` of a kv_hints action)."""

    pin: bool = Field(False, description="kept until unpinned; counted in the tenant's quota; "
                                         "refused whole when the quota cannot hold it")
    ttl_s: float = Field(0.0, ge=0, le=30 * 86_400,
                         description="kept at least this long, then ordinary eviction")
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX,
                          description="lower goes first; > 0 only its own tenant's quota "
                                      "evicts it")


_NAMESPACE = Field(None, max_length=512,
                   description="the engines' namespace (`kvtier status` lists them); omit "
                               "where one namespace is served (an embedded kvtier)")


class TokensBody(_Strict):
    namespace: str | None = _NAMESPACE
    token_ids: list[int] = _TOKENS
    cache_salt: str | None = _SALT


class RetainBody(TokensBody):
    tenant: str | None = Field(None, max_length=MAX_TENANT_BYTES,
                               description="the tenant the blocks are booked to when not yet "
                                           "(default: cache_salt)")
    retention: RetainV1


class QuotaBody(_Strict):
    namespace: str | None = _NAMESPACE
    tenant: str | None = Field(max_length=MAX_TENANT_BYTES,
                               description="null: the default quota of tenants without one")
    quota_blocks: int | None = Field(None, ge=0)
    quota_bytes: int | None = Field(None, ge=0)


class ClearBody(_Strict):
    namespace: str | None = _NAMESPACE
    tenant: str | None = Field(None, max_length=MAX_TENANT_BYTES)
    token_ids: list[int] | None = Field(None, max_length=MAX_STEER_TOKENS)
    cache_salt: str | None = _SALT
    all: bool = False
    storage: bool = Field(False, description="delete the blocks' storage pages too")


def add_steering_routes(app: FastAPI, steer: Steering, post_security: Sequence[Any],
                        post_responses: dict[int | str, dict[str, Any]],
                        not_found: dict[str, Any]) -> Steering:
    """Mount the steering routes of `steer` on `app` (see the module docstring).
    `not_found`: the 404 answer's OpenAPI entry (a namespace not served here)."""
    deps = list(post_security)
    responses = {**post_responses, 404: not_found}

    @app.exception_handler(NamespaceUnknown)
    async def unknown(request: Request, exc: NamespaceUnknown) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.get("/tenants", tags=["steering"],
             responses={404: not_found, 422: post_responses[422]})
    def tenants(namespace: str | None = None) -> dict[str, Any]:
        """Per namespace, per tenant: host blocks (of them pinned, held by a retention, with
        a storage copy), hit tokens, stores, evictions, refused stores, quota."""
        return steer.tenants(namespace)

    @app.post("/tenants/quota", tags=["steering"], dependencies=deps, responses=responses)
    def quota(body: QuotaBody) -> dict[str, Any]:
        """A tenant's host quota (blocks or bytes; null: the default's), or the default
        quota of tenants without one (`tenant: null`). A tenant past it evicts its own
        blocks first; blocks of a tenant within an explicit quota are never evicted for
        another tenant."""
        return steer.set_quota(body.namespace, body.tenant, blocks=body.quota_blocks,
                               quota_bytes=body.quota_bytes)

    @app.post("/lookup", tags=["steering"], dependencies=deps, responses=responses)
    def lookup(body: TokensBody) -> dict[str, Any]:
        """How many leading tokens of this prompt the node holds, per tier (`host`: ready,
        `pending`: being written or prefetched, `storage`: listed in storage's index after
        the host ones); nothing is touched or asked."""
        return steer.lookup(body.namespace, body.token_ids, body.cache_salt)

    @app.post("/retain", tags=["steering"], dependencies=deps, responses=responses)
    def retain(body: RetainBody) -> dict[str, Any]:
        """Apply a `kvtier.retain` v1 retention to the prompt's cached blocks (blocks
        being written get it when they land; `absent`: not cached)."""
        r = Retention(body.retention.pin, body.retention.ttl_s, body.retention.priority)
        return steer.retain(body.namespace, body.token_ids, r, body.cache_salt, body.tenant)

    @app.post("/retain/unpin", tags=["steering"], dependencies=deps, responses=responses)
    def unpin(body: TokensBody) -> dict[str, Any]:
        """Undo the pin of the prompt's blocks (a TTL or priority they have stays)."""
        return steer.unpin(body.namespace, body.token_ids, body.cache_salt)

    @app.post("/warm", tags=["steering"], dependencies=deps, responses=responses)
    def warm(body: TokensBody) -> dict[str, Any]:
        """Bring the prompt's blocks from storage into the host tier: asked now, landed when
        /lookup's `matched_tokens.host` covers them."""
        return steer.warm(body.namespace, body.token_ids, body.cache_salt)

    @app.post("/clear", tags=["steering"], dependencies=deps, responses=responses)
    def clear(body: ClearBody) -> dict[str, Any]:
        """Remove a tenant's blocks, a prompt's blocks or every block of a namespace from
        the host tier, and with `storage: true` their storage pages (tier events announce
        each removal)."""
        return steer.clear(body.namespace, tenant=body.tenant, token_ids=body.token_ids,
                           cache_salt=body.cache_salt, everything=body.all,
                           storage=body.storage)

    return steer
