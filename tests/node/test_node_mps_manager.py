from __future__ import annotations

import asyncio
import json
import stat
from pathlib import Path

import pytest

from sharegpu.model.tenant import MULTI_USER_TENANT, tenant_dir, user_tenant
from sharegpu.node.mps import (
    DaemonKey,
    MpsDaemonSpec,
    MpsError,
    MpsLimits,
    MpsManager,
    NvidiaMpsDaemon,
    SimMpsDaemon,
    mps_client_env,
    thread_percentage,
)

ALICE = user_tenant("team-a", 1000)
BOB = user_tenant("team-b", 1000)  # the same UID in another namespace: another tenant
ANON = "pod/0a1b2c3d-0000-1111-2222-000000000001"


def test_daemons_start_when_needed_restart_after_failure_and_stop_when_unused(tmp_path: Path) -> None:
    async def main() -> None:
        daemon = SimMpsDaemon()
        mps = MpsManager(tmp_path / "mps", daemon)
        spec = await mps.ensure("GPU-a", ALICE)
        assert spec.pipe_dir == tmp_path / "mps" / "GPU-a" / tenant_dir(ALICE) / "pipe" and spec.log_dir.is_dir()
        assert await daemon.healthy(spec) and daemon.starts == 1
        await mps.ensure("GPU-a", ALICE)
        assert daemon.starts == 1  # healthy: left alone
        wanted = {DaemonKey("GPU-a", ALICE), DaemonKey("MIG-b", ALICE)}
        assert await mps.reconcile(wanted) == []
        assert daemon.starts == 2
        daemon.crash(spec)
        await mps.reconcile(wanted)
        assert await daemon.healthy(spec) and daemon.starts == 3
        assert {s.unit_uuid: s.restarts for s in mps.status()} == {"GPU-a": 1, "MIG-b": 0}
        await mps.reconcile({DaemonKey("MIG-b", ALICE)})
        assert not await daemon.healthy(spec) and not (tmp_path / "mps" / "GPU-a").exists()
        assert [s.unit_uuid for s in mps.status() if s.up] == ["MIG-b"]

    asyncio.run(main())


def test_each_tenant_of_a_unit_gets_its_own_daemon_directories_and_limits(tmp_path: Path) -> None:
    """Two tenants on one GPU: two daemons, each with its own pipe and log directories (a client selects its daemon by
    its pipe directory alone), its own limits, and a life of its own."""

    async def main() -> None:
        daemon = SimMpsDaemon()
        mps = MpsManager(tmp_path / "mps", daemon)
        a = await mps.ensure("GPU-a", ALICE, MpsLimits(100, 10240))
        b = await mps.ensure("GPU-a", BOB, MpsLimits(50, 4096))
        c = await mps.ensure("GPU-a", ANON)
        assert len({a.pipe_dir, b.pipe_dir, c.pipe_dir}) == 3 and len({a.log_dir, b.log_dir, c.log_dir}) == 3
        assert a.pipe_dir.parent.parent == b.pipe_dir.parent.parent == tmp_path / "mps" / "GPU-a"
        assert daemon.starts == 3
        assert mps.running() == {DaemonKey("GPU-a", t) for t in (ALICE, BOB, ANON)}
        assert (mps.limits(a.key), mps.limits(b.key), mps.limits(c.key)) == (
            MpsLimits(100, 10240),
            MpsLimits(50, 4096),
            None,
        )
        assert daemon.limits(b) == MpsLimits(50, 4096)
        # The daemon's file says whom it serves (a container that mounts its pipe directory can read it).
        assert json.loads((b.pipe_dir / SimMpsDaemon.MARKER).read_text())["tenant"] == BOB
        # Bob's last pod is gone: his daemon stops, Alice's and the anonymous pod's keep running untouched.
        assert await mps.reconcile({a.key, c.key}) == []
        assert not await daemon.healthy(b) and not b.pipe_dir.parent.exists()
        assert await daemon.healthy(a) and await daemon.healthy(c) and daemon.starts == 3
        assert {(s.unit_uuid, s.tenant) for s in mps.status()} == {("GPU-a", ALICE), ("GPU-a", ANON)}

    asyncio.run(main())


