"""Issue 33 on a DRA node, as on the agent's (tests/node/test_node_no_pod_and_bench.py): the pod of `sharegpu bench`'s
own Job is not audited, a process of no pod is told on the Node, and the driver's Events name the driver. The DRA
watch now runs the agent's pass (sharegpu.node.watch.NodeWatch); before, it audited the bench pod (and with
--evict-on-audit evicted it), told a process of no pod to no one, and posted its Events as the node agent."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from dra_fakes import Api, Notifier, backend, driver
from test_dra_watch import TA, pipe, two_tenants

from sharegpu.node.audit import BENCH_POD_LABELS, FindingKind
from sharegpu.node.backends.sim import SimBackend
from sharegpu.node.dra.watch import DraWatch

NS = "gpu-system"  # sharegpu's namespace, where the chart runs the driver and the bench Job
DRIVER = "sharegpu-dra-driver"


def bench_pod(api: Api, name: str, namespace: str = NS, labels: dict[str, str] | None = None) -> str:
    """The chart's bench Job pod (templates/bench-job.yaml): its labels, bound by nodeName, no claim; its UID."""
    meta = {"namespace": namespace, "name": name, "uid": f"uid-{name}", "labels": dict(labels or BENCH_POD_LABELS)}
    api.pods[name] = {"metadata": meta, "spec": {"nodeName": "n1", "containers": [{"name": "bench", "image": "x"}]}}
    return str(meta["uid"])


def test_the_bench_jobs_pod_is_no_finding_and_is_not_evicted(root: Path) -> None:
    sim, api = backend(), Api()
    gpu = sim.devices()[0].uuid
    notifier = Notifier()
    watch = DraWatch(driver(root, api, sim), notifier, evict=True, namespace=NS, node_events=api)
    uid = bench_pod(api, "sg-bench-x7k2p")
    sim.add_process(4001, gpu, 9000, uid)  # the benchmark's clients, on a GPU no claim gives it
    sim.add_process(4002, gpu, 9000, uid)

    async def main() -> None:
        for _ in range(2):
            assert (await watch.check(await api.pods_on_node("n1"))).findings == ()
        assert notifier.events == [] and notifier.evicted == [] and api.node_events == []
        # A pod that merely wears the labels, outside sharegpu's namespace, is audited as any pod.
        copy = bench_pod(api, "copy", namespace="default")
        sim.add_process(5001, gpu, 500, copy)
        got = await watch.check(await api.pods_on_node("n1"))
        assert [(f.kind, f.pod) for f in got.findings] == [(FindingKind.WRONG_UNIT, "copy")]
        assert notifier.evicted == ["default/copy"]

    asyncio.run(main())


@pytest.mark.parametrize(
    ("namespace", "labels"),
    [
        ("", None),  # the driver's namespace unknown (run by hand): no pod is taken for the bench's
        (NS, {"app.kubernetes.io/name": "sharegpu-bench"}),  # not the Job's whole set of labels
    ],
)
def test_a_pod_not_known_for_the_bench_is_audited(root: Path, namespace: str, labels: dict[str, str] | None) -> None:
    sim, api = backend(), Api()
    watch = DraWatch(driver(root, api, sim), Notifier(), namespace=namespace)
    sim.add_process(4001, sim.devices()[0].uuid, 9000, bench_pod(api, "b", labels=labels))
    got = asyncio.run(watch.check(asyncio.run(api.pods_on_node("n1"))))
    assert [f.kind for f in got.findings] == [FindingKind.WRONG_UNIT]


def test_a_bench_labelled_pod_that_holds_a_claim_is_audited(root: Path) -> None:
    """The DRA counterpart of the agent's "no assignment": a pod with a prepared claim is a user's, whatever its
    labels say (the Job asks for no claim)."""
    sim, api, d, _ = two_tenants(root)  # pa (claim a, MPS) and pb, in namespace ns
    api.pods["pa"]["metadata"]["labels"] = dict(BENCH_POD_LABELS)
    sim.add_process(101, sim.devices()[0].uuid, 500, "uid-pa")  # its own context beside its MPS claim
    notifier = Notifier()
    got = asyncio.run(DraWatch(d, notifier, namespace="ns").check(asyncio.run(api.pods_on_node("n1"))))
    assert [(f.kind, f.pod) for f in got.findings] == [(FindingKind.MPS_BYPASS, "pa")]
    assert notifier.told() == [("pa", "GpuAuditMpsBypassed")]


