"""Pods/s through the real kube-scheduler: sharegpu pods (chart profile + extender) against plain pods (the stock
scheduler), on the same rig and the same nodes, measured side by side in one run (issue 8, item 5).

Needs a running ../shared/k8s-rig (install.sh, start-all.sh) and SHAREGPU_TEST_KUBECONFIG set to its kubeconfig.

    uv run python bench/k8s_throughput.py                      # the five load nodes with node agents
    uv run python bench/k8s_throughput.py --openb              # 1,213 nodes with the openb node list's inventories
    uv run python bench/k8s_throughput.py --burst --pods 1000 --nodes 120 --rounds 2   # issue 34, item 3

Each round creates ``--pods`` pods at once (16 requests in flight) and times from the first create to the last
pod bound (seen on a watch); plain and sharegpu rounds alternate, medians are reported with their ratio. The
sharegpu pods are small MPS shares (2Gi, 5 %) that all fit; a bind refused (FailedScheduling) is counted.

The stock scheduler binds through its own API client, limited by default to 50 requests/s after a burst of 100:
rounds of more than 100 pods measure that limiter for plain pods (the extender binds with its own client).

``--burst`` (issue 34, item 3): ``--nodes`` fake nodes with inventories (H100 ×8 with one GPU in MIG mode, A100 ×8,
A30 ×4, as bench/extender_profile.py makes them; no node agents) and, per round, ``--pods`` sharegpu pods created at
once: small MPS shares, whole GPUs and MIG instances (``--mix``) in ``--namespaces`` namespaces, run as one of
``--users`` Unix users or (``--no-user``) as none. Beside them, in the same run and on the same nodes, as many plain
pods through the rig's stock kube-scheduler (its API client's default limiter) and through a stock one whose limiter
is raised (``--stock-qps``). Each pod is timed from its create to its bind; a round ends when all are bound or none
was bound for ``--quiet-s``. After each sharegpu round, from the API server's objects alone: every GPU's use
recomputed into a fresh ledger (no over-allocation, no MIG overlap), every pending pod judged by ``sharegpu status``
(none may be one that fits now), status and the recomputed use agree, and no bound pod took more than
``--max-attempts`` scheduling attempts (the chart's kube-scheduler's failed attempts per pod, from its --v=2 log).
Exits 1 on any violation.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "k8s"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from rig import KUBECONFIG, LOAD_NODES, SCHEDULER_NAME, Proc, Rig, audit, status_agrees, status_json

from sharegpu.model.catalog import DEFAULT_CATALOG
from sharegpu.model.contract import INVENTORY_ANNOTATION
from sharegpu.model.inventory import NodeSpec
from sharegpu.placement.reasons import ReasonKind
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


# ----- --burst: 1,000 pods at once onto 100+ nodes (issue 34, item 3) -------------------------------------------------
STOCK_FAST = "stock-unthrottled"  # a stock kube-scheduler whose API client limiter does not bind the plain rate
BURST_KINDS = ("mps", "whole", "mig")


def burst_pods(tag: str, n: int, seed: int, namespaces: list[str], mix: list[float], users: int,
               no_user: float) -> list[tuple[str, dict[str, Any]]]:  # fmt: skip
    """(namespace, pod) × n: small MPS shares (2Gi 5 % or 4Gi 10 %, isolation memory), whole GPUs and MIG instances
    (10Gi, isolation hardware) in the proportions ``mix``, spread over ``namespaces``; a pod runs as one of ``users``
    Unix users (runAsUser 1000...) or, with probability ``no_user``, declares none (an MPS tenant of its own)."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        ns = namespaces[rng.randrange(len(namespaces))]
        user = None if rng.random() < no_user else 1000 + rng.randrange(users)
        kind = rng.choices(BURST_KINDS, weights=mix)[0]
        ann: dict[str, str] = {}
        limits = {"sharegpu.io/gpu": "1"}
        if kind == "mps":
            mem, pct_ = rng.choice([("2Gi", "5"), ("4Gi", "10")])
            limits |= {"sharegpu.io/gpu-memory": mem, "sharegpu.io/gpu-compute": pct_}
            ann["sharegpu.io/isolation"] = "memory"
        elif kind == "mig":
            limits["sharegpu.io/gpu-memory"] = "10Gi"
            ann["sharegpu.io/isolation"] = "hardware"
        spec: dict[str, Any] = {
            "schedulerName": SCHEDULER_NAME,
            "restartPolicy": "Never",
            "containers": [{"name": "main", "image": "registry.example/app:1",
                            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": limits}}],
        }  # fmt: skip
        if user is not None:
            spec["securityContext"] = {"runAsUser": user}
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{tag}-{kind}-{i:04d}", "annotations": ann},
               "spec": spec}  # fmt: skip
        out.append((ns, pod))
    return out


def pct(xs: list[float], p: float) -> float:
    """The ``p``-th percentile by rank (the value at or below which ``p`` % of ``xs`` lie)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, -(-len(xs) * p // 100) - 1))] if xs else float("nan")


# The chart's kube-scheduler at --v=2 logs every attempt that does not end bound (klog's pod="ns/name" key).
_FAILED_ATTEMPT = re.compile(
    r'^[IEW]\d{4} (\d\d):(\d\d):(\d\d\.\d+) .*?"(?:Unable to schedule pod[^"]*|Error scheduling pod; retrying)"'
    r'.*?pod="([^"]+)"',
    re.MULTILINE,
)


def failed_attempts(log: str, after: float | None = None) -> Counter[str]:
    """Failed scheduling attempts per pod (namespace/name) in a kube-scheduler's --v=2 log; with ``after`` (a Unix
    time), only those logged after it (klog's header has the time of day, UTC here)."""
    out: Counter[str] = Counter()
    for m in _FAILED_ATTEMPT.finditer(log):
        if after is not None:
            of_day = int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
            if not 0 < (of_day - after) % 86400 < 43200:  # not after it (across midnight too)
                continue
        out[m.group(4)] += 1
    return out


def burst_round(rig: Rig, kind: str, items: list[tuple[str, dict[str, Any]]], pids: dict[str, int],
                args: argparse.Namespace, sched_log: Proc | None) -> dict[str, Any]:  # fmt: skip
    """Create ``items`` at once (16 creates in flight), time each pod from its create to its bind (seen on a watch)
    until all are bound or none was bound for ``--quiet-s``; for sharegpu pods, audit the result; then delete them."""
    from lightkube.resources.core_v1 import Pod

    per_ns = Counter(ns for ns, _ in items)
    watches = {ns: BoundWatch(rig, ns, c) for ns, c in per_ns.items()}
    models = [(ns, Pod.from_dict(p)) for ns, p in items]
    created: dict[tuple[str, str], float] = {}
    cpu0 = {k: cpu_s(p) for k, p in pids.items()}
    busy0, total0 = machine_cpu()

    def create(item: tuple[str, Any]) -> None:
        ns, pod = item
        created[(ns, pod.metadata.name)] = time.perf_counter()
        rig.client.create(pod, namespace=ns)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(create, models))
    create_s = time.perf_counter() - t0
    n = len(items)
    stalled = False
    while True:
        bound = sum(len(w.bound) for w in watches.values())
        last = max([w.last for w in watches.values()] + [t0 + create_s])
        if bound == n or any(w.error for w in watches.values()):
            break
        if time.perf_counter() - last > args.quiet_s:
            break
        if time.perf_counter() - t0 > args.timeout_s:
            stalled = True
            break
        time.sleep(0.2)
    errors = [w.error for w in watches.values() if w.error]
    if errors:
        raise SystemExit(errors[0])
    busy1, total1 = machine_cpu()
    cpu1 = {k: cpu_s(p) for k, p in pids.items()}
    to_bind = [watches[ns].bound[name] - t for (ns, name), t in created.items() if name in watches[ns].bound]
    last_bind = max((w.last for w in watches.values() if w.bound), default=t0)
    res: dict[str, Any] = {
        "kind": kind, "pods": n, "bound": len(to_bind), "create_s": round(create_s, 2),
        "first_create_to_last_bind_s": round(last_bind - t0, 2),
        "pods_per_s": round(len(to_bind) / max(last_bind - t0, 1e-9), 1),
        "create_to_bind_p50_ms": round(1000 * statistics.median(to_bind), 1) if to_bind else None,
        "create_to_bind_p99_ms": round(1000 * pct(to_bind, 99), 1) if to_bind else None,
        "create_to_bind_max_ms": round(1000 * max(to_bind), 1) if to_bind else None,
        "cpu_ms_per_pod": {k: round(1000 * (cpu1[k] - cpu0[k]) / n, 2) for k in pids},
        "machine_busy": round((busy1 - busy0) / max(total1 - total0, 1e-9), 2),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "stalled": stalled,
    }  # fmt: skip
    if kind == "sharegpu":
        last_bind_unix = time.time() - (time.perf_counter() - last_bind)
        res |= burst_checks(rig, items, sched_log, last_bind_unix)
    for ns in per_ns:
        rig.client.deletecollection(Pod, namespace=ns, grace_period=0)
    for ns in per_ns:
        while rig.pods(ns):
            time.sleep(0.5)
    time.sleep(2.0)  # the extender's and the schedulers' caches see the deletions before the next round
    return res


