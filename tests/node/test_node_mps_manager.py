from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import pytest

from sharegpu.node.mps import MpsDaemonSpec, MpsError, MpsLimits, MpsManager, NvidiaMpsDaemon, SimMpsDaemon


def test_daemons_start_when_needed_restart_after_failure_and_stop_when_unused(tmp_path: Path) -> None:
    async def main() -> None:
        daemon = SimMpsDaemon()
        mps = MpsManager(tmp_path / "mps", daemon)
        spec = await mps.ensure("GPU-a")
        assert spec.pipe_dir == tmp_path / "mps" / "GPU-a" / "pipe" and spec.log_dir.is_dir()
        assert await daemon.healthy(spec) and daemon.starts == 1
        await mps.ensure("GPU-a")
        assert daemon.starts == 1  # healthy: left alone
        assert await mps.reconcile({"GPU-a", "MIG-b"}) == []
        assert daemon.starts == 2
        daemon.crash(spec)
        await mps.reconcile({"GPU-a", "MIG-b"})
        assert await daemon.healthy(spec) and daemon.starts == 3
        assert {s.unit_uuid: s.restarts for s in mps.status()} == {"GPU-a": 1, "MIG-b": 0}
        await mps.reconcile({"MIG-b"})
        assert not await daemon.healthy(spec) and not (tmp_path / "mps" / "GPU-a").exists()
        assert [s.unit_uuid for s in mps.status() if s.up] == ["MIG-b"]

    asyncio.run(main())


def test_restarted_manager_adopts_running_daemons_without_restarting_them(tmp_path: Path) -> None:
    async def main() -> None:
        daemon = SimMpsDaemon()
        await MpsManager(tmp_path, daemon).ensure("GPU-a")
        await MpsManager(tmp_path, daemon).ensure("GPU-gone")
        fresh = MpsManager(tmp_path, daemon)
        assert await fresh.recover() == {"GPU-a", "GPU-gone"}
        await fresh.reconcile({"GPU-a"})
        assert daemon.starts == 2  # GPU-a kept running through the restart
        assert not (tmp_path / "GPU-gone").exists()

    asyncio.run(main())


def test_unit_names_cannot_escape_the_root(tmp_path: Path) -> None:
    mps = MpsManager(tmp_path, SimMpsDaemon())
    for bad in ("", "../etc", ".hidden"):
        with pytest.raises(MpsError):
            mps.spec(bad)


FAKE_CONTROL = r"""#!/bin/sh
# Plays nvidia-cuda-mps-control: -d starts (records its environment), stdin commands probe or quit.
state="$CUDA_MPS_PIPE_DIRECTORY/fake-daemon"
if [ "$1" = "-d" ]; then
  [ -n "$FAIL_START" ] && { echo "An instance of this daemon is already running"; exit 1; }
  echo "$CUDA_VISIBLE_DEVICES $CUDA_MPS_LOG_DIRECTORY" > "$state"; exit 0
fi
read cmd
[ -f "$state" ] || exit 1
[ -n "$FAKE_MPS_LOG" ] && echo "$CUDA_VISIBLE_DEVICES $cmd" >> "$FAKE_MPS_LOG"
case "$cmd" in
  get_server_list) [ -n "$FAKE_SERVERS" ] && echo "$FAKE_SERVERS"; exit 0 ;;
  quit) rm -f "$state"; exit 0 ;;
  "set_default_active_thread_percentage "*|"set_default_device_pinned_mem_limit "*) exit 0 ;;
  "set_active_thread_percentage "*|"set_device_pinned_mem_limit "*) exit 0 ;;
esac
exit 2
"""


def _fake_control(tmp_path: Path) -> str:
    path = tmp_path / "mps-control"
    path.write_text(FAKE_CONTROL)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_nvidia_daemon_runs_mps_control_with_its_own_device_and_directories(tmp_path: Path) -> None:
    async def main() -> None:
        mps = MpsManager(tmp_path / "mps", NvidiaMpsDaemon(_fake_control(tmp_path)))
        spec = await mps.ensure("MIG-1234")
        recorded = (spec.pipe_dir / "fake-daemon").read_text().split()
        assert recorded == ["MIG-1234", str(spec.log_dir)]
        await mps.reconcile(set())
        assert not (tmp_path / "mps" / "MIG-1234").exists()

    asyncio.run(main())


def test_nvidia_daemon_failures_are_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        monkeypatch.setenv("FAIL_START", "1")
        mps = MpsManager(tmp_path, NvidiaMpsDaemon(_fake_control(tmp_path)))
        with pytest.raises(MpsError, match="already running"):
            await mps.ensure("GPU-x")
        missing = MpsManager(tmp_path, NvidiaMpsDaemon(str(tmp_path / "no-such-binary")))
        with pytest.raises(MpsError, match="cannot run"):
            await missing.ensure("GPU-y")

    asyncio.run(main())


