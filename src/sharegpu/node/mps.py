"""The MPS manager: one MPS control daemon per GPU or MIG instance that hosts MPS shares.

Each daemon has its own pipe and log directories under ``<root>/<unit UUID>/`` so that a client selects its
daemon with ``CUDA_MPS_PIPE_DIRECTORY`` alone. Daemons are started when an assignment first needs them,
health-checked on every reconcile, restarted after a failure and stopped when no assignment uses their unit.

Limits are set on the daemon, not only in the client's environment: right after a daemon starts, and whenever
the shares on its unit change, the manager sends it ``set_default_active_thread_percentage`` and
``set_default_device_pinned_mem_limit`` (and the per-server forms for servers already running) with the largest
share on the unit. A client's own ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` can lower its share below that, never raise it.
The daemon itself sits behind :class:`MpsDaemon`: :class:`NvidiaMpsDaemon` drives ``nvidia-cuda-mps-control``
on a real node; :class:`SimMpsDaemon` stands in for it with the simulated backend.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from sharegpu.model.contract import MPS_MEMORY_LIMIT_ENV, MPS_PIPE_DIRECTORY_ENV, MPS_THREAD_PERCENTAGE_ENV
from sharegpu.node.errors import NodeError

if TYPE_CHECKING:
    from sharegpu.node.backends.sim import SimBackend

log = logging.getLogger(__name__)

MPS_CONTROL = "nvidia-cuda-mps-control"
_COMMAND_TIMEOUT_S = 10.0


class MpsError(NodeError):
    """An MPS daemon cannot be started or stopped; the message carries what the daemon said."""


@dataclass(frozen=True, slots=True)
class MpsDaemonSpec:
    unit_uuid: str  # GPU-… or MIG-…: the one device the daemon serves
    pipe_dir: Path
    log_dir: Path


@dataclass(frozen=True, slots=True, order=True)
class MpsLimits:
    """The ceiling a daemon puts on each of its clients: the largest share on its unit."""

    thread_percentage: int  # 1..100
    pinned_mem_mib: int | None  # None: no memory limit (some share on the unit has none)

    @staticmethod
    def of_share(compute_milli: int, memory_mib: int) -> MpsLimits:
        # Rounded down, as in the client's environment: a client may use less than promised, never more.
        return MpsLimits(min(100, max(1, compute_milli // 10)), memory_mib if memory_mib > 0 else None)

    def union(self, other: MpsLimits | None) -> MpsLimits:
        """The limits that hold both: the larger thread percentage, and the larger memory limit (None wins)."""
        if other is None:
            return self
        mem = (
            None
            if self.pinned_mem_mib is None or other.pinned_mem_mib is None
            else max(self.pinned_mem_mib, other.pinned_mem_mib)
        )
        return MpsLimits(max(self.thread_percentage, other.thread_percentage), mem)


def mps_client_env(pipe_dir: str, compute_milli: int, memory_mib: int) -> dict[str, str]:
    """The MPS settings a client of a share of ``compute_milli`` and ``memory_mib`` (0: no memory limit) runs with:
    its daemon's pipe and its own limits, which can only lower what the daemon enforces (Allocate and
    ``sharegpu bench`` give a client exactly this)."""
    # Rounded down, as in MpsLimits.of_share: a client may use less than promised, never more.
    env = {MPS_PIPE_DIRECTORY_ENV: pipe_dir, MPS_THREAD_PERCENTAGE_ENV: str(max(1, compute_milli // 10))}
    if memory_mib > 0:
        env[MPS_MEMORY_LIMIT_ENV] = f"0={memory_mib}M"  # device 0: the client sees only its unit
    return env


class MpsDaemon(Protocol):
    async def start(self, spec: MpsDaemonSpec) -> None: ...

    async def healthy(self, spec: MpsDaemonSpec) -> bool: ...

    async def stop(self, spec: MpsDaemonSpec) -> None: ...

    async def set_limits(self, spec: MpsDaemonSpec, limits: MpsLimits) -> None:
        """Make ``limits`` the daemon's defaults and apply them to the servers it already runs."""
        ...


