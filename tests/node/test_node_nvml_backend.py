"""NvmlBackend through a fake NVML that behaves like an H100 driver (profile ids, placements, MIG UUIDs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sharegpu.node.backends.base import (
    BackendError,
    InstanceInUse,
    InsufficientResources,
    InvalidPlacement,
    MigNotEnabled,
    MigUnsupported,
)
from sharegpu.node.backends.nvml import NvmlBackend, pod_uid_from_cgroup, resolve_model
from sharegpu.node.backends.nvml_api import GiInfo, GiProfile, NvmlCallError, NvmlEvent, NvmlProcess

GIB = 1024**3
# NVML's H100 profile table: (profile constant → id, slices, MB, placements); id 7 is 1g.10gb+me.
H100 = {
    0: (19, 1, 9856, [(s, 1) for s in range(7)]),
    1: (14, 2, 20096, [(0, 2), (2, 2), (4, 2)]),
    2: (9, 3, 40192, [(0, 4), (4, 4)]),
    3: (5, 4, 40192, [(0, 4)]),
    4: (0, 7, 80384, [(0, 8)]),
    7: (20, 1, 9856, [(0, 1)]),
    9: (15, 1, 20096, [(0, 2), (2, 2), (4, 2), (6, 2)]),
}


@dataclass
class FakeGi:
    id: int
    profile_id: int
    start: int
    size: int


@dataclass
class FakeGpu:
    name: str
    mig: bool = False
    gis: list[FakeGi] = field(default_factory=list)
    procs: list[NvmlProcess] = field(default_factory=list)
    broken: bool = False
    mps_procs: list[NvmlProcess] = field(default_factory=list)  # the MPS-aware query's answer
    sm: dict[int, int] | None = None  # process_utilization; None: no samples
    events: bool = True  # whether the driver takes Xid event registrations


class FakeNvml:
    def __init__(self, *gpus: FakeGpu) -> None:
        self.gpus = list(gpus)
        self.next_id = 1
        self.fail_ci = False
        self.queued: list[NvmlEvent] = []  # events the driver has for the set
        self.registered: list[tuple[int, int]] = []  # (GPU position, event types)
        self.sets_freed = 0

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def device_count(self) -> int:
        return len(self.gpus)

    def handle(self, index: int) -> Any:
        return self.gpus[index]

    def uuid(self, h: FakeGpu) -> str:
        return f"GPU-{self.gpus.index(h)}"

    def name(self, h: FakeGpu) -> str:
        return h.name

    def memory(self, h: FakeGpu) -> tuple[int, int]:
        return 81559 * 2**20, sum(p.used_bytes for p in h.procs)

    def sm_count(self, h: FakeGpu) -> int | None:
        return None

    def minor_number(self, h: FakeGpu) -> int:
        return 10 + next(i for i, g in enumerate(self.gpus) if g is h)  # minors need not follow indices

    def mig_mode(self, h: FakeGpu) -> tuple[bool, bool]:
        if "T4" in h.name:
            raise NvmlCallError("not_supported", "no MIG")
        return h.mig, h.mig

    def set_mig_mode(self, h: FakeGpu, enabled: bool) -> bool:
        h.mig = enabled
        return True

    def gi_profiles(self, h: FakeGpu) -> list[GiProfile]:
        if "T4" in h.name:
            raise NvmlCallError("not_supported", "no MIG")
        return [GiProfile(pid, sl, mb) for _, (pid, sl, mb, _) in sorted(H100.items())]

    def gi_placements(self, h: FakeGpu, profile_id: int) -> list[tuple[int, int]]:
        return next(pl for pid, _, _, pl in H100.values() if pid == profile_id)

    def gpu_instances(self, h: FakeGpu, profile_id: int) -> list[Any]:
        return [g for g in h.gis if g.profile_id == profile_id]

    def gi_info(self, gi: FakeGi) -> GiInfo:
        return GiInfo(gi.id, gi.profile_id, gi.start, gi.size)

    def create_gi(self, h: FakeGpu, profile_id: int, start: int | None, size: int) -> Any:
        if not h.mig:
            raise NvmlCallError("not_supported", "MIG off")
        if start is None:
            start = max(s for s, _ in self.gi_placements(h, profile_id) if not self._overlap(h, s, size))
        if self._overlap(h, start, size):
            raise NvmlCallError("insufficient", "Insufficient Resources")
        gi = FakeGi(self.next_id, profile_id, start, size)
        self.next_id += 1
        h.gis.append(gi)
        return gi

    @staticmethod
    def _overlap(h: FakeGpu, start: int, size: int) -> bool:
        return any(g.start < start + size and start < g.start + g.size for g in h.gis)

    def create_full_ci(self, gi: FakeGi, slices: int) -> None:
        if self.fail_ci:
            raise NvmlCallError("other", "Unknown Error")

    def destroy_gi(self, gi: FakeGi) -> None:
        for g in self.gpus:
            if gi in g.gis:
                g.gis.remove(gi)

    def mig_uuids(self, h: FakeGpu) -> dict[int, str]:
        return {g.id: f"MIG-{self.gpus.index(h)}-{g.id}" for g in h.gis}

    def processes(self, h: FakeGpu) -> list[NvmlProcess]:
        return list(h.procs)

    def utilization(self, h: FakeGpu) -> tuple[int, int]:
        if h.broken:
            raise NvmlCallError("other", "GPU is lost")
        return 40, 10

    def process_utilization(self, h: FakeGpu) -> dict[int, int]:
        if h.sm is None:
            raise NvmlCallError("not_found", "no samples")
        return dict(h.sm)

    def mps_processes(self, h: FakeGpu) -> list[NvmlProcess]:
        return list(h.mps_procs)

    def event_set(self) -> Any:
        return "event-set"

    def register_events(self, h: FakeGpu, event_types: int, event_set: Any) -> None:
        assert event_set == "event-set"
        if not h.events:
            raise NvmlCallError("not_supported", "nvmlDeviceRegisterEvents: Not Supported")
        self.registered.append((self.gpus.index(h), event_types))

    def wait_event(self, event_set: Any, timeout_ms: int) -> NvmlEvent | None:
        assert timeout_ms == 0, "the agent must never wait for events"
        return self.queued.pop(0) if self.queued else None

    def free_event_set(self, event_set: Any) -> None:
        self.sets_freed += 1


def _backend(*gpus: FakeGpu) -> tuple[NvmlBackend, FakeNvml]:
    api = FakeNvml(*gpus)
    return NvmlBackend(api), api


def test_devices_resolve_to_catalog_models_and_health() -> None:
    backend, _ = _backend(
        FakeGpu("NVIDIA H100 80GB HBM3"), FakeGpu("Tesla T4"), FakeGpu("NVIDIA H100 PCIe", broken=True)
    )
    devs = backend.devices()
    assert [d.model for d in devs] == ["H100-80GB", "T4", "H100-80GB"]
    assert devs[0].sms == 132 and devs[0].memory_mib == 81559 and devs[0].product == "NVIDIA H100 80GB HBM3"
    assert [d.healthy for d in devs] == [True, True, False]
    assert not devs[1].mig_enabled


def test_profiles_get_catalog_names_and_skip_media_variants() -> None:
    backend, _ = _backend(FakeGpu("NVIDIA H100 80GB HBM3"), FakeGpu("Tesla T4"))
    names = [p.name for p in backend.mig_profiles(0)]
    assert names == ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb", "1g.20gb"]
    three = next(p for p in backend.mig_profiles(0) if p.name == "3g.40gb")
    assert [(p.start, p.size) for p in three.placements] == [(0, 4), (4, 4)]
    assert backend.mig_profiles(1) == ()


def test_create_at_placement_list_and_destroy() -> None:
    backend, api = _backend(FakeGpu("NVIDIA H100 80GB HBM3"))
    with pytest.raises(MigNotEnabled):
        backend.create_mig_instance(0, "3g.40gb", 4)
    backend.set_mig_mode(0, True)
    inst = backend.create_mig_instance(0, "3g.40gb", 4)
    assert (inst.profile, inst.start, inst.size, inst.uuid) == ("3g.40gb", 4, 4, "MIG-0-1")
    assert backend.mig_instances(0) == (inst,)
    with pytest.raises(InvalidPlacement):
        backend.create_mig_instance(0, "3g.40gb", 2)
    with pytest.raises(InsufficientResources):
        backend.create_mig_instance(0, "2g.20gb", 4)
    with pytest.raises(MigUnsupported, match=r"has: 1g\.10gb"):
        backend.create_mig_instance(0, "5g.50gb", 0)
    api.gpus[0].procs.append(NvmlProcess(77, 2 * GIB, 1))
    (proc,) = backend.processes(0)
    assert (proc.unit_uuid, proc.used_memory_mib) == ("MIG-0-1", 2048)
    with pytest.raises(InstanceInUse):
        backend.destroy_mig_instance(0, 4)
    api.gpus[0].procs.clear()
    backend.destroy_mig_instance(0, 4)
    assert backend.mig_instances(0) == ()


def test_a_failed_compute_instance_leaves_no_gpu_instance_behind() -> None:
    backend, api = _backend(FakeGpu("NVIDIA H100 80GB HBM3", mig=True))
    api.fail_ci = True
    with pytest.raises(BackendError, match="compute instance failed"):
        backend.create_mig_instance(0, "1g.10gb", 0)
    assert api.gpus[0].gis == []


def test_samples_and_pod_mapping(tmp_path: Path) -> None:
    backend, api = _backend(FakeGpu("NVIDIA H100 80GB HBM3"))
    api.gpus[0].procs.append(NvmlProcess(12, 3 * GIB, None))
    assert backend.memory_used_mib(0) == 3072 and backend.utilization(0).gpu_percent == 40
    assert backend.process_utilization(0) == {}
    proc = tmp_path / "12"
    proc.mkdir()
    (proc / "cgroup").write_text(
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b2c3d4e_5f60_7182_93a4_b5c6d7e8f901.slice/cri-containerd-abc.scope\n"
    )
    assert NvmlBackend(api, proc_root=tmp_path).pod_uid_of(12) == "1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901"
    assert NvmlBackend(api, proc_root=tmp_path).pod_uid_of(13) is None


def test_model_resolution_and_cgroup_parsing() -> None:
    assert resolve_model("NVIDIA A100-SXM4-40GB", 40536).name == "A100-40GB"
    assert resolve_model("NVIDIA A100 80GB PCIe", 81920).name == "A100-80GB"
    assert resolve_model("NVIDIA H200", 143771).name == "H200-141GB"
    assert resolve_model("NVIDIA L4", 23034).name == "L4"
    assert resolve_model("NVIDIA B200", 183359).generic
    assert pod_uid_from_cgroup("12:memory:/kubepods/besteffort/pod0a1b2c3d-0000-1111-2222-333344445555/abc") == (
        "0a1b2c3d-0000-1111-2222-333344445555"
    )
    assert pod_uid_from_cgroup("0::/user.slice") is None


def test_device_nodes_name_only_nodes_the_host_has(tmp_path: Path) -> None:
    """A CDI spec that names a missing device node fails the container (containerd stats each one)."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidiactl", "nvidia-uvm", "nvidia11"):
        (dev / name).touch()
    backend = NvmlBackend(FakeNvml(FakeGpu("NVIDIA H100 80GB HBM3"), FakeGpu("NVIDIA H100 80GB HBM3")), dev_root=dev)
    assert backend.device_nodes(1) == ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia11")
    assert backend.device_nodes(0) == ("/dev/nvidiactl", "/dev/nvidia-uvm")  # no /dev/nvidia10 here