def test_a_multi_user_manager_runs_one_daemon_per_unit_for_every_tenant(tmp_path: Path) -> None:
    async def main() -> None:
        mps = MpsManager(tmp_path / "mps", SimMpsDaemon(), multi_user=True)
        a = await mps.ensure("GPU-a", ALICE)
        b = await mps.ensure("GPU-a", BOB)
        assert a == b and a.multi_user and a.tenant == MULTI_USER_TENANT
        assert mps.running() == {DaemonKey("GPU-a", MULTI_USER_TENANT)}
        # Needs named by the pods' tenants map onto that one daemon: nothing is stopped.
        assert await mps.reconcile({DaemonKey("GPU-a", ALICE), DaemonKey("GPU-a", BOB)}) == []
        assert mps.running() == {DaemonKey("GPU-a", MULTI_USER_TENANT)}

    asyncio.run(main())


def test_restarted_manager_adopts_running_daemons_without_restarting_them(tmp_path: Path) -> None:
    async def main() -> None:
        daemon = SimMpsDaemon()
        await MpsManager(tmp_path, daemon).ensure("GPU-a", ALICE)
        await MpsManager(tmp_path, daemon).ensure("GPU-a", ANON)
        await MpsManager(tmp_path, daemon).ensure("GPU-gone", ALICE)
        fresh = MpsManager(tmp_path, daemon)
        assert await fresh.recover() == {
            DaemonKey("GPU-a", ALICE),
            DaemonKey("GPU-a", ANON),
            DaemonKey("GPU-gone", ALICE),
        }
        await fresh.reconcile({DaemonKey("GPU-a", ALICE)})
        assert daemon.starts == 3  # Alice's daemon on GPU-a kept running through the restart
        assert not (tmp_path / "GPU-gone").exists() and not (tmp_path / "GPU-a" / tenant_dir(ANON)).exists()
        assert (tmp_path / "GPU-a" / tenant_dir(ALICE) / "pipe").is_dir()

    asyncio.run(main())


def test_a_process_is_tied_to_its_daemon_by_the_end_of_its_pipe_directory(tmp_path: Path) -> None:
    async def main() -> None:
        mps = MpsManager(tmp_path / "state" / "mps", SimMpsDaemon())
        a = await mps.ensure("GPU-a", ALICE)
        await mps.ensure("GPU-a", BOB)
        assert mps.daemon_of_pipe(str(a.pipe_dir)) == a.key
        # As a container's mount resolves it where the state directory is a filesystem of its own.
        assert mps.daemon_of_pipe(f"/mps/GPU-a/{tenant_dir(ALICE)}/pipe") == a.key
        assert mps.daemon_of_pipe(f"/other/GPU-a/{tenant_dir(ALICE)}/pipe") is None  # not this manager's root
        assert mps.daemon_of_pipe(f"/mps/GPU-a/{tenant_dir(ANON)}/pipe") is None  # no such daemon runs
        assert mps.daemon_of_pipe("/tmp/nvidia-mps") is None and mps.daemon_of_pipe(None) is None

    asyncio.run(main())


def test_unit_names_cannot_escape_the_root(tmp_path: Path) -> None:
    mps = MpsManager(tmp_path, SimMpsDaemon())
    for bad in ("", "../etc", ".hidden"):
        with pytest.raises(MpsError):
            mps.spec(bad, ALICE)
    # A tenant key is a file name too: two tenants never share a directory, whatever their names.
    names = {tenant_dir(t) for t in (ALICE, BOB, ANON, user_tenant("team-a", 0), MULTI_USER_TENANT, "")}
    assert len(names) == 6 and not any("/" in n or n.startswith(".") for n in names)


