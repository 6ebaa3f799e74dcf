"""The steering routes (issue 36) on an embedded kvtier's admin, over real HTTP: an
`EmbeddedDeployment` (the stack a vLLM instance runs itself, one worker process, file
storage written through) whose admin steers its one namespace. The engine is this test,
storing blocks through `EmbeddedCache` under the hashes vLLM gives them
(`keys.engine_block_hashes` with the engine's seed); no vLLM, no node service. The same
schema, token, body limit and one-line refusals as `kvtier serve`'s (tests/test_node_steering.py),
and `namespace` may be omitted (one is served)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from kvtier.admin.cli import render_status
from kvtier.engine.embedded import EmbeddedDeployment, EmbeddedNamespace
from kvtier.manager.keys import engine_block_hashes
from kvtier.manager.node.steering import OneNamespace, Steering
from kvtier.manager.tenants import SteeringError
from support import remove_leftovers, tiny_config, wait_until

pytestmark = pytest.mark.fast

NS = "vllm:embedded-steering-test"
SEED = "embedded-steering-seed"
TOKEN = "embedded-steering-token-0123456789"
BLOCK = 4  # tiny_config's tokens per block
# how the engine names blocks, read at each request (a test may change it, then restores it)
NAMING: dict[str, tuple[str, str, int]] = {"now": ("sha256", SEED, 0)}


def prompt(tag: int, blocks: int) -> list[int]:
    return [tag * 100_000 + i for i in range(blocks * BLOCK)]


def hashes(tokens: list[int], salt: str | None) -> list[bytes]:
    return engine_block_hashes("sha256", SEED, BLOCK, tokens, salt)


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedDeployment]:
    root = tmp_path_factory.mktemp("embedded-steering")
    cfg = tiny_config(workers=1, host_blocks=32, write_policy="write_through", storage="file",
                      storage_dir=root / "storage",
                      extra={"KVTIER_ADMIN__PORT": "0", "KVTIER_ADMIN__HOST": "127.0.0.1",
                             "KVTIER_ADMIN__TOKEN": TOKEN,
                             "KVTIER_ADMIN__MAX_BODY_BYTES": "65536"})
    d = EmbeddedDeployment(cfg, NS.encode(), naming=lambda: NAMING["now"])
    try:
        yield d
    finally:
        d.close()
        remove_leftovers(cfg.deployment_id)


@pytest.fixture
def http(dep: EmbeddedDeployment) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=dep.admin_url, timeout=10.0,
                      headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        yield c


def store(dep: EmbeddedDeployment, tokens: list[int], salt: str | None) -> None:
    """What the vLLM adapter does for a request's full blocks (its tenant: the salt)."""
    keys = hashes(tokens, salt)
    plan = dep.cache.prepare_store(keys, salt or "")
    assert plan is not None and plan.keys == keys
    dep.cache.complete_store(keys)


def lookup(http: httpx.Client, tokens: list[int], salt: str | None,
           **extra: Any) -> dict[str, int]:
    r = http.post("/lookup", json={"token_ids": tokens, "cache_salt": salt, **extra})
    assert r.status_code == 200, r.text
    out: dict[str, int] = r.json()["matched_tokens"]
    return out


def refused(http: httpx.Client, path: str, body: dict[str, Any], status: int,
            words: str) -> None:
    r = http.post(path, json=body)
    assert r.status_code == status, (path, r.status_code, r.text)
    detail = r.json()["detail"]
    assert words in detail and "\n" not in detail, detail


