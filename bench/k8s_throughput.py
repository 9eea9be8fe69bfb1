"""Pods/s through the real kube-scheduler: sharegpu pods (chart profile + extender) against plain pods (the stock
scheduler), on the same rig and the same nodes, measured side by side in one run (issue 8, item 5).

Needs a running ../shared/k8s-rig (install.sh, start-all.sh) and SHAREGPU_TEST_KUBECONFIG set to its kubeconfig.

    uv run python bench/k8s_throughput.py                      # the five load nodes with node agents
    uv run python bench/k8s_throughput.py --openb              # 1,213 nodes with the openb node list's inventories

Each round creates ``--pods`` pods at once (16 requests in flight) and times from the first create to the last
pod bound (seen on a watch); plain and sharegpu rounds alternate, medians are reported with their ratio. The
sharegpu pods are small MPS shares (2Gi, 5 %) that all fit; a bind refused (FailedScheduling) is counted.

The stock scheduler binds through its own API client, limited by default to 50 requests/s after a burst of 100:
rounds of more than 100 pods measure that limiter for plain pods (the extender binds with its own client).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "k8s"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from rig import KUBECONFIG, LOAD_NODES, SCHEDULER_NAME, Rig

from sharegpu.sim.openb import load_nodes

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "openb"


def plain_pod(i: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"plain-{i:04d}"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "main", "image": "x", "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}}}],
        },
    }


def share_pod(i: int) -> dict[str, Any]:
    limits = {"sharegpu.io/gpu": "1", "sharegpu.io/gpu-memory": "2Gi", "sharegpu.io/gpu-compute": "5"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"share-{i:04d}", "annotations": {"sharegpu.io/isolation": "memory"}},
        "spec": {
            "schedulerName": SCHEDULER_NAME,
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "main",
                    "image": "x",
                    "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": limits},
                }
            ],
        },
    }


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu() -> dict[int, tuple[str, float]]:
    """Every process's (role, CPU seconds so far): where a round's machine CPU went, the bench's own included."""
    out: dict[int, tuple[str, float]] = {}
    hz = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone since listed
            continue
        out[int(entry)] = (_role(cmd), (int(fields[11]) + int(fields[12])) / hz)
    return out


def _role(cmd: str) -> str:
    if "kube-scheduler" in cmd:
        return "kube-scheduler (chart)" if "scheduler-config" in cmd else "kube-scheduler (stock)"
    for role in ("kube-apiserver", "kube-controller-manager", "etcd", "node-agent", "scheduler-extender"):
        if role in cmd:
            return role
    return "bench" if "k8s_throughput" in cmd else "other"


def cpu_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], n: int) -> dict[str, float]:
    spent: Counter[str] = Counter()
    for pid, (role, cpu) in after.items():
        spent[role] += cpu - before.get(pid, (role, 0.0))[1]
    return {role: round(1000 * cpu / n, 2) for role, cpu in spent.most_common() if cpu > 0}


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, all cores (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(fields) - idle) / hz, sum(fields) / hz


class BoundWatch(threading.Thread):
    """When each pod of namespace ``ns`` was first seen bound, from a watch (polling lists would cost the machine
    CPU in proportion to a round's length, and so slow the slower path more); ``done`` is set at the n-th."""

    def __init__(self, rig: Rig, ns: str, n: int) -> None:
        super().__init__(daemon=True)
        self.rig, self.ns, self.n = rig, ns, n
        self.bound: dict[str, float] = {}
        self.last = 0.0
        self.error = ""
        self.ready, self.done = threading.Event(), threading.Event()
        self.start()
        if not self.ready.wait(30):
            raise SystemExit(f"cannot watch the pods of {ns}")

    def run(self) -> None:
        http = self.rig.client._client._client  # lightkube's own HTTP client: the rig's server and credentials
        path = f"/api/v1/namespaces/{self.ns}/pods"
        # From a listed version: a watch without one waits for the watch cache to be fresh (ERROR 504 after 3 s).
        version = http.get(path).json()["metadata"]["resourceVersion"]
        params = {"watch": "true", "resourceVersion": version}
        with http.stream("GET", path, params=params, timeout=None) as response:
            self.ready.set()
            for line in response.iter_lines():
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    self.error = f"the watch of {self.ns} broke: {obj.get('message')}"
                    self.done.set()
                    return
                name = (obj.get("metadata") or {}).get("name")
                if name and (obj.get("spec") or {}).get("nodeName") and name not in self.bound:
                    self.last = self.bound[name] = time.perf_counter()
                    if len(self.bound) == self.n:
                        self.done.set()
                        return


