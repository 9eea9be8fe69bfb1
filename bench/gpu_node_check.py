"""A GPU check anyone can run: sharegpu's node code against a real NVIDIA GPU, no Kubernetes needed (a few minutes).

Run as root on a machine with an NVIDIA driver, ``nvidia-cuda-mps-control`` on PATH and CuPy (``pip install
'sharegpu[bench]'``) or PyTorch for the test clients. The clients also run as other UIDs (1000, and 1001-1016 for the
sweep), so the Python that runs the check must be one every user can run (not one under a directory only root can
enter)::

    python bench/gpu_node_check.py --out gpucheck        # prints what held; gpucheck/gpu_node_check.json has it all
    python bench/gpu_node_check.py --only-sweep          # stage 1 and the daemon sweep alone

What it exercises, each with the node code the agent runs (``NvmlBackend``, ``MpsManager`` + ``NvidiaMpsDaemon``
with a daemon per (unit, tenant), the placement core, the enforcement audit):

1. NVML backend: devices, MIG profiles, processes, device nodes, utilisation.
2. MPS limits set by the manager hold real CUDA clients (memory refused past the limit; compute capped).
3. Tenants: one MPS server serves one Unix user at a time (a client of another UID on the same daemon waits); two
   tenants' daemons on one GPU serve their users at once; the placement core puts MPS shares of two tenants on one
   unit, a daemon each, and refuses the second tenant where the daemon cap is 1.
4. Pods without hostIPC: a daemon and a client in their own IPC, mount and PID namespaces.
5. Per-pod usage under MPS: what NVML reports per client, and what the agent makes of it.
6. The enforcement audit: a client that bypassed MPS (no pipe directory) is found.
7. Faults under MPS: a client's illegal-address fault, its neighbour on the same server, and another tenant's client
   on another daemon of the same GPU; which daemon's log tells it; the faulting daemon serves the next client.
8. Multi-user mode (``-M``, ``MpsManager(multi_user=True)``): clients of two UIDs at once on one daemon, both held
   to the daemon's limits.
9. The daemon sweep: k daemons on one GPU (k = 1, 2, 4, 8, 16; tenants of different UIDs, one client each) against
   one daemon with k clients of one UID and against k time-sliced clients: CUDA init of each client, the GPU memory
   each MPS server takes, aggregate throughput; from it a daemon cap per GPU (the ledger's daemons_per_unit) and the
   memory to count per daemon (its daemon_memory_mib).

It never changes a GPU's MIG mode and never resets a GPU. It uses GPU 0 (``--gpu`` to change). Exit code 0 when every
check held, 1 when one did not, 2 when the machine cannot run it (not root, no driver or GPU, no CuPy/PyTorch).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLIENT = r"""
import json, os, sys, time
mode, args = sys.argv[1], json.loads(sys.argv[2])
out = {"mode": mode, "pid": os.getpid(), "uid": os.getuid(), "pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY")}
t0 = time.time()
def start_together():
    # With a barrier the check tells every client when to start once all of them are ready (their CUDA init done).
    b = args.get("barrier")
    if b:
        open(os.path.join(b, "ready-%d" % os.getpid()), "w").close()
        go, deadline = os.path.join(b, "go"), time.time() + args.get("go_timeout_s", 300)
        while not os.path.exists(go):
            if time.time() > deadline:
                raise TimeoutError("the check never said go")
            time.sleep(0.005)
        start_at = float(open(go).read())
    else:
        start_at = args.get("start_at", 0)
    out["late_s"] = round(max(0.0, time.time() - start_at), 3)
    while time.time() < start_at: time.sleep(0.002)
try:
    try:
        import cupy as xp
        def sync(): xp.cuda.runtime.deviceSynchronize()
        def empty(n): return xp.empty(n, dtype=xp.uint8)
        def mat(): return xp.ones((4096, 4096), dtype=xp.float16)
        out["lib"] = "cupy"
    except ImportError:
        import torch
        xp = None
        def sync(): torch.cuda.synchronize()
        def empty(n): return torch.empty(n, dtype=torch.uint8, device="cuda")
        def mat(): return torch.ones((4096, 4096), dtype=torch.float16, device="cuda")
        out["lib"] = "torch"
    t1 = time.time()
    out["import_s"] = round(t1 - t0, 2)
    sync()  # CUDA init: the context, under MPS the connection to the daemon (and its server's start)
    out["cuda_s"] = round(time.time() - t1, 3)
    out["init_s"] = round(time.time() - t0, 2)
    if mode == "alloc":
        held, res = [], []
        for g in args["gib"]:
            try:
                held.append(empty(int(g * (1 << 30)))); sync(); res.append("ok")
            except Exception as e:
                res.append("refused: " + str(e).splitlines()[0][:100])
        out["alloc"] = res
        time.sleep(args.get("hold_s", 0))
    elif mode == "rate":
        m = mat()
        for _ in range(3): m @ m
        sync()
        start_together()
        n, end = 0, time.time() + args["seconds"]
        try:
            while time.time() < end:
                for _ in range(4): m @ m
                sync(); n += 4
        except Exception as e:
            out["died"] = f"{type(e).__name__}: {str(e)[:120]}"; out["died_after_s"] = round(time.time() - (end - args["seconds"]), 2)
        out["tflops"] = round(n * 2 * 4096 ** 3 / args["seconds"] / 1e12, 1)
    elif mode == "fault":
        import cupy
        k = cupy.RawKernel(r'extern "C" __global__ void k(int* p){ p[threadIdx.x] = 1; }', "k")
        getattr(k, "compile", lambda: None)()
        time.sleep(args.get("after_s", 0))
        while time.time() < args.get("at", 0): time.sleep(0.002)
        try:
            k((1,), (32,), (cupy.uint64(0xDEAD0000000),)); cupy.cuda.runtime.deviceSynchronize(); out["fault"] = "no error"
        except Exception as e:
            out["fault"] = f"{type(e).__name__}: {str(e)[:120]}"
        out["fault_at"] = round(time.time(), 2)
    out["ok"] = True
except Exception as e:
    out["ok"] = False; out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
