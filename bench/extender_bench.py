"""Extender speed: filter + prioritize over the openb cluster (1,213 nodes) through loopback HTTP.

One scheduling cycle is what the kube-scheduler sends for one pod: POST /filter with the pod and every node name
(nodeCacheCapable: true), then POST /prioritize with the nodes that passed. The cluster is first filled with trace
pods (as assignments on pods, the way a running cluster holds them) to ``--fill`` of its GPU capacity; the cycles
then use trace pods that are not placed (nothing is bound, so every cycle sees the same cluster).

    uv run python bench/extender_bench.py                     # defaults: openb default trace, fill 0.6, 2000 cycles
    uv run python bench/extender_bench.py --no-node-cache     # whole Node objects in and out instead of names

Prints cycles/s and latency percentiles; targets: >= 300 cycles/s and p99 <= 20 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import http.client
import json
import math
import multiprocessing
import pstats
import random
import socket
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.extender.server import Extender, make_app
from sharegpu.k8s.extender.warm import warm_all
from sharegpu.k8s.pod_request import pod_request
from sharegpu.k8s.serving.server import Listener, Site, serve_bound
from sharegpu.kube.schema import Node, Pod
from sharegpu.ledger import Ledger
from sharegpu.model.assignment import Assignment
from sharegpu.model.catalog import DEFAULT_CATALOG
from sharegpu.model.contract import INVENTORY_ANNOTATION
from sharegpu.model.request import GpuRequest
from sharegpu.placement.fragmentation import Workload
from sharegpu.placement.framework import Decision, Scheduler
from sharegpu.placement.policies import PolicyContext, make_policy
from sharegpu.sim.openb import load_nodes, load_pods

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "openb"


def pod_json(req: GpuRequest, uid: str) -> dict[str, Any]:
    ns, name = "bench", req.name.split("/")[-1]
    limits = {"cpu": f"{max(req.cpu_milli, 1)}m", "memory": f"{max(req.host_memory_mib, 1)}Mi"}
    if req.gpu_count:
        limits["sharegpu.io/gpu"] = str(req.gpu_count)
        if req.compute_milli is not None and req.compute_milli < 1000:
            # The contract asks for whole percent; the trace's milli rounds up (at most 0.9 % more).
            limits["sharegpu.io/gpu-compute"] = str(math.ceil(req.compute_milli / 10))
    annotations = {}
    models = sorted(req.allowed_models)
    if models and all(DEFAULT_CATALOG.known(m) for m in models):
        annotations["sharegpu.io/gpu-model"] = ",".join(models)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "uid": uid, "resourceVersion": "1", "annotations": annotations},
        "spec": {
            "schedulerName": "sharegpu-scheduler",
            "containers": [{"name": "main", "image": "x", "resources": {"limits": limits}}],
        },
        "status": {"phase": "Pending"},
    }


def key_of(pod: dict[str, Any]) -> tuple[object, ...]:
    """The shape key of the request the extender reads from ``pod``."""
    req = pod_request(Pod.model_validate(pod), DEFAULT_CATALOG)
    return () if req is None else req.shape_key()


def placed_pod_json(req: GpuRequest, a: Assignment, uid: str) -> dict[str, Any]:
    """``req`` as a running pod bound to its assignment's node, carrying the assignment (pods live in ``bench``)."""
    obj = pod_json(req, uid)
    obj["metadata"]["annotations"]["sharegpu.io/assignment"] = a.to_json().replace(
        f'"pod":"{a.pod}"', f'"pod":"bench/{a.pod}"'
    )
    obj["spec"]["nodeName"] = a.node
    obj["status"]["phase"] = "Running"
    return obj


def node_json(spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": spec.name,
            "uid": f"uid-{spec.name}",
            "annotations": {INVENTORY_ANNOTATION: spec.to_json()},
            "labels": {"kubernetes.io/hostname": spec.name},
        },
        "status": {"allocatable": {"cpu": f"{spec.cpu_milli}m", "memory": f"{spec.memory_mib}Mi"}},
    }