def api_requests(rig: Rig) -> Counter[str]:
    """The API server's request counts so far (apiserver_request_total), by client, verb, resource and code."""
    http = rig.client._client._client  # lightkube's own HTTP client: the rig's server and credentials
    text = http.get("/metrics").text
    out: Counter[str] = Counter()
    for line in text.splitlines():
        if line.startswith("apiserver_request_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            what = "/".join(x for x in (labels.get("resource"), labels.get("subresource")) if x)
            out[f"{labels.get('system_client') or '?'} {labels['verb']} {what} {labels['code']}"] += int(
                float(line.rsplit(" ", 1)[1])
            )
    return out


def one_round(
    rig: Rig,
    kind: str,
    n: int,
    extender_pid: int,
    scheduler_pids: dict[str, int],
    requests: bool = False,
    profile: Path | None = None,
) -> dict[str, Any]:
    ns = rig.namespace()
    req0 = api_requests(rig) if requests else Counter()
    pods = [plain_pod(i) if kind == "plain" else share_pod(i) for i in range(n)]
    cpu0 = cpu_s(extender_pid)
    # The CPU of the kube-scheduler that schedules this round's pods: the rig's stock one for plain pods, the one
    # running the chart's profile for sharegpu pods (where the time per pod goes besides the extender).
    sched_pid = scheduler_pids[kind]
    sched0 = cpu_s(sched_pid)
    api0 = cpu_s(scheduler_pids["apiserver"])
    watch = BoundWatch(rig, ns, n)
    busy0, total0 = machine_cpu()
    procs0 = process_cpu()
    spy = _profile(extender_pid, profile, ns) if profile and kind == "sharegpu" else None
    started = time.perf_counter()
    rig.create_pods(ns, pods)
    created = time.perf_counter() - started
    if not watch.done.wait(300):
        reasons = Counter(str(e.get("message")) for e in rig.events(ns) if e.get("reason") == "FailedScheduling")
        ext_log = next(p for p in rig.procs if p.name == "extender").text()[-3000:]
        raise SystemExit(
            f"{kind}: only {len(watch.bound)}/{n} bound after 300 s; FailedScheduling: {dict(reasons)}\n"
            f"extender log (end):\n{ext_log}"
        )
    if watch.error:
        raise SystemExit(watch.error)
    elapsed = watch.last - started
    busy1, total1 = machine_cpu()
    by_role = cpu_by_role(procs0, process_cpu(), n)
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        spy.wait(30)
    cpu = cpu_s(extender_pid) - cpu0
    sched_cpu = cpu_s(sched_pid) - sched0
    api_cpu = cpu_s(scheduler_pids["apiserver"]) - api0
    refused = sum(1 for e in rig.events(ns) if e.get("reason") == "FailedScheduling")
    per_pod = {}
    if requests:  # what the API server was asked during the round, per pod (the bench's own polls included)
        diff = api_requests(rig) - req0
        per_pod = {k: round(v / n, 2) for k, v in sorted(diff.items(), key=lambda kv: -kv[1]) if v >= n / 10}
    from lightkube.resources.core_v1 import Pod

    rig.client.deletecollection(Pod, namespace=ns, grace_period=0)
    while rig.pods(ns):
        time.sleep(0.2)
    return {"kind": kind, "pods": n, "seconds": round(elapsed, 3), "create_s": round(created, 3),
            "pods_per_s": round(n / elapsed, 1), "failed_scheduling": refused,
            "extender_cpu_ms_per_pod": round(1000 * cpu / n, 2),
            "scheduler_cpu_ms_per_pod": round(1000 * sched_cpu / n, 2),
            "apiserver_cpu_ms_per_pod": round(1000 * api_cpu / n, 2),
            "machine_cpu_ms_per_pod": round(1000 * (busy1 - busy0) / n, 2),
            "machine_busy": round((busy1 - busy0) / max(total1 - total0, 1e-9), 2),
            "cpu_ms_per_pod_by_process": by_role,
            **({"api_requests_per_pod": per_pod} if requests else {})}  # fmt: skip


def _profile(pid: int, folder: Path, ns: str) -> subprocess.Popen[bytes]:
    """py-spy sampling the extender for one round (stopped with SIGINT, it writes what it sampled so far)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{ns}.folded"
    argv = ["py-spy", "record", "-p", str(pid), "-r", "250", "-f", "raw", "-o", str(out), "--nonblocking"]
    spy = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)  # attached before the first pod is created
    return spy


def openb_nodes(rig: Rig, path: Path) -> int:
    specs = load_nodes(path)
    # One at a time: lightkube's models are not safe to decode from several threads (about 30 s for 1,213 nodes).
    for s in specs:
        rig.add_node(s.name.lower(), [], agent=False, inventory=_renamed(rig, s), cpu=f"{s.cpu_milli}m",
                     memory=f"{s.memory_mib}Mi")  # fmt: skip
    return len(specs)


def _renamed(rig: Rig, spec: Any) -> Any:
    from dataclasses import replace

    return replace(spec, name=f"{rig.prefix}-{spec.name.lower()}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each kind, alternating")
    ap.add_argument("--openb", action="store_true", help="1,213 nodes from the openb node list (no agents)")
    ap.add_argument("--nodes-csv", type=Path, default=DATA / "openb_node_list_gpu_node.csv")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--requests", action="store_true", help="per round, the API requests per pod by client and verb")
    ap.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="sample the extender with py-spy during each sharegpu round (DIR/<namespace>.folded)",
    )
    args = ap.parse_args()
    if args.profile and shutil.which("py-spy") is None:
        print("--profile needs py-spy on PATH (pip install py-spy)")
        return 2
    if not KUBECONFIG:
        print("set SHAREGPU_TEST_KUBECONFIG to a running k8s-rig's kubeconfig (see ../shared/k8s-rig/README.md)")
        return 2
    with Rig.open() as rig:
        if args.openb:
            n_nodes = openb_nodes(rig, args.nodes_csv)
        else:
            for suffix, gpus in LOAD_NODES.items():
                rig.add_node(suffix, gpus)
            rig.wait_nodes_published()
            n_nodes = len(LOAD_NODES)
        ext, url = rig.start_extender()
        sched = rig.start_scheduler(url)
        pids_dir = rig.k8s_real / "pids"
        pids = {
            "plain": int((pids_dir / "kube-scheduler.pid").read_text()),
            "sharegpu": sched.p.pid,
            "apiserver": int((pids_dir / "kube-apiserver.pid").read_text()),
        }
        time.sleep(2.0)  # both schedulers' caches hold every node before the first round
        results = []
        for r in range(args.rounds):
            for kind in ("plain", "sharegpu") if r % 2 == 0 else ("sharegpu", "plain"):
                res = one_round(rig, kind, args.pods, ext.p.pid, pids, args.requests, args.profile)
                print(json.dumps(res))
                results.append(res)
        rig_extender_log = next(p for p in rig.procs if p.name == "extender").text()
    med = {k: statistics.median(x["pods_per_s"] for x in results if x["kind"] == k) for k in ("plain", "sharegpu")}
    cpu = {k: statistics.median(x["extender_cpu_ms_per_pod"] for x in results if x["kind"] == k) for k in med}
    sched_cpu = {k: statistics.median(x["scheduler_cpu_ms_per_pod"] for x in results if x["kind"] == k) for k in med}
    api_cpu = {k: statistics.median(x["apiserver_cpu_ms_per_pod"] for x in results if x["kind"] == k) for k in med}
    summary = {
        "nodes": n_nodes,
        "pods_per_round": args.pods,
        "rounds": args.rounds,
        "plain_pods_per_s_median": med["plain"],
        "sharegpu_pods_per_s_median": med["sharegpu"],
        "ratio": round(med["sharegpu"] / med["plain"], 2),
        "extender_cpu_ms_per_pod_median": cpu,
        "scheduler_cpu_ms_per_pod_median": sched_cpu,
        "apiserver_cpu_ms_per_pod_median": api_cpu,
        "load_average": os.getloadavg(),
        "sharegpu_failed_scheduling": sum(x["failed_scheduling"] for x in results if x["kind"] == "sharegpu"),
        "extender_binds_refused": rig_extender_log.count("cannot bind"),
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps({"rounds": results, "summary": summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
