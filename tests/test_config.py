"""Configuration: defaults, file and environment precedence, one-line errors, machine checks.

Every error case asserts the whole message (or its stable head): the operator sees exactly this
line and nothing else, so its wording is part of the contract. Memory checks use the real
/proc/meminfo and /dev/shm with block counts no machine holds; reachability uses a real
redis-server (tests/redis_server.py) and real refused or silent ports.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from kvtier.manager.config import (
    ConfigError,
    KvtierConfig,
    check_storage_reachable,
    defaults_toml,
    device_pool_bytes,
    host_pool_bytes,
    load_config,
    mem_available_bytes,
    page_bytes,
    shm_free_bytes,
    stale_segment_bytes,
    summary,
    to_toml,
    torch_gpu_build,
)
from kvtier.manager.stack import worker_spec
from pydantic import ValidationError
from redis_server import RedisClusterServers, RedisServer
from support import fill, free_port, tmpfs_mount

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[1]

BRIEF_DEFAULTS = {
    "deployment_id": "default",
    "model": {"name": "", "num_layers": 8, "num_kv_heads": 4, "head_dim": 64, "dtype": "float16",
              "num_extra_layers": 0, "kv_scales": "none"},
    "cache": {
        "block_size": 64,
        "device_blocks": 2048,
        "host_blocks": 8192,
        "write_policy": "write_through_selective",
        "hit_threshold": 2,
        "eviction_policy": "lru",
        "host_eviction_policy": "lru",
        "decode_reserve_blocks": 1,
    },
    "storage": {
        "backend": "file",
        "path": "",
        "url": "redis://127.0.0.1:6379/0",
        "prefetch_policy": "best_effort",
        "prefetch_threshold": 256,
        "capacity_bytes": 8 * 1024**3,
        "ttl_s": 0,
        "timeout_base_s": 0.01,
        "timeout_per_1k_tokens_s": 0.005,
        "prefetch_host_blocks_limit": None,
        "index_refresh_s": 10.0,
        "backup_one_rank": False,
        "write_policy": "write_through",
        "write_threshold": 1,
        "max_backup_mb_s": 0.0,
        "secret": "",
        "secret_file": "",
        "encrypt": True,
        "key_id": 1,
        "old_key_ids": "",
        "compression": "none",
        "slow_write_ms": 1000.0,
        "slow_read_ms": 2000.0,
    },
    "workers": {"count": 1, "device": "auto", "cuda_devices": "", "ready_timeout_s": 60,
                "engine_kv": False, "heartbeat_timeout_s": 5, "host_numa": "auto"},
    "admin": {"host": "127.0.0.1", "port": 8080, "auth": "token", "token": "",
              "max_body_bytes": 4 * 1024**2, "max_pin_tokens": 262144, "max_extra_keys": 1024,
              "request_timeout_s": 10.0, "keep_alive_s": 5, "max_connections": 64},
    "node": {"enabled": True, "socket": "", "allowed_gid": -1,
             "namespace_quota_bytes": 1 << 30, "quotas": {}, "host_budget_bytes": 0,
             "max_engines": 64, "send_timeout_s": 2.0, "hello_deadline_s": 5.0,
             "frame_deadline_s": 5.0, "max_connecting": 256, "handover": False,
             "abandon_grace_s": 5.0,
             "events": False, "events_endpoint": "", "events_replay_endpoint": "",
             "events_topic_prefix": "kvtier", "events_buffer_batches": 10000,
             "events_interval_s": 0.05},
    "audit": {"sample": "0", "max_blocks_per_s": 100.0},
}


def _plain(cfg: KvtierConfig) -> dict:
    data = cfg.model_dump()
    data["admin"]["token"] = cfg.admin.token.get_secret_value()
    data["storage"]["secret"] = cfg.storage.secret.get_secret_value()
    return data


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvtier.toml"
    path.write_text(text)
    return path


def _error(path: Path | None = None, env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(path, env or {})
    message = str(caught.value)
    assert "\n" not in message
    assert "Traceback" not in message
    return message


# --- defaults and precedence -----------------------------------------------------------------


def test_defaults_are_the_briefs():
    assert _plain(KvtierConfig()) == BRIEF_DEFAULTS
    assert _plain(load_config(None, {})) == BRIEF_DEFAULTS


def test_effective_prefetch_limit_is_a_quarter_of_the_host_pool():
    assert KvtierConfig().effective_prefetch_host_blocks_limit() == 8192 // 4
    cfg = load_config(None, {"KVTIER_CACHE__HOST_BLOCKS": "100"})
    assert cfg.effective_prefetch_host_blocks_limit() == 25
    cfg = load_config(None, {"KVTIER_STORAGE__PREFETCH_HOST_BLOCKS_LIMIT": "0"})
    assert cfg.effective_prefetch_host_blocks_limit() == 0


def test_environment_wins_over_the_file(tmp_path):
    path = _write(
        tmp_path,
        'deployment_id = "filed"\n[cache]\ndevice_blocks = 1024\nhost_blocks = 2048\n'
        "[admin]\nport = 9000\n",
    )
    cfg = load_config(
        path,
        {
            "KVTIER_CACHE__DEVICE_BLOCKS": "4096",
            "KVTIER_DEPLOYMENT_ID": "from-env",
            "KVTIER_STORAGE__BACKUP_ONE_RANK": "yes",
            "KVTIER_STORAGE__TTL_S": "3600",
            "KVTIER_WORKERS__DEVICE": "cpu",
            "PATH": "/usr/bin",  # not ours: ignored
        },
    )
    assert cfg.cache.device_blocks == 4096  # env over file
    assert cfg.cache.host_blocks == 2048  # file over default
    assert cfg.admin.port == 9000
    assert cfg.deployment_id == "from-env"
    assert cfg.storage.backup_one_rank is True
    assert cfg.storage.ttl_s == 3600.0
    assert cfg.workers.device == "cpu"
    assert cfg.model == KvtierConfig().model  # untouched section keeps its defaults


def test_process_environment_is_the_default_source(monkeypatch):
    monkeypatch.setenv("KVTIER_CACHE__HOST_BLOCKS", "16")
    assert load_config(None).cache.host_blocks == 16
    # An explicit mapping replaces the process environment entirely.
    assert load_config(None, {}).cache.host_blocks == 8192


def test_storage_secret_is_never_shown():
    secret = "0123456789abcdef-storage-secret"
    cfg = load_config(None, {"KVTIER_STORAGE__SECRET": secret})
    assert cfg.storage.secret.get_secret_value() == secret
    shown = summary(cfg)
    assert shown["storage"]["secret_set"] is True and "secret" not in shown["storage"]
    for text in (json.dumps(shown, default=str), repr(cfg), str(cfg), to_toml(cfg)):
        assert secret not in text
    assert summary(load_config(None, {}))["storage"]["secret_set"] is False
    message = _error(env={"KVTIER_STORAGE__SECRET": "short-secret"})
    assert message.startswith("storage.secret = '***': must be at least 16 bytes")
    assert "short-secret" not in message


def test_storage_secret_file_is_generated_private_and_stable(tmp_path: Path):
    from kvtier.manager.private_state import default_secret_file, storage_secret

    env = {"XDG_STATE_HOME": str(tmp_path / "state"), "HOME": str(tmp_path / "home")}
    first = storage_secret("", "", env)
    path = default_secret_file(env)
    assert path == tmp_path / "state" / "kvtier" / "storage-secret"
    assert len(first) == 32 and path.read_bytes() == first
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert storage_secret("", "", env) == first  # a second instance: the same secret
    # no XDG_STATE_HOME: ~/.local/state/kvtier/storage-secret
    home = storage_secret("", "", {"HOME": str(tmp_path / "home")})
    assert (tmp_path / "home/.local/state/kvtier/storage-secret").read_bytes() == home
    # a configured secret wins and reads no file; a named file is generated where it says
    assert storage_secret("x" * 20, str(tmp_path / "nowhere" / "s"), env) == b"x" * 20
    assert not (tmp_path / "nowhere").exists()
    named = storage_secret("", str(tmp_path / "sub" / "secret"), env)
    assert (tmp_path / "sub" / "secret").read_bytes() == named and named != first
    assert (tmp_path / "sub").stat().st_mode & 0o777 == 0o700


def test_unsafe_storage_secret_file_is_refused(tmp_path: Path):
    from kvtier.manager.private_state import StorageSecretError, storage_secret

    path = tmp_path / "secret"
    path.write_bytes(b"s" * 32)
    for mode in (0o644, 0o640, 0o604, 0o602):
        path.chmod(mode)
        with pytest.raises(StorageSecretError, match=f"has mode {mode:o}: others may read"):
            storage_secret("", str(path))
    path.chmod(0o600)
    assert storage_secret("", str(path)) == b"s" * 32
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(StorageSecretError):
        storage_secret("", str(link))
    short = tmp_path / "short"
    short.write_bytes(b"tiny")
    short.chmod(0o600)
    with pytest.raises(StorageSecretError, match="holds 4 bytes"):
        storage_secret("", str(short))
    if os.geteuid() == 0:  # only root can give a file away
        os.chown(path, 12345, -1)
        with pytest.raises(StorageSecretError, match="belongs to uid 12345, not to this user"):
            storage_secret("", str(path))
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 12345, -1)
        env = {"XDG_STATE_HOME": str(theirs)}
        (theirs / "kvtier").mkdir(mode=0o700)
        os.chown(theirs / "kvtier", 12345, -1)
        with pytest.raises(StorageSecretError, match="belongs to uid 12345"):
            storage_secret("", "", env)


def test_admin_token_from_either_variable():
    secret = "s3cret-token-value"
    for name in ("KVTIER_ADMIN_TOKEN", "KVTIER_ADMIN__TOKEN"):
        cfg = load_config(None, {name: secret})
        assert cfg.admin.token.get_secret_value() == secret
        shown = summary(cfg)
        assert shown["admin"]["token_set"] is True and "token" not in shown["admin"]
        for text in (json.dumps(shown), repr(cfg), str(cfg), to_toml(cfg)):
            assert secret not in text
    same = load_config(None, {"KVTIER_ADMIN_TOKEN": secret, "KVTIER_ADMIN__TOKEN": secret})
    assert same.admin.token.get_secret_value() == secret
    message = _error(env={"KVTIER_ADMIN_TOKEN": secret, "KVTIER_ADMIN__TOKEN": "other"})
    assert message == (
        "KVTIER_ADMIN_TOKEN and KVTIER_ADMIN__TOKEN both set admin.token to different values; "
        "set only one"
    )
    assert secret not in message
    assert summary(load_config(None, {}))["admin"]["token_set"] is False


# --- one-line errors -------------------------------------------------------------------------

FILE_ERRORS = [
    (
        "[cache]\ndevce_blocks = 4096\n",
        "cache.devce_blocks: unknown key (did you mean cache.device_blocks?)",
    ),
    ("[cahce]\ndevice_blocks = 4096\n", "cahce: unknown key (did you mean cache?)"),
    ("colour = 1\n", "colour: unknown key"),
    ("[cache]\ndevice_blocks = 'abc'\n", "cache.device_blocks = 'abc': expected an integer"),
    ("[cache]\ndevice_blocks = 1.5\n", "cache.device_blocks = 1.5: expected an integer"),
    ("[cache]\ndevice_blocks = true\n", "cache.device_blocks = True: expected an integer"),
    (
        "[storage]\nbackup_one_rank = 'yes'\n",
        "storage.backup_one_rank = 'yes': expected true or false",
    ),
    ("[storage]\nttl_s = 'long'\n", "storage.ttl_s = 'long': expected a number"),
    ("[storage]\npath = 5\n", "storage.path = 5: expected a string"),
    ("[cache]\nhost_blocks = -1\n", "cache.host_blocks = -1: must be >= 0"),
    ("[cache]\ndevice_blocks = 0\n", "cache.device_blocks = 0: must be >= 1"),
    ("[cache]\nblock_size = 0\n", "cache.block_size = 0: must be >= 1"),
    ("[admin]\nport = 70000\n", "admin.port = 70000: must be <= 65535"),
    ("[workers]\nheartbeat_timeout_s = 0\n", "workers.heartbeat_timeout_s = 0: must be > 0"),
    ("[storage]\ntimeout_base_s = inf\n", "storage.timeout_base_s = inf: expected a finite number"),
    # Issue 11 item 14: values no part of kvtier can use are refused at load, one line each.
    ("[workers]\ncount = 65\n", "workers.count = 65: must be <= 64"),
    ("[workers]\nready_timeout_s = 1e300\n", "workers.ready_timeout_s = 1e+300: must be <= 3600"),
    (
        "[workers]\nheartbeat_timeout_s = 7200\n",
        "workers.heartbeat_timeout_s = 7200: must be <= 3600",
    ),
    ("[storage]\ntimeout_base_s = 1e300\n", "storage.timeout_base_s = 1e+300: must be <= 3600"),
    ("[storage]\nttl_s = 1e300\n", "storage.ttl_s = 1e+300: must be <= 315360000"),
    (
        "[storage]\nindex_refresh_s = 0.1\n",
        "storage.index_refresh_s = 0.1: must be 0 (no listing) or at least 0.5 seconds",
    ),
    ("[storage]\nindex_refresh_s = -1\n", "storage.index_refresh_s = -1: must be >= 0"),
    (
        "[storage]\nwrite_policy = 'lazy'\n",
        "storage.write_policy = 'lazy': expected one of 'write_through', "
        "'write_through_selective' or 'write_back'",
    ),
    ("[storage]\nwrite_threshold = 0\n", "storage.write_threshold = 0: must be >= 1"),
    ("[storage]\nmax_backup_mb_s = -1\n", "storage.max_backup_mb_s = -1: must be >= 0"),
    ("[storage]\nkey_id = 0\n", "storage.key_id = 0: must be >= 1"),
    ("[storage]\nold_key_ids = '1,x'\n",
     "storage.old_key_ids = '1,x': key id 'x' is not an integer from 1 to 4294967295"),
    ("[storage]\nslow_write_ms = -5\n", "storage.slow_write_ms = -5: must be >= 0"),
    ("[storage]\nencrypt = false\ncompression = 'zstd'\n",
     "storage.compression = 'zstd': needs storage.encrypt = true (compressed pages are "
     "encrypted pages, format 4)"),
    ('[storage]\npath = "a\\u0000b"\n', "storage.path = 'a\\x00b': contains a NUL character"),
    (
        f'[storage]\npath = "/tmp/{"x" * 300}"\n',
        "storage.path = '/tmp/" + "x" * 54 + "..." + "x" * 29 + "' (305 characters): has a "
        "300-byte component; a file name may have at most 255 bytes",
    ),
    ("[admin]\nauth = 'open'\n", "admin.auth = 'open': expected one of 'token' or 'none'"),
    ("[admin]\nmax_body_bytes = 10\n", "admin.max_body_bytes = 10: must be >= 1024"),
    ("[admin]\nrequest_timeout_s = 0\n", "admin.request_timeout_s = 0: must be > 0"),
    (
        "[admin]\nauth = 'none'\ntoken = 'x'\n",
        "admin.auth = 'none' but admin.token is set: a token would be ignored; set admin.auth "
        "= 'token' to require it, or unset the token",
    ),
    (
        "[cache]\nwrite_policy = 'lru'\n",
        "cache.write_policy = 'lru': expected one of 'write_through', "
        "'write_through_selective' or 'write_back'",
    ),
    (
        "[model]\ndtype = 'int8'\n",
        "model.dtype = 'int8': expected one of 'float16', 'bfloat16', 'float32' or 'float8_e4m3fn'",
    ),
    (
        "[storage]\nbackend = 'nfs'\n",
        "storage.backend = 'nfs': expected one of 'none', 'file' or 'redis'",
    ),
    (
        "[storage]\nprefetch_policy = 'always'\n",
        "storage.prefetch_policy = 'always': expected one of 'best_effort', 'wait_complete' "
        "or 'timeout'",
    ),
    (
        "[workers]\ndevice = 'tpu'\n",
        "workers.device = 'tpu': expected one of 'auto', 'cpu' or 'cuda'",
    ),
    (
        "[storage]\nurl = 'http://h:6379/0'\n",
        "storage.url = 'http://h:6379/0': expected a redis:// or rediss:// URL "
        "(redis+cluster:// or rediss+cluster:// for a Redis Cluster)",
    ),
    (
        "[storage]\nurl = 'redis+cluster://h:7000/3'\n",
        "storage.url = 'redis+cluster://h:7000/3': a Redis Cluster has only database 0, not 3",
    ),
    ("[storage]\nurl = 'redis:///0'\n", "storage.url = 'redis:///0': the URL names no host"),
    (
        "[storage]\nurl = 'redis://h:6379/x'\n",
        "storage.url = 'redis://h:6379/x': the database 'x' is not a number",
    ),
    (
        "[storage]\nurl = 'redis://u:hunter2@h:99999/0'\n",
        "storage.url = 'redis://u:***@h:99999/0': not a valid URL (Port out of range 0-65535)",
    ),
    (
        "[admin]\nhost = 'my host'\n",
        "admin.host = 'my host': expected an address or host name such as 127.0.0.1 or 0.0.0.0",
    ),
    ("[admin]\ntoken = 1234\n", "admin.token = '***': expected a string"),
    (
        "deployment_id = 'a_b'\n",
        "deployment_id = 'a_b': expected 1-32 letters, digits or '-', starting with a letter or "
        "digit (it names shared-memory segments /kvtier_<id>_...)",
    ),
    ("cache = 5\n", "cache = 5: expected a table ([cache])"),
    (
        "[cache]\ndevice_blocks = 8\ndecode_reserve_blocks = 8\n",
        "cache.decode_reserve_blocks = 8: must be less than cache.device_blocks (8)",
    ),
    (
        "[cache]\nhost_blocks = 10\n[storage]\nprefetch_host_blocks_limit = 11\n",
        "storage.prefetch_host_blocks_limit = 11: must be at most cache.host_blocks (10)",
    ),
    (
        "[cache]\nhost_blocks = 0\n",
        "storage.backend = 'file': the storage tier moves pages through host blocks, but "
        "cache.host_blocks = 0; set storage.backend = 'none' or give the host tier blocks",
    ),
]


@pytest.mark.parametrize(
    ("text", "expected"), FILE_ERRORS, ids=[e.split(":")[0] for _, e in FILE_ERRORS]
)
def test_file_errors_are_one_line_naming_key_and_value(tmp_path, text, expected):
    assert _error(_write(tmp_path, text)) == expected


def test_several_errors_are_reported_together_on_one_line(tmp_path):
    message = _error(_write(tmp_path, "[cache]\ndevice_blocks = 'x'\nhost_blocks = -2\n"))
    assert message == (
        "cache.device_blocks = 'x': expected an integer; cache.host_blocks = -2: must be >= 0"
    )


ENV_ERRORS = [
    (
        {"KVTIER_CACHE__DEVICE_BLOCKS": "abc"},
        "cache.device_blocks = 'abc': expected an integer (from KVTIER_CACHE__DEVICE_BLOCKS)",
    ),
    (
        {"KVTIER_CACHE__DEVICE_BLOCKS": "4.0"},
        "cache.device_blocks = '4.0': expected an integer (from KVTIER_CACHE__DEVICE_BLOCKS)",
    ),
    (
        {"KVTIER_CACHE__DEVCE_BLOCKS": "1"},
        "cache.devce_blocks: unknown key (from KVTIER_CACHE__DEVCE_BLOCKS; did you mean "
        "cache.device_blocks?)",
    ),
    ({"KVTIER_COLOUR": "red"}, "colour: unknown key (from KVTIER_COLOUR)"),
    (
        {"KVTIER_CACHE": "1"},
        "cache: unknown key (from KVTIER_CACHE; [cache] is a section; name one of its keys)",
    ),
    (
        {"KVTIER_CACHE__DEVICE__BLOCKS": "1"},
        "KVTIER_CACHE__DEVICE__BLOCKS: not a kvtier setting (expected KVTIER_<SECTION>__<KEY> "
        "or KVTIER_DEPLOYMENT_ID)",
    ),
    (
        {"KVTIER_STORAGE__BACKUP_ONE_RANK": "maybe"},
        "storage.backup_one_rank = 'maybe': expected true or false "
        "(from KVTIER_STORAGE__BACKUP_ONE_RANK)",
    ),
    (
        {"KVTIER_STORAGE__TTL_S": "nan"},
        "storage.ttl_s = nan: expected a finite number (from KVTIER_STORAGE__TTL_S)",
    ),
    (
        {"KVTIER_ADMIN__PORT": "-1"},
        "admin.port = -1: must be >= 0 (from KVTIER_ADMIN__PORT)",
    ),
    (
        {"KVTIER_CACHE__WRITE_POLICY": "sometimes"},
        "cache.write_policy = 'sometimes': expected one of 'write_through', "
        "'write_through_selective' or 'write_back' (from KVTIER_CACHE__WRITE_POLICY)",
    ),
]


@pytest.mark.parametrize(
    ("env", "expected"), ENV_ERRORS, ids=[next(iter(e)) for e, _ in ENV_ERRORS]
)
def test_environment_errors_name_key_value_and_variable(env, expected):
    assert _error(env=env) == expected


def test_file_problems_name_the_file(tmp_path):
    missing = tmp_path / "absent.toml"
    assert _error(missing) == f"config file {str(missing)!r}: not found"
    broken = _write(tmp_path, "[cache\n")
    assert _error(broken).startswith(f"config file {str(broken)!r}: invalid TOML: ")
    assert _error(tmp_path) == f"config file {str(tmp_path)!r}: is a directory"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available on this machine")
def test_cuda_requested_without_cuda():
    reason = "" if torch_gpu_build() else " (the installed torch is a CPU build)"
    assert _error(env={"KVTIER_WORKERS__DEVICE": "cuda"}) == (
        f"workers.device = 'cuda': CUDA is not available on this machine{reason}"
    )


@pytest.mark.parametrize(("text", "gpu"), [
    ("cuda: Optional[str] = None\nhip: Optional[str] = None\n", False),
    ("cuda = None\nhip = None\n", False),
    ("cuda: Optional[str] = '12.8'\nhip: Optional[str] = None\n", True),
    ("cuda: Optional[str] = None\nhip: Optional[str] = '6.3.42131'\n", True),
    ("__version__ = '2.13.0'\n", True),  # cannot tell: ask torch
])
def test_torch_build_is_read_without_importing_torch(tmp_path, text, gpu):
    version = tmp_path / "version.py"
    version.write_text(text)
    assert torch_gpu_build(version) is gpu
    assert torch_gpu_build(tmp_path / "missing.py") is True


def test_auto_device_on_a_cpu_build_leaves_torch_unimported():
    """The manager process resolves `auto` without paying for `import torch`."""
    code = ("import sys; from kvtier.manager.config import KvtierConfig, resolve_device, "
            "torch_gpu_build; d = resolve_device(KvtierConfig()); "
            "print(d, torch_gpu_build(), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        assert out == ["cpu", "False", "False"]
    else:
        assert out[2] == "True"  # a GPU build: torch itself is asked


def test_a_failed_load_leaves_nothing_behind(tmp_path):
    storage = tmp_path / "storage-dir"
    path = _write(
        tmp_path,
        f"[storage]\npath = {json.dumps(str(storage))}\n[cache]\ndevice_blocks = 'many'\n",
    )
    before = path.read_bytes()
    env = {"KVTIER_CACHE__HOST_BLOCKS": "64", "KVTIER_DEPLOYMENT_ID": "leftovers"}
    env_before = dict(env)
    shm_before = set(os.listdir("/dev/shm"))
    _error(path, env)
    assert not storage.exists()
    assert path.read_bytes() == before
    assert env == env_before
    assert set(os.listdir("/dev/shm")) == shm_before
    # Nothing of the failed load sticks: the next load sees only its own inputs.
    assert _plain(load_config(None, {})) == BRIEF_DEFAULTS
    # A loaded configuration cannot be changed half-way either: it is immutable.
    cfg = load_config(None, {})
    with pytest.raises(ValidationError):
        cfg.cache.device_blocks = 1  # type: ignore[misc]
    assert cfg.cache.device_blocks == 2048


# --- sizes and memory ------------------------------------------------------------------------


def test_page_and_pool_bytes():
    cfg = KvtierConfig()
    assert page_bytes(cfg) == 2 * 8 * 64 * 4 * 64 * 2
    two_ranks = {"KVTIER_WORKERS__COUNT": "2", "KVTIER_MODEL__DTYPE": "float32"}
    cfg = load_config(None, {**two_ranks, "KVTIER_CACHE__HOST_BLOCKS": "1000"})
    assert page_bytes(cfg) == 2 * 8 * 64 * 4 * 64 * 4
    assert host_pool_bytes(cfg) == 1000 * page_bytes(cfg) * 2
    assert device_pool_bytes(cfg) == 2048 * page_bytes(cfg) * 2
    fp8 = load_config(None, {"KVTIER_MODEL__DTYPE": "float8_e4m3fn"})
    assert page_bytes(fp8) == 2 * 8 * 64 * 4 * 64
    sizes = summary(cfg)["sizes"]
    assert sizes == {
        "page_bytes": page_bytes(cfg),
        "device_pool_bytes": device_pool_bytes(cfg),
        "host_pool_bytes": host_pool_bytes(cfg),
    }


def test_device_pool_that_does_not_fit_in_memory():
    blocks = 2**31 - 1
    need = blocks * page_bytes(KvtierConfig())
    message = _error(
        env={"KVTIER_CACHE__DEVICE_BLOCKS": str(blocks), "KVTIER_WORKERS__DEVICE": "cpu"}
    )
    assert message.startswith(
        f"cache.device_blocks = {blocks}: the device pool on cpu ({blocks} blocks x 524288 "
        f"bytes per block x 1 worker) needs {need} bytes "
    )
    assert re.search(r"but only \d+ bytes \(.*\) are available in MemAvailable$", message)


def test_host_pool_that_does_not_fit_in_shared_memory():
    blocks = 2**31 - 1
    message = _error(env={"KVTIER_CACHE__HOST_BLOCKS": str(blocks)})
    assert message.startswith(f"cache.host_blocks = {blocks}: the host pool ")
    assert str(blocks * 524288) in message
    assert message.endswith("are available in /dev/shm")


def test_memory_check_counts_every_worker():
    page = page_bytes(KvtierConfig())
    room = min(shm_free_bytes("default"), mem_available_bytes())
    blocks = room // page // 3
    env = {"KVTIER_CACHE__HOST_BLOCKS": str(blocks), "KVTIER_CACHE__DEVICE_BLOCKS": "16"}
    assert load_config(None, env).cache.host_blocks == blocks  # one worker fits
    message = _error(env={**env, "KVTIER_WORKERS__COUNT": "4"})
    assert message.startswith(f"cache.host_blocks = {blocks}: the host pool ")
    assert "x 4 workers" in message and str(4 * blocks * page) in message


def test_device_and_host_pools_together_must_fit(tmp_path):
    page = page_bytes(KvtierConfig())
    mem = mem_available_bytes()
    half = mem // page // 2 + 1024  # 1 GiB over MemAvailable in all: robust to its drift
    small = min(half, shm_free_bytes("default") // page - 1)
    env = {
        "KVTIER_WORKERS__DEVICE": "cpu",
        "KVTIER_CACHE__DEVICE_BLOCKS": str(half),
        "KVTIER_CACHE__HOST_BLOCKS": str(small),
    }
    if half * page + small * page <= mem:
        pytest.fail("/dev/shm is too small on this machine to build the case")
    message = _error(env=env)
    assert message.startswith(
        f"cache.device_blocks = {half}, cache.host_blocks = {small}: device and host pools on "
        "cpu need"
    )


def test_stale_segments_of_the_same_deployment_count_as_free(tmp_path):
    stale = tmp_path / "kvtier_mine_host_0"
    stale.write_bytes(os.urandom(1 << 20))
    (tmp_path / "kvtier_other_host_0").write_bytes(os.urandom(1 << 20))
    (tmp_path / "kvtier_mine_dir").mkdir()
    # Only this deployment's files count; the directory's free space itself moves with
    # whatever else writes to it, so it is compared with a margin below.
    assert stale_segment_bytes("mine", tmp_path) == stale.stat().st_blocks * 512 >= 1 << 20
    assert stale_segment_bytes("nobody", tmp_path) == 0
    assert stale_segment_bytes("mine", tmp_path / "missing") == 0
    free = os.statvfs(tmp_path)
    mine = shm_free_bytes("mine", tmp_path)
    assert mine is not None
    assert abs(mine - free.f_bavail * free.f_frsize - (1 << 20)) < 64 << 20
    assert shm_free_bytes("mine", tmp_path / "missing") is None


def test_machine_checks_can_be_skipped_for_another_machine():
    env = {"KVTIER_CACHE__HOST_BLOCKS": str(2**31 - 1)}
    cfg = load_config(None, env, check_resources=False)
    assert cfg.cache.host_blocks == 2**31 - 1


# --- storage reachability --------------------------------------------------------------------


def _redis_cfg(url: str) -> KvtierConfig:
    return load_config(None, {"KVTIER_STORAGE__BACKEND": "redis", "KVTIER_STORAGE__URL": url})


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
def test_refused_redis_fails_within_the_timeout(scheme: str) -> None:
    url = f"{scheme}://127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        check_storage_reachable(_redis_cfg(url), timeout=1.0)
    assert time.monotonic() - started < 1.5
    message = str(caught.value)
    assert message.startswith(f"storage.url = {url!r}: cannot reach Redis: ")
    assert "\n" not in message


@pytest.mark.slow  # starts a 3-node Redis Cluster
def test_reachable_redis_cluster_passes_the_check(redis_cluster: RedisClusterServers) -> None:
    check_storage_reachable(_redis_cfg(redis_cluster.url), timeout=2.0)


def test_silent_redis_fails_within_the_timeout():
    """A server that accepts connections but never answers (SIGSTOPped redis)."""
    with RedisServer() as server:
        server.pause()
        started = time.monotonic()
        with pytest.raises(ConfigError) as caught:
            check_storage_reachable(_redis_cfg(server.url), timeout=0.5)
        elapsed = time.monotonic() - started
        server.resume()
    assert elapsed < 1.0
    assert str(caught.value).startswith(f"storage.url = {server.url!r}: ")


def test_unresolvable_redis_host_fails_within_the_timeout():
    url = "redis://kvtier-no-such-host.invalid:6379/0"
    started = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        check_storage_reachable(_redis_cfg(url), timeout=1.0)
    assert time.monotonic() - started < 1.5
    assert str(caught.value).startswith(f"storage.url = {url!r}: ")


def test_running_redis_is_reachable(redis_server):
    check_storage_reachable(_redis_cfg(redis_server.url), timeout=2.0)


def test_reachability_errors_hide_the_password(redis_server):
    url = f"redis://kvtier:hunter2@127.0.0.1:{redis_server.port}/0"
    with pytest.raises(ConfigError) as caught:
        check_storage_reachable(_redis_cfg(url), timeout=2.0)
    message = str(caught.value)
    assert "hunter2" not in message
    assert message.startswith(f"storage.url = 'redis://kvtier:***@127.0.0.1:{redis_server.port}/0'")
    assert summary(_redis_cfg(url))["storage"]["url"].count("***") == 1


def test_file_storage_reachability(tmp_path):
    target = tmp_path / "deep" / "storage"
    check_storage_reachable(load_config(None, {"KVTIER_STORAGE__PATH": str(target)}))
    assert not target.exists() and not target.parent.exists()  # checked, not created
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bad = load_config(None, {"KVTIER_STORAGE__PATH": str(blocker / "storage")})
    with pytest.raises(ConfigError) as caught:
        check_storage_reachable(bad)
    assert str(caught.value) == (
        f"storage.path = {str(blocker / 'storage')!r}: {str(blocker)!r} exists and is not a "
        "directory"
    )


def _storage_problem(path: str | Path) -> str:
    cfg = load_config(None, {"KVTIER_STORAGE__PATH": str(path)}, check_resources=False)
    with pytest.raises(ConfigError) as caught:
        check_storage_reachable(cfg)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"storage.path = {str(path)!r}: ")
    return message


def test_file_storage_on_a_read_only_file_system(tmp_path):
    """Issue 11 item 14: refused at start in one line; a worker used to fail writing pages."""
    with tmpfs_mount(tmp_path / "ro", "ro") as mounted:
        message = _storage_problem(mounted / "storage")
    assert message.endswith(f"{str(mounted)!r} is on a read-only file system")


def test_file_storage_on_a_full_file_system(tmp_path):
    """Issue 11 item 14: a file system that is full at start is reported, not found out by
    the first backup."""
    with tmpfs_mount(tmp_path / "full") as mounted:
        fill(mounted)
        message = _storage_problem(mounted / "storage")
        assert message.endswith(f"the file system holding {str(mounted)!r} is full (0 bytes "
                                f"free, one page needs {page_bytes(KvtierConfig())})")
        assert sorted(p.name for p in mounted.iterdir()) == ["filler"]  # the probe left nothing


def test_file_storage_where_no_file_can_be_created():
    """/proc takes no new files although access(2) calls it writable for root."""
    assert _storage_problem("/proc/kvtier-storage") == (
        "storage.path = '/proc/kvtier-storage': cannot create files in '/proc': No such file or "
        "directory")


def test_an_empty_config_file_is_all_defaults(tmp_path):
    """An empty file is valid TOML: every key takes its default (explicitly accepted)."""
    assert _plain(load_config(_write(tmp_path, ""), {})) == BRIEF_DEFAULTS
    assert _plain(load_config(_write(tmp_path, "# only a comment\n\n"), {})) == BRIEF_DEFAULTS


def test_no_storage_backend_needs_nothing():
    cfg = load_config(
        None,
        {"KVTIER_STORAGE__BACKEND": "none", "KVTIER_STORAGE__URL": "redis://nowhere.invalid:1/0"},
    )
    check_storage_reachable(cfg, timeout=0.1)


# --- rendering -------------------------------------------------------------------------------


def test_defaults_toml_documents_and_reloads_every_key(tmp_path):
    text = defaults_toml()
    for section, keys in BRIEF_DEFAULTS.items():
        if isinstance(keys, dict):
            assert f"[{section}]" in text
            for key in keys:
                assert re.search(rf"^(# )?{key} = ", text, re.MULTILINE), key
    assert all(len(line) <= 100 for line in text.splitlines())
    assert _plain(load_config(_write(tmp_path, text), {})) == BRIEF_DEFAULTS


def test_to_toml_round_trips_a_changed_configuration(tmp_path):
    env = {
        "KVTIER_DEPLOYMENT_ID": "node-7",
        "KVTIER_CACHE__BLOCK_SIZE": "16",
        "KVTIER_CACHE__HOST_BLOCKS": "512",
        "KVTIER_STORAGE__BACKEND": "redis",
        "KVTIER_STORAGE__URL": "redis://h:6380/3",
        "KVTIER_STORAGE__PREFETCH_HOST_BLOCKS_LIMIT": "7",
        "KVTIER_STORAGE__TIMEOUT_BASE_S": "1e-05",
        "KVTIER_STORAGE__PATH": 'dir with "quotes" and \\ backslash',
        "KVTIER_ADMIN_TOKEN": "t",
    }
    cfg = load_config(None, env)
    again = load_config(_write(tmp_path, to_toml(cfg)), {"KVTIER_ADMIN_TOKEN": "t"})
    assert again == cfg
    assert 'token = ""  # set, not written' in to_toml(cfg)


def test_default_storage_path_is_absolute_under_the_cache_dir(tmp_path, monkeypatch):
    """Issue 11 item 9: with no storage.path the file tier lives under the user's cache
    directory and the deployment id, whatever folder kvtier is started from (it used to be
    `.kvtier/storage` under the current folder); a relative path given is made absolute
    against the folder kvtier was started in, before any worker sees it."""
    cache = tmp_path / "cache"
    env = {"XDG_CACHE_HOME": str(cache), "HOME": str(tmp_path / "home")}
    cfg = load_config(None, {"KVTIER_DEPLOYMENT_ID": "dep-a"}, check_resources=False)
    assert cfg.storage.path == ""
    assert cfg.storage_dir(env) == str(cache / "kvtier" / "dep-a" / "storage")
    # XDG rules: unset or relative XDG_CACHE_HOME -> ~/.cache
    for bad in ({"HOME": str(tmp_path / "home")},
                {"XDG_CACHE_HOME": "rel/cache", "HOME": str(tmp_path / "home")}):
        assert cfg.storage_dir(bad) == str(tmp_path / "home" / ".cache" / "kvtier" / "dep-a"
                                           / "storage")
    monkeypatch.chdir(tmp_path)
    given = load_config(None, {"KVTIER_STORAGE__PATH": "rel/store"}, check_resources=False)
    assert given.storage_dir(env) == str(tmp_path / "rel" / "store")
    # the worker spec carries the absolute path, never the relative default
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    spec = worker_spec(cfg, 0)
    assert spec.storage_path == str(cache / "kvtier" / "dep-a" / "storage")
    assert os.path.isabs(spec.storage_path)


def test_default_storage_path_problems_name_the_default(tmp_path, monkeypatch):
    """A default storage folder that cannot be used is reported naming the key and the
    resolved default."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    cfg = load_config(None, {}, check_resources=False)
    with pytest.raises(ConfigError) as caught:
        check_storage_reachable(cfg)
    assert str(caught.value) == (
        f"storage.path (default {str(blocker / 'kvtier' / 'default' / 'storage')!r}): "
        f"{str(blocker)!r} exists and is not a directory")
