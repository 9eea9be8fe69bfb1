from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from sharegpu.k8s.pod_request import InvalidPodRequest, gpu_tenant, pod_request
from sharegpu.kube.schema import Node, Pod
from sharegpu.model.tenant import TenantConflict
from sharegpu.node.kube import LightkubeApi, node_info, pod_info
from sharegpu.node.proto.generate import PROTO, generate


def test_generated_modules_match_the_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (a dev dependency) regenerates the stubs")
    generate(tmp_path)
    here = PROTO.parent
    for name in (
        *(f"deviceplugin_pb2{x}" for x in (".py", ".pyi", "_grpc.py")),
        *(f"podresources_v1_pb2{x}" for x in (".py", ".pyi", "_grpc.py")),
    ):
        fresh = (tmp_path / "sharegpu" / "node" / "proto" / name).read_text()
        assert fresh == (here / name).read_text(), f"{name} is stale: run uv run python -m sharegpu.node.proto.generate"


def test_pod_and_node_from_api_json() -> None:
    p = pod_info(
        Pod.model_validate(
            {
                "metadata": {
                    "namespace": "ml",
                    "name": "train",
                    "uid": "u1",
                    "creationTimestamp": "2024-05-01T10:00:00Z",
                    "annotations": {"sharegpu.io/assignment": "{}"},
                },
                "spec": {
                    "nodeName": "node-a",
                    "initContainers": [
                        {"name": "init", "resources": {"limits": {"sharegpu.io/gpu": "2"}}},
                        {"name": "proxy", "restartPolicy": "Always", "resources": {"limits": {"sharegpu.io/gpu": "1"}}},
                    ],
                    "containers": [
                        {"name": "main", "resources": {"limits": {"sharegpu.io/gpu": "2", "cpu": "1"}}},
                        {"name": "side"},
                    ],
                },
                "status": {"phase": "Pending"},
            }
        )
    )
    assert p.key == "ml/train" and p.node_name == "node-a" and not p.deleting
    assert [(c.name, c.gpus, c.sidecar) for c in p.init_containers] == [("init", 2, False), ("proxy", 1, True)]
    assert [(c.name, c.gpus, c.sidecar) for c in p.containers] == [("main", 2, False), ("side", 0, False)]
    assert p.gpu_demand == 3  # the native sidecar runs beside main (1 + 2); init (2) ran before either
    assert p.container("proxy") == p.init_containers[1] and p.container("nope") is None
    n = node_info(
        Node.model_validate(
            {
                "metadata": {"name": "node-a", "labels": {"a": "b"}},
                "status": {"allocatable": {"cpu": "15500m", "memory": "64Gi"}},
            }
        )
    )
    assert (n.cpu_milli, n.memory_mib, n.labels) == (15500, 65536, {"a": "b"})


def test_the_node_counts_gpus_as_the_control_plane_does_limits_then_requests() -> None:
    # A request without a limit (an object the API server has not validated: the webhook's, a fake's, the sim's)
    # counts on the node as in pod_request: before, the node read limits only and saw 0 GPUs here.
    def pod(resources: dict[str, dict[str, str]]) -> Pod:
        return Pod.model_validate({"metadata": {"name": "p"}, "spec": {"containers": [{"resources": resources}]}})

    def counts(p: Pod) -> tuple[int, int | None]:
        req = pod_request(p)
        return pod_info(p).gpu_demand, None if req is None else req.gpu_count

    assert counts(pod({"requests": {"sharegpu.io/gpu": "2"}})) == (2, 2)
    assert counts(pod({"limits": {"sharegpu.io/gpu": "3"}, "requests": {"sharegpu.io/gpu": "1"}})) == (3, 3)
    assert counts(pod({})) == (0, None)


def _tenant_pod(containers: list[dict[str, Any]], **spec: Any) -> Pod:
    return Pod.model_validate(
        {"metadata": {"name": "p", "namespace": "ml", "uid": "u-1"}, "spec": {"containers": containers, **spec}}
    )


def _gpu(name: str, user: int | None = None, gpus: str = "1") -> dict[str, Any]:
    c: dict[str, Any] = {"name": name, "resources": {"limits": {"sharegpu.io/gpu": gpus}}}
    if user is not None:
        c["securityContext"] = {"runAsUser": user}
    return c


