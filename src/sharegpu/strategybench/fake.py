"""A fake GPU for testing the orchestration without one: the workloads' loops run with modelled durations.

The model (documented so that tests can predict it): alone, a light request takes ``LIGHT_MS``, a heavy iteration
``HEAVY_MS`` and a batch matmul ``BATCH_MS``. With ``peers`` clients on the unit, a client's compute runs ``peers``
times slower under MPS and ``peers × (1 + overhead)`` times slower under time-slicing (the context switches), ``1 + LIMITS_OVERHEAD`` more with a
thread limit, and no faster than that limit allows; a light request waits ``overhead`` longer under time-slicing. GPU busy
time is the kernel time under MPS and the whole time slice under time-slicing. Memory: a client with an MPS memory
limit gets its limit; without one the first client takes three quarters of the unit and the others share the rest.
The client learns its strategy from the environment exactly as CUDA does (``CUDA_MPS_PIPE_DIRECTORY``: MPS, which
needs the daemon's marker from :class:`~sharegpu.node.mps.SimMpsDaemon`), so a missing daemon or a wrong
environment shows.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from sharegpu.model.contract import MPS_MEMORY_LIMIT_ENV, MPS_PIPE_DIRECTORY_ENV, MPS_THREAD_PERCENTAGE_ENV
from sharegpu.node.mps import SimMpsDaemon
from sharegpu.strategybench.workloads import WorkloadParams

LIGHT_MS, HEAVY_MS, BATCH_MS = 1.5, 2.0, 0.2
LIMITS_OVERHEAD = 0.05  # MPS with a thread limit: this much slower than without (as the H200 measured)
LIGHT_KERNEL_SHARE = 0.05  # of a light request's time, the part the GPU is busy
MEMORY_ENV = "SHAREGPU_BENCH_FAKE_MEMORY_MIB"  # the fake unit's memory, set by the orchestrator
OVERHEAD_ENV = "SHAREGPU_BENCH_FAKE_TS_OVERHEAD"


class FakeDeviceError(RuntimeError):
    pass


class FakeDevice:
    def __init__(self, tag: int, peers: int) -> None:
        self.tag, self.peers = tag, peers
        self.overhead = float(os.environ.get(OVERHEAD_ENV, "0.1"))
        self.memory_mib = int(os.environ.get(MEMORY_ENV, "81920"))
        pipe = os.environ.get(MPS_PIPE_DIRECTORY_ENV)
        self.mps = pipe is not None
        if pipe is not None and not (Path(pipe) / SimMpsDaemon.MARKER).is_file():
            raise FakeDeviceError(f"no MPS daemon answers at {pipe}: CUDA would hang or fail here")
        self.threads = int(os.environ.get(MPS_THREAD_PERCENTAGE_ENV, "100"))
        limit = os.environ.get(MPS_MEMORY_LIMIT_ENV)
        self.mem_limit = int(limit.split("=", 1)[1].rstrip("M")) if limit else None
        self._busy = 0.0
        self._held = 0

    def _slowdown(self) -> float:
        share = 1.0 if self.peers == 1 else self.peers * (1.0 if self.mps else 1.0 + self.overhead)
        if self.threads < 100:
            # held to its thread share, a client cannot use the SMs a neighbour leaves idle between kernels
            share *= 1.0 + LIMITS_OVERHEAD
        return max(share, 100.0 / self.threads)

    def _compute(self, alone_ms: float) -> None:
        t = alone_ms * self._slowdown() / 1e3
        # GPU busy: under MPS the client's own kernels (alone_ms); time-sliced, its whole slice.
        self._busy += alone_ms / 1e3 if self.mps or self.peers == 1 else t
        time.sleep(t)

    def prepare(self, kind: str, params: WorkloadParams) -> None:
        time.sleep(0.01)

    def light_request(self) -> None:
        extra = self.overhead if not self.mps and self.peers > 1 else 0.0
        t = LIGHT_MS * (1.0 + extra) / 1e3
        self._busy += t if extra else t * LIGHT_KERNEL_SHARE
        time.sleep(t)

    def heavy_iteration(self) -> None:
        self._compute(HEAVY_MS)

    def batch_job(self, matmuls: int) -> None:
        self._compute(BATCH_MS * matmuls)

    def allocate_chunk(self, mib: int) -> bool:
        if self.mem_limit is not None:
            room = self.mem_limit
        elif self.peers == 1:
            room = self.memory_mib
        else:
            first = self.memory_mib * 3 // 4
            room = first if self.tag == 0 else (self.memory_mib - first) // (self.peers - 1)
        if self._held + mib > room:
            return False
        self._held += mib
        return True

    def release(self) -> None:
        self._held = 0

    def busy_s(self) -> float | None:
        b, self._busy = self._busy, 0.0
        return b
