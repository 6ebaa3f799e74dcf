"""The byte layout of one stored page, shared by every storage backend.

A page is one block of one rank, all layers. Storage is the one tier kvtier does not own
outright: files can be truncated by a crash or edited by hand, a Redis value can be evicted,
overwritten or half-written by another client, and anyone who can write the store could plant
KV of their choosing. So every stored page carries a fixed header that lets a reader prove the
bytes were written by a kvtier instance holding the deployment's storage secret, for the key
and namespace it asked for, before any of them is used:

    offset  size  field
    0       4     magic          b"KVTP"
    4       2     version        FORMAT_VERSION = 3 (little-endian u16)
    6       2     header length  HEADER_BYTES = 80 (lets a later version grow the header)
    8       32    key            the 32-byte page key the manager computed
    40      8     payload length bytes that follow the header (little-endian u64)
    48      32    mac            keyed BLAKE3-256 (key derived from the storage secret)
                                 over the namespace, header bytes 0..47 and the payload

Every header field is compared against what the reader expects (magic, version, header length,
key, payload length = the caller's buffer length = the bytes actually present), then the MAC
is recomputed and compared in constant time. The MAC replaces version 1's xxh3 checksum: it
catches accidental damage as well, and a page forged, edited or copied from another namespace
by someone without the secret fails it. The namespace is part of the MAC input (not of the
header), so a page moved between namespaces is refused; the secret authenticates and never
renames anything.

The payload is the host page as it lies (`kvtier.worker.page_layout`): K and V of every layer,
extra layers included, and the block's scales when the deployment has them, so the MAC covers
the scales too. The namespace names the page's shape (extra layers and scales included), so a
page of a deployment with another number of extra layers fails the MAC even where its length
happens to match.


Pages of older versions are refused as BAD_VERSION: a miss, counted, never served (version 1:
xxh3, no MAC; version 2: the same layout with a keyed BLAKE2b-256 MAC).

Why BLAKE3 (version 3) and not BLAKE2b (version 2): the MAC runs over every payload byte on
the prefetch path. hashlib's BLAKE2b ran at 1.18 GB/s on one core of the development machine
and capped the file backend's prefetch at 1.1 GB/s with one I/O thread (a plain read of the
same warm pages: 11 GB/s); keyed BLAKE3 (the `blake3` package, the reference Rust code with
SIMD) runs at 8.6 GB/s on the same core for a 256 KiB page, so the file backend reads at
several GB/s again (bench/storage.py, figures in worker/storage/README.md). BLAKE3's keyed
mode is a PRF and MAC in its own right (the same security claim as keyed BLAKE2s/BLAKE2b at a
256-bit key), so nothing weaker than version 2 is accepted: a non-cryptographic digest
(xxh3) under a keyed hash would be cheaper still but forgeable by anyone who finds an xxh3
collision, which needs no secret. The 32-byte BLAKE3 key is derived from the secret with
BLAKE3's own key-derivation mode under a context string that names this use, so the same
secret used elsewhere gives an unrelated key. The binding releases the GIL while hashing
large inputs, so the file backend's I/O threads still verify pages in parallel.

Anything that does not match is a miss, reported as a `PageStatus` so the backend can count it.

Version 4 (`page_crypto`) encrypts the payload with AES-256-GCM, whose tag replaces this MAC;
it is what a deployment writes by default (`storage.encrypt`). A reader reads one version: a
page of the other is BAD_VERSION (a miss, counted as an old-format page, deleted).
"""

from __future__ import annotations

import enum
import hmac
import struct

from blake3 import blake3

MAGIC = b"KVTP"
FORMAT_VERSION = 3
KEY_BYTES = 32
MAC_BYTES = 32
HEADER = struct.Struct("<4sHH32sQ32s")
HEADER_BYTES = HEADER.size  # 80
_PREFIX = struct.Struct("<4sHH32sQ")  # every header field but the MAC
_PREFIX_BYTES = _PREFIX.size  # 48
MIN_SECRET_BYTES = 16
# BLAKE3 key-derivation context: hard-coded, globally unique, names this one use of the secret.
MAC_KEY_CONTEXT = "kvtier 2026-11-22 storage page MAC v3"

