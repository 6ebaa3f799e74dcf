"""The shared storage tier: pages as values in a Redis server that several kvtier instances use.

This is how kvtier scales past one machine: every instance serving the same model shape opens
the same namespace, so a prefix one node computed and backed up is a storage hit on every other
node. Keys are `kvtier:<namespace>:<64 hex digits of the page key>`; values are the page header
+ payload of `page_format`, so a value that was truncated, overwritten or forged by another
client (anyone without the storage secret) or written by another format version is a miss.

A Redis Cluster is named by a `redis+cluster://` (or `rediss+cluster://`) URL of any one of its
nodes. Keys carry no hash tag, so the pages of one namespace spread over every primary; every
batch is split by the node owning each key's slot and sent as one pipeline per node through
that node's own connection (a stalled node costs one timeout), and `clear` scans every
primary.

A shared network store can be down or slow, and a storage lookup sits on the path of a
scheduler call. So nothing here may block for long or raise for an outage:
* every socket operation has a timeout (default 0.5 s) and redis-py's own retries are off, so
  one batch costs at most about one timeout when Redis does not answer;
* a failure opens a short backoff window (doubling up to a cap, reset on success) during
  which calls fail fast as misses / unwritten pages without touching the network;
* the first call after the window tries again, so the tier resumes by itself when Redis comes
  back; failures are counted per operation and logged at most once per `log_interval_s`.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit, urlunsplit

import redis
from kvtier.worker.storage.backend import (
    Buffer,
    RateLimitedLog,
    StorageBackend,
    check_keys,
    log,
    refusals,
)
from kvtier.worker.storage.page_crypto import PageKeys, make_codec
from kvtier.worker.storage.page_format import PageStatus
from redis.backoff import NoBackoff
from redis.client import Pipeline
from redis.cluster import RedisCluster
from redis.retry import Retry

T = TypeVar("T")

_PAGE_NAME = re.compile(rb"[0-9a-f]{64}")  # what follows the namespace prefix of a page


def _redact(url: str) -> str:
    """`url` with any password replaced by '***', for log lines."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<invalid url>"
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
"""URL schemes that name a Redis Cluster, and the plain scheme redis-py is given instead."""

RedisClient = redis.Redis | RedisCluster


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def open_client(url: str, *, timeout_s: float, connect_timeout_s: float) -> RedisClient:
    """A redis-py client for a `redis://` / `rediss://` server or a `redis+cluster://` /
    `rediss+cluster://` cluster, with socket timeouts and without redis-py's own retries (one
    batch must cost at most about one timeout). A cluster client connects here, to learn the
    slot map: callers open it where a failure is handled as an outage."""
    parts = urlsplit(url)
    common = {"socket_timeout": timeout_s, "socket_connect_timeout": connect_timeout_s,
              "retry": Retry(NoBackoff(), 0), "decode_responses": False}
    if parts.scheme in CLUSTER_SCHEMES:
        plain = urlunsplit(parts._replace(scheme=CLUSTER_SCHEMES[parts.scheme]))
        cluster: RedisCluster = RedisCluster.from_url(plain, **common)  # untyped classmethod
        return cluster
    return redis.Redis.from_url(url, retry_on_timeout=False, health_check_interval=0, **common)


# Errors that mean "the server is unreachable or too slow": they open the backoff window.
_OUTAGE_ERRORS: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.RedisClusterException,  # no reachable node, slots not covered
    redis.exceptions.ClusterDownError,
    OSError,
)


