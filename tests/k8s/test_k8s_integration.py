"""Against a real API server: set SHAREGPU_TEST_KUBECONFIG to a kubeconfig (kind, k3d, envtest; cluster-admin).

It creates a Node object (no kubelet behind it: nothing runs, bindings still work), a namespace and pods, drives
the cluster view, bind and status through lightkube, and deletes everything it made. The rig may hold other sharegpu
nodes and schedulers (a real node, another test's harness): the pods carry a scheduler name of this test's own, so
that no running scheduler takes them, and only this test's node and namespace are looked at.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from pathlib import Path

import pytest
from k8s_helpers import node_spec, pod_obj

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.extender.server import Extender
from sharegpu.k8s.status.report import status_report
from sharegpu.kube.api import LightkubeClusterApi
from sharegpu.kube.errors import Conflict
from sharegpu.kube.schema import ExtenderBindingArgs
from sharegpu.model.assignment import Assignment
from sharegpu.model.contract import ASSIGNMENT_ANNOTATION, INVENTORY_ANNOTATION

KUBECONFIG = os.environ.get("SHAREGPU_TEST_KUBECONFIG")
pytestmark = pytest.mark.skipif(
    not KUBECONFIG, reason="no API server: set SHAREGPU_TEST_KUBECONFIG to a kubeconfig to run the integration suite"
)


async def until(cond, what: str, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def test_against_a_real_api_server() -> None:
    from lightkube import AsyncClient, KubeConfig
    from lightkube.models.meta_v1 import ObjectMeta
    from lightkube.resources.core_v1 import Namespace
    from lightkube.resources.core_v1 import Node as KNode
    from lightkube.resources.core_v1 import Pod as KPod

    assert KUBECONFIG is not None
    suffix = uuid.uuid4().hex[:6]
    node_name, ns = f"sharegpu-it-{suffix}", f"sharegpu-it-{suffix}"
    scheduler = f"sharegpu-it-{suffix}"  # no scheduler runs by this name: only this test binds its pods
    spec = node_spec(node_name, gpus=1)

    def mine(v: ClusterView) -> tuple[object, ...]:
        """This test's node in a ledger (other nodes may come and go on a shared rig meanwhile)."""
        led = v.ledger
        n = led.index[node_name]
        held = sorted(a.to_json() for a in led.assignments.values() if a.node == node_name)
        return held, led.free_mem[n].tolist(), led.free_milli[n].tolist(), led.mode[n].tolist(), led.cpu_free[n]

    async def main() -> None:
        client = AsyncClient(config=KubeConfig.from_file(KUBECONFIG))
        api = LightkubeClusterApi(Path(KUBECONFIG))
        # Watches the server ends after 1-2 s (lightkube resumes them from the last resourceVersion seen).
        view = ClusterView(watch_timeout_s=(1, 2), scheduler_name=scheduler)
        stop = asyncio.Event()
        follow = asyncio.ensure_future(view.follow(api, stop))
        try:
            await client.create(Namespace(metadata=ObjectMeta(name=ns)))
            await client.create(
                KNode.from_dict(
                    {"metadata": {"name": node_name, "annotations": {INVENTORY_ANNOTATION: spec.to_json()}}}
                )
            )
            await until(lambda: view.synced and view.node_spec(node_name) is not None, "the node's inventory")
            for name in ("a", "b"):
                obj = pod_obj(name, ns, memory="50Gi", scheduler_name=scheduler)
                for server_set in ("uid", "resourceVersion"):
                    del obj["metadata"][server_set]
                await client.create(KPod.from_dict(obj | {"status": {}}), namespace=ns)
            await until(lambda: view.pod(f"{ns}/b") is not None, "the pods")
            ext = Extender(view, api, scheduler_name=scheduler, policy="bestfit")

            async def bind(name: str) -> str:
                pod = await api.get_pod(ns, name)
                args = ExtenderBindingArgs(PodName=name, PodNamespace=ns, PodUID=pod.metadata.uid, Node=node_name)
                return (await ext.bind(args)).Error

            results = await asyncio.gather(bind("a"), bind("b"))
            # 50Gi + 50Gi > 80Gi: one wins; the real server answers its Binding with a Status, taken as success.
            assert sorted(r == "" for r in results) == [False, True], results
            winner = "a" if results[0] == "" else "b"
            pod = await api.get_pod(ns, winner)
            assert pod.spec.node_name == node_name
            a = Assignment.from_json(pod.metadata.annotations[ASSIGNMENT_ANNOTATION])
            assert a.pod == f"{ns}/{winner}"
            # The resourceVersion precondition is enforced by the server.
            with pytest.raises(Conflict):
                await api.patch_pod_annotations(ns, winner, {"x": "y"}, "1")
            await until(lambda: f"{ns}/{winner}" in view.ledger, "the assignment in the ledger")
            report = status_report(view)
            gpu = next(n for n in report["nodes"] if n["name"] == node_name)["gpus"][0]
            assert gpu["pods"] == [f"{ns}/{winner}"]
            # Restart equality against the real server.
            fresh = ClusterView(scheduler_name=scheduler)
            fresh.reset((await api.list_nodes())[0], (await api.list_pods(scheduler))[0])
            assert mine(fresh) == mine(view)
            view.resync()  # a relist (what a new leader does, and what a broken watch leads to)
            await until(lambda: view.synced, "the relist")
            assert mine(fresh) == mine(view)
            await client.delete(KPod, winner, namespace=ns, grace_period=0)
            await until(lambda: f"{ns}/{winner}" not in view.ledger, "the release")
        finally:
            stop.set()
            await follow
            for res, name in ((KNode, node_name), (Namespace, ns)):
                with contextlib.suppress(Exception):  # best-effort cleanup; the assertion above is what counts
                    await client.delete(res, name)
            await api.close()
            await client.close()

    asyncio.run(main())
