"""The DRA driver's audit and MPS fault telling (issue 33): the node agent's code, on the claims prepared here."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dra_fakes import Api, Notifier, backend, driver

from sharegpu.kube.errors import KubeError
from sharegpu.kube.schema import Node, Pod, ResourceSlice
from sharegpu.model.tenant import own_tenant, user_tenant
from sharegpu.node.audit import FindingKind
from sharegpu.node.backends.sim import SimBackend
from sharegpu.node.dra.driver import DraDriver
from sharegpu.node.dra.plugin import DraPluginServer, SocketPaths
from sharegpu.node.dra.publisher import SlicePublisher
from sharegpu.node.dra.service import DraDriverService, ServiceConfig
from sharegpu.node.dra.watch import DraWatch
from sharegpu.node.mps import DaemonKey, SimMpsDaemon


def two_tenants(root: Path) -> tuple[SimBackend, Api, DraDriver, SimMpsDaemon]:
    """Pod pa (uid 1000) and pod pb (the image's user), each with a 10 GiB MPS claim on the one GPU, prepared."""
    sim = backend()
    api = Api()
    api.pod("pa", "a", ("app", 1000, True))
    api.pod("pb", "b", ("app", None, True))
    refs = [api.claim("a", ["pa"]), api.claim("b", ["pb"])]
    daemon = SimMpsDaemon(sim)
    d = driver(root, api, sim, daemon=daemon)
    got = asyncio.run(d.prepare(refs))
    assert all(r.error == "" for r in got.values())
    return sim, api, d, daemon


TA, TB = user_tenant("ns", 1000), own_tenant("uid-pb")


def pipe(d: DraDriver, tenant: str) -> str:
    gpu = d.backend.devices()[0].uuid
    return str(d.mps.spec(gpu, tenant).pipe_dir)


def test_a_fault_in_one_tenants_client_is_told_to_that_tenants_pods_only(root: Path) -> None:
    sim, api, d, _ = two_tenants(root)
    gpu = sim.devices()[0].uuid
    assert sim.add_process(101, gpu, 2000, "uid-pa", mps=True, daemon=pipe(d, TA), user=1000)
    assert sim.add_process(201, gpu, 3000, "uid-pb", mps=True, daemon=pipe(d, TB))
    notifier = Notifier()
    watch = DraWatch(d, notifier)

    async def main() -> None:
        pods = await api.pods_on_node("n1")
        quiet = await watch.check(pods)
        assert (quiet.findings, quiet.faults, notifier.events) == ((), (), [])
        sim.mps_fault(gpu, daemon=pipe(d, TA))  # driver 580's two lines in pa's daemon's server.log
        got = await watch.check(pods)
        assert [(f.daemon, f.pods, f.sources) for f in got.faults] == [(DaemonKey(gpu, TA), ("ns/pa",), ("log",))]
        assert notifier.told() == [("pa", "GpuMpsFault")]  # pb's daemon is another server: not told
        assert 201 in {p.pid for p in sim.processes(0)}  # and its client ran on
        again = await watch.check(pods)
        assert again.faults == () and len(notifier.events) == 1  # each line is read once

    asyncio.run(main())


def test_the_audit_holds_the_gpus_processes_against_the_prepared_claims(root: Path) -> None:
    sim, api, d, _ = two_tenants(root)
    gpu = sim.devices()[0].uuid
    api.pods["pc"] = {"metadata": {"namespace": "ns", "name": "pc", "uid": "uid-pc"}, "spec": {"containers": []}}
    api.pods["done"] = {
        "metadata": {"namespace": "ns", "name": "done", "uid": "uid-done"},
        "spec": {"containers": []},
        "status": {"phase": "Succeeded"},
    }
    assert sim.add_process(101, gpu, 11000, "uid-pa", mps=True, daemon=pipe(d, TA), user=1000)  # above 10 GiB
    sim.add_process(202, gpu, 500, "uid-pb")  # its own context beside its MPS claim: outside the daemon's limits
    sim.add_process(301, gpu, 500, "uid-pc")  # a pod that holds no claim
    sim.add_process(401, gpu, 500)  # no pod at all
    sim.add_process(501, gpu, 500, "uid-done")  # a finished pod's process is no pod's any more
    notifier = Notifier()

    async def main() -> None:
        got = await DraWatch(d, notifier).check(await api.pods_on_node("n1"))
        kinds = sorted((f.kind.value, f.pod, f.pids) for f in got.findings)
        assert kinds == [
            ("memory-over-share", "pa", (101,)),
            ("mps-bypass", "pb", (202,)),
            ("no-pod", "", (401, 501)),
            ("wrong-unit", "pc", (301,)),
        ]
        assert sorted(notifier.told()) == [
            ("pa", "GpuAuditMemoryOverShare"),
            ("pb", "GpuAuditMpsBypassed"),
            ("pc", "GpuAuditWrongGpu"),
        ]
        over = next(f for f in got.findings if f.kind is FindingKind.MEMORY_OVER_SHARE)
        assert "above its share of 10240 MiB" in over.message and "GPU 0" in over.message

    asyncio.run(main())


def test_a_client_at_another_tenants_daemon_is_found(root: Path) -> None:
    sim, api, d, _ = two_tenants(root)
    gpu = sim.devices()[0].uuid
    # pb's process reached pa's daemon (a pipe directory mounted by hand): it runs there while that server is idle.
    assert sim.add_process(203, gpu, 100, "uid-pb", mps=True, daemon=pipe(d, TA))
    notifier = Notifier()
    got = asyncio.run(DraWatch(d, notifier).check(asyncio.run(api.pods_on_node("n1"))))
    [f] = got.findings
    assert (f.kind, f.pod, f.pids) == (FindingKind.MPS_OTHER_TENANT, "pb", (203,))
    assert "uid 1000 in ns" in f.message
    assert notifier.told() == [("pb", "GpuAuditMpsOtherTenant")]


def test_a_pod_of_another_tenant_that_joins_a_prepared_claim_is_told(root: Path) -> None:
    _, api, d, _ = two_tenants(root)
    api.pod("late", "a", ("app", None, True))  # joins claim a after its Prepare: the kubelet does not ask again
    api.pod("mate", "a", ("app", 1000, True))  # same tenant as pa: nothing to tell
    api.pod("side", "a", ("app", 1000, True), ("log", 0, False))  # a sidecar without the claim decides nothing
    notifier = Notifier()
    got = asyncio.run(DraWatch(d, notifier).check(asyncio.run(api.pods_on_node("n1"))))
    [f] = got.findings
    assert (f.kind, f.pod, f.pids) == (FindingKind.MPS_OTHER_TENANT, "late", ())
    for said in ("pod uid-late alone", "claim ns/a", "MPS daemon of uid 1000 in ns", "ResourceClaimTemplate"):
        assert said in f.message
    assert notifier.told() == [("late", "GpuAuditMpsOtherTenant")]


def test_multi_user_mode_has_no_tenant_to_mistake(root: Path) -> None:
    sim = backend()
    api = Api()
    api.pod("pa", "a", ("app", 1000, True))
    ref = api.claim("a", ["pa"])
    d = driver(root, api, sim, multi_user=True, daemon=SimMpsDaemon(sim))
    assert asyncio.run(d.prepare([ref]))[ref.uid].error == ""
    api.pod("late", "a", ("app", None, True))
    assert asyncio.run(DraWatch(d, Notifier()).check(asyncio.run(api.pods_on_node("n1")))).findings == ()


def test_a_daemon_that_died_is_told_and_restarted(root: Path) -> None:
    sim, api, d, daemon = two_tenants(root)
    gpu = sim.devices()[0].uuid
    assert sim.add_process(101, gpu, 2000, "uid-pa", mps=True, daemon=pipe(d, TA), user=1000)
    notifier = Notifier()
    watch = DraWatch(d, notifier)

    async def main() -> None:
        pods = await api.pods_on_node("n1")
        await watch.check(pods)  # the server's pid is seen
        daemon.crash(d.mps.spec(gpu, TA))
        got = await watch.check(pods)
        assert [(f.daemon, f.sources) for f in got.faults] == [(DaemonKey(gpu, TA), ("server-gone",))]
        assert notifier.told() == [("pa", "GpuMpsFault")]
        status = {s.tenant: s for s in d.mps.status()}
        assert status[TA].restarts == 1 and status[TA].up and await daemon.healthy(d.mps.spec(gpu, TA))
        assert status[TB].restarts == 0

    asyncio.run(main())


def test_a_restart_after_a_fault_waits_for_the_drivers_lock(root: Path) -> None:
    """Prepare and Unprepare change the daemons too: the watch restarts one only under the driver's lock."""
    sim, api, d, daemon = two_tenants(root)
    gpu = sim.devices()[0].uuid
    assert sim.add_process(101, gpu, 2000, "uid-pa", mps=True, daemon=pipe(d, TA), user=1000)
    watch = DraWatch(d, Notifier())

    async def main() -> None:
        pods = await api.pods_on_node("n1")
        await watch.check(pods)
        daemon.crash(d.mps.spec(gpu, TA))
        async with d.lock:  # a Prepare in progress
            task = asyncio.create_task(watch.check(pods))
            for _ in range(20):
                await asyncio.sleep(0)
            assert not task.done() and {s.tenant: s.restarts for s in d.mps.status()}[TA] == 0
        got = await task
        assert [f.daemon for f in got.faults] == [DaemonKey(gpu, TA)]
        assert {s.tenant: s.restarts for s in d.mps.status()}[TA] == 1

    asyncio.run(main())


class Kube(Api):
    """An API server for the service: slices in a dict, pods and claims from :class:`Api`."""

    def __init__(self) -> None:
        super().__init__()
        self.slices: dict[str, Mapping[str, Any]] = {}
        self.fail_pods = False

    async def pods_on_node(self, node: str) -> list[Pod]:
        if self.fail_pods:
            raise KubeError("pods is forbidden")
        return await super().pods_on_node(node)

    async def get_node(self, name: str) -> Node:
        return Node.model_validate({"metadata": {"name": name, "uid": "node-uid"}})

    async def label_node(self, name: str, labels: Mapping[str, str | None]) -> None:
        pass

    async def list_slices(self, node: str) -> list[ResourceSlice]:
        return [ResourceSlice.model_validate(s) for s in self.slices.values()]

    async def apply_slice(self, obj: Mapping[str, Any]) -> None:
        self.slices[obj["metadata"]["name"]] = obj

    async def delete_slice(self, name: str) -> None:
        self.slices.pop(name, None)

    async def close(self) -> None:
        pass


def test_every_pass_of_the_service_runs_the_watch(root: Path) -> None:
    sim = backend()
    kube = Kube()
    kube.pod("pc", "none", ("app", None, False))
    sim.add_process(301, sim.devices()[0].uuid, 500, "uid-pc")
    notifier = Notifier()
    d = driver(root, kube, sim)
    server = DraPluginServer(d, SocketPaths.under(root / "kubelet"))
    service = DraDriverService(ServiceConfig("n1"), d, server, kube, SlicePublisher("n1", kube), DraWatch(d, notifier))

    async def main() -> None:
        kube.fail_pods = True
        await service.tick()  # no pods to read: the slices are published, the audit waits for the next pass
        assert kube.slices and notifier.events == []
        kube.fail_pods = False
        await service.tick()
        assert notifier.told() == [("pc", "GpuAuditWrongGpu")]

    asyncio.run(main())
