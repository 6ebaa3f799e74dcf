"""Encrypted pages (format version 4): AES-256-GCM per page, keys rotated by id.

Why: the storage tier is shared (a Redis other services reach, a folder on a shared disk), and
KV caches can be inverted back to the prompts that made them. Version 3 pages are
authenticated (keyed BLAKE3) but stored in clear; version 4 pages are encrypted and
authenticated by AES-256-GCM, whose tag takes the MAC's place.

Layout (little-endian), `HEADER_BYTES` = 80 like version 3, plus a 16-byte tag after the
ciphertext::

    offset  size  field
    0       4     magic          b"KVTP"
    4       2     version        4
    6       2     header length  80
    8       32    key            the 32-byte page key the manager computed
    40      8     payload length plaintext bytes (= ciphertext bytes)
    48      4     key id         which configured key the page was written under
    52      15    writer salt    random per writer (one codec), picks its AES key
    67      1     encoding       0: the payload as it is; 1: zstd-compressed (then n < payload)
    68      12    nonce          the writer's page counter
    80      n     ciphertext     of the payload, or of its zstd frame
    80 + n  16    GCM tag

Keys. The deployment's storage secret is the HKDF-SHA256 input keying material; a writer
draws a 120-bit random salt when it opens, and its AES key for key id `i` is
HKDF(secret, salt=writer salt, info=INFO_PREFIX + i). A reader derives the same key from the
header's key id and salt (cached per writer). Key ids are the rotation handle: new pages are
written under `storage.key_id`; a page whose key id is neither that nor one of
`storage.old_key_ids` is refused as UNKNOWN_KEY (counted, never decrypted), so removing an id
from the configuration retires every page written under it. Changing the secret itself (it
leaked) makes every older page fail its tag; bump the key id with it so they are refused as
UNKNOWN_KEY instead (cheaper: no decryption attempted).

Nonces never repeat under one AES key, by construction rather than by chance: a key is
specific to one writer (its random 120-bit salt: two writers share a key only if they drew
the same salt, probability n^2 / 2^121 for n writers, 2^-81 for a million worker starts),
and a writer's nonce is a 96-bit counter it increments for every page (`itertools.count`,
whose `next` is atomic under the GIL, so threads of one writer never draw the same value). A
random 96-bit nonce per page under one deployment-wide key would instead collide with
probability about p^2 / 2^97 after p pages (NIST SP 800-38D caps it at 2^32 pages per key),
a bound a busy fleet reaches; the per-writer key costs one HKDF per writer, not per page.

Associated data: the namespace (u16 length + UTF-8) and the 80 header bytes. The tag thus
authenticates the page key, the payload length, the key id, the salt and the nonce with the
ciphertext: a page copied under another key, to another namespace (another model shape or
rank) or with any header bit changed fails like a flipped ciphertext bit. That is everything
version 3's MAC covered (namespace, header, payload), so the tag replaces the MAC; keeping the
MAC as well would add a second pass over every byte for no property GCM lacks (GCM is an
authenticated cipher: forging a tag without the key succeeds with probability about
n / 2^128 for an n-block page, far below what a keyed BLAKE3 guessing attack needs anyway).

Compression (`storage.compression = "zstd"`, off by default): the writer compresses the
payload with zstd level 1 before sealing it and keeps the result only when it is smaller
(encoding 1; else encoding 0). Compressing before encrypting is the only order that can work
(ciphertext does not compress); the length it reveals is the compressed size of a KV block,
which says far less than the prompt an attacker would need. Every reader opens both
encodings, whatever it writes, so instances with different settings share a store. Whether it
pays: `bench/storage_codecs.py` (README, "Storage encryption and key rotation": zstd saves
8-22% of the bytes of random-weight KV at 0.4-0.75 GB/s per core, so only on a link slower
than about 150 MB/s per core).

Cost: `cryptography` (OpenSSL's AES-NI/CLMUL code) seals at ~8 GB/s and opens at ~6.5 GB/s on
one core of the development VM for 256 KiB pages (`encrypt_into` / `decrypt_into`: no extra
copy on Redis reads; a file read lands ciphertext in a scratch page of its batch first).
A reader derives one key per writer salt it meets (HKDF, ~10 us, cached in an LRU of 1,024):
pages forged with fresh salts cost their forger a store write each and the reader one HKDF,
then fail their tag.
"""

