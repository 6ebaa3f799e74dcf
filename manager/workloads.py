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
import random
from collections.abc import Iterator
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


def read_trace(path: str | Path, limit: int | None = None) -> Iterator[WorkRequest]:
    """Requests of a Mooncake-format trace (one JSON object a line: timestamp, input_length,
    output_length, hash_ids), in file order."""
    p = Path(path)
    try:
        f = p.open()
    except OSError as e:
        raise TraceError(f"trace {p}: {e.strerror}") from None
    with f:
        n = 0
        for lineno, line in enumerate(f, 1):
            if limit is not None and n >= limit:
                return
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                ids = d["hash_ids"]
                length = int(d["input_length"])
                out_len = int(d.get("output_length", 0))
                ts = int(d.get("timestamp", 0))
            except (ValueError, KeyError, TypeError) as e:
                raise TraceError(f"trace {p} line {lineno}: not a trace record ({e})") from None
            if (not isinstance(ids, list) or not all(isinstance(h, int) and h >= 0 for h in ids)
                    or length < 0):
                raise TraceError(
                    f"trace {p} line {lineno}: hash_ids must be non-negative ints and "
                    f"input_length >= 0")
            if length > len(ids) * TRACE_BLOCK_TOKENS:
                raise TraceError(
                    f"trace {p} line {lineno}: input_length {length} exceeds "
                    f"{len(ids)} blocks of {TRACE_BLOCK_TOKENS} tokens")
            n += 1
            yield WorkRequest(trace_tokens(ids, length), out_len, ts)
