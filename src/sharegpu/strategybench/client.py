"""One benchmark client: a separate OS process (MPS or not is decided when CUDA initialises, by the environment).

It lives for one (strategy, client count) and runs every workload in turn on the orchestrator's word, over
stdin/stdout, one JSON object a line:

- it starts with ``{"event": "up", ...}`` once CUDA is initialised (or ``{"event": "error", ...}``);
- ``{"op": "prepare", "kind", "params"}`` → allocate and warm up, then ``{"event": "ready"}``;
- ``{"op": "calibrate"}`` → seconds per batch matmul, alone: ``{"event": "calibrated", "s_per_matmul"}``;
- ``{"op": "run", "kind", "start_at"}`` → wait for the wall-clock ``start_at``, measure, ``{"event": "result", ...}``;
- ``{"op": "quit"}`` or the end of stdin → exit.

Run as ``python -m sharegpu.strategybench.client --backend cupy|fake --tag I --peers N``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from typing import Any

from sharegpu.strategybench.workloads import Device, WorkloadParams, run


def _die_with_parent() -> None:
    # A client must not outlive an orchestrator killed with SIGKILL (it may hold an MPS server or GPU memory).
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _send(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _device(backend: str, tag: int, peers: int) -> Device:
    if backend == "fake":
        from sharegpu.strategybench.fake import FakeDevice

        return FakeDevice(tag, peers)
    from sharegpu.strategybench.workloads import CupyDevice

    return CupyDevice()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sharegpu.strategybench.client")
    p.add_argument("--backend", choices=("cupy", "fake"), required=True)
    p.add_argument("--tag", type=int, required=True)
    p.add_argument("--peers", type=int, required=True)
    a = p.parse_args(argv)
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the orchestrator's to handle: it ends us in order
    t0 = time.perf_counter()
    try:
        dev = _device(a.backend, a.tag, a.peers)
    except Exception as e:  # any CUDA or import failure: the orchestrator reports it, with the environment
        _send({"event": "error", "error": f"{type(e).__name__}: {str(e)[:400]}"})
        return 1
    _send({"event": "up", "pid": os.getpid(), "init_s": round(time.perf_counter() - t0, 3)})
    params = WorkloadParams()
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg.get("op")
        try:
            if op == "quit":
                break
            if op == "prepare":
                params = WorkloadParams.from_json(msg["params"])
                dev.prepare(msg["kind"], params)
                _send({"event": "ready"})
            elif op == "calibrate":
                dev.prepare("batch", params)
                n = 200
                s = time.perf_counter()
                dev.batch_job(n)
                _send({"event": "calibrated", "s_per_matmul": (time.perf_counter() - s) / n})
            elif op == "run":
                _send({"event": "result"} | run(dev, msg["kind"], params, float(msg["start_at"])))
            else:
                _send({"event": "error", "error": f"unknown op {op!r}"})
        except Exception as e:  # a workload failed (e.g. a CUDA error): the orchestrator records it and goes on
            _send({"event": "error", "error": f"{type(e).__name__}: {str(e)[:400]}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
