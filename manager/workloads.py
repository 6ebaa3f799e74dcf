"""Request streams to drive kvtier with: the built-in synthetic chat workload and the Mooncake
trace format.

The chat workload is the hot-path benchmark's (the same generator semantics, seed and order
as the peer harness, so figures compare like with like) and the embedded default of
`kvtier replay`: a newcomer needs no trace file. Traces expand each 512-token trace block
into tokens derived from its hash id and position, so equal trace prefixes give equal token
prefixes and different hash ids never share a token.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.manager.errors import KvtierError

SEED = 20240611
VOCAB = 32000
N_CONV = 200
N_TURNS = 6
SYS_LEN = 1024
USER_LEN = 256
OUT_LEN = 256
CONCURRENCY = 64
CAP_FRACTION = 0.30
WARMUP_FRAC = 0.1
TRACE_BLOCK_TOKENS = 512

WORKLOADS = ("chat",)


@dataclass(frozen=True, slots=True)
class WorkRequest:
    """One request of a stream: its prompt tokens and how many tokens it will generate."""

    tokens: list[int]
    output_length: int = 0
    timestamp_ms: int = 0
    line: int = 0
    """Line of the trace the request came from (0: not from a trace)."""


class TraceError(KvtierError, ValueError):
    """A trace file that cannot be read; the message names the file and line."""


def make_chat_workload(seed: int = SEED, conversations: int = N_CONV) -> list[list[int]]:
    """Token lists of the multi-turn chat workload, in issue order: `conversations` chats of
    6 turns after a shared 1,024-token system prompt, 256 user + 256 output tokens a turn, 64
    chats open at once, the next turn taken from a random open chat."""
    rng = random.Random(seed)

    def rnd(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    system = rnd(SYS_LEN)
    convs = [[(rnd(USER_LEN), rnd(OUT_LEN)) for _ in range(N_TURNS)]
             for _ in range(conversations)]
    order = random.Random(seed + 1)
    open_convs = list(range(min(CONCURRENCY, conversations)))
    next_conv = len(open_convs)
    next_turn = [0] * conversations
    history = {c: list(system) for c in range(conversations)}
    reqs: list[list[int]] = []
    while open_convs:
        k = order.randrange(len(open_convs))
        c = open_convs[k]
        t = next_turn[c]
        user, out = convs[c][t]
        h = history[c]
        h.extend(user)
        h.extend(out)
        reqs.append(list(h))
        next_turn[c] += 1
        if next_turn[c] == N_TURNS:
            del history[c]
            if next_conv < conversations:
                open_convs[k] = next_conv
                next_conv += 1
            else:
                open_convs.pop(k)
    return reqs


def capacity_blocks(block_size: int, conversations: int = N_CONV) -> int:
    """30% of the chat workload's distinct blocks (the benchmark's cache size)."""
    distinct = SYS_LEN // block_size + conversations * N_TURNS * (
        USER_LEN + OUT_LEN) // block_size
    return math.ceil(CAP_FRACTION * distinct)


def chat_requests(limit: int | None = None) -> list[WorkRequest]:
    """The chat workload as replay requests (the last 256 tokens of each turn are the
    output the model generated; the prompt includes them for the following turn)."""
    reqs = make_chat_workload()
    if limit is not None:
        reqs = reqs[:limit]
    return [WorkRequest(t[:-OUT_LEN], OUT_LEN) for t in reqs]


def trace_tokens(hash_ids: list[int], input_length: int) -> list[int]:
    """Deterministic tokens for a trace request: block h holds h*512 .. h*512+511."""
    out: list[int] = []
    for h in hash_ids:
        base = h * TRACE_BLOCK_TOKENS
        out.extend(range(base, base + TRACE_BLOCK_TOKENS))
    del out[input_length:]
    return out


MAX_TRACE_HASH_ID = (2**31 - 1) // TRACE_BLOCK_TOKENS
"""Largest hash id whose tokens (h * 512 .. h * 512 + 511) are int32 token ids."""
MAX_TRACE_INPUT_LENGTH = 1 << 24
"""A request of more than 16 Mi tokens is a corrupt record, not a prompt."""
MAX_TRACE_INT = 2**63 - 1
"""timestamp and output_length: anything a 64-bit integer holds."""


def _trace_int(record: dict[str, object], name: str, default: int | None, high: int) -> int:
    """Field `name` of a trace record as an integer in [0, high]: a JSON integer, or a number
    without a fractional part (Mooncake traces write 123 or 123.0). ValueError names the
    field and its value."""
    if name not in record:
        if default is None:
            raise ValueError(f"{name}: missing")
        return default
    raw = value = record[name]
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} = {_shown(raw)}: expected a non-negative integer")
    if not 0 <= value <= high:
        raise ValueError(f"{name} = {_shown(raw)}: must be >= 0 and <= {high}")
    return value


def _shown(value: object) -> str:
    text = json.dumps(value) if isinstance(value, int | float | str | bool) else (
        type(value).__name__)
    return text if len(text) <= 40 else text[:37] + "..."


def _hash_ids(record: dict[str, object]) -> list[int]:
    if "hash_ids" not in record:
        raise ValueError("hash_ids: missing")
    ids = record["hash_ids"]
    if not isinstance(ids, list):
        raise ValueError(f"hash_ids = {_shown(ids)}: expected a list of non-negative integers")
    for i, h in enumerate(ids):
        if not isinstance(h, int) or isinstance(h, bool) or h < 0:
            raise ValueError(f"hash_ids[{i}] = {_shown(h)}: expected a non-negative integer")
        if h > MAX_TRACE_HASH_ID:
            raise ValueError(
                f"hash_ids[{i}] = {h}: must be <= {MAX_TRACE_HASH_ID} (its tokens, hash id x "
                f"{TRACE_BLOCK_TOKENS} + 0..{TRACE_BLOCK_TOKENS - 1}, must be int32 token ids)")
    return ids


def read_trace(path: str | Path, limit: int | None = None) -> Iterator[WorkRequest]:
    """Requests of a Mooncake-format trace (one JSON object a line: timestamp, input_length,
    output_length, hash_ids), in file order. A record kvtier cannot replay raises TraceError
    naming the file, the line and the field: not JSON (or nested too deeply), not an object,
    a missing field, a number that is not a non-negative integer (1e400, 12.5, "12"), a hash
    id whose tokens do not fit int32, an input_length beyond the blocks it names."""
    p = Path(path)
    try:
        f = p.open()
    except OSError as e:
        raise TraceError(f"trace {p}: {e.strerror}") from None
    with f:
        n = 0
        lineno = 0
        while True:
            try:
                line = f.readline()
            except (UnicodeDecodeError, OSError) as e:
                raise TraceError(f"trace {p} line {lineno + 1}: cannot be read ({e})") from None
            if not line:
                return
            lineno += 1
            if limit is not None and n >= limit:
                return
            if not line.strip():
                continue
            where = f"trace {p} line {lineno}"
            try:
                record = json.loads(line)
            except RecursionError:
                raise TraceError(f"{where}: not a trace record (JSON nested too deeply)") from None
            except ValueError as e:
                raise TraceError(f"{where}: not a trace record (not JSON: {e})") from None
            if not isinstance(record, dict):
                raise TraceError(f"{where}: not a trace record (a JSON {type(record).__name__}, "
                                 "not an object)")
            try:
                ids = _hash_ids(record)
                length = _trace_int(record, "input_length", None, MAX_TRACE_INPUT_LENGTH)
                out_len = _trace_int(record, "output_length", 0, MAX_TRACE_INT)
                ts = _trace_int(record, "timestamp", 0, MAX_TRACE_INT)
            except ValueError as e:
                raise TraceError(f"{where}: {e}") from None
            if length > len(ids) * TRACE_BLOCK_TOKENS:
                raise TraceError(
                    f"{where}: input_length = {length} exceeds the {len(ids)} blocks of "
                    f"{TRACE_BLOCK_TOKENS} tokens hash_ids names")
            n += 1
            yield WorkRequest(trace_tokens(ids, length), out_len, ts, lineno)


def check_requests_fit(requests: Sequence[WorkRequest], block_size: int, device_blocks: int,
                       trace: str | os.PathLike[str] | None = None) -> None:
    """TraceError naming the first request (its trace line and input_length) that needs more
    device blocks than the pool has: a replayed request holds all of its blocks at once, so
    it could never be served."""
    for i, wr in enumerate(requests):
        need = -(-len(wr.tokens) // block_size)
        if need > device_blocks:
            where = (f"trace {trace} line {wr.line}" if trace else
                     f"request {i + 1} of the built-in workload")
            raise TraceError(
                f"{where}: input_length = {len(wr.tokens)} needs {need} device blocks of "
                f"{block_size} tokens but cache.device_blocks = {device_blocks}")