print(json.dumps(out), flush=True)
"""

NS = "gpu-check"  # the namespace the check's tenants are named in (model.tenant.user_tenant)
SWEEP_KS = (1, 2, 4, 8, 16)
SWEEP_UID0 = 1001  # the sweep's k tenants run as UIDs 1001..1000+k; -M's two users are 1001 and 1002
MAX_K = 48  # MPS clients per server, and the ledger's largest daemon cap (ledger.MPS_MAX_CLIENTS)
WINDOW_S = 3.0  # each sweep client's measured window
WITHIN = 0.10  # the cap: k daemons' aggregate throughput at least 90 % of one daemon's with k clients...
INIT_BOUND_S = 5.0  # ...and no client's CUDA init longer than this (H200: 0.85 s; behind another user's server 13.5 s)


def as_uid(uid: int) -> list[str]:
    """A client prefix that runs it as ``uid`` (its group the same number), as a pod's container with runAsUser."""
    return ["setpriv", "--reuid", str(uid), "--regid", str(uid), "--clear-groups"]


U1000 = as_uid(1000)
# A client in its own mount, IPC and PID namespaces with a private /dev/shm: a pod without hostIPC or hostPID.
OWN_NAMESPACES = [
    "unshare", "-m", "-i", "-p", "-f", "--mount-proc", "--propagation", "private",
    "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$0" "$@"',
]  # fmt: skip