@dataclass(frozen=True, slots=True)
class MpsDaemonStatus:
    unit_uuid: str
    up: bool
    restarts: int


class MpsManager:
    def __init__(self, root: Path, daemon: MpsDaemon) -> None:
        self.root = root
        self._daemon = daemon
        self._running: set[str] = set()
        self._restarts: dict[str, int] = {}
        self._limits: dict[str, MpsLimits] = {}  # what each running daemon was last told
        self._lock = asyncio.Lock()  # Allocate and the reconcile loop must not start one daemon twice

    def spec(self, unit_uuid: str) -> MpsDaemonSpec:
        if not unit_uuid or "/" in unit_uuid or unit_uuid.startswith("."):
            raise MpsError(f"{unit_uuid!r} is not a GPU or MIG UUID")
        base = self.root / unit_uuid
        return MpsDaemonSpec(unit_uuid, base / "pipe", base / "log")

    async def recover(self) -> set[str]:
        """After a restart: adopt the daemons that still answer, so their clients are not disturbed."""
        found: set[str] = set()
        if not self.root.is_dir():
            return found
        async with self._lock:
            for entry in sorted(self.root.iterdir()):
                if entry.is_dir() and await self._daemon.healthy(self.spec(entry.name)):
                    self._running.add(entry.name)
                    found.add(entry.name)
        if found:
            log.info("adopted running MPS daemons for %s", ", ".join(sorted(found)))
        return found

    def limits(self, unit_uuid: str) -> MpsLimits | None:
        """The limits the daemon for ``unit_uuid`` enforces now (None: none set, or no daemon)."""
        return self._limits.get(unit_uuid)

    async def ensure(self, unit_uuid: str, limits: MpsLimits | None = None, *, grow: bool = True) -> MpsDaemonSpec:
        """A healthy daemon for ``unit_uuid``, started if needed (what Allocate calls before it answers).

        With ``limits`` the daemon is made to enforce them before this returns; ``grow`` (Allocate) only ever
        widens what the daemon already enforces, so the clients already admitted keep their room, while the
        reconcile loop passes the exact limits of the unit's shares. Raises :class:`MpsError` when the daemon
        cannot be started or refuses its limits: a client must never be told to use a daemon that does not
        hold it to its share.
        """
        spec = self.spec(unit_uuid)
        async with self._lock:
            if unit_uuid in self._running and not await self._daemon.healthy(spec):
                self._restarts[unit_uuid] = self._restarts.get(unit_uuid, 0) + 1
                log.warning("MPS daemon for %s failed its health check; restarting it", unit_uuid)
                await self._stop_quietly(spec)
            if unit_uuid not in self._running:
                self._limits.pop(unit_uuid, None)  # a new daemon starts with the driver's defaults
                await self._start(spec)
            if limits is not None:
                current = self._limits.get(unit_uuid)
                wanted = limits.union(current) if grow else limits
                if wanted != current:
                    self._limits.pop(unit_uuid, None)  # unknown until the daemon has taken them
                    try:
                        await self._daemon.set_limits(spec, wanted)
                    except MpsError as e:
                        raise MpsError(f"the MPS daemon for {unit_uuid} refused its limits: {e}") from None
                    self._limits[unit_uuid] = wanted
                    log.info(
                        "MPS daemon for %s: clients limited to %d%% of threads, %s pinned memory",
                        unit_uuid,
                        wanted.thread_percentage,
                        f"{wanted.pinned_mem_mib} MiB" if wanted.pinned_mem_mib is not None else "unlimited",
                    )
        return spec

    async def reconcile(
        self, needed: Iterable[str], limits: Mapping[str, MpsLimits] | None = None, keep: Iterable[str] = ()
    ) -> list[str]:
        """Start or restart daemons for ``needed`` units and stop the others; returns the errors met.

        ``limits`` are the exact limits per unit (the largest share on it); ``keep`` names units that must not be
        stopped although ``needed`` lacks them (Allocate just handed them out).
        """
        needed = set(needed)
        limits = limits or {}
        errors: list[str] = []
        for unit in sorted(needed):
            try:
                await self.ensure(unit, limits.get(unit), grow=False)
            except MpsError as e:
                errors.append(str(e))
        needed |= set(keep)
        async with self._lock:
            on_disk = {e.name for e in self.root.iterdir() if e.is_dir()} if self.root.is_dir() else set()
            for unit in sorted((self._running | on_disk) - needed):
                spec = self.spec(unit)
                try:
                    if unit in self._running or await self._daemon.healthy(spec):
                        await self._daemon.stop(spec)
                        log.info("stopped MPS daemon for %s: no assignment uses it", unit)
                    shutil.rmtree(self.root / unit, ignore_errors=True)
                except MpsError as e:
                    errors.append(str(e))
                    continue
                self._running.discard(unit)
                self._limits.pop(unit, None)
        for message in errors:
            log.warning("MPS reconcile: %s", message)
        return errors

    def running_units(self) -> frozenset[str]:
        """The units whose daemon this manager started or adopted and has not stopped."""
        return frozenset(self._running)

    def status(self) -> tuple[MpsDaemonStatus, ...]:
        units = self._running | set(self._restarts)
        return tuple(MpsDaemonStatus(u, u in self._running, self._restarts.get(u, 0)) for u in sorted(units))

    async def _start(self, spec: MpsDaemonSpec) -> None:
        try:
            spec.pipe_dir.mkdir(parents=True, exist_ok=True)
            spec.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise MpsError(f"cannot create the MPS directories under {self.root}: {e.strerror or e}") from None
        await self._daemon.start(spec)
        if not await self._daemon.healthy(spec):
            self._running.discard(spec.unit_uuid)
            raise MpsError(f"the MPS daemon for {spec.unit_uuid} started but does not answer; see {spec.log_dir}")
        self._running.add(spec.unit_uuid)
        log.info("started MPS daemon for %s (pipe %s)", spec.unit_uuid, spec.pipe_dir)

    async def _stop_quietly(self, spec: MpsDaemonSpec) -> None:
        try:
            await self._daemon.stop(spec)
        except MpsError as e:
            log.warning("stopping the failed MPS daemon for %s: %s", spec.unit_uuid, e)
        self._running.discard(spec.unit_uuid)
        self._limits.pop(spec.unit_uuid, None)


