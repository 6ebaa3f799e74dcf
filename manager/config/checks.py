"""What this machine and the storage tier allow a configuration: the bytes of a page and of
the pools, where the device pools live (`resolve_device`, `rank_device`), whether the pools
fit (MemAvailable, /dev/shm, each GPU: `check_memory`), and whether the storage tier can be
used (its secret, its directory, Redis answering: `check_storage_reachable`). Each failure is
one `ConfigError` line naming the key."""

from __future__ import annotations

import importlib.util
import os
import re
import tempfile
import threading
from pathlib import Path
from typing import Literal

from kvtier.manager.config.base import DTYPE_BYTES, MEMINFO, SHM_DIR, ConfigError
from kvtier.manager.config.model import KvtierConfig
from kvtier.manager.config.values import _short_repr, redact_url
from kvtier.worker import numa
from kvtier.worker.page_layout import PageLayout

# --------------------------------------------------------------------------------------------
# Sizes and machine checks
# --------------------------------------------------------------------------------------------


def page_bytes(cfg: KvtierConfig) -> int:
    """Bytes of one block on one rank: K and V of every layer (extra layers included) and
    the block's scales, laid out as the workers lay it out (`kvtier.worker.page_layout`)."""
    m = cfg.model
    return PageLayout(m.num_layers, m.num_extra_layers, m.num_kv_heads, m.head_dim,
                      cfg.cache.block_size, DTYPE_BYTES[m.dtype],
                      m.kv_scales != "none").page_bytes


def device_pool_bytes(cfg: KvtierConfig) -> int:
    """Bytes of the device pools of all ranks together."""
    return cfg.cache.device_blocks * page_bytes(cfg) * cfg.workers.count


def host_pool_bytes(cfg: KvtierConfig) -> int:
    """Bytes of the host pools (shared memory) of all ranks together."""
    return cfg.cache.host_blocks * page_bytes(cfg) * cfg.workers.count


def torch_gpu_build(version_file: Path | None = None) -> bool:
    """Whether the installed torch was built for a GPU (CUDA or ROCm), read from its
    `version.py` without importing torch (2-3 s of a manager's start-up): a CPU build never
    sees a GPU. True when it cannot tell, so the caller asks torch itself."""
    if version_file is None:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return True
        version_file = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        text = version_file.read_text()
    except OSError:
        return True
    builds = re.findall(r"^(cuda|hip)\b[^=\n]*=\s*(\S+)", text, re.MULTILINE)
    if {name for name, _ in builds} != {"cuda", "hip"}:
        return True
    return any(value != "None" for _, value in builds)


def resolve_device(cfg: KvtierConfig) -> Literal["cpu", "cuda"]:
    """Where the device pools live. torch is imported only when CUDA is a possibility."""
    if cfg.workers.device == "cpu":
        return "cpu"
    if not torch_gpu_build():
        if cfg.workers.device == "cuda":
            raise ConfigError("workers.device = 'cuda': CUDA is not available on this machine "
                              "(the installed torch is a CPU build)")
        return "cpu"
    import torch

    available = torch.cuda.is_available()
    if cfg.workers.device == "cuda" and not available:
        raise ConfigError("workers.device = 'cuda': CUDA is not available on this machine")
    return "cuda" if available else "cpu"


def rank_device(cfg: KvtierConfig, rank: int) -> str:
    """The device string rank `rank`'s worker builds its device pool on: "cpu", or
    "cuda:<index>" from `workers.cuda_devices` (default: rank r on cuda:r). Explicit, so a
    worker never lands on whatever CUDA device happens to be current in its process."""
    if resolve_device(cfg) == "cpu":
        return "cpu"
    return f"cuda:{cfg.workers.rank_cuda_index(rank)}"


def _human(n: int) -> str:
    """Bytes in binary units, for a reader comparing sizes at a glance."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    units = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    for unit in units:
        value /= 1024
        if value < 1024 or unit == units[-1]:
            break
    return f"{value:.1f} {unit}"


def mem_available_bytes(meminfo: Path = MEMINFO) -> int | None:
    """MemAvailable from /proc/meminfo, or None where there is no such file."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    found = re.search(r"^MemAvailable:\s+(\d+)\s*kB", text, re.MULTILINE)
    return int(found.group(1)) * 1024 if found else None


def stale_segment_bytes(deployment_id: str, shm_dir: Path = SHM_DIR) -> int:
    """Bytes held in `shm_dir` by segments of this deployment: stale ones are removed at
    start, so the memory check counts them as free."""
    held = 0
    prefix = f"kvtier_{deployment_id}_"
    try:
        with os.scandir(shm_dir) as entries:
            for entry in entries:
                if entry.name.startswith(prefix) and entry.is_file(follow_symlinks=False):
                    held += entry.stat(follow_symlinks=False).st_blocks * 512
    except OSError:
        pass
    return held


