"""A GPU check anyone can run: sharegpu's node code against a real NVIDIA GPU, no Kubernetes needed (under 5 minutes).

Run as root on a machine with an NVIDIA driver, ``nvidia-cuda-mps-control`` on PATH and CuPy (``pip install
'sharegpu[bench]'``) or PyTorch for the test clients::

    python bench/gpu_node_check.py --out gpucheck        # prints what held; gpucheck/gpu_node_check.json has it all

What it exercises, each with the node code the agent runs (``NvmlBackend``, ``MpsManager`` + ``NvidiaMpsDaemon``, the
placement core, the enforcement audit):

1. NVML backend: devices, MIG profiles, processes, device nodes, utilisation.
2. MPS limits set by the manager hold real CUDA clients (memory refused past the limit; compute capped).
3. One MPS server serves one Unix user at a time: a client of another UID waits; the placement core puts MPS shares
   of two users on different units; and whether two daemons on one GPU serve two users at once.
4. Pods without hostIPC: a daemon and a client in their own IPC, mount and PID namespaces.
5. Per-pod usage under MPS: what NVML reports per client, and what the agent makes of it.
6. The enforcement audit: a client that bypassed MPS (no pipe directory) is found.
7. Faults under MPS: a client's illegal-address fault and its MPS neighbour; what the MPS logs say.

It never changes a GPU's MIG mode and never resets a GPU. It uses GPU 0 (``--gpu`` to change). Exit code 0 when every
check held, 1 when one did not, 2 when the machine cannot run it (not root, no driver, no CuPy/PyTorch).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CLIENT = r"""
import json, os, sys, time
mode, args = sys.argv[1], json.loads(sys.argv[2])
out = {"mode": mode, "pid": os.getpid(), "uid": os.getuid(), "pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY")}
t0 = time.time()
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
    sync()
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
        while time.time() < args.get("start_at", 0): time.sleep(0.002)
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
        time.sleep(args.get("after_s", 0))
        try:
            k((1,), (32,), (cupy.uint64(0xDEAD0000000),)); cupy.cuda.runtime.deviceSynchronize(); out["fault"] = "no error"
        except Exception as e:
            out["fault"] = f"{type(e).__name__}: {str(e)[:120]}"
    out["ok"] = True
except Exception as e:
    out["ok"] = False; out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