def test_a_clients_thread_cap_is_its_share_against_its_own_tenants_shares_only() -> None:
    assert thread_percentage(150, 150) == 100  # alone in its daemon: the whole GPU in its daemon's turn
    assert thread_percentage(150, 300) == 50  # two of 15 % of one tenant: half each
    assert thread_percentage(250, 1000) == 25
    assert thread_percentage(300, 200) == 100  # never below its own share, never above 100 %
    assert thread_percentage(5, 100_000) == 1
    assert thread_percentage(150, 0) == 15  # no tenant given: its share of the unit
    assert MpsLimits.of_share(150, 10240, 450) == MpsLimits(33, 10240)
    env = mps_client_env("/run/sharegpu/mps", 150, 10240, 300)
    assert env == {
        "CUDA_MPS_PIPE_DIRECTORY": "/run/sharegpu/mps",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10240M",
    }


FAKE_CONTROL = r"""#!/bin/sh
# Plays nvidia-cuda-mps-control: -d starts (records its environment), stdin commands probe or quit.
state="$CUDA_MPS_PIPE_DIRECTORY/fake-daemon"
if [ "$1" = "-d" ]; then
  [ -n "$FAIL_START" ] && { echo "An instance of this daemon is already running"; exit 1; }
  echo "$CUDA_VISIBLE_DEVICES $CUDA_MPS_LOG_DIRECTORY $2" > "$state"; exit 0
fi
read cmd
[ -f "$state" ] || exit 1
[ -n "$FAKE_MPS_LOG" ] && echo "$CUDA_VISIBLE_DEVICES $(basename "$(dirname "$CUDA_MPS_PIPE_DIRECTORY")") $cmd" >> "$FAKE_MPS_LOG"
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
        a = await mps.ensure("MIG-1234", ALICE)
        b = await mps.ensure("MIG-1234", ANON)
        assert (a.pipe_dir / "fake-daemon").read_text().split() == ["MIG-1234", str(a.log_dir)]
        assert (b.pipe_dir / "fake-daemon").read_text().split() == ["MIG-1234", str(b.log_dir)]
        await mps.reconcile({b.key})
        assert not (a.pipe_dir / "fake-daemon").exists() and (b.pipe_dir / "fake-daemon").exists()
        await mps.reconcile(set())
        assert not (tmp_path / "mps" / "MIG-1234").exists()
        # Multi-user mode: one daemon, started with -M.
        multi = MpsManager(tmp_path / "mps-m", NvidiaMpsDaemon(_fake_control(tmp_path)), multi_user=True)
        m = await multi.ensure("GPU-9", ALICE)
        assert (m.pipe_dir / "fake-daemon").read_text().split() == ["GPU-9", str(m.log_dir), "-M"]

    asyncio.run(main())


def test_nvidia_daemon_failures_are_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        monkeypatch.setenv("FAIL_START", "1")
        mps = MpsManager(tmp_path, NvidiaMpsDaemon(_fake_control(tmp_path)))
        with pytest.raises(MpsError, match="already running"):
            await mps.ensure("GPU-x", ALICE)
        missing = MpsManager(tmp_path, NvidiaMpsDaemon(str(tmp_path / "no-such-binary")))
        with pytest.raises(MpsError, match="cannot run"):
            await missing.ensure("GPU-y", ALICE)

    asyncio.run(main())


def _limit_commands(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if " set_" in line] if log.exists() else []


def test_prestart_makes_the_control_daemon_enforce_the_limits(
    tmp_path: Path, sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The limits reach the pod's tenant's daemon itself, before PreStartContainer answers: a client cannot raise them
    by its own env. A client's thread cap is its share against its own tenant's shares on the unit only."""
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
    u1000, root = tenant_dir(user_tenant("default", 1000)), tenant_dir(user_tenant("default", 0))

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
            a = kube.add(pod("a", assignment("a", share(0, g, Mechanism.MPS, 300, 10240)), user=1000))
            assert alloc.allocate(["ta"]).envs == {"NVIDIA_VISIBLE_DEVICES": "void"}
            assert _limit_commands(log) == []  # Allocate starts nothing: the pod is not known yet
            grant = await start_container(alloc, record, a, "c0", ["ta"])
            # Alone in its daemon: its daemon's turn on the GPU is all its own, so its threads are not held to 30 %.
            assert grant.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
            assert _limit_commands(log) == [
                f"{g} {u1000} set_default_active_thread_percentage 100",
                f"{g} {u1000} set_default_device_pinned_mem_limit 0 10240M",
            ]
            # A second share of the same tenant on the same daemon: capped against the first (50 of 80), and the
            # daemon's ceiling grows to its memory (never shrinks under a running client).
            monkeypatch.setenv("FAKE_SERVERS", "4242")
            log.unlink()
            b = kube.add(pod("b", assignment("b", share(0, g, Mechanism.MPS, 500, 20480)), user=1000))
            kube.set_phase("uid-default-a", "Running")
            assert (await start_container(alloc, record, b, "c0", ["tb"])).envs[
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
            ] == "62"
            assert _limit_commands(log) == [
                f"{g} {u1000} set_default_active_thread_percentage 100",
                f"{g} {u1000} set_default_device_pinned_mem_limit 0 20480M",
                f"{g} {u1000} set_active_thread_percentage 4242 100",
                f"{g} {u1000} set_device_pinned_mem_limit 4242 0 20480M",
            ]
            # A smaller share of the tenant later: nothing to change on the daemon; its cap is 10 of 90.
            log.unlink()
            c = kube.add(pod("c", assignment("c", share(0, g, Mechanism.MPS, 100, 1024)), user=1000))
            kube.set_phase("uid-default-b", "Running")
            assert (await start_container(alloc, record, c, "c0", ["tc"])).envs[
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
            ] == "11"
            assert _limit_commands(log) == []
            # Root's pod on the same GPU: a daemon of its own, told its own limits; uid 1000's daemon is not touched.
            d = kube.add(pod("d", assignment("d", share(0, g, Mechanism.MPS, 200, 2048)), user=0))
            kube.set_phase("uid-default-c", "Running")
            grant = await start_container(alloc, record, d, "c0", ["td"])
            assert grant.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
            assert grant.mounts[0].host_path == str(mps.spec(g, user_tenant("default", 0)).pipe_dir)
            assert _limit_commands(log) == [
                f"{g} {root} set_default_active_thread_percentage 100",
                f"{g} {root} set_default_device_pinned_mem_limit 0 2048M",
                f"{g} {root} set_active_thread_percentage 4242 100",
                f"{g} {root} set_device_pinned_mem_limit 4242 0 2048M",
            ]
            # The reconcile loop sets the exact limits once b has gone.
            key = DaemonKey(g, user_tenant("default", 1000))
            log.unlink()
            await mps.reconcile({key, DaemonKey(g, user_tenant("default", 0))}, {key: MpsLimits(75, 10240)})
            assert _limit_commands(log)[:2] == [
                f"{g} {u1000} set_default_active_thread_percentage 75",
                f"{g} {u1000} set_default_device_pinned_mem_limit 0 10240M",
            ]
            assert mps.limits(key) == MpsLimits(75, 10240)
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
            await mps.ensure("GPU-a", ALICE, MpsLimits(30, 1024))
        key = DaemonKey("GPU-a", ALICE)
        assert mps.limits(key) is None
        assert await mps.reconcile({key}, {key: MpsLimits(30, 1024)}) != []

    asyncio.run(main())


def test_sim_daemon_records_its_limits_and_limits_union() -> None:
    assert MpsLimits.of_share(305, 0) == MpsLimits(30, None)
    assert MpsLimits.of_share(5, 100) == MpsLimits(1, 100)
    assert MpsLimits(30, 100).union(MpsLimits(50, 50)) == MpsLimits(50, 100)
    assert MpsLimits(30, 100).union(MpsLimits(10, None)) == MpsLimits(30, None)
