"""NUMA placement of a rank's host pool: which node it goes on, and the kernel call that puts it
there.

On a machine with several NUMA nodes a GPU sits on the PCIe root of one of them; host pages on
another node cross the socket interconnect on every H2D / D2H copy. So each rank's host pool
(`kvtier.worker.kv_pools.HostPool`) is bound to the node of the rank's device before any of
its pages exist: `mbind(2)` with `MPOL_BIND` on the fresh mapping of the shared-memory segment,
then `posix_fallocate` allocates every page under that policy (for shared memory the policy
belongs to the segment itself, so every process that maps it sees the same placement).

Decision (`choose_node`, from `workers.host_numa`):

    "off"       never bind
    N (int)     bind to node N; N must be online (`<sysfs>/devices/system/node/online`)
    "auto"      bind to the node the kernel reports for the rank's CUDA device
                (`<sysfs>/bus/pci/devices/<pci address>/numa_node`); no binding for a CPU
                device, on a machine with one node, or where the kernel reports none (-1)

Topology is read through `Topology(root)`, root "/sys" by default, so tests hand it a fake
sysfs tree. The call is a raw system call through ctypes (`syscall(SYS_mbind, ...)`): glibc has
no wrapper (libnuma does, but it is not installed everywhere) and nothing is shelled out.
Torch-free, so the manager's configuration can check a node number with it.
"""

from __future__ import annotations

import ctypes
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.worker.errors import KvtierError

MPOL_DEFAULT, MPOL_PREFERRED, MPOL_BIND = 0, 1, 2
MPOL_F_ADDR = 2  # get_mempolicy: the policy governing the address given
MAX_NODE = 1023
"""Largest node number accepted (the kernel's MAX_NUMNODES is 1024 on x86_64 builds)."""

# System call numbers of the machines kvtier runs on (asm/unistd_64.h, asm-generic/unistd.h).
_SYSCALLS = {"x86_64": (237, 239), "aarch64": (235, 236)}  # (mbind, get_mempolicy)
_WORD_BITS = 8 * ctypes.sizeof(ctypes.c_ulong)


class NumaError(KvtierError, OSError):
    """A NUMA node cannot be used as asked (not online, or the kernel refused the policy)."""


def parse_node_list(text: str) -> list[int]:
    """A sysfs node list ("0", "0-1,3") as sorted node numbers; "" is no node."""
    nodes: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        nodes.update(range(int(lo), int(hi or lo) + 1))
    return sorted(nodes)


@dataclass(frozen=True)
class Topology:
    """What the kernel says about NUMA, read from a sysfs tree at `root` (a fake one in
    tests) and, for a GPU's PCI address, the NVIDIA driver's files under `proc`."""

    root: Path = Path("/sys")
    proc: Path = Path("/proc")

    def online_nodes(self) -> list[int]:
        """Online nodes; [0] where the kernel has no NUMA support (no node folder)."""
        try:
            text = (self.root / "devices/system/node/online").read_text()
        except OSError:
            return [0]
        try:
            return parse_node_list(text) or [0]
        except ValueError:
            return [0]

    def device_node(self, pci: str) -> int | None:
        """The node of PCI device `pci` ("0000:3b:00.0"); None where the kernel reports none
        (-1, no such device, an unreadable file)."""
        try:
            node = int((self.root / "bus/pci/devices" / pci.lower() / "numa_node").read_text())
        except (OSError, ValueError):
            return None
        return node if node >= 0 else None

    def pci_of_uuid(self, uuid: str) -> str | None:
        """The PCI address of the NVIDIA GPU whose UUID is `uuid`, from the driver's
        `<proc>/driver/nvidia/gpus/<pci>/information` ("GPU UUID: GPU-..."); None if unknown."""
        want = uuid.lower().removeprefix("gpu-")
        if not want:
            return None
        try:
            folders = sorted((self.proc / "driver/nvidia/gpus").iterdir())
        except OSError:
            return None
        for folder in folders:
            try:
                text = (folder / "information").read_text().lower()
            except OSError:
                continue
            if want in text:
                return folder.name
        return None


@dataclass(frozen=True)
class NumaChoice:
    """Where a rank's host pool goes: `node` (None: not bound) and why, for logs and /status."""

    node: int | None
    reason: str


