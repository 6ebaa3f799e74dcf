"""The `kvtier` command: `serve`, `status`, `replay` and `plan`.

    kvtier serve [--config FILE] [--takeover [--takeover-timeout S]]
                                           manager + workers + admin, in the foreground
                                           (--takeover: in place of the running one)
    kvtier status [--url URL] [--json]     the admin's /status as tables (or JSON)
    kvtier replay ...                      drive a trace or workload through a stack
    kvtier plan ...                        size the tiers for a trace or workload (one pass)

Exit statuses: 0 success (and a serve stopped by SIGTERM/SIGINT); 1 a runtime failure (a worker
that never got ready, an admin that cannot be reached); 2 a usage or configuration error,
printed as one line naming the key and the value.

`serve` life cycle, one log line per event:

    config loaded and checked (file, env, machine, storage reachable)  -> "config: ..."
    admin socket bound (port 0: a free port)                           -> fails fast, exit 2
    node socket bound (node.enabled; another live serve holds it)      -> fails fast, exit 2
      --takeover: the serve on that socket asked to hand over (TAKEOVER), its lock
      waited for, its hand-over adopted                   -> "took over kvtier serve pid N"
      (nothing there, another uid or deployment: exit 2; no hand-over in time: exit 1)
    workers started, each ready                                        -> the launcher's lines
    admin serving                                                      -> "admin listening on URL"
    SIGTERM / SIGINT, or a new serve's TAKEOVER (node stopped first)   -> "stopping"
      POSTs refused (503), /readyz 503; transfers drained (bounded); admin stopped;
      stack closed: workers stopped, every segment and queue unlinked  -> "stopped", exit 0
      (node.handover: the namespaces' host pools kept and their index handed over to the
      next serve, `kvtier.manager.node.handover`)          -> "hand-over written to ..."

`replay` lives in `kvtier.admin.replay` (its front end: arguments, progress, plot, exit codes)
and `kvtier.manager.replay` (the driver), imported only when that subcommand runs, so `serve` and
`status` never pay for (or depend on) the replay machinery.

The command sits in the top layer, next to the admin it serves: it imports the manager (the
`Stack`, the configuration) and the admin; neither imports it. Run it as `kvtier` (the console
script) or `python -m kvtier.admin.cli`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.manager.config import KvtierConfig
    from kvtier.manager.launcher import WarmWorkers
    from kvtier.manager.stack import Stack

log = logging.getLogger("kvtier.serve")

DEFAULT_ADMIN_URL = "http://127.0.0.1:8080"
DRAIN_TIMEOUT_S = 10.0
"""How long `serve` waits at shutdown for transfers in flight before stopping the workers."""

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
MAX_EARLY_WARM = 16  # worker processes a plain restart starts warm from a hand-over's count


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _fail(command: str, message: object, code: int) -> int:
    print(f"kvtier {command}: {_one_line(message)}", file=sys.stderr, flush=True)
    return code


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _mib(n: int) -> str:
    return f"{n / 1024**2:.1f} MiB"


def config_line(cfg: KvtierConfig) -> str:
    """The configuration in one log line (no secrets)."""
    from kvtier.manager.config import (
        device_pool_bytes,
        host_pool_bytes,
        page_bytes,
        redact_url,
        resolve_device,
    )

    m, c, s, w, a = cfg.model, cfg.cache, cfg.storage, cfg.workers, cfg.admin
    storage = {"none": "none", "file": f"file {cfg.storage_dir()}",
               "redis": f"redis {redact_url(s.url)}"}[s.backend]
    return (
        f"config: deployment {cfg.deployment_id!r}; {w.count} worker(s) on "
        f"{resolve_device(cfg)}; model {m.num_layers} layers"
        f"{f' (+{m.num_extra_layers} extra)' if m.num_extra_layers else ''} x "
        f"{m.num_kv_heads} kv heads x {m.head_dim} {m.dtype}"
        f"{' with per-block scales' if m.kv_scales != 'none' else ''}; block {c.block_size} "
        f"tokens = {page_bytes(cfg)} bytes/rank; "
        f"device {c.device_blocks} blocks ({_mib(device_pool_bytes(cfg))}), host "
        f"{c.host_blocks} blocks ({_mib(host_pool_bytes(cfg))}); write policy "
        f"{c.write_policy}; storage {storage} (prefetch {s.prefetch_policy} >= "
        f"{s.prefetch_threshold} tokens); admin {a.host}:{a.port} (auth {a.auth}"
        + (", token configured" if a.token.get_secret_value() else
           ", token generated" if a.auth == "token" else "") + ")")


# -------------------------------------------------------------------------------- serve


class _StopDuringStart(BaseException):
    """Raised by the signal handler while the workers are starting, to abandon the start
    (Stack.start cleans up on any exception)."""


def cmd_serve(args: argparse.Namespace) -> int:
    stop = threading.Event()
    phase = ["preparing"]  # preparing -> starting (workers) -> running -> stopping

    def on_signal(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            log.warning("%s received; already stopping", name)
            return
        stop.set()
        log.info("%s received: stopping", name)
        if phase[0] == "starting":
            raise _StopDuringStart(name)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _serve(args, stop, phase)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve(args: argparse.Namespace, stop: threading.Event, phase: list[str]) -> int:
    # Imported here, not at the top: `kvtier --help` and `kvtier status` never load the
    # configuration (pydantic and the models: about 0.5 s of CPU per process).
    from kvtier.manager.config import ConfigError, check_storage_reachable, load_config, node_only

    try:
        # a `[node]`-only configuration: the node service alone, no stack of its own, so
        # its default pools are neither checked against this machine nor allocated
        alone = node_only(args.config)
        cfg = load_config(args.config, check_resources=not alone)
        alone = alone and cfg.node.enabled
        check_storage_reachable(cfg)
    except ConfigError as e:
        return _fail("serve", e, EXIT_USAGE)
    if stop.is_set():
        return EXIT_OK
    takeover = bool(getattr(args, "takeover", False))
    # a plain restart with a hand-over waiting: its namespaces' workers started warm now
    # (their torch import, ~2 s, was the longest step from this launch to the engines'
    # first hit, and began only once this process had done its own imports and bound)
    warm = _warm_for_handover(cfg) if not takeover else None
    try:
        return _serve_loaded(args, stop, phase, cfg, alone, takeover, warm)
    finally:
        if warm is not None:  # those no namespace took (the node server stops its own)
            warm.close()


def _warm_for_handover(cfg: KvtierConfig) -> WarmWorkers | None:
    """`cfg.node.handover` and a hand-over in the node socket's folder: as many worker
    processes started warm as its namespaces have ranks (`handover_workers`), for the
    stacks started from it (`Namespaces.warm`); None otherwise."""
    if not (cfg.node.enabled and cfg.node.handover):
        return None
    from kvtier.manager.launcher import WarmWorkers
    from kvtier.manager.node.handover import handover_workers
    from kvtier.manager.node.server import socket_path

    n = handover_workers(socket_path(cfg).parent, cfg.deployment_id, MAX_EARLY_WARM)
    if not n:
        return None
    warm = WarmWorkers()
    warm.start(n)
    log.info("a hand-over is waiting: %d worker process(es) started warm", n)
    return warm


def _serve_loaded(args: argparse.Namespace, stop: threading.Event, phase: list[str],
                cfg: KvtierConfig, alone: bool, takeover: bool,
                warm: WarmWorkers | None) -> int:
    from kvtier.admin.auth import TokenFileError
    from kvtier.admin.server import AdminBindError, AdminServer, AdminStartError, bind_socket

    if takeover and not cfg.node.enabled:
        return _fail("serve", "--takeover: node.enabled is false, there is no node service "
                     "to take over", EXIT_USAGE)
    sock = None
    try:  # before any worker exists: a taken port is a configuration error
        sock = bind_socket(cfg.admin.host, cfg.admin.port)
    except AdminBindError as e:
        # the old service's admin holds the port until it exits: bound after the take-over
        if not takeover:
            return _fail("serve", f"admin.port = {cfg.admin.port}: {e}", EXIT_USAGE)
    try:  # its directory only: the file is written once the deployment is ours (issue 27)
        token, token_file = _admin_token(cfg)
    except TokenFileError as e:
        if sock is not None:
            sock.close()
        return _token_failure(e)
    log.info("%s", config_line(cfg))

    # Imported only now: a bad configuration is reported without loading torch, and
    # `status` never loads FastAPI or uvicorn.
    from kvtier.admin.app import create_app
    from kvtier.manager.errors import KvtierError
    from kvtier.manager.node.server import NodeServer, NodeSocketError
    from kvtier.manager.node.takeover import TakeoverError
    from kvtier.manager.stack import Stack

    node = NodeServer(cfg) if cfg.node.enabled else None
    if node is not None and warm is not None:
        node.namespaces.warm = warm
    if node is not None:
        node.on_takeover = stop.set  # a new service's --takeover stops this one
        try:  # before any worker exists: a socket another serve holds is a usage error
            if takeover:
                taken = _take_over(node, args.takeover_timeout)
            else:
                node.start()
        except NodeSocketError as e:
            if sock is not None:
                sock.close()
            return _fail("serve", e, EXIT_USAGE)
        except TakeoverError as e:
            if sock is not None:
                sock.close()
            return _fail("serve", e, EXIT_USAGE if e.usage else EXIT_FAILURE)
        if takeover and (sock is None or not alone):
            # the old process's admin port and scheduler-API stack (its deployment's IPC
            # names) are its own until it exits; the node socket is served meanwhile
            _wait_exit(taken.pid, args.takeover_timeout)
        if sock is None:
            try:
                sock = bind_socket(cfg.admin.host, cfg.admin.port)
            except AdminBindError as e:
                node.stop()
                return _fail("serve", f"admin.port = {cfg.admin.port}: {e}", EXIT_USAGE)
    assert sock is not None
    stack = Stack(cfg)
    server = AdminServer(app := create_app(stack, token=token, node=node, node_only=alone),
                         cfg.admin.host,
                         sock=sock, limits=cfg.admin)
    code = EXIT_OK
    written = False  # whether this serve wrote the token file (and so removes it)
    try:
        if stop.is_set():  # a signal while loading: nothing was started
            return EXIT_OK
        try:
            phase[0] = "starting"
            if alone:
                log.info("node service only ([node] without [model], [cache] or "
                         "[workers]): no scheduler-API stack, no pools of its own")
            else:
                stack.start()
            phase[0] = "running"
        except _StopDuringStart:
            log.info("stopped while starting; every worker, segment and queue removed")
            return EXIT_OK
        except KvtierError as e:  # IPC errors included
            print(f"kvtier serve: cannot start: {e}", file=sys.stderr, flush=True)
            return EXIT_FAILURE
        # Only now, with the deployment's names ours: a second serve of a live deployment
        # that refused to start never replaced (nor, leaving, removed) its token file.
        if token is not None and token_file is not None:
            from kvtier.admin.auth import write_token
            try:
                write_token(token_file, token)
            except TokenFileError as e:
                return _token_failure(e)
            written = True
        _log_auth(cfg, token_file)
        try:
            server.start()
        except AdminStartError as e:
            print(f"kvtier serve: {e}", file=sys.stderr, flush=True)
            return EXIT_FAILURE
        log.info("admin listening on %s (API docs at %s/docs)", server.url, server.url)
        while not stop.wait(0.2):
            if not server.running:
                log.error("the admin server stopped unexpectedly; shutting down")
                code = EXIT_FAILURE
                break
        phase[0] = "stopping"
        if node is not None and node.taken_over is not None:
            node.stop()  # first: the new service waits for this (its hand-over)
        app.state.admin.stop_accepting("kvtier is shutting down")
        _drain(stack)
    finally:
        phase[0] = "stopping"
        server.stop()
        if node is not None:
            node.stop()  # engines detached, every namespace's stack closed
        stack.close()
        if written:
            _forget_token(token, token_file)
    log.info("stopped: workers gone, every shared-memory segment and queue removed")
    return code


def _take_over(node: Any, timeout_s: float) -> Any:
    """`--takeover`: the running service asked to hand over, this one started in its place
    (`NodeServer.take_over`); everything slow before this (config, imports, the admin
    app) is done while the old one still serves."""
    t0 = time.monotonic()
    taken = node.take_over(timeout_s)
    log.info("took over kvtier serve pid %d: its hand-over adopted, the node socket bound "
             "%.0f ms after the request", taken.pid, (time.monotonic() - t0) * 1e3)
    return taken


def _wait_exit(pid: int, timeout_s: float) -> None:
    """Until process `pid` has exited (at most `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:  # gone, or a zombie its parent has not reaped yet (state Z): exited
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[-1].split()[0] == b"Z":
                    return
        except (OSError, IndexError):
            return
        time.sleep(0.01)
    log.warning("kvtier serve pid %d still running %.0f s after its hand-over", pid, timeout_s)


def _admin_token(cfg: KvtierConfig) -> tuple[str | None, Path | None]:
    """The token the admin requires (None: `admin.auth = "none"`) and, when it is generated
    here, the state file it is to be written to once the stack started (its directories are
    made now: TokenFileError when they cannot be)."""
    from kvtier.admin.auth import generate_token, prepare_token_dir, token_path

    if cfg.admin.auth == "none":
        return None, None
    configured = cfg.admin.token.get_secret_value()
    if configured:
        return configured, None
    token, path = generate_token(), token_path(cfg.deployment_id)
    prepare_token_dir(path)
    return token, path


def _token_failure(e: Exception) -> int:
    return _fail("serve", "admin.token is empty, so a token is generated, but it cannot be "
                 f"written: {e} (set KVTIER_ADMIN_TOKEN or XDG_STATE_HOME, or admin.auth = "
                 "'none')", EXIT_USAGE)


def _forget_token(token: str | None, path: Path | None) -> None:
    """Remove the generated token's state file at exit (if it still holds this token)."""
    if token is not None and path is not None:
        from kvtier.admin.auth import remove_token

        remove_token(path, token)


def _log_auth(cfg: KvtierConfig, token_file: Path | None) -> None:
    """Say how POSTs are authenticated; never the token itself."""
    from kvtier.admin.auth import is_loopback

    if token_file is not None:
        log.info("admin token generated and written to %s (readable by this user only; "
                 "every POST needs 'Authorization: Bearer <token>')", token_file)
    elif cfg.admin.auth == "none" and not is_loopback(cfg.admin.host):
        log.warning("admin.auth = 'none' with admin.host = %r: anyone who can reach this "
                    "address can reset, pause and pin without a token", cfg.admin.host)
    elif cfg.admin.auth == "none":
        log.warning("admin.auth = 'none': every local user can reset, pause and pin without "
                    "a token")


def _drain(stack: Stack) -> None:
    """Let transfers in flight finish (bounded) so no worker is stopped mid-copy. While
    paused they cannot run, so there is nothing to wait for."""
    manager = stack.manager
    if manager is None:
        return
    pending = manager.dispatcher.pending()
    if not pending:
        return
    if manager.paused:
        log.info("transfers are paused: not waiting for %d task(s) in flight", pending)
        return
    log.info("draining %d transfer task(s) (at most %.0f s)", pending, DRAIN_TIMEOUT_S)
    if not manager.dispatcher.drain(DRAIN_TIMEOUT_S):
        log.warning("%d task(s) still in flight after %.0f s; stopping anyway",
                    manager.dispatcher.pending(), DRAIN_TIMEOUT_S)


# -------------------------------------------------------------------------------- status


def fetch_status(url: str, timeout: float, token: str | None = None) -> dict[str, Any]:
    """GET <url>/status as JSON. Raises RuntimeError (`client.AdminCallError`) with one
    readable line."""
    from kvtier.admin.client import call_json

    status: dict[str, Any] = call_json(url, "/status", token=token, timeout=timeout)
    return status


def _bytes(n: object) -> str:
    if not isinstance(n, int | float):
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _backend_figures(f: dict[str, int]) -> str:
    """One rank's storage backend figures as a phrase (only what its backend reports)."""
    if not f:
        return "no figures published yet"
    parts = [f"{f.get('corrupt_pages', 0)} damaged pages refused",
             f"{f.get('evicted_pages', 0)} evicted for capacity",
             f"{f.get('misses', 0)} missed"]
    if "stored_pages" in f:
        cap = f.get("capacity_bytes", 0)
        parts.append(f"{f['stored_pages']} pages held ({_bytes(f.get('used_bytes'))}"
                     + (f" of {_bytes(cap)})" if cap else ")"))
    if "available" in f:
        parts.append(f"store {'up' if f['available'] else 'DOWN'}, {f.get('outages', 0)} outages")
    return ", ".join(parts)


def render_status(data: dict[str, Any]) -> None:
    """Print /status as a few small tables."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    # A pipe or a file gets 120 columns: rich would otherwise assume 80 and wrap the tables.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 120)
    ready = data.get("ready", {})
    console.print(
        f"deployment [bold]{data.get('deployment_id')}[/bold]  ready: "
        f"{'yes' if ready.get('ready') else 'no'} ({ready.get('reason', '-')})  paused: "
        f"{'yes' if data.get('paused') else 'no'}  uptime: {data.get('uptime_s', '-')} s")
    console.print(
        f"requests active: {data.get('requests_active', '-')}  tasks in flight: "
        f"{data.get('tasks_inflight', '-')}")

    tiers = Table(title="tiers (blocks; bytes over all ranks)", box=box.SIMPLE)
    for col in ("tier", "capacity", "free", "cached", "evictable", "in use", "capacity bytes",
                "cached bytes", "in use bytes"):
        tiers.add_column(col, justify="left" if col == "tier" else "right")
    for name, t in data.get("tiers", {}).items():
        tiers.add_row(name, str(t.get("capacity")), str(t.get("free")), str(t.get("cached")),
                      str(t.get("evictable")), str(t.get("in_use")),
                      _bytes(t.get("capacity_bytes")), _bytes(t.get("cached_bytes")),
                      _bytes(t.get("in_use_bytes")))
    console.print(tiers)

    workers = Table(title="workers", box=box.SIMPLE)
    for col in ("rank", "pid", "state", "heartbeat age", "tasks in flight", "restarts"):
        workers.add_column(col, justify="right" if col != "state" else "left")
    for w in data.get("workers", []):
        age = w.get("heartbeat_age_s")
        workers.add_row(str(w.get("rank")), str(w.get("pid")), str(w.get("state")),
                        "-" if age is None else f"{age:.2f} s", str(w.get("tasks_inflight")),
                        str(w.get("restarts")))
    console.print(workers)

    hits = Table(title="hit rate (hit tokens / lookup tokens)", box=box.SIMPLE)
    hits.add_column("tier")
    hits.add_column("hit rate", justify="right")
    for tier, rate in data.get("hit_rate", {}).items():
        hits.add_row(tier, f"{100 * float(rate):.1f} %")
    console.print(hits)

    storage = data.get("storage")
    if storage:
        c = storage.get("counters", {})
        console.print(
            f"storage {storage.get('backend')}: prefetch {storage.get('prefetch_policy')}, "
            f"{c.get('queries', 0)} queries, {c.get('prefetch_pages_completed', 0)} pages "
            f"prefetched ({_bytes(storage.get('prefetch_bytes'))}), "
            f"{c.get('backup_pages', 0)} backed up ({_bytes(storage.get('backup_bytes'))}), "
            f"errors: query {c.get('errors_query', 0)}, prefetch "
            f"{c.get('errors_prefetch', 0)}, backup {c.get('errors_backup', 0)}")
        for rank, figures in enumerate(storage.get("ranks", [])):
            console.print(f"  rank {rank}: {_backend_figures(figures)}")
    else:
        console.print("storage: none")
    node = data.get("node")
    if node:
        _render_node(console, node)
    elif data.get("tenants"):  # an embedded kvtier: its one namespace's tenants
        _render_tenants(console, data["tenants"])


def _render_node(console: Any, node: dict[str, Any]) -> None:
    """The node service: its namespaces and the engines attached to it."""
    from rich import box
    from rich.table import Table

    console.print(f"node socket {node.get('socket')} (instance "
                  f"{str(node.get('instance', ''))[:8]}, {node.get('dropped', 0)} connections "
                  "refused or dropped)")
    spaces = Table(title="namespaces", box=box.SIMPLE)
    for col in ("namespace", "quota", "used", "engines", "looked up", "loaded (host)",
                "loaded (storage)", "stored"):
        spaces.add_column(col, justify="left" if col == "namespace" else "right")
    for ns in node.get("namespaces", []):
        b = ns.get("blocks", {})
        spaces.add_row(str(ns.get("namespace"))[:40], _bytes(ns.get("quota_bytes")),
                       _bytes(ns.get("used_bytes")), str(ns.get("engines")),
                       str(b.get("looked_up")), str(b.get("loaded_host")),
                       str(b.get("loaded_storage")), str(b.get("stored")))
    console.print(spaces)
    engines = Table(title="attached engines (blocks)", box=box.SIMPLE)
    for col in ("pid", "namespace", "connected since", "lookups", "hits host",
                "hits storage", "stores"):
        engines.add_column(col, justify="left" if col in ("namespace", "connected since")
                           else "right")
    for e in node.get("engines", []):
        since = time.strftime("%Y-%m-%d %H:%M:%S",
                              time.localtime(float(e.get("connected_since", 0))))
        engines.add_row(str(e.get("pid")), str(e.get("namespace"))[:40], since,
                        str(e.get("lookups")), str(e.get("hit_host_blocks")),
                        str(e.get("hit_storage_blocks")), str(e.get("stores")))
    console.print(engines)
    _render_tenants(console, {str(ns.get("namespace")): ns.get("tenants") or {}
                              for ns in node.get("namespaces", [])})


def _render_tenants(console: Any, by_namespace: dict[str, Any]) -> None:
    """Per-tenant figures by namespace (the node's namespaces, or an embedded kvtier's one);
    nothing when no namespace has a tenant yet."""
    from rich import box
    from rich.table import Table

    tenants = Table(title="tenants (host blocks, tokens)", box=box.SIMPLE)
    for col in ("namespace", "tenant", "blocks", "pinned", "quota", "hit tokens", "stores",
                "evictions", "refused"):
        tenants.add_column(col, justify="left" if col in ("namespace", "tenant") else "right")
    for ns, figs in by_namespace.items():
        for name, f in (figs or {}).items():
            tenants.add_row(ns[:24], repr(name)[:24],
                            str(f.get("host_blocks")), str(f.get("pinned_blocks", "-")),
                            str(f.get("quota_blocks", "-")), str(f.get("hit_tokens")),
                            str(f.get("stores")), str(f.get("evictions")),
                            str(f.get("stores_refused")))
    if tenants.row_count:
        console.print(tenants)


def cmd_status(args: argparse.Namespace) -> int:
    from kvtier.admin.auth import client_token

    try:
        data = fetch_status(args.url, args.timeout, client_token(args.deployment_id))
    except RuntimeError as e:
        return _fail("status", e, EXIT_FAILURE)
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        render_status(data)
    return EXIT_OK


# -------------------------------------------------------------------------------- replay


def cmd_replay(args: argparse.Namespace) -> int:
    from kvtier.admin.replay import run_replay_command

    return int(run_replay_command(args))


# -------------------------------------------------------------------------------- plan


def cmd_plan(args: argparse.Namespace) -> int:
    from kvtier.admin.plan import run_plan_command

    return run_plan_command(args)


# -------------------------------------------------------------------------------- parser


def build_parser(with_replay_arguments: bool = False) -> argparse.ArgumentParser:
    """The full parser. The replay subcommand's own arguments are added only when asked,
    because they come from `kvtier.admin.replay` (imported only for that subcommand)."""
    parser = argparse.ArgumentParser(
        prog="kvtier", description="kvtier: a hierarchical KV-cache manager for LLM inference.")
    parser.add_argument("--log-level", default=None,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], type=str.upper,
                        help="log level of the manager process (default: INFO for serve, "
                        "WARNING otherwise)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser(
        "serve", help="run the manager, its workers and the admin API in the foreground",
        description="Run the manager, one worker per rank and the admin API until SIGTERM or "
        "SIGINT; then drain transfers, stop the workers and remove every shared-memory "
        "segment and queue. Without --config the embedded defaults are used; "
        "KVTIER_<SECTION>__<KEY> variables override the file.")
    serve.add_argument("--config", metavar="FILE", help="TOML configuration file")
    serve.add_argument(
        "--takeover", action="store_true",
        help="start beside the kvtier serve running on the same node socket, then ask it to "
             "hand over its host tier and take its place (issue 37)")
    serve.add_argument(
        "--takeover-timeout", type=float, default=30.0, metavar="S",
        help="seconds the running service has to hand over (default 30); past them this "
             "one exits (status 1) and the old one finishes its stop")
    serve.set_defaults(func=cmd_serve)

    status = sub.add_parser(
        "status", help="show a running deployment's status",
        description="Ask a running kvtier's admin for /status and print it as tables.")
    status.add_argument("--url", default=DEFAULT_ADMIN_URL,
                        help=f"admin base URL (default {DEFAULT_ADMIN_URL})")
    status.add_argument("--json", action="store_true", help="print the raw JSON")
    status.add_argument(
        "--deployment-id", default=os.environ.get("KVTIER_DEPLOYMENT_ID", "default"),
        metavar="ID", help="whose generated admin token to present, from "
        "$XDG_STATE_HOME/kvtier/ID/admin-token (default: $KVTIER_DEPLOYMENT_ID or 'default'; "
        "KVTIER_ADMIN_TOKEN wins)")
    status.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                        help="give up after this many seconds (default 5)")
    status.set_defaults(func=cmd_status)

    replay = sub.add_parser(
        "replay", help="drive a trace or a built-in workload through a stack",
        description="Replay a Mooncake-format trace or a built-in workload through a kvtier "
        "stack and print per-tier hit rates and transfer figures.")
    replay.set_defaults(func=cmd_replay)
    if with_replay_arguments:
        from kvtier.admin.replay import add_replay_arguments

        add_replay_arguments(replay)

    from kvtier.admin.plan import add_plan_arguments

    plan = sub.add_parser(
        "plan", help="size the tiers: hit rate of every cache size from one pass over a trace",
        description="Compute the token hit rate of every device size (and of device + host "
        "sizes) for a Mooncake-format trace or a built-in workload in one pass (LRU stack "
        "distances), as `kvtier replay` would measure it (exactly for device only and "
        "write_back: see README.md, Sizing the tiers); print the sizes that reach "
        "50/80/90/95/99% of the achievable hit rate.")
    add_plan_arguments(plan)
    plan.set_defaults(func=cmd_plan)

    from kvtier.admin.steering_cli import add_steering_commands

    add_steering_commands(sub, DEFAULT_ADMIN_URL)
    return parser


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand named in argv, found without the full parser."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--log-level")
    pre.add_argument("command", nargs="?")
    known, _ = pre.parse_known_args(argv)
    command: str | None = known.command
    return command


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    with_replay = _command_of(args_list) == "replay"
    try:
        parser = build_parser(with_replay_arguments=with_replay)
    except ImportError as e:
        return _fail("replay", f"not available: {e}", EXIT_FAILURE)
    args = parser.parse_args(args_list)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    _setup_logging(args.log_level or ("INFO" if args.command == "serve" else "WARNING"))
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