def burst_checks(
    rig: Rig, items: list[tuple[str, dict[str, Any]]], sched_log: Proc | None, last_bind: float
) -> dict[str, Any]:
    """What fits and what was bound, from the API server's objects: every GPU's use recomputed into a fresh ledger
    (``rig.audit``: no over-allocation, no MIG overlap), `sharegpu status` (a view of its own) for the pending pods
    and whether each really cannot fit now, and the kube-scheduler's failed attempts per pod."""
    from lightkube.resources.core_v1 import Node

    ours = {f"{ns}/{p['metadata']['name']}" for ns, p in items}
    namespaces = sorted({ns for ns, _ in items})
    pods = [p for ns in namespaces for p in rig.pods(ns)]
    nodes = [x.to_dict() for x in rig.client.list(Node, labels={"sharegpu-test/rig": rig.prefix})]
    result = audit(nodes, pods)
    # Independently of any placement code: the GPUs outside MIG mode that hold no pod's share. A whole-GPU pod left
    # pending while one is idle would be a pod that fits (every node has CPU and memory to spare for these pods).
    idle = [
        g.uuid
        for n in nodes
        if (text := n["metadata"].get("annotations", {}).get(INVENTORY_ANNOTATION))
        for g in NodeSpec.from_json(text, DEFAULT_CATALOG).gpus
        if g.healthy and not g.mig_pinned and g.uuid not in result.per_gpu
    ]
    report = status_json(rig)
    pending = [p for p in report["pending"] if p["pod"] in ours]
    pending_fits = [p["pod"] for p in pending if p["reason"] == ReasonKind.FITS.value]
    bound_keys = {f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in pods if p["spec"].get("nodeName")}
    unbound = ours - bound_keys
    log = sched_log.text() if sched_log is not None else ""
    failed = failed_attempts(log)
    # A pod that cannot fit is tried again while other pods are bound (each bind is a cluster event that requeues
    # it); later than the kube-scheduler's longest back-off (10 s) after the last bind, no attempt should follow: a
    # retry storm or a livelock would go on.
    after = sum(n for k, n in failed_attempts(log, last_bind + 10.0).items() if k in ours)
    attempts = {k: failed.get(k, 0) + (k in bound_keys) for k in ours}
    why: Counter[str] = Counter()
    for ns in namespaces:
        for e in rig.events(ns):
            if e.get("reason") == "FailedScheduling":
                why[re.sub(r"127\.0\.0\.1:\d+", "EXTENDER", e["message"])[:160]] += 1
    ext_log = "".join(p.text() for p in rig.procs if p.name.startswith("extender"))
    by_kind = Counter(k.split("/", 1)[1].split("-")[1] for k in unbound)
    return {
        "with_room": len(bound_keys & ours) + len(pending_fits),  # the pods that fit: bound, or judged to fit
        "pending": len(unbound),
        "pending_by_kind": dict(by_kind),
        "pending_reasons": dict(Counter(p["reason"] for p in pending)),
        "pending_not_in_status": len(unbound - {p["pod"] for p in pending}),
        "pending_that_fit": pending_fits[:10],
        "idle_gpus": len(idle),
        "over_allocations": result.findings[:10],
        "status_disagreements": status_agrees(report, result, rig.nodes)[:10],
        "max_attempts_bound": max((a for k, a in attempts.items() if k in bound_keys), default=0),
        "max_attempts_pending": max((a for k, a in attempts.items() if k not in bound_keys), default=0),
        "attempts_histogram": dict(sorted(Counter(attempts.values()).items())),
        "failed_attempts_10s_after_last_bind": after,
        "failed_scheduling_events": sum(why.values()),
        "failed_scheduling_why": dict(why.most_common(3)),
        "extender_binds_refused": ext_log.count("cannot bind"),
    }


