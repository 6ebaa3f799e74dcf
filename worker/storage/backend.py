"""The storage-tier interface every backend implements and its shared bookkeeping (the
factory that opens a backend by name is `kvtier.worker.storage.factory`).

The storage tier holds *pages*: one block of one rank, all layers, a fixed number of bytes for a
given model shape. A worker moves pages between its host pool and a backend in batches (a
prefetch reads the pages of a matched prefix, a backup writes the pages of committed blocks),
so every operation takes a list of keys and answers per key.

Keys are opaque 32-byte digests computed by the manager from the chained block key. The backend
never interprets them; it only stores them inside each page's header (see `page_format`) and
refuses any page whose header names another key.

A backend is opened on a *namespace* that names the model shape and the rank
(`namespace_for`). Two deployments that serve the same model with the same tensor-parallel
layout get the same namespace on purpose: that is how one node hits the prefixes another node
computed through a shared store. Different shapes, layouts or ranks never share a namespace,
so they can never read each other's bytes.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from kvtier.worker.storage.page_format import KEY_BYTES
from kvtier.worker.storage.retention import RetentionMarks

if TYPE_CHECKING:
    import mmap

    import numpy

log = logging.getLogger("kvtier.storage")

# A page buffer: anything exposing the buffer protocol as contiguous bytes (a torch tensor is
# passed as `tensor.numpy()`; a host-pool page as its memoryview).
Buffer: TypeAlias = "bytes | bytearray | memoryview | mmap.mmap | numpy.ndarray"

# Upper bounds (seconds) of the latency histogram buckets; the last bucket is +Inf.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)

OPERATIONS = ("exists", "get", "set", "delete", "clear", "list", "retain")

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$")
_SHAPE_VALUE_TYPES = (str, int, float, bool)


def validate_namespace(namespace: str) -> str:
    """Return `namespace` if it is safe as both a directory path and a Redis key part: path
    components of letters, digits, '.', '_', '-' (not starting with '.'), separated by '/'.
    That rules out '..', absolute paths, ':' (the Redis key separator) and glob characters
    (so a SCAN pattern over the namespace matches exactly the namespace)."""
    if not isinstance(namespace, str) or not namespace:
        raise ValueError(f"storage namespace must be a non-empty string, got {namespace!r}")
    if len(namespace) > 200 or not _NAMESPACE_RE.match(namespace):
        raise ValueError(
            f"storage namespace {namespace!r} is invalid: use '/'-separated components of "
            "letters, digits, '.', '_' and '-' (not starting with '.'), at most 200 characters"
        )
    return namespace


def namespace_for(shape_fields: dict[str, Any], rank: int, tp_size: int) -> str:
    """The storage namespace of one rank of a deployment: `<fingerprint>-tp<tp_size>/r<rank>`.

    `shape_fields` must hold everything that decides a page's bytes for a given key: the KV
    shape (layers, KV heads, head dim, dtype, block size) and, when the deployment knows it, a
    model identity (name or weights hash). Two different models with identical shapes would
    otherwise share pages for the same tokens. The deployment id is deliberately NOT part of
    it: instances serving the same model share pages through a shared store.

    The fingerprint is the first 16 hex digits of SHA-256 over a canonical JSON encoding
    (sorted keys, no whitespace), so every process and every node computes the same string.
    """
    if not isinstance(shape_fields, dict) or not shape_fields:
        raise ValueError("namespace_for: shape_fields must be a non-empty dict of model fields")
    for name, value in shape_fields.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"namespace_for: field name {name!r} must be a non-empty string")
        if not isinstance(value, _SHAPE_VALUE_TYPES):
            raise ValueError(
                f"namespace_for: field {name!r} has type {type(value).__name__}; "
                "use str, int, float or bool"
            )
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"namespace_for: tp_size must be an int >= 1, got {tp_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp_size:
        raise ValueError(f"namespace_for: rank must be an int in [0, {tp_size}), got {rank!r}")
    canonical = json.dumps(shape_fields, sort_keys=True, separators=(",", ":"))
    fingerprint = hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]
    return f"{fingerprint}-tp{tp_size}/r{rank}"


def check_keys(keys: Sequence[bytes]) -> list[bytes]:
    """Validate a batch of page keys; returns them as `bytes`. Raises naming the bad index."""
    if isinstance(keys, bytes | bytearray | memoryview | str):
        raise TypeError("keys must be a list of 32-byte keys, not a single bytes/str object")
    out: list[bytes] = []
    for i, key in enumerate(keys):
        if not isinstance(key, bytes | bytearray | memoryview):
            raise TypeError(f"key {i} has type {type(key).__name__}; expected bytes")
        key_b = bytes(key)
        if len(key_b) != KEY_BYTES:
            raise ValueError(f"key {i} is {len(key_b)} bytes; page keys are {KEY_BYTES} bytes")
        out.append(key_b)
    return out


def as_page_view(obj: Buffer, index: int, *, writable: bool, page_bytes: int | None) -> memoryview:
    """A flat byte view of one page buffer (bytes, memoryview, numpy array, torch tensor via
    `.numpy()`, mmap slice). Raises naming the page index when it is not contiguous, not
    writable where it must be, or not `page_bytes` long."""
    try:
        # numpy's stubs give ndarray `__buffer__` only for Python >= 3.12 (PEP 688).
        view = memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"page {index} has type {type(obj).__name__}, which exposes no buffer "
            "(pass bytes, a memoryview, a numpy array or tensor.numpy())"
        ) from None
    if not view.c_contiguous:
        raise ValueError(f"page {index} is not a contiguous buffer")
    if writable and view.readonly:
        raise ValueError(f"page {index} is a read-only buffer; get_into needs writable pages")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if page_bytes is not None and view.nbytes != page_bytes:
        raise ValueError(f"page {index} is {view.nbytes} bytes; this backend stores {page_bytes}")
    return view


class RateLimitedLog:
    """Emits at most one warning per `interval_s`, reporting how many were suppressed since
    the previous one: an outage produces one error per call, which must not flood the log."""

    def __init__(self, logger: logging.Logger, interval_s: float) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._last = float("-inf")
        self._suppressed = 0
        self._lock = threading.Lock()

    def warning(self, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self._interval_s:
                self._suppressed += 1
                return
            suppressed, self._suppressed, self._last = self._suppressed, 0, now
        if suppressed:
            message = f"{message} ({suppressed} similar messages suppressed)"
        self._logger.warning(message)


class BackendStats:
    """Thread-safe counters and latency histograms of one backend.

    `counters` maps a name to a monotonically increasing number (pages, bytes, errors by
    operation, latency sums); `_hist[op]` holds per-bucket (non-cumulative) counts for the
    `LATENCY_BUCKETS_S` bounds plus one +Inf bucket. All updates take `_lock`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters: dict[str, float] = {
            "pages_read": 0,
            "bytes_read": 0,
            "pages_written": 0,
            "bytes_written": 0,
            "misses": 0,
            "corrupt_pages": 0,
            "unknown_key_pages": 0,
            "old_format_pages": 0,
            "pages_deleted": 0,
            "read_calls": 0,
            "read_seconds_total": 0.0,
            "write_calls": 0,
            "write_seconds_total": 0.0,
        }
        for op in OPERATIONS:
            self.counters[f"errors_{op}"] = 0
        self._hist = {op: [0] * (len(LATENCY_BUCKETS_S) + 1) for op in ("read", "write")}
        self._hist_sum = {"read": 0.0, "write": 0.0}

    def add(self, **amounts: float) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self.counters[name] = self.counters.get(name, 0) + amount

    def observe(self, op: str, seconds: float) -> None:
        """Record the duration of one `get_into` (op="read") or `set` (op="write") call."""
        with self._lock:
            self.counters[f"{op}_calls"] += 1
            self.counters[f"{op}_seconds_total"] += seconds
            self._hist[op][bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
            self._hist_sum[op] += seconds

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.counters)

    def histograms(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            out: dict[str, dict[str, Any]] = {}
            for op, counts in self._hist.items():
                cumulative, running = [], 0
                for count in counts:
                    running += count
                    cumulative.append(running)
                out[op] = {
                    "le": [*LATENCY_BUCKETS_S, float("inf")],
                    "cumulative_counts": cumulative,
                    "count": running,
                    "sum": self._hist_sum[op],
                }
            return out


def refusals(reasons: Sequence[str]) -> dict[str, int]:
    """Counter increments for refused pages by reason (`PageStatus` values): every refusal is
    a `corrupt_pages`; those under a key id the configuration does not list (unknown or
    retired) are also `unknown_key_pages`, those of another format version
    `old_format_pages`."""
    return {"corrupt_pages": len(reasons),
            "unknown_key_pages": sum(r == "unknown_key" for r in reasons),
            "old_format_pages": sum(r == "bad_version" for r in reasons)}


class StorageBackend(ABC):
    """A batch key -> page store for the pages of one namespace (one model shape, one rank).

    Contract shared by all backends:
    * keys are 32-byte `bytes`; pages are byte buffers of `page_bytes` bytes when the backend
      was given a page size (then a page of another length is rejected up front), otherwise of
      any length, as long as `get_into` is called with buffers of the length that was stored;
    * a stored page whose header or MAC does not match (damaged, forged, of an older format,
      or written with another storage secret) is a miss, counted in `stats()["corrupt_pages"]`;
      it is never returned as data;
    * an unavailable store degrades: reads miss, writes report fewer pages written, errors are
      counted per operation; no call raises for an outage or blocks past the backend timeout;
    * bad arguments (wrong key length, mismatched list lengths, wrong page size) raise
      `ValueError`/`TypeError` naming the index before anything is read or written.
    * methods are safe to call from several threads of one process.
    """

    kind: str = "abstract"

    def __init__(self, namespace: str, page_bytes: int | None) -> None:
        self.namespace = validate_namespace(namespace)
        if page_bytes is not None and (
            isinstance(page_bytes, bool) or not isinstance(page_bytes, int) or page_bytes < 1
        ):
            raise ValueError(f"page_bytes must be a positive int or None, got {page_bytes!r}")
        self.page_bytes = page_bytes
        self._stats = BackendStats()
        self._marks = RetentionMarks()

    # -- retention (issue 36; `kvtier.worker.storage.retention`) ---------------------------
    def retain(self, keys: Sequence[bytes], *, pin: bool = False, ttl_s: float = 0.0,
               priority: int = 0) -> int:
        """Keep these pages: pinned (until `unpin`), at least `ttl_s` seconds from now, and
        at `priority` (lower goes first where this backend evicts). Pages not stored yet get
        it when written. Returns the pages marked (a full mark table refuses the rest)."""
        self._ensure_open()
        keys_b = check_keys(keys)
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not (
                0 <= ttl_s < float("inf")):
            raise ValueError(f"retain: ttl_s = {ttl_s!r}, must be finite seconds >= 0")
        if isinstance(priority, bool) or not isinstance(priority, int) or not (
                -8 <= priority <= 8):
            raise ValueError(f"retain: priority = {priority!r}, must be an int in [-8, 8]")
        now = time.monotonic()
        marked = self._marks.retain([k.hex() for k in keys_b], pin=bool(pin),
                                    ttl_s=float(ttl_s), priority=priority, now=now)
        if marked:
            self._apply_retain(marked, now)
        return len(marked)

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Take the pin off these pages (their TTL and priority stay); the ordinary expiry
        applies again. Returns the pages that were pinned."""
        self._ensure_open()
        keys_b = check_keys(keys)
        now = time.monotonic()
        released = self._marks.unpin([k.hex() for k in keys_b], now)
        if released:
            self._apply_unpin(released, now)
        return len(released)

    def _apply_retain(self, hexkeys: list[str], now: float) -> None:  # noqa: B027 (optional)
        """Apply the marks of these pages to what is stored now (a backend whose store
        expires pages by itself: Redis). The default: the marks are read where the backend
        evicts."""

    def _apply_unpin(self, hexkeys: list[str], now: float) -> None:  # noqa: B027 (optional)
        """These pages lost their pin: give them their ordinary expiry back (Redis)."""

    @abstractmethod
    def _ensure_open(self) -> None:
        """Raise if the backend was closed."""

    # -- the operations -----------------------------------------------------------------
    @abstractmethod
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether a page is stored (its content is verified only on read)."""

    def leading_present(self, keys: Sequence[bytes]) -> int:
        """How many keys from the start of `keys` are present: the storage hit length of a
        prefix whose block keys are `keys` in order. Backends may stop at the first miss."""
        count = 0
        for present in self.exists(keys):
            if not present:
                break
            count += 1
        return count

    @abstractmethod
    def get_into(self, keys: Sequence[bytes], dests: Sequence[Buffer]) -> list[bool]:
        """Read the page of `keys[i]` into the caller-owned writable buffer `dests[i]`.
        Returns per key True (dests[i] now holds the verified page) or False (a miss: absent,
        corrupt or unreachable; dests[i] content is then unspecified)."""

    @abstractmethod
    def set(self, keys: Sequence[bytes], pages: Sequence[Buffer]) -> int:
        """Store `pages[i]` under `keys[i]` (overwriting). Returns the number of pages written."""

    @abstractmethod
    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove the pages of `keys` if present. Returns the number of pages removed."""

    @abstractmethod
    def clear(self) -> int:
        """Remove every page of this namespace (and nothing else). Returns pages removed."""

    @abstractmethod
    def list_keys(self, cursor: int, count: int) -> tuple[list[bytes], int]:
        """A bounded batch of the keys of this namespace's pages: about `count` of them
        (a batch may hold somewhat more or fewer) from `cursor` (0 starts a listing), and the
        cursor of the next batch, 0 once the listing is done. A listing sees every page that
        stayed stored from its start to its end; one written or deleted meanwhile may or may
        not be in it, and a key may come twice. An outage counts `errors_list` and ends the
        listing (0)."""

    @abstractmethod
    def close(self) -> None:
        """Release files, threads and connections. The backend is unusable afterwards."""

    # -- observability --------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Counters since construction: pages/bytes read and written, misses, corrupt pages,
        `errors_<op>` for op in exists/get/set/delete/clear/list, `read_calls`,
        `read_seconds_total`, `write_calls`, `write_seconds_total`, the retention marks
        (`retained_pinned_pages`, `retained_ttl_pages`, `retention_marks`,
        `retain_refused_pages`), plus backend extras."""
        out = self._stats.snapshot()
        out.update(self._marks.counts(time.monotonic()))
        return out

    def latency_histograms(self) -> dict[str, dict[str, Any]]:
        """Per op ("read" = get_into calls, "write" = set calls): bucket bounds `le`,
        `cumulative_counts`, `count`, `sum` — ready to export as a Prometheus histogram."""
        return self._stats.histograms()

    # -- shared argument checks -------------------------------------------------------------
    def _check_pages(
        self, keys: Sequence[bytes], pages: Sequence[Buffer], *, writable: bool, what: str
    ) -> tuple[list[bytes], list[memoryview]]:
        keys_b = check_keys(keys)
        if isinstance(pages, bytes | bytearray | memoryview):
            raise TypeError(f"{what} must be a list of page buffers, not a single buffer")
        if len(pages) != len(keys_b):
            raise ValueError(f"got {len(keys_b)} keys but {len(pages)} {what}")
        views = [
            as_page_view(p, i, writable=writable, page_bytes=self.page_bytes)
            for i, p in enumerate(pages)
        ]
        return keys_b, views

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(namespace={self.namespace!r})"