def fill(
    specs: list[Any], tasks: list[GpuRequest], target: float, how: str, policy: str, workload: Workload, seed: int
) -> tuple[list[tuple[GpuRequest, Assignment]], list[GpuRequest], int]:
    """Place trace pods until ``target`` of the GPU capacity is allocated: (placed, not placed, capacity).

    The fill only sets up the state that the cycles are then measured on. ``policy``: each pod placed by the
    policy under test (a full cycle per pod: about 20 min for 41,000 pods at 10,000 nodes). ``first-fit``: each pod
    on the first node, in a seeded random order of the nodes, that passes the filter, its GPUs chosen best-fit
    (the per-shape filter is incremental, so one pod costs about one node's refresh): seconds at any size.
    """
    if how == "policy":
        sched = Scheduler(Ledger(specs), make_policy(policy, PolicyContext(workload)), seed)
    else:
        sched = Scheduler(Ledger(specs), make_policy("bestfit", PolicyContext()), seed)
    order = np.random.default_rng(seed).permutation(len(sched.ledger.nodes))
    capacity = sched.ledger.total_gpu_milli
    goal = target * capacity
    allocated = 0
    placed: list[tuple[GpuRequest, Assignment]] = []
    rest: list[GpuRequest] = []
    for req in tasks:
        if allocated >= goal:
            rest.append(req)
            continue
        if how == "policy":
            d = sched.decide(req)
        else:
            ok = sched.feasible(req)[0][order]
            if not ok.any():
                continue
            d = sched.decide_on(req, int(order[int(np.argmax(ok))]))
        if isinstance(d, Decision):
            sched.ledger.place(d.assignment)
            allocated += sched.ledger.gpu_milli_of(d.assignment)
            placed.append((req, d.assignment))
    assert allocated == sched.ledger.allocated_gpu_milli
    return placed, rest, capacity