from __future__ import annotations

import itertools
import os
import struct
import threading
from collections import OrderedDict
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from kvtier.worker.storage.page_format import (
    HEADER_BYTES,
    KEY_BYTES,
    MAGIC,
    MIN_SECRET_BYTES,
    PageCodec,
    PageStatus,
)

AEAD_VERSION = 4
TAG_BYTES = 16
SALT_BYTES = 15
NONCE_BYTES = 12
RAW, ZSTD = 0, 1  # the encoding byte
COMPRESSIONS = ("none", "zstd")
ZSTD_LEVEL = 1  # level 3 compressed KV no smaller and ran slower (bench/storage_codecs.py)
MAX_KEY_ID = 0xFFFFFFFF
INFO_PREFIX = b"kvtier 2026-11-27 storage page AES-256-GCM v4 key id "
AEAD_HEADER = struct.Struct("<4sHH32sQI15sB12s")
_FIXED = struct.Struct("<4sHH32sQ")  # the fields a reader knows in advance
_FIXED_BYTES = _FIXED.size  # 48
_WRITERS_CACHED = 1024  # readers' per-writer AESGCM objects kept (LRU)

assert AEAD_HEADER.size == HEADER_BYTES


def parse_key_ids(text: str) -> tuple[int, ...]:
    """`"3, 2"` -> (3, 2): key ids of `storage.old_key_ids` (ValueError naming the bad one)."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not (part.isascii() and part.isdigit()) or not 1 <= int(part) <= MAX_KEY_ID:
            raise ValueError(f"key id {part!r} is not an integer from 1 to {MAX_KEY_ID}")
        out.append(int(part))
    return tuple(out)


class PageKeys:
    """The key ids a deployment reads and the one it writes, derived from its storage secret.

    Holds the secret (bytes, never shown by repr) because each writer's AES key is derived
    from it with the writer's salt; `write_id` is in `read_ids` (invariant).
    """

    __slots__ = ("_secret", "read_ids", "write_id")

    def __init__(self, secret: bytes, write_id: int = 1,
                 old_ids: tuple[int, ...] = ()) -> None:
        if not isinstance(secret, bytes | bytearray) or len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"storage secret must be at least {MIN_SECRET_BYTES} bytes")
        for kid in (write_id, *old_ids):
            if isinstance(kid, bool) or not isinstance(kid, int) or not 1 <= kid <= MAX_KEY_ID:
                raise ValueError(f"storage key id {kid!r} is not an integer from 1 to "
                                 f"{MAX_KEY_ID} (storage.key_id, storage.old_key_ids)")
        self._secret = bytes(secret)
        self.write_id = write_id
        self.read_ids = frozenset((write_id, *old_ids))

    def __repr__(self) -> str:
        return f"PageKeys(write_id={self.write_id}, read_ids={sorted(self.read_ids)})"

    def derive(self, key_id: int, salt: bytes) -> AESGCM:
        """The AES-256-GCM key of writer `salt` under key id `key_id`."""
        hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=salt,
                    info=INFO_PREFIX + str(key_id).encode())
        return AESGCM(hkdf.derive(self._secret))


class AeadPageCodec:
    """Seals and opens the version 4 pages of one namespace (see the module docstring).

    State: `_writer` (this codec's salt, its AESGCM key for the write id, its nonce counter),
    `_readers`, an LRU of (key id, salt) -> AESGCM for the writers whose pages it opened
    (guarded by `_lock`), and `_local`: a zstd compressor and decompressor per thread (their
    objects must not be shared between threads). Invariant: a nonce value is drawn from
    `_nonces` once.
    """

    version = AEAD_VERSION
    overhead = HEADER_BYTES + TAG_BYTES  # stored bytes beyond the payload (uncompressed)
    in_place = False  # a split read needs a scratch buffer for ciphertext + tag
    variable = True  # a compressed page is shorter than payload + overhead

    def __init__(self, keys: PageKeys, namespace: str, compression: str = "none") -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"storage.compression = {compression!r}: expected one of "
                             f"{', '.join(COMPRESSIONS)}")
        self.namespace = namespace
        self.keys = keys
        self.compression = compression
        self._local = threading.local()
        encoded = namespace.encode("utf-8")
        self._ns = struct.pack("<H", len(encoded)) + encoded
        self._salt = os.urandom(SALT_BYTES)
        self._write_key = keys.derive(keys.write_id, self._salt)
        self._nonces = itertools.count()
        self._lock = threading.Lock()
        self._readers: OrderedDict[tuple[int, bytes], AESGCM] = OrderedDict()
        self._readers[(keys.write_id, self._salt)] = self._write_key

    def __repr__(self) -> str:
        return f"AeadPageCodec(namespace={self.namespace!r}, keys={self.keys!r})"

    # -- writing ---------------------------------------------------------------------------
    def _zstd(self) -> tuple[Any, Any]:
        """This thread's zstd compressor and decompressor (imported on first use)."""
        local = self._local
        pair = getattr(local, "zstd", None)
        if pair is None:
            import zstandard

            pair = local.zstd = (zstandard.ZstdCompressor(level=ZSTD_LEVEL),
                                 zstandard.ZstdDecompressor())
        return pair

    def _plain(self, payload: bytes | bytearray | memoryview) -> tuple[memoryview, int, int]:
        """What is sealed (the payload or, when smaller, its zstd frame), its encoding and
        the payload's length."""
        view = memoryview(payload)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        if self.compression == "zstd":
            packed = self._zstd()[0].compress(view)
            if len(packed) < view.nbytes:
                return memoryview(packed), ZSTD, view.nbytes
        return view, RAW, view.nbytes

    def _header(self, key: bytes, nbytes: int, encoding: int) -> bytes:
        if len(key) != KEY_BYTES:
            raise ValueError(f"page key must be {KEY_BYTES} bytes, got {len(key)}")
        nonce = next(self._nonces).to_bytes(NONCE_BYTES, "little")
        return AEAD_HEADER.pack(MAGIC, AEAD_VERSION, HEADER_BYTES, bytes(key), nbytes,
                                self.keys.write_id, self._salt, encoding, nonce)

    def encode_parts(self, key: bytes, payload: bytes | bytearray | memoryview,
                     ) -> list[bytes | bytearray | memoryview]:
        """The buffers of a stored page in order: header, ciphertext + tag."""
        plain, encoding, nbytes = self._plain(payload)
        header = self._header(key, nbytes, encoding)
        body = bytearray(plain.nbytes + TAG_BYTES)
        self._write_key.encrypt_into(header[68:80], plain, self._ns + header, body)
        return [header, body]

    def encode_page(self, key: bytes, payload: bytes | bytearray | memoryview) -> memoryview:
        """The whole stored page as one buffer (one value of a key-value store; a memoryview,
        which redis-py sends as it is, where it refuses a bytearray)."""
        plain, encoding, nbytes = self._plain(payload)
        header = self._header(key, nbytes, encoding)
        page = bytearray(HEADER_BYTES + plain.nbytes + TAG_BYTES)
        page[:HEADER_BYTES] = header
        self._write_key.encrypt_into(header[68:80], plain, self._ns + header,
                                     memoryview(page)[HEADER_BYTES:])
        return memoryview(page)

    # -- reading ---------------------------------------------------------------------------
    def _reader(self, key_id: int, salt: bytes) -> AESGCM:
        with self._lock:
            aead = self._readers.get((key_id, salt))
            if aead is not None:
                self._readers.move_to_end((key_id, salt))
                return aead
        aead = self.keys.derive(key_id, salt)
        with self._lock:
            self._readers[(key_id, salt)] = aead
            if len(self._readers) > _WRITERS_CACHED:
                self._readers.popitem(last=False)
        return aead

    def _open(self, key: bytes, header: memoryview, body: memoryview,
              dest: memoryview) -> PageStatus:
        """Check the header against what the reader expects, then decrypt `body`
        (ciphertext + tag) into `dest`, decompressing a zstd page; `dest` holds garbage
        unless OK. Nothing is decompressed before its tag proved a writer holding the key
        made it (no zstd frame of anybody else's is ever parsed)."""
        if header[:_FIXED_BYTES] != _FIXED.pack(MAGIC, AEAD_VERSION, HEADER_BYTES, key,
                                                dest.nbytes):
            return _bad_fixed(header, key, dest.nbytes)
        _, _, _, _, _, key_id, salt, encoding, nonce = AEAD_HEADER.unpack_from(header)
        if key_id not in self.keys.read_ids:
            return PageStatus.UNKNOWN_KEY
        sealed = body.nbytes - TAG_BYTES
        if encoding == RAW:
            if sealed != dest.nbytes:
                return PageStatus.TRUNCATED if sealed < dest.nbytes else PageStatus.TOO_LONG
            plain = dest
        elif encoding == ZSTD and 0 < sealed < dest.nbytes:
            plain = memoryview(bytearray(sealed))
        else:
            return PageStatus.BAD_LENGTH  # an unknown encoding, or a frame no smaller
        aad = self._ns + bytes(header)
        try:
            self._reader(key_id, salt).decrypt_into(nonce, body, aad, plain)
        except InvalidTag:
            return PageStatus.BAD_TAG
        if encoding == ZSTD:
            try:
                out = self._zstd()[1].decompress(plain, max_output_size=dest.nbytes)
            except Exception:  # zstandard.ZstdError: authentic, yet not a frame
                return PageStatus.BAD_LENGTH
            if len(out) != dest.nbytes:
                return PageStatus.BAD_LENGTH
            dest[:] = out
        return PageStatus.OK

    def verify_split(self, key: bytes, header: bytes | bytearray | memoryview,
                     body: memoryview, total_read: int, dest: memoryview) -> PageStatus:
        """A page read as a header buffer and a `body` buffer (room for ciphertext + tag of
        an uncompressed page, `dest.nbytes + TAG_BYTES`) plus a spare byte; `total_read` is
        every byte the read returned (a compressed page is shorter). Decrypts into `dest`
        when authentic."""
        expected = HEADER_BYTES + dest.nbytes + TAG_BYTES
        if total_read >= 8 and _version(header) not in (None, AEAD_VERSION):
            return PageStatus.BAD_VERSION
        if total_read <= HEADER_BYTES + TAG_BYTES:
            return PageStatus.TRUNCATED
        if total_read > expected:
            return PageStatus.TOO_LONG
        return self._open(key, memoryview(header), body[:total_read - HEADER_BYTES], dest)

    def decode_into(self, key: bytes, page: bytes | bytearray | memoryview,
                    dest: memoryview) -> PageStatus:
        """Open a whole stored page (one buffer) into `dest`."""
        view = memoryview(page)
        expected = HEADER_BYTES + dest.nbytes + TAG_BYTES
        if view.nbytes >= 8 and _version(view) not in (None, AEAD_VERSION):
            return PageStatus.BAD_VERSION
        if view.nbytes <= HEADER_BYTES + TAG_BYTES:
            return PageStatus.TRUNCATED
        if view.nbytes > expected:
            return PageStatus.TOO_LONG
        return self._open(key, view[:HEADER_BYTES], view[HEADER_BYTES:], dest)


def _version(header: bytes | bytearray | memoryview) -> int | None:
    """The version field of a header with the right magic, else None."""
    magic, version = struct.unpack_from("<4sH", header, 0)
    return int(version) if magic == MAGIC else None


def _bad_fixed(header: memoryview, key: bytes, payload_len: int) -> PageStatus:
    """Name the first fixed header field that differs from what the reader expects."""
    magic, version, header_len, stored_key, stored_len = _FIXED.unpack_from(header)
    if magic != MAGIC:
        return PageStatus.BAD_MAGIC
    if version != AEAD_VERSION or header_len != HEADER_BYTES:
        return PageStatus.BAD_VERSION
    if stored_key != key:
        return PageStatus.BAD_KEY
    if stored_len != payload_len:
        return PageStatus.BAD_LENGTH
    return PageStatus.BAD_VERSION  # unreachable: the fixed fields matched


AnyCodec = PageCodec | AeadPageCodec
"""What a backend seals and opens its pages with: version 3 (clear, MAC) or 4 (encrypted)."""


def make_codec(secret: bytes, namespace: str, keys: PageKeys | None,
               compression: str = "none") -> AnyCodec:
    """Version 4 pages under `keys` (which carries the secret), compressed as `compression`
    says, or version 3 pages authenticated with `secret` when `keys` is None
    (`storage.encrypt = false`; compression needs encryption)."""
    if keys is None:
        if compression != "none":
            raise ValueError(f"storage.compression = {compression!r} needs storage.encrypt "
                             "= true (compressed pages are format 4)")
        return PageCodec(secret, namespace)
    return AeadPageCodec(keys, namespace, compression)