@pytest.mark.parametrize(
    ("pod", "tenant"),
    [
        (_tenant_pod([_gpu("a", 1000), _gpu("b", 1000)]), "ml/uid-1000"),
        # Issue 33: one declared and one undeclared GPU container is a tenant of its own, on the node too (the
        # declared user's daemon would serve a container that runs as its image's user).
        (_tenant_pod([_gpu("a", 1000), _gpu("b")]), "pod/u-1"),
        (_tenant_pod([_gpu("a"), _gpu("b")]), "pod/u-1"),
        (_tenant_pod([_gpu("a", 1000), _gpu("log", 0, gpus="0")]), "ml/uid-1000"),  # a sidecar without a GPU
        (_tenant_pod([_gpu("a")], securityContext={"runAsUser": 1000}), "ml/uid-1000"),
        (_tenant_pod([_gpu("a", 1000)], initContainers=[_gpu("warm")]), "pod/u-1"),
        (_tenant_pod([_gpu("a", 1000)], hostUsers=False), "pod/u-1"),
        (_tenant_pod([_gpu("a", 1000), _gpu("b", 0)]), None),  # refused on both sides
    ],
)
def test_the_node_reads_a_pods_tenant_as_the_control_plane_does(pod: Pod, tenant: str | None) -> None:
    """PodInfo.tenant picks the pod's MPS daemon on a device-plugin node; pod_request.gpu_tenant wrote the tenant the
    extender placed the pod under. They must agree on every pod, or a pod runs beside tenants it was never placed
    with."""
    if tenant is None:
        with pytest.raises(InvalidPodRequest, match="different Unix users"):
            gpu_tenant(pod)
        with pytest.raises(TenantConflict, match="different Unix users"):
            _ = pod_info(pod).tenant
        return
    assert gpu_tenant(pod) == tenant
    assert pod_info(pod).tenant == tenant


@pytest.mark.skipif(
    not os.environ.get("SHAREGPU_TEST_KUBECONFIG"), reason="needs a real API server: set SHAREGPU_TEST_KUBECONFIG"
)
def test_lightkube_api_against_a_real_server() -> None:
    async def main() -> None:
        api = LightkubeApi(Path(os.environ["SHAREGPU_TEST_KUBECONFIG"]))
        try:
            from lightkube import AsyncClient, KubeConfig
            from lightkube.resources.core_v1 import Node
            from lightkube.types import PatchType

            raw = AsyncClient(config=KubeConfig.from_file(os.environ["SHAREGPU_TEST_KUBECONFIG"]))
            name = f"sharegpu-node-it-{uuid.uuid4().hex[:6]}"  # a Node of its own, as a kubelet registers it
            await raw.create(Node.from_dict({"metadata": {"name": name}}))
            status = {"capacity": {"cpu": "16", "memory": "64Gi"}, "allocatable": {"cpu": "16", "memory": "64Gi"}}
            await raw.patch(Node.Status, name, {"status": status}, patch_type=PatchType.MERGE)
            try:
                node = await api.get_node(name)
                assert node.name == name and node.cpu_milli == 16000
                await api.patch_node_metadata(name, {"sharegpu.io/test": "1"}, {})
                assert (await api.get_node(name)).labels["sharegpu.io/test"] == "1"
                await api.patch_node_metadata(name, {"sharegpu.io/test": None}, {})
                assert "sharegpu.io/test" not in (await api.get_node(name)).labels
                assert all(p.node_name == name for p in await api.pods_on_node(name))
                # A finding of no pod is told on the Node where `kubectl describe node` looks (issue 33): it searches
                # every namespace for the Node's name and kind, no namespace, and the name as the UID (as the
                # kubelet records its own Node events).
                await api.create_node_event(name, "GpuAuditNoPod", "pid 7 holds GPU 0 and belongs to no pod", "agent")
                from lightkube.resources.core_v1 import Event

                fields = {
                    "involvedObject.kind": "Node",
                    "involvedObject.name": name,
                    "involvedObject.namespace": "",
                    "involvedObject.uid": name,
                }
                found = [e async for e in raw.list(Event, namespace="*", fields=fields)]
                assert [(e.reason, e.type, e.source.component if e.source else None) for e in found] == [
                    ("GpuAuditNoPod", "Warning", "agent")
                ]
                assert found[0].message == "pid 7 holds GPU 0 and belongs to no pod"
            finally:
                await raw.delete(Node, name)
                await raw.close()
        finally:
            await api.close()

    asyncio.run(main())
