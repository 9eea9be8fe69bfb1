"""The benchmark's workloads, defined once: what each client process does in a measured window.

Each workload is a timing loop over a few device primitives (:class:`Device`). :class:`CupyDevice` runs them as
CUDA kernels (cuBLAS fp16 matmuls); the fake device of :mod:`sharegpu.strategybench.fake` runs the same loops with
modelled durations, so the orchestration is tested without a GPU.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Protocol

# light: a 4-layer MLP block of a d512 transformer (d → 4d → d), batch 256 tokens: one "request".
LIGHT_TOKENS, LIGHT_DIM, LIGHT_LAYERS = 256, 512, 4
HEAVY_N = 8192  # heavy: one fp16 N³ matmul per iteration, back to back
BATCH_N = 4096  # batch: a job is a fixed number of fp16 N³ matmuls
PROBE_CHUNK_MIB = 1024  # memory: allocated in chunks of this size until refused
KINDS = ("light", "heavy", "batch", "memory")


def matmul_flops(n: int) -> float:
    return 2.0 * n**3


@dataclass(frozen=True, slots=True)
class WorkloadParams:
    seconds: float = 3.0  # the measured window of light and heavy
    rate: float = 200.0  # light: requests per second per client (open loop)
    batch_matmuls: int = 0  # batch: matmuls per job (calibrated by the orchestrator)
    probe_cap_mib: int = 0  # memory: stop probing here (the unit's memory)
    hold_s: float = 1.0  # memory: keep what was got this long after the start, so clients probe side by side

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> WorkloadParams:
        return WorkloadParams(**d)


class Device(Protocol):
    """What a workload needs from the GPU; every call returns once its work is done (synchronised)."""

    def prepare(self, kind: str, params: WorkloadParams) -> None:
        """Allocate the workload's operands and warm it up (compiles, cuBLAS heuristics): not measured."""
        ...

    def light_request(self) -> None: ...

    def heavy_iteration(self) -> None: ...

    def batch_job(self, matmuls: int) -> None: ...

    def allocate_chunk(self, mib: int) -> bool:
        """Hold ``mib`` more MiB of device memory; False when the device (or the MPS limit) refuses."""
        ...

    def release(self) -> None:
        """Free everything :meth:`allocate_chunk` holds."""
        ...

    def busy_s(self) -> float | None:
        """Device time this client used since the last call, where the device can tell (the fake); else None."""
        ...


def wait_until(t: float) -> None:
    while True:
        left = t - time.time()
        if left <= 0:
            return
        time.sleep(min(left, 0.05) if left > 0.002 else 0)


def _percentile(sorted_ms: list[float], q: float) -> float:
    if not sorted_ms:
        return 0.0
    return sorted_ms[min(len(sorted_ms) - 1, int(len(sorted_ms) * q))]


def run(dev: Device, kind: str, params: WorkloadParams, start_at: float) -> dict[str, Any]:
    """Run ``kind`` from the wall-clock time ``start_at`` (every client gets the same): its measurement."""
    late = max(0.0, time.time() - start_at)
    wait_until(start_at)
    dev.busy_s()  # reset the fake's account: only the window counts
    # late_s: how long after the common start this client began (its warm-up overran, or it was not scheduled)
    out: dict[str, Any] = {"kind": kind, "start_at": start_at, "late_s": round(late, 3)}
    if kind == "light":
        out |= _light(dev, params)
    elif kind == "heavy":
        out |= _heavy(dev, params)
    elif kind == "batch":
        t0 = time.perf_counter()
        dev.batch_job(params.batch_matmuls)
        out["elapsed_s"] = round(time.perf_counter() - t0, 4)
    elif kind == "memory":
        out |= _memory(dev, params, start_at)
    else:
        raise ValueError(f"unknown workload {kind!r}; one of {', '.join(KINDS)}")
    out["busy_s"] = dev.busy_s()
    return out


def _light(dev: Device, params: WorkloadParams) -> dict[str, Any]:
    period = 1.0 / params.rate
    lat: list[float] = []
    t0 = time.perf_counter()
    end = t0 + params.seconds
    due = t0
    while True:
        now = time.perf_counter()
        if now >= end:
            break
        if now < due:
            time.sleep(due - now)
        s = time.perf_counter()
        dev.light_request()
        lat.append((time.perf_counter() - s) * 1e3)
        due += period
        if due < time.perf_counter() - 0.5:  # fell far behind: an open loop does not fire a burst to catch up
            due = time.perf_counter()
    lat.sort()
    return {
        "requests": len(lat),
        "throughput": round(len(lat) / params.seconds, 2),  # requests/s
        "latencies_ms": [round(x, 4) for x in lat],
    }


