"""The orchestrator: for each (strategy, client count) it starts the MPS daemon the strategy needs, launches the
clients as separate processes with the environment the node agent would give them, and runs every workload in turn
with a barrier (all clients prepared and warmed up) and a common wall-clock start, repeated; GPU busy time is
sampled through NVML during each window. Daemons and clients are always cleaned up, on Ctrl-C or an error too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any, Protocol

from sharegpu.model.contract import MPS_ENV_PREFIX
from sharegpu.model.tenant import NO_TENANT
from sharegpu.node.backends.base import GpuBackend
from sharegpu.node.mps import MpsDaemon, MpsError, MpsLimits, MpsManager, mps_client_env
from sharegpu.strategybench.results import Measurement
from sharegpu.strategybench.workloads import KINDS, WorkloadParams

START_DELAY_S = 0.25  # from the last "ready" to the common start: every client is waiting on the clock by then
UP_TIMEOUT_S = 120.0  # CUDA initialisation (an MPS client waits for the daemon's server)
FULL_MILLI = 1000


class BenchError(Exception):
    """The benchmark cannot run as asked; the message says what to do."""


@dataclass(frozen=True, slots=True)
class Unit:
    """The GPU or MIG instance the clients share."""

    uuid: str
    gpu_index: int
    name: str  # e.g. "NVIDIA H200" or "NVIDIA H200 MIG 3g.71gb"
    memory_mib: int
    mig: bool


@dataclass(frozen=True, slots=True)
class Group:
    """One (strategy, client count): its clients live for all its workloads."""

    strategy: str
    clients: int
    units: tuple[Unit, ...]  # one per client (MIG: each its own instance; else the same unit)


@dataclass(frozen=True, slots=True)
class Skipped:
    strategy: str
    clients: int
    why: str


class BusySampler(Protocol):
    def start(self) -> None: ...

    def stop(self, results: Sequence[dict[str, Any]], window_s: float) -> float | None:
        """The mean GPU busy % over the window (None: the device cannot say, e.g. a MIG instance)."""
        ...


class NvmlBusySampler:
    """NVML's GPU utilisation (the share of time a kernel ran), sampled every ``period_s`` during the window."""

    def __init__(self, gpu: GpuBackend, gpu_index: int, period_s: float = 0.1) -> None:
        self._gpu, self._index, self._period = gpu, gpu_index, period_s
        self._samples: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed = False

    def start(self) -> None:
        self._samples, self._failed = [], False
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="nvml-busy", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self._samples.append(self._gpu.utilization(self._index).gpu_percent)
            except Exception:  # MIG mode: NVML has no utilisation for the GPU or its instances (NotSupported)
                self._failed = True
                return

    def stop(self, results: Sequence[dict[str, Any]], window_s: float) -> float | None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._failed or not self._samples:
            return None
        return round(sum(self._samples) / len(self._samples), 1)


class ReportedBusySampler:
    """The fake device's busy time, as its clients report it (they model what NVML would see)."""

    def start(self) -> None:
        pass

    def stop(self, results: Sequence[dict[str, Any]], window_s: float) -> float | None:
        busy = [r.get("busy_s") for r in results]
        if window_s <= 0 or any(b is None for b in busy):
            return None
        return round(min(100.0, 100.0 * sum(float(b) for b in busy if b is not None) / window_s), 1)


@dataclass(frozen=True, slots=True)
class BenchBackend:
    """Where clients run: ``cupy`` on the real GPU, ``fake`` for tests (modelled timings, simulated MPS daemon)."""

    name: str
    gpu: GpuBackend
    daemon: MpsDaemon
    sampler: Callable[[int], BusySampler]
    extra_env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Plan:
    unit: Unit
    groups: tuple[Group, ...]
    skipped: tuple[Skipped, ...]
    notes: tuple[str, ...]


