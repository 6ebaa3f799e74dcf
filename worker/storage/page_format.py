"""The byte layout of one stored page, shared by every storage backend.

A page is one block of one rank, all layers. Storage is the one tier kvtier does not own
outright: files can be truncated by a crash or edited by hand, a Redis value can be evicted,
overwritten or half-written by another client. So every stored page carries a fixed header that
lets a reader prove the bytes belong to the key it asked for before any of them is used:

    offset  size  field
    0       4     magic          b"KVTP"
    4       2     version        FORMAT_VERSION (little-endian u16)
    6       2     header length  HEADER_BYTES (lets a later version grow the header)
    8       32    key            the 32-byte page key the manager computed
    40      8     payload length bytes that follow the header (little-endian u64)
    48      16    checksum       xxh3-128 digest of the payload

Every header field is compared against what the reader expects (magic, version, header length,
key, payload length = the caller's buffer length = the bytes actually present), and the payload
is checked against the checksum. xxh3 is not cryptographic and does not need to be: the key is
already a SHA-256 digest, the checksum only has to catch accidental damage, and it runs at
memory speed so verifying costs little next to moving the bytes.

Anything that does not match is a miss, reported as a `PageStatus` so the backend can count it.
"""

from __future__ import annotations

import enum
import struct

import xxhash

MAGIC = b"KVTP"
FORMAT_VERSION = 1
KEY_BYTES = 32
HEADER = struct.Struct("<4sHH32sQ16s")
HEADER_BYTES = HEADER.size  # 64
CHECKSUM_BYTES = 16
_PREFIX = struct.Struct("<4sHH32sQ")  # every header field but the checksum
_PREFIX_BYTES = _PREFIX.size  # 48

assert HEADER_BYTES == 64 and _PREFIX_BYTES + CHECKSUM_BYTES == HEADER_BYTES


class PageStatus(enum.Enum):
    """Outcome of checking one stored page against the key and length the reader expects."""

    OK = "ok"
    TRUNCATED = "truncated"  # fewer bytes than a header + the expected payload
    TOO_LONG = "too_long"  # more bytes than a header + the expected payload
    BAD_MAGIC = "bad_magic"
    BAD_VERSION = "bad_version"
    BAD_KEY = "bad_key"
    BAD_LENGTH = "bad_length"
    BAD_CHECKSUM = "bad_checksum"


def checksum(payload: bytes | bytearray | memoryview) -> bytes:
    """The 16-byte xxh3-128 digest stored in the header."""
    return xxhash.xxh3_128_digest(payload)


def encode_header(key: bytes, payload: bytes | bytearray | memoryview) -> bytes:
    """The 64-byte header for `payload` stored under `key` (the payload is only hashed)."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"page key must be {KEY_BYTES} bytes, got {len(key)}")
    nbytes = memoryview(payload).nbytes
    return HEADER.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, bytes(key), nbytes, checksum(payload))


def encode_page(key: bytes, payload: bytes | bytearray | memoryview) -> bytes:
    """Header + payload as one bytes object (one copy of the payload), for stores that keep a
    page as a single value."""
    return b"".join((encode_header(key, payload), payload))


def check_header(
    header: bytes | bytearray | memoryview, key: bytes, payload_len: int
) -> PageStatus:
    """Check a header's fixed fields against the key and payload length the reader expects.
    The checksum is returned by `header_checksum`, checked by the caller over the payload."""
    if memoryview(header).nbytes < HEADER_BYTES:
        return PageStatus.TRUNCATED
    magic, version, header_len, stored_key, stored_len, _ = HEADER.unpack_from(header, 0)
    if magic != MAGIC:
        return PageStatus.BAD_MAGIC
    if version != FORMAT_VERSION or header_len != HEADER_BYTES:
        return PageStatus.BAD_VERSION
    if stored_key != key:
        return PageStatus.BAD_KEY
    if stored_len != payload_len:
        return PageStatus.BAD_LENGTH
    return PageStatus.OK


def header_checksum(header: bytes | bytearray | memoryview) -> bytes:
    """The checksum field of a header that `check_header` accepted."""
    return bytes(memoryview(header)[HEADER_BYTES - CHECKSUM_BYTES : HEADER_BYTES])


def _expected_prefix(key: bytes, payload_len: int) -> bytes:
    """The first 48 header bytes a page of `key` with `payload_len` bytes must start with."""
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, key, payload_len)


def _bad_header(header: bytes | bytearray | memoryview, key: bytes, payload_len: int) -> PageStatus:
    """Name what is wrong with a header whose fixed fields did not match. `check_header`
    compares the same fields one by one, so it names the first that differs (it cannot
    accept the header; should it, the page is still refused)."""
    status = check_header(header, key, payload_len)
    return PageStatus.BAD_VERSION if status is PageStatus.OK else status


def verify_split(
    key: bytes, header: bytes | bytearray | memoryview, payload: memoryview, total_read: int
) -> PageStatus:
    """Verify a page that was read as separate header and payload buffers (a vectored file
    read straight into the caller's page). `total_read` is every byte the read returned, so a
    stored page longer or shorter than header + payload is caught. The fixed header fields are
    compared as one 48-byte string (this runs once per page on the prefetch path)."""
    expected = HEADER_BYTES + payload.nbytes
    if total_read != expected:
        return PageStatus.TRUNCATED if total_read < expected else PageStatus.TOO_LONG
    head = memoryview(header)
    if head[:_PREFIX_BYTES] != _expected_prefix(key, payload.nbytes):
        return _bad_header(header, key, payload.nbytes)
    if checksum(payload) != head[_PREFIX_BYTES:HEADER_BYTES]:
        return PageStatus.BAD_CHECKSUM
    return PageStatus.OK


def decode_into(key: bytes, page: bytes | bytearray | memoryview, dest: memoryview) -> PageStatus:
    """Verify a whole stored page (header + payload in one buffer) and, only if it is intact,
    copy its payload into `dest`. On any other status `dest` is left untouched."""
    view = memoryview(page)
    expected = HEADER_BYTES + dest.nbytes
    if view.nbytes < expected:
        return PageStatus.TRUNCATED
    if view.nbytes > expected:
        return PageStatus.TOO_LONG
    if view[:_PREFIX_BYTES] != _expected_prefix(key, dest.nbytes):
        return _bad_header(view, key, dest.nbytes)
    payload = view[HEADER_BYTES:]
    if checksum(payload) != view[_PREFIX_BYTES:HEADER_BYTES]:
        return PageStatus.BAD_CHECKSUM
    dest[:] = payload
    return PageStatus.OK