class NvidiaMpsDaemon:
    """``nvidia-cuda-mps-control`` on a real node: ``-d`` starts it, ``get_server_list`` probes it, ``quit`` stops it."""

    def __init__(self, control: str = MPS_CONTROL, timeout_s: float = _COMMAND_TIMEOUT_S) -> None:
        self._control = control
        self._timeout_s = timeout_s

    async def start(self, spec: MpsDaemonSpec) -> None:
        code, out = await self._run(spec, ["-d"], None)
        if code != 0:
            raise MpsError(f"{self._control} -d for {spec.unit_uuid} exited with {code}: {out.strip() or 'no output'}")

    async def healthy(self, spec: MpsDaemonSpec) -> bool:
        if not spec.pipe_dir.is_dir():
            return False
        try:
            code, _ = await self._run(spec, [], "get_server_list\n")
        except MpsError:
            return False
        return code == 0

    async def stop(self, spec: MpsDaemonSpec) -> None:
        code, out = await self._run(spec, [], "quit\n")
        if code != 0:
            raise MpsError(f"quitting the MPS daemon for {spec.unit_uuid} failed ({code}): {out.strip()}")

    async def set_limits(self, spec: MpsDaemonSpec, limits: MpsLimits) -> None:
        # The defaults hold every server the daemon starts from now on; servers already running (they start with
        # their first client) take the per-server commands, which hold their clients connecting from now on.
        # Device 0 is the unit itself: the daemon runs with CUDA_VISIBLE_DEVICES=<unit UUID>.
        commands = [f"set_default_active_thread_percentage {limits.thread_percentage}"]
        if limits.pinned_mem_mib is not None:
            commands.append(f"set_default_device_pinned_mem_limit 0 {limits.pinned_mem_mib}M")
        code, out = await self._run(spec, [], "get_server_list\n")
        if code != 0:
            raise MpsError(f"get_server_list failed ({code}): {out.strip() or 'no output'}")
        for pid in (line.strip() for line in out.splitlines()):
            if pid.isdigit():
                commands.append(f"set_active_thread_percentage {pid} {limits.thread_percentage}")
                if limits.pinned_mem_mib is not None:
                    commands.append(f"set_device_pinned_mem_limit {pid} 0 {limits.pinned_mem_mib}M")
        for command in commands:
            code, out = await self._run(spec, [], command + "\n")
            if code != 0:
                raise MpsError(f"{command!r} failed ({code}): {out.strip() or 'no output'}")

    async def _run(self, spec: MpsDaemonSpec, args: list[str], stdin: str | None) -> tuple[int, str]:
        env = dict(os.environ)
        # The daemon sees only its unit, so a client's device 0 (and its pinned memory limit "0=…") is that unit.
        env["CUDA_VISIBLE_DEVICES"] = spec.unit_uuid
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(spec.pipe_dir)
        env["CUDA_MPS_LOG_DIRECTORY"] = str(spec.log_dir)
        try:
            proc = await asyncio.create_subprocess_exec(
                self._control,
                *args,
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
            )
        except OSError as e:
            raise MpsError(f"cannot run {self._control}: {e.strerror or e}; is the NVIDIA driver installed?") from None
        try:
            out, _ = await asyncio.wait_for(
                proc.communicate(stdin.encode() if stdin is not None else None), self._timeout_s
            )
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise MpsError(f"{self._control} did not answer within {self._timeout_s:g}s") from None
        return proc.returncode if proc.returncode is not None else -1, out.decode(errors="replace")