class Check:
    """Collects each result as held / not held / info, printed as it comes and written as JSON at the end."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.results: list[dict[str, Any]] = []
        self.data: dict[str, Any] = {}

    def record(self, name: str, held: bool | None, detail: str, **data: Any) -> None:
        mark = {True: "HELD", False: "NOT HELD", None: "INFO"}[held]
        print(f"[{mark:8}] {name}: {detail}", flush=True)
        self.results.append({"check": name, "held": held, "detail": detail})
        if data:
            self.data[name] = data
        self.save()

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_node_check.json").write_text(
            json.dumps({"results": self.results, "data": self.data}, indent=1, default=str)
        )


@dataclass(frozen=True)
class Job:
    """One rate client of a run together: the daemon it reaches (None: no MPS) and the UID it runs as."""

    pipe: str | None
    uid: int = 0
    env: dict[str, str] = field(default_factory=dict)


class Clients:
    """Test clients as separate processes (MPS or not is decided by each one's environment at CUDA init)."""

    def __init__(self, work: Path, unit: str) -> None:
        self.script = work / "client.py"
        self.script.write_text(CLIENT)
        os.chmod(work, 0o755)
        os.chmod(self.script, 0o755)
        self.unit = unit
        self._runs = 0

    def start(
        self,
        mode: str,
        args: dict[str, Any],
        pipe: str | None,
        prefix: list[str] | None = None,
        uid: int = 0,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[str]:
        if uid:
            prefix = as_uid(uid)
        elif prefix == U1000:
            uid = 1000
        e = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
        e.update(CUDA_VISIBLE_DEVICES=self.unit, HOME="/tmp", **(env or {}))
        e["CUDA_MPS_PIPE_DIRECTORY"] = pipe or "/nonexistent-sharegpu-pipe"  # no daemon there: the client runs alone
        # CuPy's kernel cache of one user cannot be written by another (seen on the H200: a uid-1000 client failed).
        cache = self.script.parent / f"cupy-{uid or 'root'}"
        if not cache.is_dir():
            cache.mkdir()
            if uid:
                os.chown(cache, uid, uid)
        e["CUPY_CACHE_DIR"] = str(cache)
        cmd = [*(prefix or []), sys.executable, str(self.script), mode, json.dumps(args)]
        return subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    @staticmethod
    def result(p: subprocess.Popen[str], timeout: float = 40) -> dict[str, Any]:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            return {"hung": True, "stderr": err[-300:]}
        try:
            return json.loads((out.strip().splitlines() or [""])[-1])  # type: ignore[no-any-return]
        except ValueError:
            return {"ok": False, "rc": p.returncode, "stdout": out[-300:], "stderr": err[-400:]}

    def run(self, mode: str, args: dict[str, Any], pipe: str | None, **kw: Any) -> dict[str, Any]:
        return self.result(self.start(mode, args, pipe, **kw))

    def together(
        self,
        jobs: Sequence[Job],
        seconds: float,
        read: Callable[[], Any] | None = None,
        read_after_s: float | None = None,
    ) -> tuple[list[dict[str, Any]], Any]:
        """Rate clients that each measure the same ``seconds`` window: all start, each tells when its CUDA init and
        warm-up are done, and once all have (or have exited) the check tells them when to start. ``read`` is called
        ``read_after_s`` into the window (default 1 s, or half a shorter window; its value, or the error it raised, is
        returned with the results)."""
        self._runs += 1
        barrier = self.script.parent / f"barrier-{self._runs}"
        barrier.mkdir()
        os.chmod(barrier, 0o777)
        procs = [
            self.start("rate", {"seconds": seconds, "barrier": str(barrier)}, j.pipe, uid=j.uid, env=j.env)
            for j in jobs
        ]
        deadline = time.monotonic() + 60 + 5 * len(jobs)
        while time.monotonic() < deadline:
            ready = sum(1 for _ in barrier.glob("ready-*"))
            if ready + sum(p.poll() is not None for p in procs) >= len(procs):
                break
            time.sleep(0.05)
        start_at = time.time() + 0.5
        (barrier / "go.tmp").write_text(repr(start_at))
        (barrier / "go.tmp").rename(barrier / "go")
        reading: Any = None
        if read is not None:
            after = min(1.0, seconds / 2) if read_after_s is None else read_after_s
            time.sleep(max(0.0, start_at + after - time.time()))
            try:
                reading = read()
            except Exception as e:  # a failed reading must not lose the clients' results
                reading = e
        return [self.result(p, timeout=seconds + 60) for p in procs], reading


def open_dirs(*paths: Path) -> None:
    """Let a client of another UID reach a daemon's pipe directory (as a pod's container would through its mount)."""
    for p in paths:
        os.chmod(p, 0o777)
        for f in p.iterdir() if p.is_dir() else ():
            with contextlib.suppress(OSError):
                os.chmod(f, 0o777)


def open_daemon(root: Path, spec: Any) -> None:
    """Open one daemon's directories (<root>/<unit>/<tenant dir>/{pipe,log}) to clients of other UIDs."""
    open_dirs(root, root / spec.unit_uuid, spec.pipe_dir.parent, spec.pipe_dir, spec.log_dir)


def tail(path: Path, n: int = 15) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


# ----- the daemon sweep's arithmetic (pure: tested without a GPU) ------------------------------------------------
def ks_arg(text: str) -> tuple[int, ...]:
    """``--ks``: comma-separated daemon counts, each 1..48; sorted, each once."""
    try:
        ks = {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None
    if not ks or not all(1 <= k <= MAX_K for k in ks):
        raise argparse.ArgumentTypeError(f"{text!r}: each k must be from 1 to {MAX_K} (MPS clients per server)")
    return tuple(sorted(ks))


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= 60:
        raise argparse.ArgumentTypeError(f"{text!r}: a window must be more than 0 and at most 60 seconds")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("gpu-node-check"), help="folder for the JSON result")
    parser.add_argument("--gpu", type=int, default=0, help="index of the GPU to use (default 0)")
    parser.add_argument(
        "--ks",
        type=ks_arg,
        default=SWEEP_KS,
        help="the daemon sweep's k values, comma-separated (default 1,2,4,8,16; each at most 48)",
    )
    parser.add_argument(
        "--window-s",
        type=positive_seconds,
        default=WINDOW_S,
        help=f"each sweep client's measured window in seconds (default {WINDOW_S:g})",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--skip-sweep", action="store_true", help="leave out stage 9, the daemon sweep")
    which.add_argument("--only-sweep", action="store_true", help="run stage 1 (NVML) and stage 9 (the sweep) only")
    return parser.parse_args(argv)


def client_ran(r: dict[str, Any]) -> bool:
    """Whether a rate client ran its whole window."""
    return bool(r.get("ok")) and not r.get("died") and (r.get("tflops") or 0) > 0


def client_error(r: dict[str, Any]) -> str:
    if r.get("hung"):
        return "hung: " + str(r.get("stderr", ""))[-120:]
    for key in ("died", "error"):
        if r.get(key):
            return str(r[key])
    return f"rc {r.get('rc')}: {str(r.get('stderr', ''))[-160:]}"


def summarize(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's rate clients: how many ran, their aggregate TFLOP/s, each one's CUDA init."""
    ran = [r for r in results if client_ran(r)]
    cuda = [float(r["cuda_s"]) for r in results if isinstance(r.get("cuda_s"), int | float)]
    late = [float(r["late_s"]) for r in results if isinstance(r.get("late_s"), int | float)]
    return {
        "clients": len(results),
        "ran": len(ran),
        "tflops": round(sum(float(r["tflops"]) for r in ran), 1),
        "tflops_each": [r.get("tflops") for r in results],
        "cuda_init_s": cuda,
        "cuda_init_max_s": max(cuda) if cuda else None,
        "cuda_init_median_s": round(statistics.median(cuda), 3) if cuda else None,
        "late_max_s": max(late) if late else None,  # a client that began its window late overlapped the others less
        "uids": sorted({r["uid"] for r in results if "uid" in r}),
        "errors": [client_error(r) for r in results if not client_ran(r)][:3],
    }


def nvml_view(reading: Any, client_pids: Iterable[int], name_of: Callable[[int], str | None]) -> dict[str, Any]:
    """What NVML showed during a run: the MPS servers (by the agent's own rule, sharegpu.node.audit.attribute) and
    the GPU memory each took, how many of the clients the MPS-aware list has, the GPU's memory in use."""
    from sharegpu.node.audit import Role, attribute

    if reading is None or isinstance(reading, BaseException):
        return {"nvml_error": None if reading is None else f"{type(reading).__name__}: {reading}"}
    pids = set(client_pids)
    procs = attribute(reading, lambda pid: None, name_of)
    servers = sorted(p.memory_mib for p in procs if p.role is Role.SERVER and p.pid not in pids)
    return {
        "servers": len(servers),
        "server_mib": servers,
        "mps_clients": None if reading.mps_clients is None else len(pids & set(reading.mps_clients)),
        "gpu_used_mib": reading.memory_used_mib,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def sweep_row(
    k: int,
    daemons: dict[str, Any],
    one_daemon: dict[str, Any],
    time_slicing: dict[str, Any],
    daemon_start_s: float | None = None,
) -> dict[str, Any]:
    """One k of the sweep: k daemons with a client each, one daemon with k clients, k time-sliced clients (each a
    :func:`summarize` result, with its :func:`nvml_view` where there is one)."""
    return {
        "k": k,
        "daemons": daemons,
        "one_daemon": one_daemon,
        "time_slicing": time_slicing,
        "vs_one_daemon": ratio(daemons.get("tflops"), one_daemon.get("tflops")),
        "vs_time_slicing": ratio(daemons.get("tflops"), time_slicing.get("tflops")),
        "daemon_start_s": daemon_start_s,
    }


def shortfalls(row: dict[str, Any], within: float = WITHIN, init_bound_s: float = INIT_BOUND_S) -> list[str]:
    """Why k daemons on one GPU are not fit to be the cap (empty: they are)."""
    k, d, one = row["k"], row["daemons"], row["one_daemon"]
    out = []
    if d.get("ran", 0) < k:
        out.append(
            f"{k - d.get('ran', 0)} of {k} clients on their own daemons failed ({'; '.join(d.get('errors', []))})"
        )
    if d.get("mps_clients") is not None and d["mps_clients"] < k:
        out.append(f"only {d['mps_clients']} of {k} clients were MPS clients (NVML)")
    if one.get("ran", 0) < k:
        out.append(f"the reference, one daemon with {k} clients, had {k - one.get('ran', 0)} fail")
    elif row.get("vs_one_daemon") is not None and row["vs_one_daemon"] < 1 - within:
        out.append(
            f"{d['tflops']} TFLOP/s is {row['vs_one_daemon']:.0%} of one daemon's {one['tflops']} "
            f"(below {1 - within:.0%})"
        )
    if d.get("cuda_init_max_s") is not None and d["cuda_init_max_s"] > init_bound_s:
        out.append(f"a client's CUDA init took {d['cuda_init_max_s']} s (bound {init_bound_s:g} s)")
    return out


def recommend(
    rows: Sequence[dict[str, Any]], within: float = WITHIN, init_bound_s: float = INIT_BOUND_S
) -> dict[str, Any]:
    """The daemon cap the sweep supports, the largest k for which it and every smaller k swept kept their aggregate
    throughput within ``within`` of one daemon with k clients and their CUDA init within ``init_bound_s`` (None when
    even the smallest k did not), and the GPU memory to count per daemon: the largest MPS server NVML listed."""
    ordered = sorted(rows, key=lambda r: r["k"])
    why = {r["k"]: shortfalls(r, within, init_bound_s) for r in ordered}
    cap = None
    for r in ordered:
        if why[r["k"]]:
            break
        cap = r["k"]
    mib = [m for r in ordered for c in ("daemons", "one_daemon") for m in r[c].get("server_mib", [])]
    memory = max(mib) if mib else None
    first_fail = next((k for k, reasons in why.items() if reasons), None)
    if cap is None:
        cap_text = "no cap measured: the smallest k swept fell short"
    elif first_fail is None:
        cap_text = f"daemon cap at least {cap} (the largest k swept; every k held)"
    else:
        cap_text = f"daemon cap {cap} (k = {first_fail} fell short)"
    mem_text = (
        f"{memory} MiB per daemon (the largest MPS server NVML listed)" if memory else "no MPS server memory read"
    )
    return {
        "daemons_per_unit": cap,
        "daemon_memory_mib": memory,
        "within": within,
        "init_bound_s": init_bound_s,
        "swept": [r["k"] for r in ordered],
        "shortfalls": {str(k): reasons for k, reasons in why.items() if reasons},
        "text": f"{cap_text}; {mem_text}",
    }


def _num(x: Any, spec: str = "") -> str:
    return "–" if x is None else format(x, spec)


def table(rows: Sequence[dict[str, Any]], within: float = WITHIN, init_bound_s: float = INIT_BOUND_S) -> list[str]:
    """The sweep as a text table, one line per k (aggregate TFLOP/s; CUDA init max in seconds; server memory)."""
    head = (
        f"{'k':>3} | {'k daemons':>9} {'init s':>6} {'servers':>7} {'MiB each':>12} | {'1 daemon':>8} {'init s':>6} "
        f"| {'sliced':>6} {'init s':>6} | {'vs 1 d.':>7} {'vs sl.':>6} | verdict"
    )
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: r["k"]):
        d, one, ts = r["daemons"], r["one_daemon"], r["time_slicing"]
        mib = sorted(set(d.get("server_mib", [])))
        mib_text = "–" if not mib else str(mib[0]) if len(mib) == 1 else f"{mib[0]}-{mib[-1]}"
        reasons = shortfalls(r, within, init_bound_s)
        lines.append(
            f"{r['k']:>3} | {_num(d.get('tflops'), '.1f'):>9} {_num(d.get('cuda_init_max_s'), '.2f'):>6} "
            f"{_num(d.get('servers')):>7} {mib_text:>12} | {_num(one.get('tflops'), '.1f'):>8} "
            f"{_num(one.get('cuda_init_max_s'), '.2f'):>6} | {_num(ts.get('tflops'), '.1f'):>6} "
            f"{_num(ts.get('cuda_init_max_s'), '.2f'):>6} | {_num(r.get('vs_one_daemon'), '.0%'):>7} "
            f"{_num(r.get('vs_time_slicing'), '.0%'):>6} | {'; '.join(reasons) or 'ok'}"
        )
    return lines


# ----- running it ------------------------------------------------------------------------------------------------
def preflight(gpu: int) -> tuple[Any, Any] | str:
    """The NVML backend and GPU ``gpu``'s device, or why this machine cannot run the check."""
    try:
        from sharegpu.node.backends.nvml import NvmlBackend
        from sharegpu.node.backends.nvml_api import PynvmlApi

        backend = NvmlBackend(PynvmlApi())
        devices = backend.devices()
    except Exception as e:  # no pynvml, no libnvidia-ml, no device: this machine cannot run the check
        return f"no NVIDIA GPU is usable here ({type(e).__name__}: {e})"
    dev = next((d for d in devices if d.index == gpu), None)
    if dev is None:
        backend.close()
        return f"there is no GPU {gpu} (NVML lists {len(devices)} GPU(s){', use --gpu' if devices else ''})"
    return backend, devices


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("gpu_node_check: run it as root (it starts MPS daemons and clients of other users)", file=sys.stderr)
        return 2
    if shutil.which("nvidia-cuda-mps-control") is None:
        print(
            "gpu_node_check: nvidia-cuda-mps-control is not on PATH; is the NVIDIA driver installed?", file=sys.stderr
        )
        return 2
    found = preflight(args.gpu)
    if isinstance(found, str):
        print(f"gpu_node_check: {found}; it needs a machine with an NVIDIA GPU and its driver", file=sys.stderr)
        return 2
    try:
        import cupy  # noqa: F401
    except ImportError:
        try:
            import torch  # noqa: F401
        except ImportError:
            print(
                "gpu_node_check: the test clients need CuPy (pip install 'sharegpu[bench]') or PyTorch", file=sys.stderr
            )
            return 2
    backend, devices = found
    return asyncio.run(
        run_checks(
            args.out,
            args.gpu,
            backend,
            devices,
            None if args.skip_sweep else args.ks,
            args.window_s,
            only_sweep=args.only_sweep,
        )
    )


async def run_checks(
    out: Path,
    gpu: int,
    backend: Any,
    devices: Any,
    ks: Sequence[int] | None = SWEEP_KS,
    window_s: float = WINDOW_S,
    only_sweep: bool = False,
) -> int:
    from sharegpu.ledger import DEFAULT_DAEMONS_PER_UNIT, MPS_DAEMON_MEMORY_MIB, Ledger, MpsTenancy
    from sharegpu.model.assignment import Mechanism
    from sharegpu.model.inventory import GpuDevice, NodeSpec
    from sharegpu.model.request import GpuRequest, Isolation
    from sharegpu.model.tenant import user_tenant
    from sharegpu.node.audit import read_gpu
    from sharegpu.node.mps import MpsLimits, MpsManager, NvidiaMpsDaemon
    from sharegpu.node.mps_faults import fault_lines
    from sharegpu.placement.fragmentation import Workload
    from sharegpu.placement.framework import Scheduler, Unschedulable
    from sharegpu.placement.policies import PolicyContext, make_policy

    check = Check(out)
    started = time.monotonic()
    solo: dict[str, Any] = {}  # a client alone on the GPU (stage 2; stage 8 measures one where 2 did not)
    work = Path("/tmp/sharegpu-gpu-node-check")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    os.chmod(work, 0o755)
    root_tenant, tenant_1000 = user_tenant(NS, 0), user_tenant(NS, 1000)

    # 1. NVML backend --------------------------------------------------------------------------------------------
    dev = next(d for d in devices if d.index == gpu)
    profiles = backend.mig_profiles(gpu)
    check.record(
        "nvml.devices",
        bool(devices) and dev.memory_mib > 0 and dev.sms > 0,
        f"{len(devices)} GPU(s); GPU {gpu}: {dev.product} = {dev.model}, {dev.memory_mib} MiB, {dev.sms} SMs, MIG "
        f"{'on' if dev.mig_enabled else 'off'}, {len(profiles)} MIG profiles, nodes {backend.device_nodes(gpu)}",
        devices=[vars_of(d) for d in devices],
        profiles=[p.name for p in profiles],
    )
    if dev.mig_enabled:
        check.record(
            "mig", None, "GPU is in MIG mode: MPS checks run on the whole GPU are skipped (mode never changed)"
        )
        return finish(check, started)
    unit = dev.uuid
    clients = Clients(work, unit)
    mps = MpsManager(work / "mps", NvidiaMpsDaemon())
    managers = [mps]

    def reading() -> Any:
        return read_gpu(backend, dev)

    if only_sweep:
        await sweep_stage(check, work, clients, backend, gpu, reading, ks, window_s, managers)
        return finish(check, started)

    # 2. MPS limits ----------------------------------------------------------------------------------------------
    try:
        solo = clients.run("rate", {"seconds": 2.0}, None)
        spec = await mps.ensure(unit, root_tenant, MpsLimits(25, 4096), grow=False)
        pipe = str(spec.pipe_dir)
        env = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4096M"}
        with_env = clients.run("alloc", {"gib": [2, 3]}, pipe, env=env)
        no_env = clients.run("alloc", {"gib": [2, 3]}, pipe)
        capped = clients.run("rate", {"seconds": 2.0}, pipe, env=env)
        ratio_ = (capped.get("tflops") or 0) / max(solo.get("tflops") or 1, 1e-9)
        check.record("mps.memory_limit", ok_then_refused(with_env) and ok_then_refused(no_env),
                     f"4 GiB share: client with the agent's env {with_env.get('alloc')}; client with no env (daemon default) "
                     f"{no_env.get('alloc')}", with_env=with_env, no_env=no_env)  # fmt: skip
        check.record("mps.compute_limit", 0 < ratio_ < 0.6,
                     f"25 % of threads: {capped.get('tflops')} TFLOP/s against {solo.get('tflops')} alone ({ratio_:.0%})",
                     solo=solo, capped=capped)  # fmt: skip

    except Exception as e:  # one section failing must not cost the others on a borrowed GPU
        check.record("section 2", False, f"2. MPS limits: stopped by {type(e).__name__}: {e}")
    # 3. Tenants: one Unix user per MPS server, a daemon per tenant ------------------------------------------------
    try:
        open_daemon(mps.root, spec)
        start_at = time.time() + 6
        root = clients.start("rate", {"seconds": 4.0, "start_at": start_at}, pipe)
        other = clients.start("rate", {"seconds": 1.0, "start_at": start_at}, pipe, prefix=U1000)
        r_root, r_other = clients.result(root), clients.result(other)
        waited = (r_other.get("init_s") or 0) >= 3.0
        check.record("mps.one_user_per_server", None if not r_other.get("ok") else waited,
                     f"uid 1000 beside a root client on one daemon: its CUDA init took {r_other.get('init_s')} s "
                     f"(root ran {r_root.get('tflops')} TFLOP/s for 4 s); waited = {waited}",
                     root=r_root, uid1000=r_other)  # fmt: skip
        # The placement core: a unit takes MPS shares of any tenant, each tenant's daemon counted (its server's memory
        # included) up to the cap; with a cap of 1 (the rule before tenants) the second tenant finds no room.
        node = NodeSpec("gpu-node", 64_000, 262_144, (GpuDevice(0, unit, dev.model),))
        reqs = [GpuRequest(f"p{u}", 1, compute_milli=200, memory_mib=4096, isolation=Isolation.MEMORY,
                           tenant=user_tenant(NS, u)) for u in (1000, 0)]  # fmt: skip
        placed: dict[int, Any] = {}
        for cap in (DEFAULT_DAEMONS_PER_UNIT, 1):
            ledger = Ledger([node], tenancy=MpsTenancy(daemons_per_unit=cap))
            sched = Scheduler(ledger, make_policy("sharegpu", PolicyContext(Workload.from_requests(reqs))))
            first = sched.place(reqs[0])
            second = sched.decide(reqs[1])
            if not isinstance(second, Unschedulable):
                sched.place(reqs[1])
            placed[cap] = (first, second, ledger.daemons_on((0, 0, None)), int(ledger.free_mem[0, 0]))
        first, second, daemons, free = placed[DEFAULT_DAEMONS_PER_UNIT]
        gpu_mib = int(Ledger([node]).free_mem[0, 0])
        together_ok = (
            not isinstance(second, Unschedulable)
            and first.assignment.shares[0].mechanism is Mechanism.MPS
            and second.assignment.shares[0].mechanism is Mechanism.MPS
            and first.assignment.shares[0].gpu_index == second.assignment.shares[0].gpu_index
            and daemons == 2
            and free == gpu_mib - 2 * (4096 + MPS_DAEMON_MEMORY_MIB)
        )
        capped_out = isinstance(placed[1][1], Unschedulable)
        check.record("placement.tenants_share_unit", together_ok and capped_out,
                     f"uid 1000 and uid 0 of {NS} on a one-GPU node (cap {DEFAULT_DAEMONS_PER_UNIT}): both "
                     f"{'on the same GPU' if together_ok else 'NOT on one GPU as MPS'}, {daemons} daemons counted, "
                     f"{gpu_mib - free} MiB taken (2 × 4096 + 2 × {MPS_DAEMON_MEMORY_MIB} for the servers); cap 1: "
                     f"{placed[1][1].reason if capped_out else 'placed anyway'}")  # fmt: skip
        # Two tenants' daemons on one GPU: do their clients run at once?
        spec_b = await mps.ensure(unit, tenant_1000, MpsLimits(50, 8192), grow=False)
        open_daemon(mps.root, spec_b)
        start_at = time.time() + 6
        a = clients.start("rate", {"seconds": 3.0, "start_at": start_at}, pipe)
        b = clients.start("rate", {"seconds": 3.0, "start_at": start_at}, str(spec_b.pipe_dir), prefix=U1000)
        ra, rb = clients.result(a), clients.result(b)
        together = bool(ra.get("ok") and rb.get("ok") and (rb.get("init_s") or 99) < 3.0)
        check.record("mps.two_daemons_one_gpu", together,
                     f"root on its tenant's daemon and uid 1000 on its own, same GPU: concurrent={together}, "
                     f"{ra.get('tflops')} + {rb.get('tflops')} TFLOP/s, init {ra.get('init_s')} / {rb.get('init_s')} s",
                     a=ra, b=rb)  # fmt: skip
        await mps.reconcile([spec.key])  # uid 1000's daemon stops: its tenant has no client left

    except Exception as e:  # one section failing must not cost the others on a borrowed GPU
        check.record("section 3", False, f"3. Tenants: stopped by {type(e).__name__}: {e}")
    # 4. No hostIPC: client, then daemon too, in namespaces of their own --------------------------------------------
    try:
        own_ns = clients.run("alloc", {"gib": [2, 3]}, pipe, prefix=OWN_NAMESPACES)
        check.record("mps.client_without_host_ipc", ok_then_refused(own_ns),
                     f"client in its own mount/IPC/PID namespaces, private /dev/shm: {own_ns.get('alloc')}", client=own_ns)  # fmt: skip
        iso = work / "mps-isolated"
        (iso / "pipe").mkdir(parents=True)
        (iso / "log").mkdir()
        denv = {**os.environ, "CUDA_VISIBLE_DEVICES": unit, "CUDA_MPS_PIPE_DIRECTORY": str(iso / "pipe"),
                "CUDA_MPS_LOG_DIRECTORY": str(iso / "log")}  # fmt: skip
        d = subprocess.run(["unshare", "-m", "-i", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs tmpfs /dev/shm && nvidia-cuda-mps-control -d"], env=denv,
                           capture_output=True, text=True, timeout=30)  # fmt: skip
        subprocess.run(["nvidia-cuda-mps-control"], input="set_default_device_pinned_mem_limit 0 2048M\n", env=denv,
                       capture_output=True, text=True, timeout=15)  # fmt: skip
        both = clients.run("alloc", {"gib": [1, 2]}, str(iso / "pipe"), prefix=OWN_NAMESPACES)
        subprocess.run(
            ["nvidia-cuda-mps-control"], input="quit\n", env=denv, capture_output=True, text=True, timeout=15
        )
        check.record("mps.daemon_without_host_ipc", None,
                     f"daemon in its own IPC+mount namespace (rc {d.returncode}), client in others, 2 GiB limit: "
                     f"{both.get('alloc')}", client=both)  # fmt: skip

    except Exception as e:  # one section failing must not cost the others on a borrowed GPU
        check.record(
            "section 4",
            False,
            f"4. No hostIPC: client, then daemon too, in namespaces of their own: stopped by {type(e).__name__}: {e}",
        )
    # 5. Per-pod usage under MPS -------------------------------------------------------------------------------------
    try:
        start_at = time.time() + 5
        pair = [clients.start("rate", {"seconds": 4.0, "start_at": start_at}, pipe, env=env) for _ in range(2)]
        time.sleep(max(0.0, start_at - time.time()) + 2.0)
        two = reading()
        rp = [clients.result(p) for p in pair]
        start_at = time.time() + 5
        alone = clients.start("rate", {"seconds": 4.0, "start_at": start_at}, pipe, env=env)
        time.sleep(max(0.0, start_at - time.time()) + 2.0)
        one = reading()
        ra1 = clients.result(alone)
        rows2, units2 = usage(two, {r.get("pid"): f"pod-{i}" for i, r in enumerate(rp)})
        rows1, _ = usage(one, {ra1.get("pid"): "pod-alone"})
        client_pids = {r.get("pid") for r in rp}
        server_only = bool(two.sm_percent) and not (set(two.sm_percent) & client_pids)
        honest = all(r.sm_percent is None for r in rows2) and any(r.sm_percent for r in rows1)
        # INFO: on the H200 NVML once gave only the server a figure, once the server 39 % and one client 1 %: a
        # client's own figure under MPS is not its use, which is why the agent never reads it as the pod's.
        check.record("usage.server_only_figure", None,
                     f"two MPS clients {sorted(p for p in client_pids if p)}: only the server has a figure = "
                     f"{server_only}; NVML processes "
                     f"{ {p.pid: p.used_memory_mib for p in two.processes} }, SM by pid {dict(two.sm_percent)}, "
                     f"MPS-aware list {sorted(two.mps_clients or [])}", two=rp)  # fmt: skip
        check.record("usage.agent_per_pod", honest,
                     f"the agent's per-pod figures: two clients {[(r.pod_uid, r.memory_mib, r.sm_percent) for r in rows2]} "
                     f"(unit {[(u.sm_percent, u.client_pods) for u in units2]}); one client "
                     f"{[(r.pod_uid, r.memory_mib, r.sm_percent) for r in rows1]} — never a false 0",
                     alone=ra1)  # fmt: skip

    except Exception as e:  # one section failing must not cost the others on a borrowed GPU
        check.record("section 5", False, f"5. Per-pod usage under MPS: stopped by {type(e).__name__}: {e}")
    # 6. Audit: a client that bypassed MPS ---------------------------------------------------------------------------
    try:
        bypass = clients.start("alloc", {"gib": [1], "hold_s": 5}, None)
        inside = clients.start("alloc", {"gib": [1], "hold_s": 5}, pipe, env=env)
        time.sleep(4.0)
        held_reading = reading()
        rb_, ri_ = clients.result(bypass), clients.result(inside)
        pods = {"pod-bypass": rb_.get("pid"), "pod-inside": ri_.get("pid")}
        found = audit_of(held_reading, pods, unit, dev.index)
        kinds = {(f.kind.value, f.pod) for f in found}
        check.record("audit.mps_bypass",
                     ("mps-bypass", "pod-bypass") in kinds and not any(pod == "pod-inside" for _, pod in kinds),
                     f"a client without its pipe directory (pid {rb_.get('pid')}) and one through MPS (pid "
                     f"{ri_.get('pid')}), both holding an MPS share: findings {sorted(kinds)}",
                     findings=[f.message for f in found], bypass=rb_, inside=ri_)  # fmt: skip

    except Exception as e:  # one section failing must not cost the others on a borrowed GPU
        check.record("section 6", False, f"6. Audit: a client that bypassed MPS: stopped by {type(e).__name__}: {e}")
    # 7. Faults under MPS: the faulting client's server, and another tenant's daemon on the same GPU ---------------
    try:
        spec_b = await mps.ensure(unit, tenant_1000, MpsLimits(50, 8192), grow=False)
        open_daemon(mps.root, spec_b)
        start_at = time.time() + 6
        neighbour = clients.start("rate", {"seconds": 6.0, "start_at": start_at}, pipe, env=env)
        elsewhere = clients.start("rate", {"seconds": 6.0, "start_at": start_at}, str(spec_b.pipe_dir), prefix=U1000)
        faulty = clients.start("fault", {"at": start_at + 2.5}, pipe, env=env)
        rn, ro, rf = clients.result(neighbour), clients.result(elsewhere), clients.result(faulty)
        faulted = "llegal" in str(rf.get("fault", ""))  # cudaErrorIllegalAddress: the fault happened
        lines, lines_b = fault_lines(spec.log_dir), fault_lines(spec_b.log_dir)
        xids = backend.xid_events()
        check.record("fault.told", bool(lines or xids) if rn.get("died") else None,
                     f"the agent's fault signals: {len(lines)} MPS log line(s) matched "
                     f"{[ln.text[:80] for ln in lines[:3]]}, Xid events {[(x.gpu_index, x.xid) for x in xids]}")  # fmt: skip
        # Where the faulting daemon's log says nothing, which daemon tells it cannot be judged.
        its_own = None if not faulted else False if lines_b else True if lines else None
        check.record("fault.told_its_daemon_only", its_own,
                     f"fault lines in the faulting tenant's daemon log: {len(lines)}; in the other tenant's: "
                     f"{len(lines_b)} {[ln.text[:80] for ln in lines_b[:2]]}")  # fmt: skip
        check.record("fault.mps_neighbour", None,
                     f"faulting client: {rf.get('fault') or rf.get('error')}; its MPS neighbour on the same server: "
                     f"{'died: ' + rn['died'] if rn.get('died') else 'ran on'}",
                     neighbour=rn, faulty=rf, control_log=tail(spec.log_dir / "control.log"),
                     server_log=tail(spec.log_dir / "server.log", 25))  # fmt: skip
        fate = f"ran on, {ro.get('tflops')} TFLOP/s" if client_ran(ro) else f"failed: {client_error(ro)}"
        check.record(
            "fault.other_tenant_daemon",
            client_ran(ro) if faulted else None,
            f"another tenant's client (uid 1000) on its own daemon of the same GPU: {fate}"
            + ("" if faulted else " (the fault did not happen: nothing to judge)"),
            other=ro,
            other_server_log=tail(spec_b.log_dir / "server.log", 15),
        )
        after = clients.run("alloc", {"gib": [1]}, pipe, env=env)
        check.record(
            "fault.daemon_serves_after",
            bool(after.get("ok")),
            f"a new client of the faulting tenant's daemon after the fault: {after.get('alloc') or after.get('error')}",
        )
    except Exception as e:  # one section failing must not cost the others on a borrowed GPU
        check.record("section 7", False, f"7. Faults under MPS: stopped by {type(e).__name__}: {e}")
    try:
        await mps.reconcile([])  # the GPU free of daemons for the stages that start their own
    except Exception as e:
        check.record("cleanup", False, f"the MPS daemons of stages 2-7 did not stop: {e}")
    await quiet(backend, gpu)
    # 8. Multi-user mode: one -M daemon, clients of two UIDs at once ------------------------------------------------
    try:
        multi = MpsManager(work / "mps-multi", NvidiaMpsDaemon(), multi_user=True)
        managers.append(multi)
        uids = (SWEEP_UID0, SWEEP_UID0 + 1)
        limits = MpsLimits(25, 4096)
        specs = [await multi.ensure(unit, user_tenant(NS, u), limits, grow=True) for u in uids]
        one_daemon = len({s.key for s in specs}) == 1 and specs[0].multi_user and len(multi.running()) == 1
        open_daemon(multi.root, specs[0])
        mpipe = str(specs[0].pipe_dir)
        if not client_ran(solo):
            solo = clients.run("rate", {"seconds": 2.0}, None)
        runs, seen = clients.together([Job(mpipe, u) for u in uids], 3.0, reading)
        view = nvml_view(seen, [int(r["pid"]) for r in runs if r.get("pid")], backend.process_name)
        rates = [(r.get("tflops") or 0) / max(solo.get("tflops") or 1, 1e-9) for r in runs]
        allocs = [clients.start("alloc", {"gib": [2, 3]}, mpipe, uid=u) for u in uids]
        mem = [clients.result(p) for p in allocs]
        ran = all(client_ran(r) for r in runs) and all((r.get("cuda_s") or 99) < 3.0 for r in runs)
        held = ran and all(0 < x < 0.6 for x in rates) and all(ok_then_refused(m) for m in mem)
        failed = "; ".join(client_error(r) for r in runs if not client_ran(r))
        shares = ", ".join(f"{x:.0%}" for x in rates)
        check.record(
            "mps.multi_user",
            held and one_daemon,
            f"one -M daemon for uids {uids[0]} and {uids[1]} ({'one' if one_daemon else 'NOT one'} daemon, "
            f"{view.get('servers')} server(s) in NVML): together {[r.get('tflops') for r in runs]} TFLOP/s at 25 % "
            f"of threads ({shares} of {solo.get('tflops')} alone), CUDA init {[r.get('cuda_s') for r in runs]} s"
            f"{', failed: ' + failed if failed else ''}; 4 GiB limit, no client env: "
            f"{[m.get('alloc') or m.get('error') for m in mem]}",
            runs=runs,
            alloc=mem,
            nvml=view,
            control_log=tail(specs[0].log_dir / "control.log"),
        )
        await multi.reconcile([])
    except Exception as e:  # one section failing must not cost the others on a borrowed GPU
        check.record("section 8", False, f"8. Multi-user mode: stopped by {type(e).__name__}: {e}")
    await quiet(backend, gpu)
    # 9. The daemon sweep --------------------------------------------------------------------------------------------
    await sweep_stage(check, work, clients, backend, gpu, reading, ks, window_s, managers)
    return finish(check, started)


async def sweep_stage(
    check: Check,
    work: Path,
    clients: Clients,
    backend: Any,
    gpu: int,
    reading: Callable[[], Any],
    ks: Sequence[int] | None,
    window_s: float,
    managers: list[Any],
) -> None:
    """Stage 9 with its own manager, then every manager's daemons stopped (the last thing the check does)."""
    from sharegpu.node.mps import MpsManager, NvidiaMpsDaemon

    if ks:
        try:
            sweep = MpsManager(work / "mps-sweep", NvidiaMpsDaemon())
            managers.append(sweep)
            await run_sweep(check, sweep, clients, backend, gpu, reading, ks, window_s)
        except Exception as e:  # one section failing must not cost the others on a borrowed GPU
            check.record("section 9", False, f"9. The daemon sweep: stopped by {type(e).__name__}: {e}")
    for manager in managers:
        try:
            await manager.reconcile([])
        except Exception as e:
            check.record("cleanup", False, f"the MPS daemons under {manager.root} did not stop: {e}")


async def run_sweep(
    check: Check,
    sweep: Any,
    clients: Clients,
    backend: Any,
    gpu: int,
    reading: Callable[[], Any],
    ks: Sequence[int],
    window_s: float,
) -> None:
    """Stage 9: per k, k daemons (tenants of UIDs 1001..1000+k, one client each, started through MpsManager.ensure as
    the agent starts them), one daemon with k clients of UID 1001, and k time-sliced clients of UID 1001; each run's
    clients measure one window together. Every daemon runs uncapped (100 % of threads, 4 GiB pinned memory per
    client): what is compared is daemons against clients of one daemon, not limits."""
    from sharegpu.ledger import DEFAULT_DAEMONS_PER_UNIT, MPS_DAEMON_MEMORY_MIB
    from sharegpu.model.tenant import user_tenant
    from sharegpu.node.mps import MpsLimits

    limits = MpsLimits(100, 4096)
    unit = clients.unit
    rows: list[dict[str, Any]] = []

    def measured(results: list[dict[str, Any]], seen: Any) -> dict[str, Any]:
        pids = [int(r["pid"]) for r in results if r.get("pid")]
        return {**summarize(results), **nvml_view(seen, pids, backend.process_name)}

    for k in ks:
        uids = [SWEEP_UID0 + i for i in range(k)]
        t0 = time.monotonic()
        specs = [await sweep.ensure(unit, user_tenant(NS, u), limits, grow=False) for u in uids]
        daemon_start_s = round(time.monotonic() - t0, 2)
        for s in specs:
            open_daemon(sweep.root, s)
        runs, seen = clients.together(
            [Job(str(s.pipe_dir), u) for s, u in zip(specs, uids, strict=True)], window_s, reading
        )
        daemons = measured(runs, seen)
        await sweep.reconcile([])
        await quiet(backend, gpu)
        one = await sweep.ensure(unit, user_tenant(NS, uids[0]), limits, grow=False)
        open_daemon(sweep.root, one)
        runs, seen = clients.together([Job(str(one.pipe_dir), uids[0])] * k, window_s, reading)
        one_daemon = measured(runs, seen)
        await sweep.reconcile([])
        await quiet(backend, gpu)
        runs, seen = clients.together([Job(None, uids[0])] * k, window_s, reading)
        sliced = measured(runs, seen)
        await quiet(backend, gpu)
        row = sweep_row(k, daemons, one_daemon, sliced, daemon_start_s)
        rows.append(row)
        reasons = shortfalls(row)
        check.record(f"sweep.k{k}", None,
                     f"{k} daemons: {daemons['tflops']} TFLOP/s ({daemons['ran']}/{k} ran, CUDA init max "
                     f"{daemons['cuda_init_max_s']} s, {daemons.get('servers')} servers of {daemons.get('server_mib')} "
                     f"MiB, daemons started in {daemon_start_s} s); one daemon with {k}: {one_daemon['tflops']} "
                     f"({row['vs_one_daemon']}); {k} time-sliced: {sliced['tflops']} ({row['vs_time_slicing']})"
                     f"{'; falls short: ' + '; '.join(reasons) if reasons else ''}", row=row)  # fmt: skip
        if k == ks[0] and not (daemons["ran"] or one_daemon["ran"] or sliced["ran"]):
            break  # nothing ran at the smallest k (the clients cannot run as other users?): the rest would not either
    rec = recommend(rows)
    print("\nThe daemon sweep (aggregate TFLOP/s of the k clients; CUDA init: the slowest client's):")
    for line in table(rows):
        print("  " + line)
    check.record("mps.daemon_sweep", None if rec["daemons_per_unit"] else False,
                 f"{rec['text']}; the ledger's defaults now: {DEFAULT_DAEMONS_PER_UNIT} daemons per unit, "
                 f"{MPS_DAEMON_MEMORY_MIB} MiB per daemon (rule: within {WITHIN:.0%} of one daemon with k clients, "
                 f"CUDA init at most {INIT_BOUND_S:g} s, every smaller k too)",
                 rows=rows, recommendation=rec, table=table(rows), window_s=window_s,
                 limits={"thread_percentage": limits.thread_percentage, "pinned_mem_mib": limits.pinned_mem_mib})  # fmt: skip


async def quiet(backend: Any, gpu: int, timeout_s: float = 15.0) -> None:
    """Wait until no process holds GPU ``gpu`` (stopped daemons' servers and ended clients let go), so that one
    run's servers are not counted in the next."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if not backend.processes(gpu):
                return
        except Exception:
            return
        await asyncio.sleep(0.2)


def ok_then_refused(r: dict[str, Any]) -> bool:
    """An alloc client whose first allocation fitted its limit and whose second did not."""
    alloc = r.get("alloc") or ["", ""]
    return len(alloc) >= 2 and alloc[0] == "ok" and str(alloc[1]).startswith("refused")


def pod_info(name: str) -> Any:
    from sharegpu.node.kube import PodInfo

    return PodInfo("gpu-check", name, name, "gpu-node", "Running")


def usage(reading: Any, pod_of_pid: dict[Any, str]) -> Any:
    """The agent's per-pod usage figures for ``reading``, the test clients standing in for pods."""
    from sharegpu.node.audit import attribute, pod_usage

    procs = attribute(reading, pod_of_pid.get, lambda pid: process_name(pid))
    return pod_usage(procs, reading.sm_percent, {n: pod_info(n) for n in pod_of_pid.values()})


def audit_of(reading: Any, pods: dict[str, Any], unit: str, gpu: int) -> Any:
    """The agent's audit of ``reading``, each test client a pod holding a 4 GiB MPS share of the GPU."""
    from sharegpu.model.assignment import Mechanism
    from sharegpu.node.audit import UnitShare, attribute, audit

    of_pid = {pid: name for name, pid in pods.items()}
    procs = attribute(reading, of_pid.get, lambda pid: process_name(pid))
    shares = {name: (UnitShare(unit, gpu, Mechanism.MPS, 4096, f"GPU {gpu}"),) for name in pods}
    return audit(procs, {n: pod_info(n) for n in pods}, shares, {gpu: reading.mps_clients is not None})


def process_name(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def vars_of(d: Any) -> dict[str, Any]:
    return {k: getattr(d, k) for k in d.__slots__}


def finish(check: Check, started: float) -> int:
    failed = [r["check"] for r in check.results if r["held"] is False]
    print(f"\n{len(check.results)} checks in {time.monotonic() - started:.0f} s; not held: {failed or 'none'}")
    print(f"details: {check.out / 'gpu_node_check.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
