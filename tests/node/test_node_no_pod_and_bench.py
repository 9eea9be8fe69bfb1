"""Issue 33: a process of no pod is told on the Node (it had a metric and a log line only, nothing a user looks at),
and the pod of `sharegpu bench`'s own Job (bound by nodeName, no assignment, the node's GPUs by design) is not a
finding (it was flagged, and with --evict-on-audit evicted mid-measurement)."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from node_fakes import FakeKube, agent_config, pod
from test_node_audit import FakeNotifier, _sim, _text

from proc_helpers import kubeconfig
from sharegpu.kube.schema import Pod
from sharegpu.node.agent import NodeAgent
from sharegpu.node.audit import BENCH_POD_LABELS, FindingKind
from sharegpu.node.dra.kube import LightkubeDraApi
from sharegpu.node.enforcement import COMPONENT
from sharegpu.node.kube import LightkubeApi, NodeInfo, pod_info
from sharegpu.node.mps import SimMpsDaemon

NS = "gpu-system"  # sharegpu's namespace, where the chart runs the agent and the bench Job


def _node(tmp: Path, notifier: FakeNotifier | None = None, **kw: Any) -> tuple[Any, list[str], FakeKube, NodeAgent]:
    sim, g = _sim()
    kube = FakeKube(NodeInfo("node-a", {}, {}, 32000, 256 * 1024))
    agent = NodeAgent(agent_config(tmp, tmp, **kw), sim, kube, SimMpsDaemon(sim), notifier=notifier)
    return sim, g, kube, agent


def _bench_pod(namespace: str = NS, labels: dict[str, str] | None = None) -> Any:
    """The chart's bench Job pod (templates/bench-job.yaml): its labels, no sharegpu.io/gpu, no assignment."""
    return pod(
        "sg-bench-x7k2p", None, namespace=namespace, gpus=(0,), phase="Running", labels=labels or BENCH_POD_LABELS
    )


def test_the_bench_jobs_pod_is_no_finding_and_is_not_evicted(tmp_path: Path) -> None:
    async def main() -> None:
        notifier = FakeNotifier()
        sim, g, kube, agent = _node(tmp_path, notifier, evict_on_audit=True, namespace=NS)
        bench = kube.add(_bench_pod())
        sim.add_process(4001, g[0], 9000, bench.uid)  # a dedicated-strategy client of the benchmark
        sim.add_process(4002, g[0], 9000, bench.uid)
        for _ in range(2):
            await agent.reconcile_once()
        assert agent.snapshot.findings == ()
        assert notifier.events == [] and notifier.evicted == [] and kube.node_events == []
        # A pod that merely wears the labels, outside sharegpu's namespace, is audited as any pod.
        copy = kube.add(_bench_pod(namespace="default"))
        sim.add_process(5001, g[1], 500, copy.uid)
        await agent.reconcile_once()
        assert [(f.kind, f.pod) for f in agent.snapshot.findings] == [(FindingKind.WRONG_UNIT, copy.name)]
        assert notifier.evicted == [("default", copy.name, copy.uid)]

    asyncio.run(main())


@pytest.mark.parametrize(
    ("namespace", "labels"),
    [
        ("", None),  # the agent's namespace unknown (run by hand): no pod is taken for the bench's
        (NS, {"app.kubernetes.io/name": "sharegpu-bench"}),  # not the Job's whole set of labels
    ],
)
def test_a_pod_not_known_for_the_bench_is_audited(
    tmp_path: Path, namespace: str, labels: dict[str, str] | None
) -> None:
    async def main() -> None:
        sim, g, kube, agent = _node(tmp_path, namespace=namespace)
        bench = kube.add(_bench_pod(labels=labels))
        sim.add_process(4001, g[0], 9000, bench.uid)
        await agent.reconcile_once()
        assert [f.kind for f in agent.snapshot.findings] == [FindingKind.WRONG_UNIT]

    asyncio.run(main())


