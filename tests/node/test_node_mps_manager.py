from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import pytest

from sharegpu.node.mps import MpsError, MpsManager, NvidiaMpsDaemon, SimMpsDaemon


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


FAKE_CONTROL = """#!/bin/sh
# Plays nvidia-cuda-mps-control: -d starts (records its environment), stdin commands probe or quit.
state="$CUDA_MPS_PIPE_DIRECTORY/fake-daemon"
if [ "$1" = "-d" ]; then
  [ -n "$FAIL_START" ] && { echo "An instance of this daemon is already running"; exit 1; }
  echo "$CUDA_VISIBLE_DEVICES $CUDA_MPS_LOG_DIRECTORY" > "$state"; exit 0
fi
read cmd
[ -f "$state" ] || exit 1
case "$cmd" in
  get_server_list) exit 0 ;;
  quit) rm -f "$state"; exit 0 ;;
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