def _limit_commands(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if " set_" in line] if log.exists() else []


def test_prestart_makes_the_control_daemon_enforce_the_limits(
    tmp_path: Path, sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The limits reach the daemon itself, before PreStartContainer answers: a client cannot raise them by its own env."""
    from node_fakes import SIM_YAML, FakeKube, KubeletRecord, assignment, pod, share, start_container

    from sharegpu.model.assignment import Mechanism
    from sharegpu.node.allocation import Allocator
    from sharegpu.node.backends.sim import SimBackend
    from sharegpu.node.backends.sim_config import parse_sim_config
    from sharegpu.node.cdi import CdiWriter
    from sharegpu.node.mig import MigManager
    from sharegpu.node.state import AgentState

    log = tmp_path / "commands.log"
    monkeypatch.setenv("FAKE_MPS_LOG", str(log))

    async def main() -> None:
        sim = SimBackend(parse_sim_config(SIM_YAML), seed="node-a")
        kube, state = FakeKube(), AgentState()
        record = KubeletRecord(sock_dir / "pr" / "kubelet.sock", tmp_path / "dp")
        await record.start()
        mps = MpsManager(tmp_path / "mps", NvidiaMpsDaemon(_fake_control(tmp_path)))
        alloc = Allocator(
            "node-a",
            sim,
            kube,
            MigManager(sim, state),
            mps,
            state,
            record.attributor(),
            CdiWriter(tmp_path / "cdi"),
            wait_s=0.2,
        )
        try:
            g = sim.devices()[0].uuid
            a = kube.add(pod("a", assignment("a", share(0, g, Mechanism.MPS, 300, 10240))))
            assert alloc.allocate(["ta"]).envs == {"NVIDIA_VISIBLE_DEVICES": "void"}
            assert _limit_commands(log) == []  # Allocate starts nothing: the pod is not known yet
            grant = await start_container(alloc, record, a, "c0", ["ta"])
            assert grant.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
            assert _limit_commands(log) == [
                f"{g} set_default_active_thread_percentage 30",
                f"{g} set_default_device_pinned_mem_limit 0 10240M",
            ]
            # A second, larger share on the same daemon: the ceiling grows to it (never shrinks under a running
            # client).
            monkeypatch.setenv("FAKE_SERVERS", "4242")
            log.unlink()
            b = kube.add(pod("b", assignment("b", share(0, g, Mechanism.MPS, 500, 20480))))
            kube.set_phase("uid-default-a", "Running")
            await start_container(alloc, record, b, "c0", ["tb"])
            assert _limit_commands(log) == [
                f"{g} set_default_active_thread_percentage 50",
                f"{g} set_default_device_pinned_mem_limit 0 20480M",
                f"{g} set_active_thread_percentage 4242 50",
                f"{g} set_device_pinned_mem_limit 4242 0 20480M",
            ]
            # A smaller share later: nothing to change.
            log.unlink()
            c = kube.add(pod("c", assignment("c", share(0, g, Mechanism.MPS, 100, 1024))))
            kube.set_phase("uid-default-b", "Running")
            assert (await start_container(alloc, record, c, "c0", ["tc"])).envs[
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
            ] == "10"
            assert _limit_commands(log) == []
            # The reconcile loop sets the exact largest share once b has gone.
            await mps.reconcile({g}, {g: MpsLimits(30, 10240)})
            assert _limit_commands(log)[:2] == [
                f"{g} set_default_active_thread_percentage 30",
                f"{g} set_default_device_pinned_mem_limit 0 10240M",
            ]
            assert mps.limits(g) == MpsLimits(30, 10240)
        finally:
            await record.stop()

    asyncio.run(main())


def test_a_daemon_that_refuses_its_limits_is_not_handed_out(tmp_path: Path) -> None:
    class Refusing(SimMpsDaemon):
        async def set_limits(self, spec: MpsDaemonSpec, limits: MpsLimits) -> None:
            raise MpsError("unknown command")

    async def main() -> None:
        mps = MpsManager(tmp_path, Refusing())
        with pytest.raises(MpsError, match="refused its limits"):
            await mps.ensure("GPU-a", MpsLimits(30, 1024))
        assert mps.limits("GPU-a") is None
        assert await mps.reconcile({"GPU-a"}, {"GPU-a": MpsLimits(30, 1024)}) != []

    asyncio.run(main())


def test_sim_daemon_records_its_limits_and_limits_union() -> None:
    assert MpsLimits.of_share(305, 0) == MpsLimits(30, None)
    assert MpsLimits.of_share(5, 100) == MpsLimits(1, 100)
    assert MpsLimits(30, 100).union(MpsLimits(50, 50)) == MpsLimits(50, 100)
    assert MpsLimits(30, 100).union(MpsLimits(10, None)) == MpsLimits(30, None)