def test_a_pod_with_the_bench_labels_that_asks_a_sharegpu_gpu_is_audited(tmp_path: Path) -> None:
    """The bench's Job asks no sharegpu.io/gpu: a pod that does is a workload whatever its labels (the audit found
    that dropping this condition survived every test)."""

    async def main() -> None:
        sim, g, kube, agent = _node(tmp_path, namespace=NS)
        wearer = kube.add(
            pod("sg-bench-x7k2p", None, namespace=NS, gpus=(1,), phase="Running", labels=BENCH_POD_LABELS)
        )
        sim.add_process(4001, g[0], 9000, wearer.uid)
        await agent.reconcile_once()
        assert [(f.kind, f.pod) for f in agent.snapshot.findings] == [(FindingKind.WRONG_UNIT, wearer.name)]

    asyncio.run(main())


def test_a_process_of_no_pod_is_told_on_the_node_once_with_what_to_do(tmp_path: Path) -> None:
    async def main() -> None:
        sim, g, kube, agent = _node(tmp_path, FakeNotifier())
        await agent.reconcile_once()
        sim.add_process(900, g[0], 300)  # a CUDA process started on the host, or in a container outside Kubernetes
        kube.fail_events = 1  # the API server refuses it once: tried again next reconcile
        await agent.reconcile_once()
        assert kube.node_events == []
        for _ in range(3):
            await agent.reconcile_once()
        ((node, reason, message, component),) = kube.node_events  # once while it lasts
        assert (node, reason, component) == ("node-a", "GpuAuditProcessOfNoPod", COMPONENT)
        assert f"process(es) 900 on GPU 0 ({g[0]}) belong to no pod" in message
        assert "`ps -o pid,user,args -p 900`" in message and "sharegpu.io/gpu" in message
        assert 'sharegpu_audit_findings{UUID="' in _text(agent)  # the metric stays
        sim.remove_process(900)
        await agent.reconcile_once()
        sim.add_process(900, g[0], 300)
        await agent.reconcile_once()
        assert len(kube.node_events) == 2  # gone and back: told again

    asyncio.run(main())


def test_without_a_notifier_a_process_of_no_pod_is_logged_and_counted_only(tmp_path: Path) -> None:
    async def main() -> None:
        sim, g, kube, agent = _node(tmp_path)
        sim.add_process(900, g[0], 300)
        await agent.reconcile_once()
        assert [f.kind for f in agent.snapshot.findings] == [FindingKind.NO_POD] and kube.node_events == []

    asyncio.run(main())


def test_pod_info_keeps_the_labels() -> None:
    p = Pod.model_validate(
        {
            "metadata": {"namespace": NS, "name": "b", "uid": "u", "labels": dict(BENCH_POD_LABELS)},
            "spec": {"nodeName": "node-a", "containers": [{"name": "bench", "image": "x"}]},
        }
    )
    assert pod_info(p).labels == BENCH_POD_LABELS


@pytest.mark.parametrize(
    ("api_class", "component"),
    [(LightkubeApi, COMPONENT), (LightkubeDraApi, "sharegpu-dra-driver")],  # the agent's client, the DRA driver's
)
def test_the_node_event_is_posted_where_kubectl_describe_node_finds_it(
    tmp_path: Path, api_class: type[LightkubeApi | LightkubeDraApi], component: str
) -> None:
    """As the kubelet records a Node's Events: in the default namespace, the involved object's UID the node's name
    (kubectl describe node searches for exactly that)."""
    posted: list[tuple[str, dict[str, Any]]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            posted.append((self.path, body))
            out = json.dumps(body | {"metadata": body["metadata"] | {"name": "node-a.1"}}).encode()
            self.send_response(201)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()

    async def main() -> None:
        api = api_class(kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{httpd.server_address[1]}"))
        try:
            await api.create_node_event("node-a", "GpuAuditProcessOfNoPod", "x" * 5000, component)
        finally:
            await api.close()

    try:
        asyncio.run(main())
    finally:
        httpd.shutdown()
    ((path, event),) = posted
    assert path.split("?")[0] == "/api/v1/namespaces/default/events"
    assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": "node-a"}
    assert (event["reason"], event["type"], event["source"]["component"]) == (
        "GpuAuditProcessOfNoPod",
        "Warning",
        component,
    )
    assert len(event["message"]) == 1024  # kept under the API server's limit