print(json.dumps(out), flush=True)
"""

U1000 = ["setpriv", "--reuid", "1000", "--regid", "1000", "--clear-groups"]
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


class Clients:
    """Test clients as separate processes (MPS or not is decided by each one's environment at CUDA init)."""

    def __init__(self, work: Path, unit: str) -> None:
        self.script = work / "client.py"
        self.script.write_text(CLIENT)
        os.chmod(work, 0o755)
        os.chmod(self.script, 0o755)
        self.unit = unit

    def start(
        self, mode: str, args: dict[str, Any], pipe: str | None, prefix: list[str] | None = None, **env: str
    ) -> subprocess.Popen[str]:
        e = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
        e.update(CUDA_VISIBLE_DEVICES=self.unit, HOME="/tmp", **env)
        e["CUDA_MPS_PIPE_DIRECTORY"] = pipe or "/nonexistent-sharegpu-pipe"  # no daemon there: the client runs alone
        # CuPy's kernel cache of one user cannot be written by another (seen on the H200: a uid-1000 client failed).
        cache = self.script.parent / ("cupy-1000" if prefix == U1000 else "cupy-root")
        if not cache.is_dir():
            cache.mkdir()
            if prefix == U1000:
                os.chown(cache, 1000, 1000)
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


def open_dirs(*paths: Path) -> None:
    """Let a client of another UID reach a daemon's pipe directory (as a pod's container would through its mount)."""
    for p in paths:
        os.chmod(p, 0o777)
        for f in p.iterdir() if p.is_dir() else ():
            with contextlib.suppress(OSError):
                os.chmod(f, 0o777)


def tail(path: Path, n: int = 15) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("gpu-node-check"), help="folder for the JSON result")
    parser.add_argument("--gpu", type=int, default=0, help="index of the GPU to use (default 0)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("gpu_node_check: run it as root (it starts MPS daemons and clients of other users)", file=sys.stderr)
        return 2
    if shutil.which("nvidia-cuda-mps-control") is None:
        print(
            "gpu_node_check: nvidia-cuda-mps-control is not on PATH; is the NVIDIA driver installed?", file=sys.stderr
        )
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
    return asyncio.run(run_checks(args.out, args.gpu))


async def run_checks(out: Path, gpu: int) -> int:
    from sharegpu.ledger import Ledger
    from sharegpu.model.inventory import GpuDevice, NodeSpec
    from sharegpu.model.request import GpuRequest, Isolation
    from sharegpu.node.audit import read_gpu
    from sharegpu.node.backends.nvml import NvmlBackend
    from sharegpu.node.backends.nvml_api import PynvmlApi
    from sharegpu.node.mps import MpsLimits, MpsManager, NvidiaMpsDaemon
    from sharegpu.node.mps_faults import fault_lines
    from sharegpu.placement.fragmentation import Workload
    from sharegpu.placement.framework import Scheduler, Unschedulable
    from sharegpu.placement.policies import PolicyContext, make_policy

    check = Check(out)
    started = time.monotonic()
    work = Path("/tmp/sharegpu-gpu-node-check")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    os.chmod(work, 0o755)

    # 1. NVML backend --------------------------------------------------------------------------------------------
    backend = NvmlBackend(PynvmlApi())
    devices = backend.devices()
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

    # 2. MPS limits ----------------------------------------------------------------------------------------------
    try:
        solo = clients.run("rate", {"seconds": 2.0}, None)
        spec = await mps.ensure(unit, MpsLimits(25, 4096), grow=False)
        pipe = str(spec.pipe_dir)
        env = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4096M"}
        with_env = clients.run("alloc", {"gib": [2, 3]}, pipe, **env)
        no_env = clients.run("alloc", {"gib": [2, 3]}, pipe)
        capped = clients.run("rate", {"seconds": 2.0}, pipe, **env)
        ratio = (capped.get("tflops") or 0) / max(solo.get("tflops") or 1, 1e-9)
        mem_held = with_env.get("alloc", [""])[0] == "ok" and str(with_env.get("alloc", ["", ""])[1]).startswith(
            "refused"
        )
        daemon_held = no_env.get("alloc", [""])[0] == "ok" and str(no_env.get("alloc", ["", ""])[1]).startswith(
            "refused"
        )
        check.record("mps.memory_limit", mem_held and daemon_held,
                     f"4 GiB share: client with the agent's env {with_env.get('alloc')}; client with no env (daemon default) "
                     f"{no_env.get('alloc')}", with_env=with_env, no_env=no_env)  # fmt: skip
        check.record("mps.compute_limit", 0 < ratio < 0.6,
                     f"25 % of threads: {capped.get('tflops')} TFLOP/s against {solo.get('tflops')} alone ({ratio:.0%})",
                     solo=solo, capped=capped)  # fmt: skip

    except Exception as e:  # one section failing must not cost the others on a borrowed GPU
        check.record("section 2", False, f"2. MPS limits: stopped by {type(e).__name__}: {e}")
    # 3. One Unix user per MPS server ------------------------------------------------------------------------------
    try:
        open_dirs(work / "mps", spec.pipe_dir.parent, spec.pipe_dir, spec.log_dir)
        start_at = time.time() + 6
        root = clients.start("rate", {"seconds": 4.0, "start_at": start_at}, pipe)
        other = clients.start("rate", {"seconds": 1.0, "start_at": start_at}, pipe, prefix=U1000)
        r_root, r_other = clients.result(root), clients.result(other)
        waited = (r_other.get("init_s") or 0) >= 3.0
        check.record("mps.one_user_per_server", None if not r_other.get("ok") else waited,
                     f"uid 1000 beside a root client on one daemon: its CUDA init took {r_other.get('init_s')} s "
                     f"(root ran {r_root.get('tflops')} TFLOP/s for 4 s); waited = {waited}",
                     root=r_root, uid1000=r_other)  # fmt: skip
        node = NodeSpec("gpu-node", 64_000, 262_144, (GpuDevice(0, unit, dev.model),))
        reqs = [GpuRequest(f"p{u}", 1, compute_milli=200, memory_mib=4096, isolation=Isolation.MEMORY, user=u)
                for u in (1000, 0)]  # fmt: skip
        sched = Scheduler(Ledger([node]), make_policy("sharegpu", PolicyContext(Workload.from_requests(reqs))))
        first = sched.place(reqs[0])
        second = sched.decide(reqs[1])
        apart = isinstance(second, Unschedulable)
        check.record("placement.one_user_per_unit", apart,
                     f"uid 1000 placed as {first.assignment.shares[0].mechanism}; uid 0 on the same one-GPU node: "
                     f"{second.reason if isinstance(second, Unschedulable) else second.assignment}")  # fmt: skip
        # Two daemons on one GPU, one per user: do their clients run at once?
        mps_b = MpsManager(work / "mps-b", NvidiaMpsDaemon())
        spec_b = await mps_b.ensure(unit, MpsLimits(50, 8192), grow=False)
        open_dirs(work / "mps-b", spec_b.pipe_dir.parent, spec_b.pipe_dir, spec_b.log_dir)
        start_at = time.time() + 6
        a = clients.start("rate", {"seconds": 3.0, "start_at": start_at}, pipe)
        b = clients.start("rate", {"seconds": 3.0, "start_at": start_at}, str(spec_b.pipe_dir), prefix=U1000)
        ra, rb = clients.result(a), clients.result(b)
        together = bool(ra.get("ok") and rb.get("ok") and (rb.get("init_s") or 99) < 3.0)
        check.record("mps.two_daemons_one_gpu", None,
                     f"root on daemon A and uid 1000 on daemon B of the same GPU: concurrent={together}, "
                     f"{ra.get('tflops')} + {rb.get('tflops')} TFLOP/s, init {ra.get('init_s')} / {rb.get('init_s')} s",
                     a=ra, b=rb)  # fmt: skip
        await mps_b.reconcile([])

    except Exception as e:  # one section failing must not cost the others on a borrowed GPU
        check.record("section 3", False, f"3. One Unix user per MPS server: stopped by {type(e).__name__}: {e}")
    # 4. No hostIPC: client, then daemon too, in namespaces of their own --------------------------------------------
    try:
        own_ns = clients.run("alloc", {"gib": [2, 3]}, pipe, prefix=OWN_NAMESPACES)
        check.record("mps.client_without_host_ipc",
                     own_ns.get("alloc", [""])[0] == "ok" and str(own_ns.get("alloc", ["", ""])[1]).startswith("refused"),
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
        pair = [clients.start("rate", {"seconds": 4.0, "start_at": start_at}, pipe, **env) for _ in range(2)]
        time.sleep(max(0.0, start_at - time.time()) + 2.0)
        two = read_gpu(backend, dev)
        rp = [clients.result(p) for p in pair]
        start_at = time.time() + 5
        alone = clients.start("rate", {"seconds": 4.0, "start_at": start_at}, pipe, **env)
        time.sleep(max(0.0, start_at - time.time()) + 2.0)
        one = read_gpu(backend, dev)
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
        inside = clients.start("alloc", {"gib": [1], "hold_s": 5}, pipe, **env)
        time.sleep(4.0)
        reading = read_gpu(backend, dev)
        rb_, ri_ = clients.result(bypass), clients.result(inside)
        pods = {"pod-bypass": rb_.get("pid"), "pod-inside": ri_.get("pid")}
        found = audit_of(reading, pods, unit, dev.index)
        kinds = {(f.kind.value, f.pod) for f in found}
        check.record("audit.mps_bypass",
                     ("mps-bypass", "pod-bypass") in kinds and not any(pod == "pod-inside" for _, pod in kinds),
                     f"a client without its pipe directory (pid {rb_.get('pid')}) and one through MPS (pid "
                     f"{ri_.get('pid')}), both holding an MPS share: findings {sorted(kinds)}",
                     findings=[f.message for f in found], bypass=rb_, inside=ri_)  # fmt: skip

    except Exception as e:  # one section failing must not cost the others on a borrowed GPU
        check.record("section 6", False, f"6. Audit: a client that bypassed MPS: stopped by {type(e).__name__}: {e}")
    # 7. Faults under MPS --------------------------------------------------------------------------------------------
    try:
        start_at = time.time() + 5
        neighbour = clients.start("rate", {"seconds": 5.0, "start_at": start_at}, pipe, **env)
        faulty = clients.start("fault", {"after_s": 7.0}, pipe, **env)
        rn, rf = clients.result(neighbour), clients.result(faulty)
        lines = fault_lines(spec.log_dir)
        xids = backend.xid_events()
        check.record("fault.told", bool(lines or xids) if rn.get("died") else None,
                     f"the agent's fault signals: {len(lines)} MPS log line(s) matched "
                     f"{[ln.text[:80] for ln in lines[:3]]}, Xid events {[(x.gpu_index, x.xid) for x in xids]}")  # fmt: skip
        check.record("fault.mps_neighbour", None,
                     f"faulting client: {rf.get('fault') or rf.get('error')}; its MPS neighbour: "
                     f"{'died: ' + rn['died'] if rn.get('died') else 'ran on'}",
                     neighbour=rn, faulty=rf, control_log=tail(spec.log_dir / "control.log"),
                     server_log=tail(spec.log_dir / "server.log", 25))  # fmt: skip
        after = clients.run("alloc", {"gib": [1]}, pipe, **env)
        check.record(
            "fault.daemon_serves_after",
            bool(after.get("ok")),
            f"a new client after the fault: {after.get('alloc') or after.get('error')}",
        )
    except Exception as e:  # one section failing must not cost the others on a borrowed GPU
        check.record("section 7", False, f"7. Faults under MPS: stopped by {type(e).__name__}: {e}")
    try:
        await mps.reconcile([])
    except Exception as e:
        check.record("cleanup", False, f"the MPS daemon did not stop: {e}")
    return finish(check, started)


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
