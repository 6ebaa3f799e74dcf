"""Steering a real `kvtier serve` (issue 36): tenants by cache_salt with quotas, a pin sent
per request on the node wire (what the vLLM adapter sends for a kv_hints `kvtier.retain`),
lookup / warm / clear by token ids over REST and the `kvtier` command, hostile inputs. The
engines are `node_engine.py` processes (the engine-side NodeClient, no vLLM) naming blocks
exactly as vLLM does (`keys.engine_block_hashes`)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import kvtier_script, wait_until
from test_node_service import NS_A, Node

pytestmark = pytest.mark.fast

BLOCKS = 64  # the namespace's host blocks (512-byte pages)
QUOTA = f"namespace_quota_bytes = {BLOCKS * 512}\n"


def prompt(tag: int, blocks: int) -> list[int]:
    return [tag * 100_000 + i for i in range(blocks * 4)]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path, node_toml=QUOTA)
    try:
        yield n.start()
    finally:
        n.close()


def post(node: Node, path: str, body: dict[str, Any]) -> Any:
    assert node.serve is not None
    with node.serve.client(node.serve.token()) as http:
        return http.post(path, json=body)


def tenants(node: Node) -> dict[str, Any]:
    assert node.serve is not None
    with node.serve.client() as http:
        out: dict[str, Any] = http.get("/tenants").json()[NS_A]
        return out


def lookup(node: Node, tokens: list[int], salt: str | None) -> dict[str, int]:
    r = post(node, "/lookup", {"namespace": NS_A, "token_ids": tokens, "cache_salt": salt})
    assert r.status_code == 200, r.text
    out: dict[str, int] = r.json()["matched_tokens"]
    return out


def storage_counters(node: Node) -> dict[str, int]:
    assert node.serve is not None
    with node.serve.client() as http:
        spaces = http.get("/status").json()["node"]["namespaces"]
        out: dict[str, int] = next(s for s in spaces if s["namespace"] == NS_A)[
            "storage_counters"]
        return out


def test_pinned_tenant_survives_another_tenants_flood(node: Node) -> None:
    a, b = node.engine(), node.engine()
    assert a.first["attached"] and b.first["attached"]
    for tenant, blocks in (("a", 40), ("b", 16)):
        r = post(node, "/tenants/quota", {"namespace": NS_A, "tenant": tenant,
                                          "quota_blocks": blocks})
        assert r.status_code == 200, r.text
    system = prompt(1, 8)
    assert b.call(op="store", tokens=system, salt="b")["stored"] == 8
    # the pin rides on the engine's own connection (kv_hints -> RETAIN), no REST call
    b.call(op="retain", tokens=system, salt="b", pin=True)
    assert b.call(op="load", tokens=system, salt="b")["hits"] == 8  # sends the RETAIN
    for i in range(12):  # A floods: 12 one-shot documents of 6 blocks, 1.8x its quota
        assert a.call(op="store", tokens=prompt(100 + i, 6), salt="a")["stored"] == 6
    got = b.call(op="load", tokens=system, salt="b")
    assert got["hits"] == 8 and got["identical"] is True, got
    figs = tenants(node)
    assert figs["b"]["pinned_blocks"] == 8 and figs["b"]["evictions"] == 0, figs
    assert figs["a"]["evictions"] == 72 - figs["a"]["host_blocks"] > 0, figs
    assert figs["a"]["host_blocks"] <= 40 and figs["b"]["hit_tokens"] == 2 * 8 * 4, figs
    st = {ns["namespace"]: ns for ns in node.status()["node"]["namespaces"]}[NS_A]
    assert sum(f["host_blocks"] for f in figs.values()) * 512 == st["used_bytes"], (figs, st)
    # lookup names the blocks the engines stored: per tier, and per salt
    assert lookup(node, system, "b")["host"] == 32
    assert lookup(node, system, "a")["host"] == 0  # another salt: other blocks
    assert lookup(node, system, None)["host"] == 0
    # one namespace attached: a request may omit it (as an embedded admin's always may)
    r = post(node, "/lookup", {"token_ids": system, "cache_salt": "b"})
    assert r.status_code == 200 and r.json()["matched_tokens"]["host"] == 32, r.text
    # /metrics and `kvtier status` show the tenants
    assert node.serve is not None
    with node.serve.client() as http:
        text = http.get("/metrics").text
    assert (f'kvtier_node_tenant_host_blocks{{namespace="{NS_A}",state="pinned",tenant="b"}}'
            " 8.0") in text, text[-3000:]
    out = subprocess.run([str(kvtier_script()), "status", "--url", node.serve.url],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "tenants" in out.stdout, out.stdout


def test_lookup_cost_on_a_4096_token_prompt(node: Node) -> None:
    e = node.engine()
    tokens = prompt(7, 1024)  # 4,096 tokens in 4-token blocks: 1,024 hashes
    assert e.call(op="store", tokens=tokens[:4 * BLOCKS], salt="r")["stored"] == BLOCKS
    best: dict[str, float] = {}
    for _ in range(5):
        r = post(node, "/lookup", {"namespace": NS_A, "token_ids": tokens, "cache_salt": "r"})
        assert r.status_code == 200, r.text
        body = r.json()
        for k in ("hash_us", "lookup_us"):
            best[k] = min(best.get(k, 1e9), body[k])
    assert body["matched_tokens"]["host"] == 4 * BLOCKS
    assert lookup(node, tokens, "other")["host"] == 0  # another salt names other blocks
    print(f"lookup of a 4,096-token prompt (1,024 blocks): hash {best['hash_us']:.0f} us, "
          f"lookup {best['lookup_us']:.0f} us (best of 5)")


def test_hostile_steering_inputs_change_nothing(node: Node) -> None:
    e = node.engine()
    system = prompt(2, 8)
    assert e.call(op="store", tokens=system, salt="b")["stored"] == 8
    assert post(node, "/tenants/quota", {"namespace": NS_A, "tenant": "b",
                                         "quota_blocks": 4}).status_code == 200
    before = tenants(node)

    def refused(path: str, body: dict[str, Any], status: int, words: str) -> None:
        r = post(node, path, body)
        assert r.status_code == status, (path, r.status_code, r.text)
        detail = r.json()["detail"]
        assert words in detail and "\n" not in detail, detail

    base = {"namespace": NS_A, "token_ids": system, "cache_salt": "b"}
    refused("/retain", {**base, "retention": {"pin": True}}, 422,
            "pin of 8 blocks refused: tenant 'b' has 0 pinned, quota 4 blocks")
    refused("/retain", {**base, "retention": {"ttl_s": -1}}, 422, "ttl_s")
    refused("/retain", {**base, "retention": {"pin": True, "version": 2}}, 422, "version")
    refused("/retain", {**base, "namespace": "nope", "retention": {"pin": True}}, 404,
            "namespace 'nope': not served here")
    refused("/lookup", {**base, "token_ids": list(range(300_000))}, 422, "at most 262144 items")
    refused("/clear", {"namespace": NS_A}, 422, "exactly one of tenant, token_ids, all")
    # the same pin over quota on the engine's connection: counted, nothing pinned
    e.call(op="retain", tokens=system, salt="b", pin=True)
    assert e.call(op="load", tokens=system, salt="b")["hits"] == 8
    row = node.status()["node"]["engines"][0]
    assert row["retain_refused"] == 1 and "quota 4 blocks" in row["retain_last_refusal"], row
    after = tenants(node)
    assert after["b"]["pinned_blocks"] == before["b"]["pinned_blocks"] == 0
    assert after["b"]["host_blocks"] == before["b"]["host_blocks"] == 8
    # no token: 401, nothing read
    assert node.serve is not None
    with node.serve.client() as http:
        assert http.post("/retain", json={**base, "retention": {}}).status_code == 401


def test_clear_by_tenant_and_warm_from_storage(tmp_path: Path) -> None:
    n = Node(tmp_path, node_toml=QUOTA, storage="file").start()
    try:
        e = n.engine()
        x, y = prompt(3, 6), prompt(4, 6)
        assert e.call(op="store", tokens=x, salt="x")["stored"] == 6
        assert e.call(op="store", tokens=y, salt="y")["stored"] == 6
        wait_until(lambda: lookup(n, x, "x")["storage"] == 0
                   and tenants(n)["x"]["storage_blocks"] == 6, 20, "x backed up")
        r = post(n, "/clear", {"namespace": NS_A, "tenant": "x"})
        assert r.status_code == 200 and r.json()["host_blocks_removed"] == 6, r.text
        assert lookup(n, x, "x") == {"host": 0, "pending": 0, "storage": 24}
        assert lookup(n, y, "y")["host"] == 24, "clear by tenant touched another tenant"
        # warm: storage -> host ahead of traffic, through the CLI
        out = subprocess.run([str(kvtier_script()), "warm", "--url", n.serve.url,  # type: ignore[union-attr]
                              "--namespace", NS_A, "--tokens", ",".join(map(str, x)),
                              "--salt", "x"], capture_output=True, text=True, timeout=30,
                             env=dict(os.environ, KVTIER_ADMIN_TOKEN=n.serve.token()))  # type: ignore[union-attr]
        assert out.returncode == 0, out.stdout + out.stderr
        assert json.loads(out.stdout)["blocks"] == 6
        wait_until(lambda: lookup(n, x, "x")["host"] == 24, 20, "the warm landed")
        got = e.call(op="load", tokens=x, salt="x")
        assert got["hits"] == 6 and got["identical"] is True, got
        # clear by prompt, storage included: both tiers forget it, the other tenant stays
        r = post(n, "/clear", {"namespace": NS_A, "token_ids": x, "cache_salt": "x",
                               "storage": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["host_blocks_removed"] == 6 and body["storage_pages_deleted"] == 6, body
        assert lookup(n, x, "x") == {"host": 0, "pending": 0, "storage": 0}
        assert lookup(n, y, "y") == {"host": 24, "pending": 0, "storage": 0}
        assert e.call(op="load", tokens=x, salt="x")["hits"] == 0
        # retention reaches storage: a pin over REST goes to y's pages on every rank
        r = post(n, "/retain", {"namespace": NS_A, "token_ids": y, "cache_salt": "y",
                                "retention": {"pin": True}})
        assert r.status_code == 200, r.text
        wait_until(lambda: storage_counters(n)["retain_pages"] == 6, 20,
                   "the pin reached y's storage pages")
        t0 = time.monotonic()
        out = subprocess.run([str(kvtier_script()), "tenants", "--url", n.serve.url,  # type: ignore[union-attr]
                              "--namespace", NS_A], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and '"y"' in out.stdout, out.stdout
        assert time.monotonic() - t0 < 30
    finally:
        n.close()