class SimMpsDaemon:
    """A stand-in daemon for the simulated backend: its "process" is a file in the pipe directory.

    Being on disk, it outlives an agent restart exactly like a real daemon; deleting the file is a crash.
    Given the simulated backend, a daemon that quits (or crashes) ends its unit's MPS server there, and its clients.
    """

    MARKER = "sim-mps-daemon.json"

    def __init__(self, backend: SimBackend | None = None) -> None:
        self.starts = 0
        self._backend = backend

    async def start(self, spec: MpsDaemonSpec) -> None:
        spec.pipe_dir.mkdir(parents=True, exist_ok=True)
        (spec.pipe_dir / self.MARKER).write_text(json.dumps({"unit": spec.unit_uuid}))
        self.starts += 1

    async def healthy(self, spec: MpsDaemonSpec) -> bool:
        return (spec.pipe_dir / self.MARKER).is_file()

    async def stop(self, spec: MpsDaemonSpec) -> None:
        (spec.pipe_dir / self.MARKER).unlink(missing_ok=True)
        if self._backend is not None:
            self._backend.stop_mps_server(spec.unit_uuid)

    async def set_limits(self, spec: MpsDaemonSpec, limits: MpsLimits) -> None:
        marker = spec.pipe_dir / self.MARKER
        if not marker.is_file():
            raise MpsError(f"the simulated MPS daemon for {spec.unit_uuid} is not running")
        data = json.loads(marker.read_text())
        data["threadPercentage"], data["pinnedMemMiB"] = limits.thread_percentage, limits.pinned_mem_mib
        marker.write_text(json.dumps(data))

    def limits(self, spec: MpsDaemonSpec) -> MpsLimits | None:
        """What the simulated daemon was told (for tests and the simulated node's users)."""
        try:
            data = json.loads((spec.pipe_dir / self.MARKER).read_text())
        except (OSError, ValueError):
            return None
        if "threadPercentage" not in data:
            return None
        return MpsLimits(int(data["threadPercentage"]), data["pinnedMemMiB"])

    def crash(self, spec: MpsDaemonSpec) -> None:
        (spec.pipe_dir / self.MARKER).unlink(missing_ok=True)
        if self._backend is not None:
            self._backend.stop_mps_server(spec.unit_uuid)