def test_lookup_retain_and_refusals_on_the_one_namespace(
        dep: EmbeddedDeployment, http: httpx.Client, capsys: pytest.CaptureFixture[str]) -> None:
    system = prompt(1, 6)
    store(dep, system, "b")
    # the engine's names: with or without the namespace, per salt
    assert lookup(http, system, "b") == {"host": 24, "pending": 0, "storage": 0}
    assert lookup(http, system, "b", namespace=NS)["host"] == 24
    assert lookup(http, system, "a")["host"] == 0  # another tenant's salt: other blocks
    assert lookup(http, system + [7] * BLOCK, "b")["host"] == 24  # the prefix held
    spec = http.get("/openapi.json").json()["paths"]
    assert {"/lookup", "/retain", "/retain/unpin", "/warm", "/clear", "/tenants",
            "/tenants/quota"} <= set(spec)
    # quota and pin; a pin over quota is refused whole, in one line, nothing changed
    r = http.post("/tenants/quota", json={"tenant": "b", "quota_blocks": 4})
    assert r.status_code == 200, r.text
    base = {"token_ids": system, "cache_salt": "b"}
    refused(http, "/retain", {**base, "retention": {"pin": True}}, 422,
            "pin of 6 blocks refused: tenant 'b' has 0 pinned, quota 4 blocks")
    figs = http.get("/tenants").json()[NS]["b"]
    assert figs["pinned_blocks"] == 0 and figs["host_blocks"] == 6, figs
    refused(http, "/retain", {**base, "retention": {"ttl_s": -1}}, 422, "ttl_s")
    refused(http, "/retain", {**base, "namespace": "vllm:other", "retention": {}}, 404,
            "namespace 'vllm:other': not served here")
    refused(http, "/lookup", {**base, "token_ids": list(range(300_000))}, 413,
            "admin.max_body_bytes = 65536")
    refused(http, "/clear", {}, 422, "exactly one of tenant, token_ids, all")
    assert http.post("/tenants/quota", json={"tenant": "b", "quota_blocks": 8}).is_success
    r = http.post("/retain", json={**base, "namespace": NS, "retention": {"pin": True}})
    assert r.status_code == 200, r.text
    assert http.get(f"/tenants?namespace={NS}").json()[NS]["b"]["pinned_blocks"] == 6
    # the tenants in /status and /metrics too (bounded, as the node's)
    status = http.get("/status").json()
    assert status["tenants"][NS]["b"]["pinned_blocks"] == 6
    render_status(status)  # `kvtier status`'s tables show them too, not only its --json
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert [NS[:24], "'b'", "6", "6", "8"] in [r[:5] for r in rows], rows
    assert (f'kvtier_node_tenant_host_blocks{{namespace="{NS}",state="pinned",tenant="b"}} '
            "6.0") in http.get("/metrics").text
    r = http.post("/retain/unpin", json=base)
    assert r.status_code == 200 and r.json()["unpinned"] == 6, r.text
    # no token: 401, nothing read
    assert httpx.post(dep.admin_url + "/retain", json={**base, "retention": {}},
                      timeout=10.0).status_code == 401


def test_clear_by_tenant_then_warm_from_storage(dep: EmbeddedDeployment,
                                                http: httpx.Client) -> None:
    x, y = prompt(3, 5), prompt(4, 5)
    store(dep, x, "x")
    store(dep, y, "y")
    wait_until(lambda: http.get("/tenants").json()[NS]["x"]["storage_blocks"] == 5, 20,
               "x written through to storage")
    r = http.post("/clear", json={"tenant": "x"})
    assert r.status_code == 200 and r.json()["host_blocks_removed"] == 5, r.text
    assert lookup(http, x, "x") == {"host": 0, "pending": 0, "storage": 20}
    assert lookup(http, y, "y")["host"] == 20, "clear by tenant touched another tenant"
    r = http.post("/warm", json={"token_ids": x, "cache_salt": "x"})
    assert r.status_code == 200 and r.json()["blocks"] == 5, r.text
    wait_until(lambda: lookup(http, x, "x")["host"] == 20, 20, "the warm landed")


def test_an_engine_naming_blocks_otherwise_is_refused_in_one_line(
        dep: EmbeddedDeployment, http: httpx.Client) -> None:
    """Token ids name kvtier's blocks only with the engine's own naming: another block size
    of the hash, another algorithm, or none given (an embedded stack of an engine that did
    not say) is refused in one line; tenants, quotas and clear by tenant still answer."""
    tokens = {"token_ids": prompt(5, 2)}
    try:
        NAMING["now"] = ("sha256", SEED, 2)
        refused(http, "/lookup", tokens, 422, "its engine hashes blocks of 2 tokens, "
                "kvtier's blocks are 4: token ids cannot name them")
        NAMING["now"] = ("xxhash", SEED, 0)
        refused(http, "/retain", {**tokens, "retention": {"pin": True}}, 422,
                "hash algorithm 'xxhash': token-id steering supports ['sha256']")
        # an engine of several KV cache groups (a hybrid model keys each block per group)
        NAMING["now"] = ("sha256", SEED, 0)
        dep.steered.kv_groups = 2
        for path, extra in (("/lookup", {}), ("/retain", {"retention": {"pin": True}}),
                            ("/warm", {}), ("/clear", {})):
            refused(http, path, {**tokens, **extra}, 422, f"namespace '{NS}': its engine "
                    "keeps 2 KV cache groups (a hybrid model), each keyed per group: token "
                    "ids cannot name its blocks")
    finally:
        NAMING["now"] = ("sha256", SEED, 0)
        dep.steered.kv_groups = 1
    assert http.post("/clear", json={"tenant": "nobody"}).json()["host_blocks_removed"] == 0
    silent = Steering(OneNamespace(EmbeddedNamespace(dep.stack, NS, None)))
    with pytest.raises(SteeringError, match="'\\(not given by the engine\\)'"):
        silent.lookup(None, prompt(5, 2))
    assert NS in silent.tenants()