class RedisBackend(StorageBackend):
    """Pages of one namespace in Redis, reached through one redis-py connection pool.

    State: `client` (redis-py's thread-safe pool of connections; a plain client connects
    lazily and a cluster client is created on first use, so a backend can be opened while Redis
    is down); `_retry_at` / `_backoff_s` (the fail-fast window and its next
    length) and `_failing` (an outage is in progress), all guarded by `_state_lock`. Batches
    are cut so that one request carries at most `batch_bytes` of page data (bounded memory and
    bounded time per round trip) or `batch_keys` keys.
    """

    kind = "redis"

    def __init__(
        self,
        url: str,
        namespace: str,
        *,
        secret: bytes,
        ttl_s: int = 0,
        page_bytes: int | None = None,
        timeout_s: float = 0.5,
        connect_timeout_s: float | None = None,
        backoff_s: float = 0.25,
        backoff_max_s: float = 4.0,
        log_interval_s: float = 30.0,
        batch_bytes: int = 8 << 20,
        batch_keys: int = 512,
        keys: PageKeys | None = None,
        compression: str = "none",
    ) -> None:
        super().__init__(namespace, page_bytes)
        self._codec = make_codec(secret, self.namespace, keys, compression)
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s < 0:
            raise ValueError(f"ttl_s must be an int >= 0 (0 = no expiry), got {ttl_s!r}")
        for name, value in (
            ("timeout_s", timeout_s),
            ("backoff_s", backoff_s),
            ("backoff_max_s", backoff_max_s),
            ("log_interval_s", log_interval_s),
        ):
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if batch_bytes < 1 or batch_keys < 1:
            raise ValueError("batch_bytes and batch_keys must be >= 1")
        self.url = url
        self._shown_url = _redact(url)  # what logs show: never the password
        self.ttl_s = ttl_s
        self.timeout_s = float(timeout_s)
        self._batch_bytes = batch_bytes
        self._batch_keys = batch_keys
        self._prefix = f"kvtier:{self.namespace}:".encode()
        self.cluster = is_cluster_url(url)
        self._connect_timeout_s = float(connect_timeout_s or timeout_s)
        self._client_obj: RedisClient | None = None
        self._reload_slots = False
        self._open_lock = threading.Lock()
        if not self.cluster:  # a plain client connects lazily: open it now to check the URL
            try:
                self._client_obj = open_client(url, timeout_s=self.timeout_s,
                                               connect_timeout_s=self._connect_timeout_s)
            except ValueError as exc:
                raise ValueError(f"storage url {self._shown_url!r} is not a valid Redis URL: "
                                 f"{exc}") from exc
        self._state_lock = threading.Lock()
        self._backoff_base_s = float(backoff_s)
        self._backoff_max_s = float(backoff_max_s)
        self._backoff_s = self._backoff_base_s
        self._retry_at = 0.0
        self._failing = False
        self._closed = False
        self._warn = RateLimitedLog(log, log_interval_s)
        self._policy: str | None = None  # the server's maxmemory-policy, read at the first pin
        self._stats.add(outages=0, fast_failed_calls=0, pins_evictable=0)

    @property
    def client(self) -> RedisClient:
        """The redis-py client (a cluster client is opened on first use, inside a call whose
        failure counts as an outage, so a backend can be opened while its cluster is down)."""
        client = self._client_obj
        if client is None:
            with self._open_lock:
                client = self._client_obj
                if client is None:
                    client = self._client_obj = open_client(
                        self.url, timeout_s=self.timeout_s,
                        connect_timeout_s=self._connect_timeout_s)
        return client

    # -- keys and batching -------------------------------------------------------------------
    def redis_key(self, key: bytes) -> bytes:
        """The Redis key of a page key (exposed for operators and tests)."""
        return self._prefix + key.hex().encode()

    def batch_bounds(self, n: int, page_len: int) -> Iterator[tuple[int, int]]:
        """The [lo, hi) index ranges one call of `n` pages of `page_len` bytes is cut into."""
        stored = max(1, page_len + self._codec.overhead)
        per = max(1, min(self._batch_keys, self._batch_bytes // stored))
        for lo in range(0, n, per):
            yield lo, min(n, lo + per)

    # -- outage handling ---------------------------------------------------------------------
    def _ensure_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")

    def _in_backoff(self, op: str) -> bool:
        with self._state_lock:
            skip = time.monotonic() < self._retry_at
        if skip:
            self._stats.add(**{f"errors_{op}": 1, "fast_failed_calls": 1})
        return skip

    def _call(self, op: str, fn: Callable[[], T]) -> tuple[bool, T | None]:
        """Run one network round trip. Returns (True, result), or (False, None) after an
        outage-type failure (counted, logged, backoff window opened). Other Redis errors
        (e.g. out of memory on write) are counted and logged but do not open the window."""
        try:
            result = fn()
        except _OUTAGE_ERRORS as exc:
            with self._state_lock:
                self._retry_at = time.monotonic() + self._backoff_s
                window = self._backoff_s
                self._backoff_s = min(self._backoff_s * 2, self._backoff_max_s)
                new_outage = not self._failing
                self._failing = True
            self._stats.add(**{f"errors_{op}": 1, "outages": int(new_outage)})
            self._warn.warning(
                f"redis storage {self._shown_url} ({self.namespace}) unavailable during {op}: "
                f"{type(exc).__name__}: {exc}; failing fast for {window:.2f}s"
            )
            return False, None
        except redis.RedisError as exc:
            self._stats.add(**{f"errors_{op}": 1})
            self._warn.warning(
                f"redis storage {self._shown_url} ({self.namespace}) {op} failed: "
                f"{type(exc).__name__}: {exc}"
            )
            return False, None
        with self._state_lock:
            recovered = self._failing
            self._failing = False
            self._backoff_s = self._backoff_base_s
        if recovered:
            log.info("redis storage %s (%s) reachable again", self._shown_url, self.namespace)
        return True, result

    # -- operations --------------------------------------------------------------------------
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        self._ensure_open()
        keys_b = check_keys(keys)
        out = [False] * len(keys_b)
        if not keys_b or self._in_backoff("exists"):
            return out
        for lo, hi in self.batch_bounds(len(keys_b), 0):
            ok, found = self._call("exists", partial(self._exists_batch, keys_b[lo:hi]))
            if not ok or found is None:
                break
            out[lo:hi] = found
        return out

    def leading_present(self, keys: Sequence[bytes]) -> int:
        """Like `exists`, but asks in growing batches and stops at the first absent page, so
        a long prompt whose storage hit is short costs one small round trip."""
        self._ensure_open()
        keys_b = check_keys(keys)
        if not keys_b or self._in_backoff("exists"):
            return 0
        count, lo, step = 0, 0, 32
        while lo < len(keys_b):
            hi = min(len(keys_b), lo + step)
            ok, found = self._call("exists", partial(self._exists_batch, keys_b[lo:hi]))
            if not ok or found is None:
                return count
            for present in found:
                if not present:
                    return count
                count += 1
            lo, step = hi, min(step * 4, self._batch_keys)
        return count

    def _pipelined(self, names: list[bytes], queue: Callable[[Pipeline, int], object], *,
                   raise_on_error: bool) -> list[Any]:
        """Queue one command per name (`queue(pipe, index)`) and run them in one round trip
        per node: the whole batch on a plain server; on a cluster, grouped by the node that
        owns each key's slot and sent through that node's own client, so a stalled node costs
        one socket timeout (redis-py's cluster pipeline re-sends each failed command on its
        own, one timeout each). A MOVED or ASK answer (the cluster resharded) is an error for
        that key and makes the next call reload the slot map."""
        client = self.client
        if not isinstance(client, RedisCluster):
            pipe = client.pipeline(transaction=False)
            for i in range(len(names)):
                queue(pipe, i)
            return pipe.execute(raise_on_error=raise_on_error)
        if self._reload_slots:
            client.nodes_manager.initialize()
            self._reload_slots = False
        groups: dict[str, tuple[redis.Redis, list[int]]] = {}
        for i, name in enumerate(names):
            node = client.get_node_from_key(name)
            group = groups.get(node.name)
            if group is None:
                group = groups[node.name] = (node.redis_connection, [])
            group[1].append(i)
        out: list[Any] = [None] * len(names)
        for node_client, indexes in groups.values():
            pipe = node_client.pipeline(transaction=False)
            for i in indexes:
                queue(pipe, i)
            for i, result in zip(indexes, pipe.execute(raise_on_error=False), strict=True):
                if isinstance(result, redis.ResponseError) and str(result).startswith(
                        ("MOVED", "ASK")):
                    self._reload_slots = True
                out[i] = result
        if raise_on_error:
            for result in out:
                if isinstance(result, Exception):
                    raise result
        return out

    def _exists_batch(self, keys: list[bytes]) -> list[bool]:
        names = [self.redis_key(k) for k in keys]
        found = self._pipelined(names, lambda pipe, i: pipe.exists(names[i]),
                                raise_on_error=True)
        return [bool(n) for n in found]

    def get_into(self, keys: Sequence[bytes], dests: Sequence[Buffer]) -> list[bool]:
        self._ensure_open()
        keys_b, views = self._check_pages(keys, dests, writable=True, what="destination buffers")
        start = time.perf_counter()
        hits = [False] * len(keys_b)
        corrupt: list[tuple[int, PageStatus]] = []
        if keys_b and not self._in_backoff("get"):
            page_len = max(v.nbytes for v in views)
            for lo, hi in self.batch_bounds(len(keys_b), page_len):
                names = [self.redis_key(k) for k in keys_b[lo:hi]]
                ok, values = self._call("get", partial(self._read_batch, names))
                if not ok or values is None:
                    break
                for i, value in enumerate(values, start=lo):
                    if value is None:
                        continue
                    status = self._codec.decode_into(keys_b[i], value, views[i])
                    if status is PageStatus.OK:
                        hits[i] = True
                    else:
                        corrupt.append((i, status))
                del values
        pages = sum(hits)
        self._stats.add(
            pages_read=pages,
            bytes_read=sum(v.nbytes for v, ok in zip(views, hits, strict=True) if ok),
            misses=len(hits) - pages,
            **refusals([status.value for _, status in corrupt]),
        )
        self._stats.observe("read", time.perf_counter() - start)
        if corrupt:
            self._drop_corrupt([keys_b[i] for i, _ in corrupt])
            i, status = corrupt[0]
            self._warn.warning(
                f"redis storage {self.namespace}: {len(corrupt)} corrupt page(s) dropped "
                f"(first: key {keys_b[i].hex()[:16]}..., {status.value})"
            )
        return hits

    def _read_batch(self, names: list[bytes]) -> list[bytes | None]:
        client = self.client
        if isinstance(client, RedisCluster):  # keys of many slots: no single MGET
            return self._pipelined(names, lambda pipe, i: pipe.get(names[i]),
                                   raise_on_error=True)
        # redis-py annotates its commands for the sync and asyncio clients at once
        # (`Awaitable[Any] | Any`); the sync client's MGET answers a list.
        return cast(list[bytes | None], client.mget(names))

    def _unlink(self, names: list[bytes]) -> int:
        if isinstance(self.client, RedisCluster):  # one UNLINK per key: keys of many slots
            removed = self._pipelined(names, lambda pipe, i: pipe.unlink(names[i]),
                                      raise_on_error=True)
            return sum(int(n) for n in removed)
        return int(cast(int, self.client.unlink(*names)))  # sync client: an int, see _read_batch

    def _drop_corrupt(self, keys: list[bytes]) -> None:
        """Delete values that failed verification so `exists` stops reporting them. Best
        effort: if another instance rewrote a good page in the few milliseconds since the
        read, that page is lost too, which costs one later miss and never wrong data."""
        names = [self.redis_key(k) for k in keys]
        self._call("delete", lambda: self._unlink(names))

    def set(self, keys: Sequence[bytes], pages: Sequence[Buffer]) -> int:
        self._ensure_open()
        keys_b, views = self._check_pages(keys, pages, writable=False, what="pages")
        start = time.perf_counter()
        written_bytes = 0
        written = 0
        if keys_b and not self._in_backoff("set"):
            page_len = max(v.nbytes for v in views)
            for lo, hi in self.batch_bounds(len(keys_b), page_len):
                ok, results = self._call(
                    "set", partial(self._set_batch, keys_b[lo:hi], views[lo:hi]))
                if not ok or results is None:
                    break
                for i, result in enumerate(results, start=lo):
                    if result is True:
                        written += 1
                        written_bytes += views[i].nbytes
                failed = [r for r in results if r is not True]
                if failed:
                    self._stats.add(errors_set=len(failed))
                    self._warn.warning(
                        f"redis storage {self.namespace}: {len(failed)} SET(s) refused: "
                        f"{failed[0]!r}"
                    )
        self._stats.add(pages_written=written, bytes_written=written_bytes)
        self._stats.observe("write", time.perf_counter() - start)
        return written

    def _set_batch(self, keys: list[bytes], views: list[memoryview]) -> list[object]:
        names = [self.redis_key(k) for k in keys]
        encode = self._codec.encode_page
        if self._marks:  # a page written while a mark holds is written with its expiry
            now = time.monotonic()
            ttls = [self._expiry_of(k.hex(), now) for k in keys]
            return self._pipelined(
                names, lambda pipe, i: pipe.set(names[i], encode(keys[i], views[i]),
                                                ex=ttls[i]),
                raise_on_error=False)
        ttl = self.ttl_s or None
        return self._pipelined(
            names, lambda pipe, i: pipe.set(names[i], encode(keys[i], views[i]), ex=ttl),
            raise_on_error=False)

    # -- retention (`kvtier.worker.storage.retention`) --------------------------------------
    def _expiry_of(self, hexkey: str, now: float) -> int | None:
        """The expiry (seconds; None: none) a page gets when written now: none while
        pinned or without an ordinary TTL (`ttl_s` 0), else the longer of the ordinary TTL
        and what its mark's TTL has left."""
        if not self.ttl_s:
            return None
        mark = self._marks.get(hexkey, now)
        if mark is None:
            return self.ttl_s
        if mark.pin:
            return None
        return max(self.ttl_s, math.ceil(mark.until - now))

    def _apply_retain(self, hexkeys: list[str], now: float) -> None:
        """Pinned pages: PERSIST (their key never expires, so a `volatile-*` maxmemory
        policy never evicts it either). Pages within a TTL: `EXPIRE key t GT`, which lifts
        an expiry to t seconds and never shortens one (a key without expiry keeps none).
        Without an ordinary TTL (`ttl_s` 0) keys never expire: nothing to send. Absent
        keys are untouched (their mark applies when they are written)."""
        if self._policy is None and any(m.pin for h in hexkeys
                                         if (m := self._marks.get(h, now)) is not None):
            self._check_eviction_policy()
        if not self.ttl_s or self._in_backoff("retain"):
            return
        todo: list[tuple[bytes, int | None]] = []
        for h in hexkeys:
            mark = self._marks.get(h, now)
            if mark is None:
                continue
            if mark.pin:
                todo.append((self._prefix + h.encode(), None))
            elif mark.until > now:
                todo.append((self._prefix + h.encode(), math.ceil(mark.until - now)))
        self._send_expiries(todo, gt=True)

    def _check_eviction_policy(self) -> None:
        """Once, at the first pin: read the server's `maxmemory-policy`. Under an
        `allkeys-*` policy Redis may evict any key when it is full, a pinned page included,
        and kvtier cannot stop it: say so once in the log and in `stats()`
        (`pins_evictable`). A server that refuses CONFIG (a managed Redis, an ACL) is not
        asked again ("unknown")."""
        policies: list[str] = []

        def read() -> None:
            found = self.client.config_get("maxmemory-policy")
            stack: list[Any] = [found]
            while stack:  # a cluster client answers per node: walk nested answers
                item = stack.pop()
                if isinstance(item, dict):
                    stack.extend(item.values())
                elif isinstance(item, bytes | str):
                    policies.append(item.decode() if isinstance(item, bytes) else item)

        try:  # not `_call`: a refused CONFIG is no storage error, nor an outage
            read()
        except (redis.RedisError, OSError):
            policies.clear()
        self._policy = ",".join(sorted(set(policies))) or "unknown"
        if any(p.startswith("allkeys-") for p in policies):
            self._stats.add(pins_evictable=1)
            log.warning(
                "redis storage %s: maxmemory-policy is %s, so Redis may evict pinned pages "
                "when it is full; use a volatile-* policy (pinned keys have no expiry and "
                "are then never evicted) or noeviction", self._shown_url, self._policy)

    def _apply_unpin(self, hexkeys: list[str], now: float) -> None:
        """Unpinned pages get an expiry again: the ordinary TTL, or what their mark's TTL
        has left if that is longer; `EXPIRE ... NX` sets it only on a key without one (a
        key another writer re-wrote with its expiry keeps that)."""
        if not self.ttl_s or self._in_backoff("retain"):
            return
        todo: list[tuple[bytes, int | None]] = [
            (self._prefix + h.encode(), self._expiry_of(h, now) or self.ttl_s)
            for h in hexkeys]
        self._send_expiries(todo, gt=False)

    def _send_expiries(self, todo: list[tuple[bytes, int | None]], *, gt: bool) -> None:
        """PERSIST (seconds None) or `EXPIRE name seconds GT` (`gt`, else NX) per key, one
        pipeline per `batch_keys` (per node on a cluster)."""
        for lo in range(0, len(todo), self._batch_keys):
            part = todo[lo:lo + self._batch_keys]

            def queue(pipe: Pipeline, i: int, part: list[tuple[bytes, int | None]] = part
                      ) -> object:
                name, seconds = part[i]
                if seconds is None:
                    return pipe.persist(name)
                return pipe.expire(name, max(1, seconds), gt=gt, nx=not gt)

            names = [name for name, _ in part]
            ok, _ = self._call("retain", partial(self._pipelined, names, queue,
                                                 raise_on_error=True))
            if not ok:
                return

    def delete(self, keys: Sequence[bytes]) -> int:
        self._ensure_open()
        keys_b = check_keys(keys)
        removed = 0
        if not keys_b or self._in_backoff("delete"):
            return 0
        for lo in range(0, len(keys_b), self._batch_keys):
            names = [self.redis_key(k) for k in keys_b[lo : lo + self._batch_keys]]
            ok, n = self._call("delete", partial(self._unlink, names))
            if not ok:
                break
            removed += int(n or 0)
        self._marks.drop(k.hex() for k in keys_b)
        self._stats.add(pages_deleted=removed)
        return removed

    def clear(self) -> int:
        """SCAN the namespace's keys (`kvtier:<namespace>:*`, exact because namespaces hold no
        glob characters or ':') and UNLINK them in batches; other namespaces and other
        applications' keys are untouched. Returns the number of keys removed (0 and an
        `errors_clear` count when Redis is unreachable)."""
        self._ensure_open()
        if self._in_backoff("clear"):
            return 0
        ok, removed = self._call("clear", self._clear_all)
        removed = int(removed or 0) if ok else 0
        self._marks.clear()
        self._stats.add(pages_deleted=removed)
        return removed

    def _clear_all(self) -> int:
        pattern = self._prefix + b"*"
        client = self.client
        scanned = ([p.redis_connection for p in client.get_primaries()]
                   if isinstance(client, RedisCluster) else [client])
        removed = 0
        for server in scanned:  # every primary of a cluster holds some of the pages
            batch: list[bytes] = []
            for name in server.scan_iter(match=pattern, count=1000):
                batch.append(name)
                if len(batch) >= 1000:
                    removed += self._unlink(batch)
                    batch = []
            if batch:
                removed += self._unlink(batch)
        return removed

    def list_keys(self, cursor: int, count: int) -> tuple[list[bytes], int]:
        """One `SCAN <cursor> MATCH kvtier:<namespace>:* COUNT <count>` round trip (SCAN's
        COUNT bounds the keys the server looks at, so a batch holds at most about `count`
        of ours, often fewer). On a cluster every primary is scanned in turn (sorted by
        name): the cursor is the server's cursor times 2**16 plus the primary's index. An
        outage or a reshard mid-listing counts `errors_list` and ends the listing."""
        self._ensure_open()
        if isinstance(cursor, bool) or not isinstance(cursor, int) or cursor < 0:
            raise ValueError(f"list_keys: cursor {cursor!r} must be an int >= 0")
        if self._in_backoff("list"):
            return [], 0
        ok, got = self._call("list", partial(self._scan_batch, cursor, max(1, count)))
        if not ok or got is None:
            return [], 0
        return got

    def _scan_batch(self, cursor: int, count: int) -> tuple[list[bytes], int]:
        client = self.client
        if isinstance(client, RedisCluster):
            primaries = sorted(client.get_primaries(), key=lambda p: p.name)
            index, server_cursor = cursor & 0xFFFF, cursor >> 16
            if index >= len(primaries):
                raise redis.exceptions.RedisClusterException(
                    f"listing cursor names primary {index} of {len(primaries)}: resharded")
            server = primaries[index].redis_connection
        else:
            index, server_cursor, primaries, server = 0, cursor, [], client
        # the sync client answers (cursor, names); see _read_batch on the annotation
        nxt, names = cast(tuple[int, list[bytes]],
                          server.scan(server_cursor, match=self._prefix + b"*", count=count))
        n = len(self._prefix)
        keys = [bytes.fromhex(name[n:].decode("ascii")) for name in names
                if _PAGE_NAME.fullmatch(name, n)]
        if nxt:
            return keys, (int(nxt) << 16) | index if primaries else int(nxt)
        if index + 1 < len(primaries):
            return keys, index + 1  # the next primary, from its start
        return keys, 0

    def close(self) -> None:
        self._closed = True
        with self._open_lock:
            if self._client_obj is not None:
                self._client_obj.close()

    def stats(self) -> dict[str, float]:
        """Adds `outages` (transitions from reachable to unreachable), `fast_failed_calls`
        (calls answered without the network during a backoff window) and `available`
        (1 unless the last round trip failed)."""
        out = super().stats()
        with self._state_lock:
            out["available"] = 0 if self._failing else 1
        return out