def plan(
    gpu: GpuBackend, gpu_ref: str, unit_uuid: str | None, strategies: Sequence[str], counts: Sequence[int]
) -> Plan:
    """The unit to share and the groups to run; what cannot run here is skipped with the reason."""
    devices = gpu.devices()
    dev = next((d for d in devices if str(d.index) == gpu_ref or d.uuid == gpu_ref), None)
    if dev is None:
        have = ", ".join(f"{d.index} ({d.uuid})" for d in devices) or "none"
        raise BenchError(f"no GPU {gpu_ref!r} on this machine; its GPUs: {have}. Pass --gpu INDEX or UUID")
    notes: list[str] = []
    instances = gpu.mig_instances(dev.index) if dev.mig_enabled else ()
    profiles = {p.name: p.memory_mib for p in gpu.mig_profiles(dev.index)} if dev.mig_enabled else {}
    mig_units = tuple(
        Unit(i.uuid, dev.index, f"{dev.product} MIG {i.profile}", profiles.get(i.profile, 0), True) for i in instances
    )
    if unit_uuid is not None:
        unit = next((u for u in mig_units if u.uuid == unit_uuid), None)
        if unit is None and unit_uuid != dev.uuid:
            have = ", ".join(u.uuid for u in mig_units) or "none"
            raise BenchError(f"{unit_uuid} is not GPU {dev.index} or one of its MIG instances ({have})")
        if unit is None and dev.mig_enabled:
            raise BenchError(f"GPU {dev.index} is in MIG mode: pass one of its MIG instances as --unit")
        unit = unit or Unit(dev.uuid, dev.index, dev.product, dev.memory_mib, False)
    elif dev.mig_enabled:
        if not mig_units:
            raise BenchError(
                f"GPU {dev.index} is in MIG mode and has no MIG instance to run on; create one (sharegpu bench never "
                "changes a GPU's MIG mode or layout) or pick another GPU with --gpu"
            )
        unit = mig_units[0]
        notes.append(f"GPU {dev.index} is in MIG mode: the strategies share its MIG instance {unit.name} ({unit.uuid})")
    else:
        unit = Unit(dev.uuid, dev.index, dev.product, dev.memory_mib, False)
    groups: list[Group] = []
    skipped: list[Skipped] = []
    for n in sorted(set(counts)):
        for s in strategies:
            if s == "dedicated":
                if n == 1:
                    groups.append(Group(s, 1, (unit,)))
                continue
            if n == 1:
                continue  # one client alone is the dedicated run
            if s == "mig":
                if not dev.mig_enabled:
                    skipped.append(
                        Skipped(
                            s,
                            n,
                            f"GPU {dev.index} is not in MIG mode; sharegpu bench never changes a GPU's MIG mode "
                            "(enable it and create instances yourself, e.g. with the node agent's MIG shares)",
                        )
                    )
                elif len(mig_units) < n:
                    skipped.append(
                        Skipped(s, n, f"needs {n} MIG instances on GPU {dev.index}, it has {len(mig_units)}")
                    )
                else:
                    groups.append(Group(s, n, mig_units[:n]))
                continue
            groups.append(Group(s, n, (unit,) * n))
    # dedicated first: it calibrates the batch job and is the baseline of every comparison
    groups.sort(key=lambda g: (g.strategy != "dedicated", g.clients))
    return Plan(unit, tuple(groups), tuple(skipped), tuple(notes))


@dataclass
class Client:
    tag: int
    proc: subprocess.Popen[str]
    lines: queue.Queue[str | None]
    stderr_tail: list[str]

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def receive(self, deadline: float) -> dict[str, Any]:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"client {self.tag} did not answer in time{self._tail()}")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise BenchError(f"client {self.tag} exited ({self.proc.poll()}){self._tail()}")
            with contextlib.suppress(ValueError):
                obj: dict[str, Any] = json.loads(line)
                return obj

    def _tail(self) -> str:
        tail = "".join(self.stderr_tail[-8:]).strip()
        return f": {tail}" if tail else ""


