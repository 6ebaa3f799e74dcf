"""NUMA-local host pools (`kvtier.worker.numa`, `workers.host_numa`).

The decision runs against fake sysfs trees (these machines have one node, a GPU box may have
two): which node `auto`, a node number and `off` pick for CPU and CUDA ranks. The kernel call
runs for real: a host pool bound to node 0, the one node every Linux machine has, must carry
`MPOL_BIND {0}` on its segment, as `get_mempolicy` reads it back from the pool's own mapping and
from another mapping of the same segment (the policy belongs to the shared-memory object).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kvtier.manager.config import ConfigError, load_config
from kvtier.worker import numa
from kvtier.worker.executor import RankResources
from kvtier.worker.kv_pools import HostPool, KVShape
from kvtier.worker.spec import WorkerSpec
from support import new_deployment_id, tiny_config

pytestmark = pytest.mark.fast

SHAPE = KVShape(2, 2, 8, 4, "float16")
GPU = "0000:3b:00.0"
GPU_UUID = "GPU-5f0c1f2a-7d1e-4a8b-9e3c-0123456789ab"


def fake_sysfs(root: Path, online: str, devices: dict[str, str] | None = None) -> numa.Topology:
    """A sysfs tree with `online` nodes and PCI devices -> their `numa_node` file, and a
    /proc tree where the NVIDIA driver lists GPU at `GPU` with `GPU_UUID`."""
    node_dir = root / "sys/devices/system/node"
    node_dir.mkdir(parents=True)
    (node_dir / "online").write_text(online + "\n")
    for pci, node in (devices or {}).items():
        d = root / "sys/bus/pci/devices" / pci
        d.mkdir(parents=True)
        (d / "numa_node").write_text(node + "\n")
    gpu = root / "proc/driver/nvidia/gpus" / GPU
    gpu.mkdir(parents=True)
    (gpu / "information").write_text(f"Model: \t\t NVIDIA H100\nGPU UUID: \t {GPU_UUID}\n")
    return numa.Topology(root / "sys", root / "proc")


@pytest.mark.parametrize(("online", "expected"), [
    ("0", [0]), ("0-1", [0, 1]), ("0-1,4,6-7", [0, 1, 4, 6, 7]), ("", [0])])
def test_online_node_lists_are_read_from_sysfs(tmp_path: Path, online: str,
                                               expected: list[int]) -> None:
    assert fake_sysfs(tmp_path, online).online_nodes() == expected


def test_auto_binds_a_gpu_rank_to_the_node_of_its_device(tmp_path: Path) -> None:
    topo = fake_sysfs(tmp_path, "0-1", {GPU: "1", "0000:86:00.0": "0"})
    choice = numa.choose_node("auto", "cuda:0", topo, GPU)
    assert choice.node == 1 and GPU in choice.reason
    assert numa.choose_node("auto", "cuda:1", topo, "0000:86:00.0").node == 0
    # the PCI address of a GPU found by its UUID in the driver's files
    assert topo.pci_of_uuid(GPU_UUID) == GPU
    assert topo.pci_of_uuid("GPU-00000000-0000-0000-0000-000000000000") is None


@pytest.mark.parametrize(("device", "online", "node_file", "pci", "why"), [
    ("cpu", "0-1", "1", GPU, "not a GPU"),
    ("cuda:0", "0", "0", GPU, "one NUMA node"),
    ("cuda:0", "0-1", "-1", GPU, "reports no NUMA node"),
    ("cuda:0", "0-1", "1", None, "unknown"),
])
def test_auto_does_not_bind_where_there_is_nothing_to_be_near(
        tmp_path: Path, device: str, online: str, node_file: str, pci: str | None,
        why: str) -> None:
    topo = fake_sysfs(tmp_path, online, {GPU: node_file})
    choice = numa.choose_node("auto", device, topo, pci)
    assert choice.node is None and why in choice.reason, choice


def test_a_node_number_must_be_online_and_off_never_binds(tmp_path: Path) -> None:
    topo = fake_sysfs(tmp_path, "0-1", {GPU: "1"})
    assert numa.choose_node(0, "cuda:0", topo, GPU).node == 0  # the operator's word wins
    assert numa.choose_node(1, "cpu", topo).node == 1
    assert numa.choose_node("off", "cuda:0", topo, GPU).node is None
    with pytest.raises(numa.NumaError, match=r"node 2 is not online.*online nodes: 0, 1"):
        numa.choose_node(2, "cuda:0", topo, GPU)


def test_settings_are_checked_with_one_line_naming_the_key() -> None:
    assert tiny_config().workers.host_numa == "auto"
    assert tiny_config(extra={"KVTIER_WORKERS__HOST_NUMA": "0"}).workers.host_numa == 0
    assert tiny_config(extra={"KVTIER_WORKERS__HOST_NUMA": "OFF"}).workers.host_numa == "off"
    online = numa.Topology().online_nodes()
    absent = max(online) + 1
    for bad, why in ((str(absent), f"node {absent} is not online"),
                     ("near", "expected 'auto', 'off' or a NUMA node number"),
                     ("-1", "expected 'auto', 'off'"), ("5000", "must be in [0, 1023]")):
        with pytest.raises(ConfigError) as e:
            tiny_config(extra={"KVTIER_WORKERS__HOST_NUMA": bad})
        msg = str(e.value)
        assert "workers.host_numa" in msg and why in msg and "\n" not in msg, msg
    # a node is a machine check: a file validated for another machine may name any node
    other = load_config(None, {"KVTIER_WORKERS__HOST_NUMA": str(absent)}, check_resources=False)
    assert other.workers.host_numa == absent


def test_a_pool_bound_to_node_0_carries_the_policy_on_its_segment(shm_name: str) -> None:
    """The real system call on a real segment: MPOL_BIND {0} from both mappings; an unbound
    pool keeps the default policy (so the check tells the two apart)."""
    with HostPool(SHAPE, 8, shm_name, numa_node=0) as pool:
        assert pool.numa_node == 0
        assert numa.policy_at(pool.data.data_ptr()) == (numa.MPOL_BIND, [0])
        last_page = pool.data[7].data_ptr()
        assert numa.policy_at(last_page) == (numa.MPOL_BIND, [0])
        with HostPool.attach(shm_name, SHAPE) as seen:  # another mapping, same segment
            assert numa.policy_at(seen.data.data_ptr()) == (numa.MPOL_BIND, [0])
        pool.data.fill_(7)  # the pages are usable
        assert int(pool.data.sum()) == 7 * pool.nbytes
    with HostPool(SHAPE, 8, shm_name) as pool:
        assert pool.numa_node is None
        assert numa.policy_at(pool.data.data_ptr())[0] == numa.MPOL_DEFAULT


def test_a_node_the_kernel_refuses_fails_the_pool_in_one_line(shm_name: str) -> None:
    absent = max(numa.Topology().online_nodes()) + 1
    with pytest.raises(numa.NumaError, match=f"to NUMA node {absent} failed: Invalid argument"):
        HostPool(SHAPE, 8, shm_name, numa_node=absent)
    # nothing left behind: the segment was unlinked (the shm_name fixture checks it)


def test_rank_resources_bind_the_host_pool_as_the_setting_says(tmp_path: Path) -> None:
    """What a worker builds: `host_numa = "0"` binds its host pool, `auto` on a CPU rank does
    not; the choice and its reason are kept for the worker's log and /status."""
    dep = new_deployment_id("numa")
    base = WorkerSpec(deployment_id=dep, rank=0, num_ranks=1, num_layers=2, num_kv_heads=2,
                      head_dim=8, dtype="float16", block_size=4, device_blocks=4,
                      host_blocks=4, device="cpu")
    two_nodes = fake_sysfs(tmp_path, "0-1", {GPU: "1"})
    for setting, node in (("0", 0), ("auto", None), ("off", None)):
        spec = WorkerSpec(**{**base.__dict__, "host_numa": setting})
        res = RankResources(spec, f"/kvtier_{dep}_host_r0", two_nodes)
        try:
            assert res.numa.node == node, (setting, res.numa)
            assert res.host is not None
            mode = numa.policy_at(res.host.data.data_ptr())[0]
            assert mode == (numa.MPOL_BIND if node is not None else numa.MPOL_DEFAULT)
        finally:
            res.close()