assert HEADER_BYTES == 80 and _PREFIX_BYTES + MAC_BYTES == HEADER_BYTES


class PageStatus(enum.Enum):
    """Outcome of checking one stored page against the key and length the reader expects."""

    OK = "ok"
    TRUNCATED = "truncated"  # fewer bytes than a header + the expected payload
    TOO_LONG = "too_long"  # more bytes than a header + the expected payload
    BAD_MAGIC = "bad_magic"
    BAD_VERSION = "bad_version"  # includes pages of an older format version
    BAD_KEY = "bad_key"
    BAD_LENGTH = "bad_length"
    BAD_MAC = "bad_mac"  # damaged, forged, or written with another secret
    UNKNOWN_KEY = "unknown_key"  # version 4: a key id the configuration does not list
    BAD_TAG = "bad_tag"  # version 4: the GCM tag failed (damaged, forged, another secret)


def mac_key(secret: bytes) -> bytes:
    """The 32-byte BLAKE3 key for `secret`, derived with BLAKE3's key-derivation mode under
    `MAC_KEY_CONTEXT` (any secret length; the MAC key is never the secret itself). Raises
    ValueError for a secret shorter than 16 bytes."""
    if not isinstance(secret, bytes | bytearray):
        raise TypeError(f"storage secret must be bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"storage secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
    return blake3(bytes(secret), derive_key_context=MAC_KEY_CONTEXT).digest()


class PageCodec:
    """Encodes and verifies the pages of one namespace under one storage secret.

    Holds a keyed BLAKE3 state already fed the namespace; each page copies it (cheaper than
    re-keying) and adds the header prefix and the payload. The secret itself is
    not kept, and the repr shows neither it nor the key.
    """

    __slots__ = ("_base", "namespace")
    version = FORMAT_VERSION
    overhead = HEADER_BYTES  # stored bytes beyond the payload
    in_place = True  # a split read lands the payload straight in the caller's page
    variable = False  # every page is exactly payload + overhead bytes

    def __init__(self, secret: bytes, namespace: str) -> None:
        self.namespace = namespace
        base = blake3(key=mac_key(secret))
        encoded = namespace.encode("utf-8")
        base.update(struct.pack("<H", len(encoded)) + encoded)
        self._base = base

    def __repr__(self) -> str:
        return f"PageCodec(namespace={self.namespace!r})"

    def mac(self, prefix: bytes | bytearray | memoryview,
            payload: bytes | bytearray | memoryview) -> bytes:
        """The MAC of a page whose header starts with `prefix` (48 bytes)."""
        h = self._base.copy()
        h.update(prefix)
        h.update(payload)
        return h.digest(MAC_BYTES)

    def encode_header(self, key: bytes, payload: bytes | bytearray | memoryview) -> bytes:
        """The 80-byte header for `payload` stored under `key` (the payload is only hashed)."""
        if len(key) != KEY_BYTES:
            raise ValueError(f"page key must be {KEY_BYTES} bytes, got {len(key)}")
        nbytes = memoryview(payload).nbytes
        prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, bytes(key), nbytes)
        return prefix + self.mac(prefix, payload)

    def encode_parts(self, key: bytes, payload: bytes | bytearray | memoryview,
                     ) -> list[bytes | bytearray | memoryview]:
        """The buffers of a stored page in order: header, payload (not copied)."""
        return [self.encode_header(key, payload), payload]

    def encode_page(self, key: bytes, payload: bytes | bytearray | memoryview) -> bytes:
        """Header + payload as one bytes object (one copy of the payload), for stores that
        keep a page as a single value."""
        return b"".join((self.encode_header(key, payload), payload))

    def verify_split(self, key: bytes, header: bytes | bytearray | memoryview,
                     payload: memoryview, total_read: int,
                     dest: memoryview | None = None) -> PageStatus:
        """Verify a page that was read as separate header and payload buffers (a vectored
        file read straight into the caller's page, so `dest`, if given, is `payload`).
        `total_read` is every byte the read returned, so a stored page longer or shorter than
        header + payload is caught. The fixed header fields are compared as one 48-byte
        string (this runs once per page on the prefetch path). A page of another version
        (an encrypted version 4 page is 16 bytes longer) is BAD_VERSION."""
        expected = HEADER_BYTES + payload.nbytes
        if total_read != expected:
            if total_read >= 8 and _other_version(header):
                return PageStatus.BAD_VERSION
            return PageStatus.TRUNCATED if total_read < expected else PageStatus.TOO_LONG
        head = memoryview(header)
        prefix = _expected_prefix(key, payload.nbytes)
        if head[:_PREFIX_BYTES] != prefix:
            return _bad_header(header, key, payload.nbytes)
        if not hmac.compare_digest(self.mac(prefix, payload),
                                   bytes(head[_PREFIX_BYTES:HEADER_BYTES])):
            return PageStatus.BAD_MAC
        return PageStatus.OK

    def decode_into(self, key: bytes, page: bytes | bytearray | memoryview,
                    dest: memoryview) -> PageStatus:
        """Verify a whole stored page (header + payload in one buffer) and, only if it is
        authentic, copy its payload into `dest`. On any other status `dest` is untouched."""
        view = memoryview(page)
        expected = HEADER_BYTES + dest.nbytes
        if view.nbytes != expected and view.nbytes >= 8 and _other_version(view):
            return PageStatus.BAD_VERSION
        if view.nbytes < expected:
            return PageStatus.TRUNCATED
        if view.nbytes > expected:
            return PageStatus.TOO_LONG
        prefix = _expected_prefix(key, dest.nbytes)
        if view[:_PREFIX_BYTES] != prefix:
            return _bad_header(view, key, dest.nbytes)
        payload = view[HEADER_BYTES:]
        if not hmac.compare_digest(self.mac(prefix, payload),
                                   bytes(view[_PREFIX_BYTES:HEADER_BYTES])):
            return PageStatus.BAD_MAC
        dest[:] = payload
        return PageStatus.OK