def test_a_process_of_no_pod_is_told_on_the_drivers_node_once_with_what_to_do(root: Path) -> None:
    sim, api = backend(), Api()
    gpu = sim.devices()[0].uuid
    watch = DraWatch(driver(root, api, sim), Notifier(), node_events=api)

    async def main() -> None:
        pods = await api.pods_on_node("n1")
        await watch.check(pods)
        sim.add_process(900, gpu, 300)  # a CUDA process started on the host, or in a container outside Kubernetes
        api.fail_events = 1  # the API server refuses it once: tried again next pass
        await watch.check(pods)
        assert api.node_events == []
        for _ in range(3):
            await watch.check(pods)
        ((node, reason, message, component),) = api.node_events  # once while it lasts
        assert (node, reason, component) == ("n1", "GpuAuditProcessOfNoPod", DRIVER)
        assert f"process(es) 900 on GPU 0 ({gpu}) belong to no pod" in message
        assert "`ps -o pid,user,args -p 900`" in message
        sim.remove_process(900)
        await watch.check(pods)
        sim.add_process(900, gpu, 300)
        await watch.check(pods)
        assert len(api.node_events) == 2  # gone and back: told again

    asyncio.run(main())


def test_without_a_notifier_a_process_of_no_pod_is_logged_and_counted_only(root: Path) -> None:
    sim, api = backend(), Api()
    sim.add_process(900, sim.devices()[0].uuid, 300)
    got = asyncio.run(DraWatch(driver(root, api, sim), None, node_events=api).check([]))
    assert [f.kind for f in got.findings] == [FindingKind.NO_POD] and api.node_events == []


def test_the_drivers_events_name_the_driver(root: Path) -> None:
    """Findings, their evictions and MPS faults are posted as sharegpu-dra-driver, not as the node agent."""
    sim, api, d, _ = two_tenants(root)
    gpu = sim.devices()[0].uuid
    assert sim.add_process(101, gpu, 2000, "uid-pa", mps=True, daemon=pipe(d, TA), user=1000)
    sim.add_process(202, gpu, 500, "uid-pb")  # pb bypasses its daemon
    notifier = Notifier()
    watch = DraWatch(d, notifier, evict=True)

    async def main() -> None:
        pods = await api.pods_on_node("n1")
        await watch.check(pods)
        sim.mps_fault(gpu, daemon=pipe(d, TA))
        await watch.check(pods)

    asyncio.run(main())
    assert notifier.told() == [("pb", "GpuAuditMpsBypassed"), ("pb", "GpuAuditEvicted"), ("pa", "GpuMpsFault")]
    assert set(notifier.components) == {DRIVER}
    assert "evicted by the sharegpu dra driver (--evict-on-audit)" in notifier.events[1].message


def test_the_command_gives_the_watch_its_namespace_and_the_node_events(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sharegpu dra-driver reads POD_NAMESPACE, as the agent does, and posts Node Events through its own client."""
    from sharegpu.node.cli import BackendKind, build_dra_service

    monkeypatch.setenv("SHAREGPU_STATE_DIR", str(root / "state"))
    monkeypatch.setenv("POD_NAMESPACE", NS)
    (root / "a100.yaml").write_text("gpus: [{model: A100-80GB, count: 1}]\n")
    api, notifier = Api(), Notifier()
    paths = (root / "a100.yaml", root / "kl", None, None, root / "cdi")
    service = build_dra_service("n1", None, BackendKind.SIM, *paths, kube=api, notifier=notifier)  # type: ignore[arg-type]
    sim = service.driver.backend
    assert isinstance(sim, SimBackend) and service.watch is not None
    gpu = sim.devices()[0].uuid
    sim.add_process(4001, gpu, 9000, bench_pod(api, "sg-bench-x7k2p"))
    sim.add_process(900, gpu, 300)
    got = asyncio.run(service.watch.check(asyncio.run(api.pods_on_node("n1"))))
    assert [(f.kind, f.pids) for f in got.findings] == [(FindingKind.NO_POD, (900,))]
    assert [(n, r, c) for n, r, _, c in api.node_events] == [("n1", "GpuAuditProcessOfNoPod", DRIVER)]
    assert notifier.events == []
