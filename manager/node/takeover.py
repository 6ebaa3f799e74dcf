"""The asking side of `kvtier serve --takeover` (issue 37): one TAKEOVER on a connection of
its own to the service on a node socket, its TAKEN (see `wire`). The server
(`NodeServer.take_over`) asks twice: `prepare` (how many workers to start warm), then the
take-over itself; the answering side is `NodeServer._give_over`.

Every refusal is one line (`TakeoverError`): nothing listens there, a service of another uid,
an ERROR frame (another deployment, already stopping), no answer before the deadline.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

from kvtier.manager.errors import KvtierError
from kvtier.manager.node import wire

_UCRED = struct.Struct("3i")


class TakeoverError(KvtierError):
    """`kvtier serve --takeover` cannot take the running service over (one line);
    `usage`: nothing or the wrong thing to take over (exit 2), else the running service did
    not answer or hand over in time (exit 1)."""

    def __init__(self, message: str, *, usage: bool = True) -> None:
        super().__init__(message)
        self.usage = usage


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{len(buf)} of {n} bytes before the deadline")
        sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"closed {len(buf)} bytes into {n}")
        buf += chunk
    return bytes(buf)


def ask(path: Path, req: wire.Takeover, deadline: float) -> wire.Taken:
    """`req` sent to the service on `path`, its TAKEN read before `deadline` (monotonic);
    TakeoverError otherwise."""
    where = f"--takeover: {path}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            raise TakeoverError(f"{where}: no kvtier serve to take over (nothing listens "
                                "there)") from None
        except OSError as e:
            raise TakeoverError(f"{where}: cannot connect ({e.strerror})") from None
        pid, uid, _ = _UCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        if uid != os.getuid():
            raise TakeoverError(f"{where}: the service there (pid {pid}) runs as uid {uid}, "
                                f"this one as {os.getuid()}: not taken over")
        sock.sendall(wire.encode_takeover(req))
        prefix = _recv_exact(sock, wire.LEN_BYTES, deadline)
        ftype, _, body = wire.decode_takeover_head(
            _recv_exact(sock, wire.frame_length(prefix), deadline))
        if ftype is wire.FrameType.ERROR:
            raise TakeoverError(f"{where}: the service there (pid {pid}) refused: "
                                f"{body.decode('utf-8', 'replace')}")
        if ftype is not wire.FrameType.TAKEN:
            raise TakeoverError(f"{where}: the service there answered {ftype.name}, not TAKEN")
        return wire.decode_taken(body)
    except (OSError, wire.WireError) as e:
        raise TakeoverError(f"{where}: the service there did not answer ({e})",
                            usage=False) from None
    finally:
        sock.close()