def shm_free_bytes(deployment_id: str, shm_dir: Path = SHM_DIR) -> int | None:
    """Free bytes in /dev/shm, counting this deployment's stale segments as free, or None
    where there is no such directory."""
    try:
        stat = os.statvfs(shm_dir)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize + stale_segment_bytes(deployment_id, shm_dir)


def _too_big(key: str, value: int, what: str, need: int, where: str, have: int) -> ConfigError:
    return ConfigError(
        f"{key} = {value}: {what} needs {need} bytes ({_human(need)}) but only {have} bytes "
        f"({_human(have)}) are available in {where}"
    )


def check_memory(
    cfg: KvtierConfig,
    *,
    meminfo: Path = MEMINFO,
    shm_dir: Path = SHM_DIR,
) -> None:
    """Refuse block counts whose pools cannot be allocated on this machine (and a
    `workers.host_numa` node it does not have).

    A pool that does not fit would otherwise fail deep inside a worker (SIGBUS on a shared-memory
    page, or the OOM killer), long after start and far from the key that caused it.
    """
    node = cfg.workers.host_numa
    if isinstance(node, int):
        try:
            numa.check_online(node)
        except numa.NumaError as e:
            raise ConfigError(str(e)) from None
    page = page_bytes(cfg)
    count = cfg.workers.count
    mem = mem_available_bytes(meminfo)
    # With engine_kv the device KV is the engine's, allocated (and counted) already.
    device = 0 if cfg.workers.engine_kv else device_pool_bytes(cfg)
    host = host_pool_bytes(cfg)
    per_ranks = f"x {page} bytes per block x {count} worker{'s' if count != 1 else ''}"
    on_cpu = resolve_device(cfg) == "cpu"
    if on_cpu and mem is not None and device > mem:
        what = f"the device pool on cpu ({cfg.cache.device_blocks} blocks {per_ranks})"
        raise _too_big(
            "cache.device_blocks", cfg.cache.device_blocks, what, device, "MemAvailable", mem
        )
    if host:
        shm = shm_free_bytes(cfg.deployment_id, shm_dir)
        what = f"the host pool ({cfg.cache.host_blocks} blocks {per_ranks})"
        if shm is not None and host > shm:
            raise _too_big(
                "cache.host_blocks", cfg.cache.host_blocks, what, host, str(shm_dir), shm
            )
        if mem is not None and host > mem:
            raise _too_big(
                "cache.host_blocks", cfg.cache.host_blocks, what, host, "MemAvailable", mem
            )
    if on_cpu and mem is not None and device + host > mem:
        raise ConfigError(
            f"cache.device_blocks = {cfg.cache.device_blocks}, cache.host_blocks = "
            f"{cfg.cache.host_blocks}: device and host pools on cpu need {device + host} bytes "
            f"({_human(device + host)}) together but MemAvailable is {mem} bytes ({_human(mem)})"
        )
    if not on_cpu:
        _check_cuda_memory(cfg, device // count)  # with engine_kv: only that the GPUs exist


def _check_cuda_memory(cfg: KvtierConfig, per_rank: int) -> None:
    """Each rank's device pool must fit on its GPU (`rank_device`); ranks sharing a GPU
    need their pools there together."""
    import torch

    gpus = torch.cuda.device_count()
    need: dict[int, list[int]] = {}
    for rank in range(cfg.workers.count):
        need.setdefault(cfg.workers.rank_cuda_index(rank), []).append(rank)
    for index, ranks in sorted(need.items()):
        if index >= gpus:
            key = ("workers.cuda_devices = " + repr(cfg.workers.cuda_devices)
                   if cfg.workers.cuda_devices else f"workers.count = {cfg.workers.count}")
            raise ConfigError(
                f"{key}: rank {ranks[0]} would use cuda:{index} but {gpus} CUDA device(s) are "
                "visible (set workers.cuda_devices to place several ranks on one GPU)"
            )
        free, _total = torch.cuda.mem_get_info(index)
        if per_rank * len(ranks) > free:
            what = "the device pool" + (f"s of ranks {ranks}" if len(ranks) > 1
                                        else f" of rank {ranks[0]}")
            raise _too_big("cache.device_blocks", cfg.cache.device_blocks, what,
                           per_rank * len(ranks), f"cuda:{index}", free)


# --------------------------------------------------------------------------------------------
# Storage directory, secret and reachability
# --------------------------------------------------------------------------------------------


def _foreign_directory_problem(path: Path) -> str | None:
    """What every worker's file backend would refuse in `path` (issue 27: a 17-line
    traceback per worker): a folder not owned by this user or writable by group or others."""
    try:
        st = os.stat(path)
    except OSError:
        return None  # not there yet: kvtier creates it 0700
    if st.st_uid != os.geteuid():
        return (f"{str(path)!r} is owned by uid {st.st_uid}, not by this user (uid "
                f"{os.geteuid()}): refusing to read pages anybody else may write")
    if st.st_mode & 0o022:
        return (f"{str(path)!r} is writable by group or others (mode {st.st_mode & 0o7777:o}): "
                f"refusing it (chmod go-w {str(path)!r})")
    return None


def _writable_directory_problem(path: Path, need_bytes: int = 1) -> str | None:
    """Why the file backend could not create or write `path`, leaving nothing behind: the
    nearest existing ancestor must be a directory in which a file can be created (a file
    without a name, or one removed at once), on a file system with `need_bytes` free."""
    probe = path.absolute()
    try:
        while not probe.exists():
            if probe.parent == probe:
                break
            probe = probe.parent
    except OSError as e:  # too long a path, a loop of links
        return f"cannot be looked up: {e.strerror or e}"
    if not probe.is_dir():
        return f"{str(probe)!r} exists and is not a directory"
    try:
        stat = os.statvfs(probe)
    except OSError as e:
        return f"cannot read the free space of {str(probe)!r}: {e.strerror or e}"
    if stat.f_flag & os.ST_RDONLY:
        return f"{str(probe)!r} is on a read-only file system"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{str(probe)!r} is not writable"
    free = stat.f_bavail * stat.f_frsize
    sized = stat.f_blocks > 0  # 0: no size to speak of (procfs, sysfs, tmpfs size=0)
    if sized and (free < need_bytes or (stat.f_files and stat.f_favail == 0)):
        what = "no inodes left" if free >= need_bytes else (
            f"{free} bytes free, one page needs {need_bytes}")
        return f"the file system holding {str(probe)!r} is full ({what})"
    try:
        with tempfile.TemporaryFile(dir=probe, prefix=".kvtier-probe-"):
            pass
    except OSError as e:
        return f"cannot create files in {str(probe)!r}: {e.strerror or e}"
    return None


def check_storage_secret(cfg: KvtierConfig) -> None:
    """The storage secret can be had (issue 27: a bad `storage.secret_file` was found only
    once the workers started, exit 1 in three lines): `storage.secret` set, or a safe
    `storage.secret_file` (this user's regular file, mode 0600, 16 to 4096 bytes), generated
    now on first use. ConfigError naming the key otherwise."""
    s = cfg.storage
    if s.backend == "none" or s.secret.get_secret_value():
        return
    from kvtier.manager.private_state import (
        StorageSecretError,
        default_secret_file,
        storage_secret,
    )

    path = os.path.expanduser(s.secret_file) if s.secret_file else str(default_secret_file())
    try:
        storage_secret("", s.secret_file)
    except StorageSecretError as e:
        key = (f"storage.secret_file = {_short_repr(s.secret_file)}" if s.secret_file
               else f"storage.secret_file (default {_short_repr(path)})")
        problem = str(e).removeprefix(f"storage secret file {path} ")  # the key names it
        raise ConfigError(f"{key}: {problem}") from None


def check_storage_reachable(cfg: KvtierConfig, timeout: float = 2.0) -> None:
    """Fail early, in one line naming the key, when the storage tier cannot be used.

    redis: connect and PING within `timeout` seconds overall (name resolution included, which
    socket timeouts alone do not bound). file: the directory exists or can be created and is
    writable (a nameless file can be created in it) on a file system with room for a page.
    Nothing is left behind or open.
    """
    backend = cfg.storage.backend
    if backend == "none":
        return
    check_storage_secret(cfg)
    if backend == "file":
        path = cfg.storage_dir()
        problem = (_writable_directory_problem(Path(path), page_bytes(cfg))
                   or _foreign_directory_problem(Path(path)))
        if problem:
            key = (f"storage.path = {_short_repr(cfg.storage.path)}" if cfg.storage.path
                   else f"storage.path (default {_short_repr(path)})")
            raise ConfigError(f"{key}: {problem}")
        return
    shown = redact_url(cfg.storage.url)
    outcome: list[BaseException | None] = []

    def ping() -> None:
        from kvtier.worker.storage.redis_backend import open_client

        try:  # a cluster client connects (and learns the slot map) when it is opened
            client = open_client(cfg.storage.url, timeout_s=timeout, connect_timeout_s=timeout)
        except BaseException as exc:
            outcome.append(exc)
            return
        try:
            client.ping()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)
        finally:
            client.close()

    thread = threading.Thread(target=ping, name="kvtier-storage-check", daemon=True)
    thread.start()
    thread.join(timeout)
    if not outcome:
        raise ConfigError(f"storage.url = {shown!r}: no answer from Redis within {timeout:g} s")
    error = outcome[0]
    if error is not None:
        reason = " ".join(str(error).split()) or type(error).__name__
        raise ConfigError(f"storage.url = {shown!r}: cannot reach Redis: {reason}")