def _heavy(dev: Device, params: WorkloadParams) -> dict[str, Any]:
    it: list[float] = []
    t0 = time.perf_counter()
    end = t0 + params.seconds
    while time.perf_counter() < end:
        s = time.perf_counter()
        dev.heavy_iteration()
        it.append((time.perf_counter() - s) * 1e3)
    wall = time.perf_counter() - t0
    it.sort()
    return {
        "iterations": len(it),
        "throughput": round(len(it) * matmul_flops(HEAVY_N) / wall / 1e12, 2),  # TFLOP/s
        "latencies_ms": [round(x, 4) for x in it],
    }


def _memory(dev: Device, params: WorkloadParams, start_at: float) -> dict[str, Any]:
    got = 0
    refused = False
    try:
        while params.probe_cap_mib <= 0 or got + PROBE_CHUNK_MIB <= params.probe_cap_mib:
            if not dev.allocate_chunk(PROBE_CHUNK_MIB):
                refused = True
                break
            got += PROBE_CHUNK_MIB
        wait_until(start_at + params.hold_s)
    finally:
        dev.release()
    return {"memory_mib": got, "refused": refused}


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """A client's result with its percentiles (what it prints in its log line, without the raw latencies)."""
    out = {k: v for k, v in result.items() if k != "latencies_ms"}
    lat = result.get("latencies_ms")
    if lat:
        out["p50_ms"], out["p99_ms"] = _percentile(lat, 0.5), _percentile(lat, 0.99)
    return out


class CupyDevice:
    """The workloads on a CUDA device through CuPy: cuBLAS fp16 matmuls and elementwise kernels."""

    def __init__(self) -> None:
        import cupy  # the bench extra; imported only in a client process that runs on a GPU

        self._cp: Any = cupy
        self._stream: Any = cupy.cuda.Stream(non_blocking=True)
        self._stream.use()
        self._ops: dict[str, Any] = {}
        self._held: list[Any] = []
        cupy.cuda.Device(0).synchronize()  # CUDA initialised here, not in the first window

    def _sync(self) -> None:
        self._stream.synchronize()

    def prepare(self, kind: str, params: WorkloadParams) -> None:
        cp = self._cp
        self._ops.clear()
        self._cp.get_default_memory_pool().free_all_blocks()
        if kind == "light":
            w = [
                (
                    cp.random.standard_normal((LIGHT_DIM, 4 * LIGHT_DIM), dtype=cp.float32).astype(cp.float16) * 0.02,
                    cp.random.standard_normal((4 * LIGHT_DIM, LIGHT_DIM), dtype=cp.float32).astype(cp.float16) * 0.02,
                )
                for _ in range(LIGHT_LAYERS)
            ]
            self._ops = {"w": w, "x": cp.ones((LIGHT_TOKENS, LIGHT_DIM), dtype=cp.float16)}
            for _ in range(20):
                self.light_request()
        elif kind in ("heavy", "batch"):
            n = HEAVY_N if kind == "heavy" else BATCH_N
            a = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
            self._ops = {"a": a, "b": a.copy(), "c": cp.empty_like(a)}
            for _ in range(3):
                cp.matmul(a, self._ops["b"], out=self._ops["c"])
        self._sync()

    def light_request(self) -> None:
        cp = self._cp
        h = self._ops["x"]
        for w1, w2 in self._ops["w"]:
            h = h + cp.matmul(cp.maximum(cp.matmul(h, w1), 0), w2)  # a residual MLP block
        self._sync()

    def heavy_iteration(self) -> None:
        self._cp.matmul(self._ops["a"], self._ops["b"], out=self._ops["c"])
        self._sync()

    def batch_job(self, matmuls: int) -> None:
        a, b, c = self._ops["a"], self._ops["b"], self._ops["c"]
        for _ in range(matmuls):
            self._cp.matmul(a, b, out=c)
        self._sync()

    def allocate_chunk(self, mib: int) -> bool:
        cp = self._cp
        try:
            # Straight from the driver (cudaMalloc), past CuPy's pool: what the device or the MPS limit allows.
            self._held.append(cp.cuda.memory.Memory(mib << 20))
        except (cp.cuda.memory.OutOfMemoryError, cp.cuda.runtime.CUDARuntimeError):
            return False
        return True

    def release(self) -> None:
        self._held.clear()
        self._sync()

    def busy_s(self) -> float | None:
        return None