# What /proc/<pid>/mountinfo shows for a container that CDI gave its tenant's pipe directory (the host's state
# directory on the root filesystem), and for the agent's own MPS server (the state directory on a filesystem of its own,
# mounted at the same path: its root there is /sharegpu/...).
CONTAINER_MOUNTS = """\
1200 1100 0:52 / / rw,relatime - overlay overlay rw,lowerdir=/x
1201 1200 0:53 / /proc rw,nosuid - proc proc rw
1210 1200 259:1 /var/lib/sharegpu/mps/GPU-1/team-a_uid-1000/pipe /run/sharegpu/mps rw,relatime - ext4 /dev/nvme0n1p1 rw
1211 1200 259:1 /var/lib/x\\040y /mnt/with\\040space rw - ext4 /dev/nvme0n1p1 rw
"""
SERVER_MOUNTS = """\
22 1 259:1 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p1 rw
40 22 259:2 /sharegpu /var/lib/sharegpu rw,relatime shared:9 - xfs /dev/nvme1n1 rw
"""


def test_the_pipe_directory_a_process_uses_is_read_through_its_own_mounts(tmp_path: Path) -> None:
    from sharegpu.node.backends.nvml import host_pipe_dir

    env = b"PATH=/bin\0CUDA_MPS_PIPE_DIRECTORY=/run/sharegpu/mps\0HOME=/root\0"
    assert host_pipe_dir(env, CONTAINER_MOUNTS) == "/var/lib/sharegpu/mps/GPU-1/team-a_uid-1000/pipe"
    assert host_pipe_dir(b"CUDA_MPS_PIPE_DIRECTORY=/run/sharegpu/mps/", CONTAINER_MOUNTS).endswith("uid-1000/pipe")
    assert host_pipe_dir(b"CUDA_MPS_PIPE_DIRECTORY=/mnt/with space/p", CONTAINER_MOUNTS) == "/var/lib/x y/p"
    assert host_pipe_dir(b"", CONTAINER_MOUNTS) == "/tmp/nvidia-mps"  # CUDA's default, through the overlay root
    server_env = b"CUDA_MPS_PIPE_DIRECTORY=/var/lib/sharegpu/mps/GPU-1/team-a_uid-1000/pipe\0"
    assert host_pipe_dir(server_env, SERVER_MOUNTS) == "/sharegpu/mps/GPU-1/team-a_uid-1000/pipe"
    assert host_pipe_dir(env, "") is None
    # Through the backend: /proc/<pid>/environ and mountinfo, and None where either cannot be read.
    backend = NvmlBackend(FakeNvml(FakeGpu("NVIDIA H100 80GB HBM3")), proc_root=tmp_path)
    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "environ").write_bytes(env)
    (tmp_path / "77" / "mountinfo").write_text(CONTAINER_MOUNTS)
    assert backend.mps_pipe_dir(77) == "/var/lib/sharegpu/mps/GPU-1/team-a_uid-1000/pipe"
    (tmp_path / "77" / "environ").unlink()  # no hostPID, or not root: unknown
    assert backend.mps_pipe_dir(77) is None and backend.mps_pipe_dir(78) is None