def _pump(stream: IO[str], sink: queue.Queue[str | None] | list[str]) -> None:
    for line in stream:
        if isinstance(sink, list):
            sink.append(line)
            del sink[:-50]
        else:
            sink.put(line)
    if not isinstance(sink, list):
        sink.put(None)


class Orchestrator:
    def __init__(
        self,
        backend: BenchBackend,
        mps_root: Path,
        params: WorkloadParams,
        kinds: Sequence[str],
        repeat: int,
        log: Callable[[str], None],
        batch_seconds: float,
    ) -> None:
        self.backend = backend
        self.mps = MpsManager(mps_root, backend.daemon)
        self.params = params
        self.kinds = [k for k in KINDS if k in kinds]
        self.repeat = repeat
        self.log = log
        self.batch_seconds = batch_seconds
        self.batch_matmuls = params.batch_matmuls
        self._clients: list[Client] = []

    # ----- environments ---------------------------------------------------------------------------------------
    def client_env(self, group: Group, unit: Unit, spec_pipe: str | None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(MPS_ENV_PREFIX)}
        env.pop("NVIDIA_VISIBLE_DEVICES", None)
        env["CUDA_VISIBLE_DEVICES"] = unit.uuid  # what the container runtime does with the agent's device
        env["PYTHONUNBUFFERED"] = "1"
        env |= self.backend.extra_env
        env["SHAREGPU_BENCH_FAKE_MEMORY_MIB"] = str(unit.memory_mib)
        if spec_pipe is not None:
            if group.strategy == "mps-limits":
                # Each client's share is an even split of the unit, as the agent gives n equal MPS shares.
                env |= mps_client_env(spec_pipe, FULL_MILLI // group.clients, unit.memory_mib // group.clients)
            else:
                env[MPS_ENV_PREFIX + "PIPE_DIRECTORY"] = spec_pipe
        return env

    async def _mps_for(self, group: Group) -> str | None:
        if group.strategy not in ("mps", "mps-limits"):
            return None
        unit = group.units[0]
        limits = (
            MpsLimits.of_share(FULL_MILLI // group.clients, unit.memory_mib // group.clients)
            if group.strategy == "mps-limits"
            else None
        )
        try:
            spec = await self.mps.ensure(unit.uuid, NO_TENANT, limits, grow=False)  # one user: the bench
        except MpsError as e:
            raise BenchError(
                f"cannot start the MPS daemon for {unit.uuid}: {e} (MPS needs root and nvidia-cuda-mps-control on "
                "PATH; or leave MPS out with --strategies dedicated,time-slicing)"
            ) from None
        return str(spec.pipe_dir)

    # ----- clients --------------------------------------------------------------------------------------------
    def _launch(self, group: Group, pipe: str | None) -> list[Client]:
        clients = []
        for i, unit in enumerate(group.units):
            cmd = [
                sys.executable,
                "-m",
                "sharegpu.strategybench.client",
                f"--backend={self.backend.name}",
                f"--tag={i}",
                f"--peers={group.clients}",
            ]
            proc = subprocess.Popen(
                cmd,
                env=self.client_env(group, unit, pipe),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                bufsize=1,
            )
            c = Client(i, proc, queue.Queue(), [])
            assert proc.stdout is not None and proc.stderr is not None
            threading.Thread(target=_pump, args=(proc.stdout, c.lines), daemon=True).start()
            threading.Thread(target=_pump, args=(proc.stderr, c.stderr_tail), daemon=True).start()
            clients.append(c)
            self._clients.append(c)
        return clients

    def _stop_clients(self) -> None:
        for c in self._clients:
            with contextlib.suppress(OSError, ValueError):
                c.send({"op": "quit"})
        deadline = time.monotonic() + 3.0
        for c in self._clients:
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
        self._clients.clear()

    def _all(self, clients: Sequence[Client], event: str, timeout_s: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        out = []
        for c in clients:
            msg = c.receive(deadline)
            if msg.get("event") == "error":
                msg = {"error": f"client {c.tag}: {msg.get('error')}"}
            elif msg.get("event") != event:
                msg = {"error": f"client {c.tag}: expected {event}, got {msg}"}
            out.append(msg)
        return out

    # ----- one group ------------------------------------------------------------------------------------------
    def run_group(self, group: Group) -> Iterator[Measurement]:
        pipe = asyncio.run(self._mps_for(group))
        done: set[str] = set()

        def failed(why: str) -> Iterator[Measurement]:
            # The group's remaining workloads are recorded as failed with the reason; the next group runs.
            for kind in self.kinds:
                if kind not in done:
                    yield Measurement(group.strategy, group.clients, kind, 0, ({"error": why},), None, 0)

        try:
            clients = self._launch(group, pipe)
            ups = self._all(clients, "up", UP_TIMEOUT_S)
            errors = [u["error"] for u in ups if "error" in u]
            if errors:
                yield from failed("; ".join(errors))
                return
            if "batch" in self.kinds and self.batch_matmuls <= 0:
                self._calibrate(clients[0])
            sampler = self.backend.sampler(group.units[0].gpu_index)
            for kind in self.kinds:
                params = replace(self.params, batch_matmuls=self.batch_matmuls, probe_cap_mib=group.units[0].memory_mib)
                for c in clients:
                    c.send({"op": "prepare", "kind": kind, "params": params.to_json()})
                ready = self._all(clients, "ready", 120.0)
                done.add(kind)
                if any("error" in r for r in ready):
                    yield Measurement(group.strategy, group.clients, kind, 0, tuple(ready), None, 0)
                    continue
                for rep in range(self.repeat):
                    yield self._window(group, clients, kind, rep, params, sampler)
        except BenchError as e:
            yield from failed(str(e))
        finally:
            self._stop_clients()
            if pipe is not None:
                asyncio.run(self._stop_mps())

    def _calibrate(self, client: Client) -> None:
        client.send({"op": "calibrate"})
        msg = self._all([client], "calibrated", 120.0)[0]
        if "error" in msg:
            raise BenchError(f"calibrating the batch job failed: {msg['error']}")
        self.batch_matmuls = max(10, round(self.batch_seconds / float(msg["s_per_matmul"])))
        self.log(f"batch job: {self.batch_matmuls} matmuls (≈ {self.batch_seconds:g} s alone)")

    def _window(
        self, group: Group, clients: Sequence[Client], kind: str, rep: int, params: WorkloadParams, sampler: BusySampler
    ) -> Measurement:
        start_at = time.time() + START_DELAY_S
        for c in clients:
            c.send({"op": "run", "kind": kind, "start_at": start_at})
        wait_until_wall(start_at)
        sampler.start()
        limit = (
            params.seconds + params.hold_s + 60.0 + (self.batch_seconds * group.clients * 10 if kind == "batch" else 0)
        )
        results: list[dict[str, Any]] = []
        try:
            results = self._all(clients, "result", START_DELAY_S + limit)
        finally:
            window = time.time() - start_at
            busy = sampler.stop(results, window)
        for r in results:
            r.pop("event", None)
        return Measurement(group.strategy, group.clients, kind, rep, tuple(results), busy, round(window, 3))

    async def _stop_mps(self) -> None:
        errors = await self.mps.reconcile([])
        for e in errors:
            self.log(f"warning: stopping the MPS daemon: {e}")

    def close(self) -> None:
        """Kill what is left (clients, MPS daemons): the Ctrl-C and error path."""
        self._stop_clients()
        with contextlib.suppress(Exception):
            asyncio.run(self._stop_mps())


def wait_until_wall(t: float) -> None:
    left = t - time.time()
    if left > 0:
        time.sleep(left)


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (a Job's deletion, ``kill``) cleans up like Ctrl-C."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