class InProcess:
    """The extender's ASGI app called directly (no sockets, no HTTP parsing): what a profile of the extender's own
    work should see. The app's middleware, request parsing and response encoding are all on this path."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        return self.loop.run_until_complete(self._post(path, body))

    async def _post(self, path: str, body: bytes) -> tuple[int, bytes]:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "query_string": b"",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
        }
        sent = False
        status = 0
        chunks: list[bytes] = []

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, send)
        return status, b"".join(chunks)

    def __enter__(self) -> InProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.close()


class Server:
    """The extender in a child process of its own, as it runs beside the kube-scheduler (forked after the view is
    built, so the child inherits it); the benchmark process is the client."""

    def __init__(self, app: Any, profile: Path | None = None) -> None:
        self.profile = profile  # cProfile the server process into this file (dumped when it stops)
        self.site = Site(app, Listener("127.0.0.1", 0), "scheduler extender")
        self.sock = self.site.listener.bind()
        self.port = self.sock.getsockname()[1]
        self.app = app
        self.proc = multiprocessing.get_context("fork").Process(target=self._serve, daemon=True)

    def _serve(self) -> None:
        profiler = cProfile.Profile() if self.profile else None
        if profiler is not None:
            profiler.enable()
        asyncio.run(serve_bound([(self.site, self.sock)]))  # until SIGTERM
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(str(self.profile))

    def __enter__(self) -> Server:
        self.proc.start()
        deadline = time.monotonic() + 20
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1)
                conn.request("GET", "/healthz")
                if conn.getresponse().status == 200:
                    conn.close()
                    return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the extender did not start")
            time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.join(10)
        self.sock.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=Path, default=DATA / "openb_node_list_gpu_node.csv")
    ap.add_argument("--pods", type=Path, default=DATA / "openb_pod_list_default.csv")
    ap.add_argument("--cycles", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument(
        "--no-warm",
        action="store_true",
        help="skip the extender's warm-up of the view's pod shapes (issue 34): the first cycle of each shape is cold",
    )
    ap.add_argument("--fill", type=float, default=0.6, help="fraction of GPU capacity placed before measuring")
    ap.add_argument("--policy", default="sharegpu")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--no-node-cache", action="store_true", help="send whole Node objects (nodeCacheCapable: false)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument(
        "--scale", type=int, default=0, help="replicate the node list (names suffixed) up to this many nodes"
    )
    ap.add_argument(
        "--fill-by",
        choices=["first-fit", "policy"],
        default="first-fit",
        help="how the fill places pods (it only sets up the state measured on): first-fit is seconds at any size, "
        "policy places each with the policy under test (minutes at 5,000 nodes)",
    )
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="call the extender's ASGI app in this process (no sockets): its own work only, for profiling",
    )
    ap.add_argument("--profile", type=Path, help="cProfile the measured cycles into this file (and print the top)")
    ap.add_argument("--profile-server", type=Path, help="cProfile the HTTP server process into this file")
    args = ap.parse_args()
    if not args.nodes.is_file() or not args.pods.is_file():
        print(f"openb trace not found at {args.nodes} / {args.pods}; pass --nodes and --pods", file=sys.stderr)
        return 2

    specs = load_nodes(args.nodes)
    base = specs
    if args.scale > len(specs):
        specs = [
            replace(s, name=f"{s.name}-r{i // len(base)}") for i, s in enumerate(base * (args.scale // len(base) + 1))
        ]
        specs = specs[: args.scale]
    tasks = [t.request for t in load_pods(args.pods)]
    if args.scale > len(base):
        # The workload grows with the cluster, so that it can fill it to --fill as well (names kept unique).
        tasks = [replace(t, name=f"{t.name}-r{k}") for k in range(args.scale // len(base) + 1) for t in tasks]
    rnd = random.Random(args.seed)
    rnd.shuffle(tasks)
    workload = Workload.from_requests(tasks)

    started = time.perf_counter()
    placed, rest, capacity = fill(specs, tasks, args.fill, args.fill_by, args.policy, workload, args.seed)
    fill_s = time.perf_counter() - started
    placed_pods: list[dict[str, Any]] = []
    for req, a in placed:
        placed_pods.append(placed_pod_json(req, a, f"uid-placed-{len(placed_pods)}"))
    node_objs = [node_json(s) for s in specs]
    view = ClusterView()
    started = time.perf_counter()
    view.reset([Node.model_validate(n) for n in node_objs], [Pod.model_validate(p) for p in placed_pods])
    rebuild_s = time.perf_counter() - started
    # A relist of the same cluster (every watch ends after 240-300 s): the objects as listed again, already parsed.
    again = ([Node.model_validate(n) for n in node_objs], [Pod.model_validate(p) for p in placed_pods])
    started = time.perf_counter()
    view.reset(*again)
    relist_s = time.perf_counter() - started
    view.synced = True
    alloc = view.ledger.allocated_gpu_milli / capacity
    ext = Extender(view, None, policy=args.policy, seed=args.seed, workload=workload)
    sched = ext.decisions.schedulers.placement()  # built before the fork, so that the report names the active policy
    warm_s = 0.0
    warmed_shapes = 0
    warmed_keys: set[tuple[object, ...]] = set()
    if not args.no_warm:
        # issue 34: as the running extender's keep_warm does once the view is listed (here all at once, untimed
        # by the cycles): every shape of the pods the view holds filtered and scored on every node.
        started = time.perf_counter()
        warmed_shapes = warm_all(sched, ext.decisions.schedulers)
        warmed_keys = {r.shape_key() for r in ext.decisions.schedulers.warm_requests()}
        warm_s = time.perf_counter() - started
    names = [s.name for s in specs]
    cycle_reqs = rest[: args.cycles + args.warmup]
    if len(cycle_reqs) < args.cycles + args.warmup:
        cycle_reqs = (cycle_reqs * (1 + (args.cycles + args.warmup) // max(1, len(cycle_reqs))))[
            : args.cycles + args.warmup
        ]
    cycle_pods = [pod_json(r, f"uid-cycle-{i}") for i, r in enumerate(cycle_reqs)]
    # A cycle whose request shape no earlier cycle had is cold: the scheduler filters, scores and explains every node
    # for that shape afresh (its caches are per shape). A running extender has seen its workload's shapes; a
    # benchmark of a thousand cycles meets many for the first time, and those make its p99.
    # The shape as the extender reads it from the pod (whole percent of compute, etc.), not the trace's request.
    cycle_keys = [key_of(p) for p in cycle_pods]
    seen_shapes: set[tuple[object, ...]] = set()
    cold: list[bool] = []
    for k in cycle_keys:
        cold.append(k not in seen_shapes)
        seen_shapes.add(k)

    app = make_app(ext)
    # The node names are the same every cycle: encoded once, as the kube-scheduler's own cost, not the extender's.
    names_bytes = json.dumps(names).encode()
    lat: list[float] = []
    filt: list[float] = []
    passed_counts: list[int] = []
    warm: list[bool] = []
    client: list[float] = []  # the benchmark's own JSON work per cycle (encoding requests, decoding answers)
    with contextlib.ExitStack() as stack:
        if args.in_process:
            call = stack.enter_context(InProcess(app)).post
        else:
            srv = stack.enter_context(Server(app, args.profile_server))
            conn = http.client.HTTPConnection("127.0.0.1", srv.port)
            conn.connect()
            stack.callback(conn.close)
            # As the kube-scheduler's Go client does: no Nagle delay on small writes.
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def call(path: str, body: bytes) -> tuple[int, bytes]:
                conn.request("POST", path, body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                return resp.status, resp.read()

        spent = 0.0  # in-process: the app's own time only (the client's JSON work is left out)

        def post(path: str, body: bytes) -> Any:
            nonlocal spent
            t = time.perf_counter()
            status, data = call(path, body)
            spent += time.perf_counter() - t
            if status != 200:
                raise SystemExit(f"{path}: HTTP {status}: {data[:300]!r}")
            return json.loads(data)

        profiler = cProfile.Profile() if args.profile else None
        total_started = time.perf_counter()
        for i, pod in enumerate(cycle_pods):
            if i == args.warmup:
                total_started = time.perf_counter()
                if profiler is not None:
                    profiler.enable()
            t0 = time.perf_counter()
            spent = 0.0
            if args.no_node_cache:
                f = post("/filter", json.dumps({"Pod": pod, "Nodes": {"items": node_objs}, "NodeNames": None}).encode())
                passed = f["Nodes"]["items"]
                t1, in_filter = time.perf_counter(), spent
                post("/prioritize", json.dumps({"Pod": pod, "Nodes": {"items": passed}, "NodeNames": None}).encode())
                n_passed = len(passed)
            else:
                pod_bytes = json.dumps(pod).encode()
                f = post("/filter", b'{"Pod":' + pod_bytes + b',"Nodes":null,"NodeNames":' + names_bytes + b"}")
                t1, in_filter = time.perf_counter(), spent
                passed_bytes = json.dumps(f["NodeNames"]).encode()
                post("/prioritize", b'{"Pod":' + pod_bytes + b',"Nodes":null,"NodeNames":' + passed_bytes + b"}")
                n_passed = len(f["NodeNames"])
            t2 = time.perf_counter()
            if i >= args.warmup:
                if args.in_process:
                    lat.append(spent * 1000)
                    filt.append(in_filter * 1000)
                else:
                    lat.append((t2 - t0) * 1000)
                    filt.append((t1 - t0) * 1000)
                passed_counts.append(n_passed)
                warm.append(not cold[i])
                client.append((t2 - t0 - spent) * 1000)
        total = time.perf_counter() - total_started
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)

    warm_lat = sorted(x for x, w in zip(lat, warm, strict=True) if w)
    lat.sort()
    filt.sort()

    def pct(xs: list[float], p: float) -> float:
        return xs[min(len(xs) - 1, math.ceil(p / 100 * len(xs)) - 1)]

    figures = {
        "nodes": len(specs),
        "gpus": int(sum(len(s.gpus) for s in specs)),
        "policy": ext.decisions.schedulers.active_policy,
        "node_cache": not args.no_node_cache,
        "pods_placed_before": len(placed_pods),
        "fill_by": args.fill_by,
        "fill_s": round(fill_s, 1),
        "gpu_allocated_pct": round(100 * alloc, 1),
        "transport": "in-process" if args.in_process else "loopback HTTP",
        "rebuild_s": round(rebuild_s, 3),
        "relist_s": round(relist_s, 3),
        "cycles": len(lat),
        # In-process: the app's own time only; over HTTP: wall time, the client's JSON work included.
        "cycles_per_s": round(1000 * len(lat) / sum(lat) if args.in_process else len(lat) / total, 1),
        "cycle_p50_ms": round(statistics.median(lat), 2),
        "cycle_p99_ms": round(pct(lat, 99), 2),
        "cycle_max_ms": round(lat[-1], 2),
        "filter_p99_ms": round(pct(filt, 99), 2),
        "client_json_p50_ms": round(statistics.median(client), 2),
        # first of their shape among the cycles (warm-up cycles included), whether warmed beforehand or not
        "cold_cycles": len(lat) - len(warm_lat),
        "warmed_shapes": warmed_shapes,
        "warm_up_s": round(warm_s, 2),
        # the first-of-shape cycles whose shape the warm-up did not cover: the cycles still cold
        "cold_cycles_not_warmed": sum(
            1 for i, k in enumerate(cycle_keys) if i >= args.warmup and cold[i] and k not in warmed_keys
        ),
        "warm_cycle_p50_ms": round(statistics.median(warm_lat), 2) if warm_lat else None,
        "warm_cycle_p99_ms": round(pct(warm_lat, 99), 2) if warm_lat else None,
        "nodes_passing_filter_median": int(statistics.median(passed_counts)),
    }
    for k, v in figures.items():
        print(f"{k:>30}: {v}")
    ok = figures["cycles_per_s"] >= 300 and figures["cycle_p99_ms"] <= 20
    print(f"{'target (>=300/s, p99<=20ms)':>30}: {'met' if ok else 'NOT met'}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
