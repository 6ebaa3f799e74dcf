"""What one rank's worker is built from: its `WorkerSpec` and the names derived from it.

Kept free of torch so the manager can describe its workers without importing it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.worker.storage.backend import namespace_for
from kvtier.worker.storage.page_crypto import PageKeys

WARM_LINE = "kvtier worker: warm (imports done), waiting for its spec on stdin"
"""What a warm worker (`--spec-stdin`, issue 37's take-over) prints once its imports are
done; the launcher's `WarmWorkers` waits for it."""

REFUSED_EXIT = 3
"""A worker's exit status when it refused to start (a deliberate KvtierError: a registration
that does not fit, a pool that cannot be had): its stderr (the log) then ends with one line
REFUSED_PREFIX + the reason, which the manager reports instead of a traceback (issue 27)."""
REFUSED_PREFIX = "kvtier-worker refused to start: "

if TYPE_CHECKING:
    from kvtier.worker.kv_pools import KVShape


SHM_DIR = "/dev/shm"  # where POSIX shared-memory segments live (name "/x" is SHM_DIR/x)


def host_segment_name(deployment_id: str, rank: int) -> str:
    """The host pool's shared-memory name (the launcher unlinks it after a crash)."""
    return f"/kvtier_{deployment_id}_host_r{rank}"


KEPT_PREFIX = "/kvtier-keep_"
"""Host pools a stopping node service hands over (issue 37) are kept under a second name of
this prefix: not `kvtier_<id>_`, so neither the janitor, nor the launcher, nor a worker's
own unlink of the pool's name removes them; the next service's worker renames the kept
segment back (`WorkerSpec.host_adopt`)."""


def kept_segment_name(deployment_id: str, rank: int) -> str:
    """The hand-over name of a rank's host pool (`KEPT_PREFIX`)."""
    return f"{KEPT_PREFIX}{deployment_id}_host_r{rank}"


def segment_inode(name: str, share_gid: int = -1) -> int:
    """The inode of shared-memory segment `name` now: the one place a host pool segment's
    identity is read (a segment created again under the same name is another inode, and a
    plan made against the old one must not copy into it). OSError when it is not there.

    `share_gid` >= 0 (the node service's `node.allowed_gid`): the segment, which must be
    this user's, is first made usable by that group (mode 0660, still no access for anyone
    else). The worker creates it 0600, and again when it is replaced, so the service does
    this on every attach (idempotent)."""
    path = SHM_DIR + name
    if share_gid < 0:
        return os.stat(path).st_ino
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise PermissionError(13, "not this user's segment")
        if st.st_gid != share_gid:
            os.fchown(fd, -1, share_gid)
        if st.st_mode & 0o777 != 0o660:
            os.fchmod(fd, 0o660)
        return st.st_ino
    finally:
        os.close(fd)


def host_segments(deployment_id: str, ranks: int,
                  share_gid: int = -1) -> list[tuple[int, str, int]]:
    """(rank, name, inode) of every rank's host pool segment of deployment `deployment_id`
    now (`segment_inode`; OSError while a rank's segment is not there, e.g. its worker is
    being replaced)."""
    return [(r, name, segment_inode(name, share_gid))
            for r in range(ranks) for name in (host_segment_name(deployment_id, r),)]


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs, passed as JSON in an environment variable (see the
    launcher's SPEC_ENV): a process's environment is readable by its user only, its command
    line by everybody, and the spec carries the storage secret."""

    deployment_id: str
    rank: int
    num_ranks: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    device_blocks: int
    host_blocks: int
    device: str = "auto"
    storage_backend: str = "none"
    storage_path: str = ""  # absolute, resolved by the manager (KvtierConfig.storage_dir)
    storage_url: str = "redis://127.0.0.1:6379/0"
    storage_capacity_bytes: int = 0
    storage_ttl_s: int = 0
    storage_timeout_s: float = 0.5
    backup_one_rank: bool = False
    manager_timeout_s: float = 3.0
    model_name: str = ""
    # workers.engine_kv: attach the model runner's registered KV instead of allocating a
    # device pool (kvtier.worker.engine_pool), waiting at most engine_kv_timeout_s for it
    engine_kv: bool = False
    engine_kv_timeout_s: float = 60.0
    # Keeps pages of a different kind of content apart: "verify" for `kvtier replay
    # --verify`, whose pages hold key-derived bytes (a verified run must never read the
    # pages of an unverified one, whose bytes are whatever the blocks held). "": none.
    storage_tag: str = ""
    # The instance nonce of the manager IPC the worker must attach to (0: any): a worker
    # started by a manager whose names a successor took over never joins the successor.
    ipc_instance: int = 0
    # workers.host_numa: "auto", "off" or a node number, as a string (kvtier.worker.numa)
    host_numa: str = "auto"
    # The deployment's storage secret (hex) that authenticates every stored page; "" only
    # with storage_backend = "none". Never in the repr (and so never in a log line).
    storage_secret: str = field(default="", repr=False)
    # model.num_extra_layers: KV layers beyond num_layers (MTP draft layers), after them in
    # every pool and page; model.kv_scales: "none" | "per_block_head" (float32 scales per
    # block, layer, K/V and KV head travel with every block, see worker/page_layout.py)
    num_extra_layers: int = 0
    kv_scales: str = "none"
    # storage.encrypt, storage.key_id, storage.old_key_ids (worker/storage/page_crypto.py):
    # pages are AES-256-GCM under key id storage_key_id, readable under those ids too
    storage_encrypt: bool = False
    storage_key_id: int = 1
    storage_old_key_ids: tuple[int, ...] = ()
    storage_compression: str = "none"  # storage.compression: "none" | "zstd"
    # A kept host pool to adopt instead of creating one (issue 37: `kept_segment_name`, a
    # node service's hand-over): renamed to the pool's name when it is this user's, private
    # and of the pool's size, else unlinked and a fresh pool created. "": create.
    host_adopt: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        fields = json.loads(text)
        fields["storage_old_key_ids"] = tuple(fields.get("storage_old_key_ids", ()))
        return cls(**fields)

    def storage_keys(self) -> PageKeys | None:
        """The page keys of an encrypting deployment (None: version 3 pages, in clear)."""
        if not self.storage_encrypt or self.storage_backend == "none":
            return None
        return PageKeys(self.storage_secret_bytes, self.storage_key_id,
                        self.storage_old_key_ids)

    @property
    def storage_secret_bytes(self) -> bytes:
        """The storage secret as bytes (ValueError when it is not hex)."""
        return bytes.fromhex(self.storage_secret)

    @property
    def shape(self) -> KVShape:
        from kvtier.worker.kv_pools import KVShape, parse_dtype

        return KVShape(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size,
                       parse_dtype(self.dtype), self.num_extra_layers,
                       self.kv_scales != "none")

    def storage_namespace(self, layout: str | None = None) -> str:
        """The rank's storage namespace. With `engine_kv` the bytes of a row are in the
        engine's element order, so the registration's `layout` name is part of it (pages of
        different layouts never mix) and must be given."""
        fields: dict[str, Any] = {"num_layers": self.num_layers,
                                  "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                                  "dtype": self.dtype, "block_size": self.block_size}
        if self.model_name:  # unnamed models share by shape alone
            fields["model_name"] = self.model_name
        # Only when set, so the pages of a deployment without them keep their namespace.
        # A different number of extra layers (or scales on / off) is a different page: the
        # namespace, which the MAC of every stored page covers, keeps them apart.
        if self.num_extra_layers:
            fields["num_extra_layers"] = self.num_extra_layers
        if self.kv_scales != "none":
            fields["kv_scales"] = self.kv_scales
        if self.engine_kv:
            if not layout:
                raise ValueError(
                    f"rank {self.rank}: with engine_kv the storage namespace needs the "
                    "registration's layout name")
            fields["layout"] = layout
        elif layout not in (None, "kvtier"):
            raise ValueError(f"rank {self.rank}: layout {layout!r} without engine_kv")
        if self.storage_tag:
            fields["storage_tag"] = self.storage_tag
        if self.backup_one_rank:  # every rank holds the same KV: all share rank 0's pages
            return namespace_for(fields, 0, 1)
        return namespace_for(fields, self.rank, self.num_ranks)