def check_header(
    header: bytes | bytearray | memoryview, key: bytes, payload_len: int
) -> PageStatus:
    """Check a header's fixed fields against the key and payload length the reader expects.
    The MAC is checked by `PageCodec` over the payload. A version 1 header (64 bytes long) is
    BAD_VERSION as soon as its first 8 bytes are there."""
    view = memoryview(header)
    if view.nbytes >= 8:
        magic, version, header_len = struct.unpack_from("<4sHH", view, 0)
        if magic != MAGIC:
            return PageStatus.BAD_MAGIC
        if version != FORMAT_VERSION or header_len != HEADER_BYTES:
            return PageStatus.BAD_VERSION
    if view.nbytes < HEADER_BYTES:
        return PageStatus.TRUNCATED
    _, _, _, stored_key, stored_len, _ = HEADER.unpack_from(view, 0)
    if stored_key != key:
        return PageStatus.BAD_KEY
    if stored_len != payload_len:
        return PageStatus.BAD_LENGTH
    return PageStatus.OK


def header_mac(header: bytes | bytearray | memoryview) -> bytes:
    """The MAC field of a header that `check_header` accepted."""
    return bytes(memoryview(header)[_PREFIX_BYTES:HEADER_BYTES])


def _other_version(header: bytes | bytearray | memoryview) -> bool:
    """Whether a header has kvtier's magic and a version other than this one."""
    magic, version = struct.unpack_from("<4sH", header, 0)
    return bool(magic == MAGIC and version != FORMAT_VERSION)


def _expected_prefix(key: bytes, payload_len: int) -> bytes:
    """The first 48 header bytes a page of `key` with `payload_len` bytes must start with."""
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, key, payload_len)


def _bad_header(header: bytes | bytearray | memoryview, key: bytes, payload_len: int) -> PageStatus:
    """Name what is wrong with a header whose fixed fields did not match. `check_header`
    compares the same fields one by one, so it names the first that differs (it cannot
    accept the header; should it, the page is still refused)."""
    status = check_header(header, key, payload_len)
    return PageStatus.BAD_VERSION if status is PageStatus.OK else status