def stock_fast_config(rig: Rig, qps: int) -> dict[str, Any]:
    """The stock default profile under its own name, its API client allowed ``qps`` (the rig's stock scheduler keeps
    the defaults, 50/s after a burst of 100, which bound a 1,000-pod round's binds: see the docstring)."""
    return {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": str(rig.k8s_real / "scheduler.kubeconfig"), "qps": qps, "burst": qps},
        "leaderElection": {"leaderElect": False},
        "profiles": [{"schedulerName": STOCK_FAST}],
    }


def burst_main(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from extender_profile import node_specs

    mix = [float(x) for x in args.mix.split(",")]
    with Rig.open() as rig:
        t = time.perf_counter()
        specs = node_specs(rig.prefix, args.nodes)
        for s in specs:
            rig.add_node(s.name.removeprefix(rig.prefix + "-"), [], agent=False, inventory=s)
        gpus = sum(len(s.gpus) for s in specs)
        print(f"{len(specs)} nodes, {gpus} GPUs made in {time.perf_counter() - t:.1f} s", flush=True)
        namespaces = [rig.namespace(f"{rig.prefix}-t{k}") for k in range(args.namespaces)]
        plain_ns = rig.namespace(f"{rig.prefix}-plain")
        ext, url = rig.start_extender()
        sched = rig.start_scheduler(url)
        fast = rig.start_scheduler(url, config_obj=stock_fast_config(rig, args.stock_qps), verbosity=0)
        pids_dir = rig.k8s_real / "pids"
        apiserver = int((pids_dir / "kube-apiserver.pid").read_text())
        stock = int((pids_dir / "kube-scheduler.pid").read_text())
        pids = {
            "plain": {"kube-scheduler": stock, "kube-apiserver": apiserver, "extender": ext.p.pid},
            "plain-fast": {"kube-scheduler": fast.p.pid, "kube-apiserver": apiserver, "extender": ext.p.pid},
            "sharegpu": {"kube-scheduler": sched.p.pid, "kube-apiserver": apiserver, "extender": ext.p.pid},
        }
        time.sleep(2.0)  # every scheduler's cache holds every node
        results = []
        kinds = ["plain", "plain-fast", "sharegpu"]
        for r in range(args.rounds):
            for kind in kinds if r % 2 == 0 else kinds[::-1]:
                if kind == "sharegpu":
                    items = burst_pods(f"b{r}", args.pods, args.seed + r, namespaces, mix, args.users, args.no_user)
                else:
                    items = [(plain_ns, plain_pod(i)) for i in range(args.pods)]
                    for _, p in items:
                        if kind == "plain-fast":
                            p["spec"]["schedulerName"] = STOCK_FAST
                res = burst_round(rig, kind, items, pids[kind], args, sched) | {"round": r}
                print(json.dumps(res), flush=True)
                results.append(res)
        if not ext.alive:
            print("the extender exited")
            return 1
    return burst_summary(args, len(specs), gpus, results)


def burst_summary(args: argparse.Namespace, n_nodes: int, gpus: int, results: list[dict[str, Any]]) -> int:
    def med(kind: str, key: str) -> Any:
        xs = [x[key] for x in results if x["kind"] == kind and x[key] is not None]
        return statistics.median(xs) if xs else None

    share = [x for x in results if x["kind"] == "sharegpu"]
    summary: dict[str, Any] = {"nodes": n_nodes, "gpus": gpus, "pods_per_round": args.pods, "rounds": args.rounds,
                               "mix_mps_whole_mig": args.mix, "namespaces": args.namespaces, "users": args.users,
                               "no_user": args.no_user}  # fmt: skip
    for kind in ("plain", "plain-fast", "sharegpu"):
        summary[kind] = {k: med(kind, k) for k in ("pods_per_s", "create_to_bind_p50_ms", "create_to_bind_p99_ms",
                                                   "bound", "first_create_to_last_bind_s")}  # fmt: skip
    summary["sharegpu"] |= {
        "bound_of_fits": [f"{x['bound']}/{x['with_room']}" for x in share],
        "pending": [x["pending"] for x in share],
        "max_attempts_bound": max(x["max_attempts_bound"] for x in share),
        "over_allocations": sum(len(x["over_allocations"]) for x in share),
        "status_disagreements": sum(len(x["status_disagreements"]) for x in share),
    }
    for kind in ("plain", "plain-fast"):
        summary[f"ratio_to_{kind}"] = round(med("sharegpu", "pods_per_s") / med(kind, "pods_per_s"), 2)
    violations = []
    for x in share:
        r = x["round"]
        if x["over_allocations"]:
            violations.append(f"round {r}: over-allocated: {x['over_allocations']}")
        if x["pending_that_fit"] or x["bound"] < x["with_room"]:
            violations.append(f"round {r}: pods that fit left pending: {x['pending_that_fit']}")
        if x["pending_by_kind"].get("whole") and x["idle_gpus"]:
            violations.append(
                f"round {r}: {x['pending_by_kind']['whole']} whole-GPU pods pending, {x['idle_gpus']} idle"
            )
        if x["pending_not_in_status"]:
            violations.append(f"round {r}: {x['pending_not_in_status']} pending pods that status does not judge")
        if x["status_disagreements"]:
            violations.append(f"round {r}: sharegpu status disagrees: {x['status_disagreements']}")
        if x["max_attempts_bound"] > args.max_attempts:
            violations.append(f"round {r}: a bound pod took {x['max_attempts_bound']} attempts > {args.max_attempts}")
    for x in results:
        if x["stalled"]:
            violations.append(f"round {x['round']} ({x['kind']}): still binding after {args.timeout_s:g} s")
        if x["kind"] != "sharegpu" and x["bound"] < x["pods"]:
            violations.append(f"round {x['round']} ({x['kind']}): {x['bound']}/{x['pods']} plain pods bound")
    summary["violations"] = violations
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps({"rounds": results, "summary": summary}, indent=2) + "\n")
    return 1 if violations else 0


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
    burst = ap.add_argument_group("--burst: one burst of --pods pods at once onto --nodes nodes (issue 34, item 3)")
    burst.add_argument("--burst", action="store_true", help="small MPS shares, whole GPUs and MIG of a few tenants")
    burst.add_argument("--nodes", type=int, default=120, help="fake nodes (H100 ×8 with one in MIG, A100 ×8, A30 ×4)")
    burst.add_argument("--mix", default="60,20,20", help="weights of MPS shares, whole GPUs and MIG instances")
    burst.add_argument("--namespaces", type=int, default=4, help="the tenants' namespaces")
    burst.add_argument("--users", type=int, default=3, help="runAsUser values (1000, 1001, ...)")
    burst.add_argument("--no-user", type=float, default=0.25, help="the share of pods that declare no user")
    burst.add_argument("--seed", type=int, default=0)
    burst.add_argument("--quiet-s", type=float, default=30.0, help="a round ends when no pod was bound for this long")
    burst.add_argument("--timeout-s", type=float, default=600.0, help="a round still binding after this is a stall")
    burst.add_argument("--max-attempts", type=int, default=3, help="most scheduling attempts a bound pod may take")
    burst.add_argument("--stock-qps", type=int, default=1000, help="API client qps and burst of the unthrottled stock")
    args = ap.parse_args()
    if args.profile and shutil.which("py-spy") is None:
        print("--profile needs py-spy on PATH (pip install py-spy)")
        return 2
    if not KUBECONFIG:
        print("set SHAREGPU_TEST_KUBECONFIG to a running k8s-rig's kubeconfig (see ../shared/k8s-rig/README.md)")
        return 2
    if args.burst:
        return burst_main(args)
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