def check_setting(value: object) -> str | int:
    """`workers.host_numa` as "auto", "off" or a node number (a numeric string, as an
    environment variable gives it, is a node number). ValueError with the reason otherwise."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("auto", "off"):
            return text
        if text.isdigit():
            value = int(text)
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value <= MAX_NODE:
            raise ValueError(f"a NUMA node number must be in [0, {MAX_NODE}], got {value}")
        return value
    raise ValueError(f"expected 'auto', 'off' or a NUMA node number, got {value!r}")


def check_online(node: int, topology: Topology | None = None) -> None:
    """NumaError unless `node` is an online node of this machine."""
    nodes = (topology or Topology()).online_nodes()
    if node not in nodes:
        raise NumaError(f"workers.host_numa = {node}: node {node} is not online on this "
                        f"machine (online nodes: {', '.join(map(str, nodes))})")


def choose_node(setting: str | int, device: str, topology: Topology | None = None,
                pci: str | None = None) -> NumaChoice:
    """The node rank's host pool is bound to (see the module docstring). `device` is the
    rank's device string ("cpu", "cuda:1"); `pci` its PCI address when known."""
    topo = topology or Topology()
    if setting == "off":
        return NumaChoice(None, "workers.host_numa = off")
    if isinstance(setting, int):
        check_online(setting, topo)
        return NumaChoice(setting, f"workers.host_numa = {setting}")
    if not device.startswith("cuda"):
        return NumaChoice(None, f"auto: device {device} is not a GPU")
    nodes = topo.online_nodes()
    if len(nodes) < 2:
        return NumaChoice(None, f"auto: one NUMA node (node {nodes[0]})")
    if pci is None:
        return NumaChoice(None, f"auto: the PCI address of {device} is unknown")
    node = topo.device_node(pci)
    if node is None:
        return NumaChoice(None, f"auto: the kernel reports no NUMA node for {device} ({pci})")
    return NumaChoice(node, f"auto: the NUMA node of {device} ({pci})")


def cuda_pci_address(index: int, topology: Topology | None = None) -> str | None:
    """The PCI address ("0000:3b:00.0") of CUDA device `index` of this process: from torch's
    device properties where they carry it, else by its UUID in the NVIDIA driver's files."""
    import torch

    try:
        props = torch.cuda.get_device_properties(index)
    except (AssertionError, RuntimeError):
        return None
    domain, bus, dev = (getattr(props, f"pci_{n}_id", None) for n in ("domain", "bus", "device"))
    if isinstance(bus, int) and isinstance(dev, int):
        return f"{domain or 0:04x}:{bus:02x}:{dev:02x}.0"
    return (topology or Topology()).pci_of_uuid(str(getattr(props, "uuid", "")))


def _syscalls() -> tuple[int, int]:
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        raise NumaError(f"binding memory to a NUMA node is not supported on "
                        f"{platform.machine()} (workers.host_numa = 'off' turns it off)")
    return numbers


_libc: ctypes.CDLL | None = None


def _syscall() -> Any:
    """libc's `syscall(2)`, returning a long (errno kept for `ctypes.get_errno`)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    fn = _libc.syscall
    fn.restype = ctypes.c_long
    return fn


def _mask(node: int) -> tuple[ctypes.Array[ctypes.c_ulong], int]:
    words = node // _WORD_BITS + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // _WORD_BITS] = 1 << (node % _WORD_BITS)
    # The kernel reads maxnode - 1 bits (a historical off-by-one every caller allows for).
    return mask, words * _WORD_BITS + 1


def bind(address: int, length: int, node: int) -> None:
    """Bind `length` bytes of mapped memory at `address` (page aligned) to `node`
    (`MPOL_BIND`): pages allocated afterwards come from that node only. For a shared-memory
    mapping the policy is the segment's. NumaError with the kernel's reason when refused."""
    if not 0 <= node <= MAX_NODE:
        raise NumaError(f"NUMA node {node} out of range [0, {MAX_NODE}]")
    mbind, _ = _syscalls()
    mask, maxnode = _mask(node)
    rc = _syscall()(ctypes.c_long(mbind), ctypes.c_void_p(address), ctypes.c_ulong(length),
                    ctypes.c_long(MPOL_BIND), mask, ctypes.c_ulong(maxnode), ctypes.c_uint(0))
    if rc != 0:
        err = ctypes.get_errno()
        raise NumaError(f"mbind of {length} bytes to NUMA node {node} failed: "
                        f"{os.strerror(err)} (errno {err})")


def policy_at(address: int) -> tuple[int, list[int]]:
    """The memory policy governing `address` (mode: MPOL_*, and its nodes), as
    `get_mempolicy(MPOL_F_ADDR)` reports it; for checks and diagnostics."""
    _, get_mempolicy = _syscalls()
    mode = ctypes.c_int(-1)
    mask, maxnode = _mask(MAX_NODE)
    rc = _syscall()(ctypes.c_long(get_mempolicy), ctypes.byref(mode), mask,
                    ctypes.c_ulong(maxnode), ctypes.c_void_p(address), ctypes.c_ulong(MPOL_F_ADDR))
    if rc != 0:
        err = ctypes.get_errno()
        raise NumaError(f"get_mempolicy failed: {os.strerror(err)} (errno {err})")
    nodes = [w * _WORD_BITS + b for w in range(len(mask)) for b in range(_WORD_BITS)
             if mask[w] >> b & 1]
    return mode.value, nodes
