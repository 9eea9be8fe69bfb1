"""Test doubles for the node agent: an in-memory Kubernetes API, a kubelet peer over real gRPC, pod builders."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import grpc
import grpc.aio

from sharegpu.model.assignment import Assignment, GpuShare, Mechanism, MigSlot
from sharegpu.node.kube import ASSIGNMENT_ANNOTATION, ContainerInfo, KubeError, NodeInfo, PodInfo
from sharegpu.node.proto import deviceplugin_pb2 as pb
from sharegpu.node.proto import deviceplugin_pb2_grpc as pb_grpc

SIM_YAML = "gpus: [{model: H100-80GB, count: 2}, {model: A30-24GB, count: 1}]\n"


class FakeKube:
    """The API server, in memory. ``honour_field_selector=False`` plays a server that returns every pod."""

    def __init__(self, *nodes: NodeInfo, honour_field_selector: bool = True) -> None:
        self.nodes = {n.name: n for n in nodes}
        self.pods: dict[str, PodInfo] = {}
        self.patches: list[tuple[str, dict[str, str | None], dict[str, str | None]]] = []
        self.honour_field_selector = honour_field_selector
        self.fail_lists = 0

    async def get_node(self, name: str) -> NodeInfo:
        if name not in self.nodes:
            raise KubeError(f"nodes {name!r} not found")
        return self.nodes[name]

    async def patch_node_metadata(
        self, name: str, labels: Mapping[str, str | None], annotations: Mapping[str, str | None]
    ) -> None:
        node = await self.get_node(name)
        self.patches.append((name, dict(labels), dict(annotations)))
        self.nodes[name] = replace(
            node, labels=_merge(node.labels, labels), annotations=_merge(node.annotations, annotations)
        )

    async def pods_on_node(self, node: str) -> list[PodInfo]:
        if self.fail_lists:
            self.fail_lists -= 1
            raise KubeError("connection refused")
        return [p for p in self.pods.values() if p.node_name == node or not self.honour_field_selector]

    async def close(self) -> None:
        pass

    def add(self, pod: PodInfo) -> PodInfo:
        self.pods[pod.uid] = pod
        return pod

    def set_phase(self, uid: str, phase: str) -> None:
        self.pods[uid] = replace(self.pods[uid], phase=phase)


def _merge(base: Mapping[str, str], patch: Mapping[str, str | None]) -> dict[str, str]:
    out = dict(base)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def pod(
    name: str,
    annotation: Assignment | str | None,
    *,
    node: str = "node-a",
    namespace: str = "default",
    gpus: tuple[int, ...] = (1,),
    phase: str = "Pending",
    created: str = "2024-05-01T10:00:00+00:00",
) -> PodInfo:
    annotations = {}
    if isinstance(annotation, Assignment):
        annotations[ASSIGNMENT_ANNOTATION] = annotation.to_json()
    elif annotation is not None:
        annotations[ASSIGNMENT_ANNOTATION] = annotation
    return PodInfo(
        namespace=namespace,
        name=name,
        uid=f"uid-{namespace}-{name}",
        node_name=node,
        phase=phase,
        created=created,
        annotations=annotations,
        containers=tuple(ContainerInfo(f"c{i}", n) for i, n in enumerate(gpus)),
    )


def share(
    gpu_index: int,
    gpu_uuid: str,
    mechanism: Mechanism,
    compute_milli: int = 1000,
    memory_mib: int = 0,
    mig: MigSlot | None = None,
    inner: Mechanism | None = None,
) -> GpuShare:
    return GpuShare(gpu_index, gpu_uuid, mechanism, compute_milli, memory_mib, mig, inner)


def assignment(name: str, *shares: GpuShare, node: str = "node-a", namespace: str = "default") -> Assignment:
    return Assignment(pod=f"{namespace}/{name}", node=node, shares=tuple(shares))


class FakeKubelet(pb_grpc.RegistrationServicer):
    """The kubelet's side of the device plugin protocol: a Registration server and a DevicePlugin client."""

    def __init__(self, plugin_dir: Path) -> None:
        self.plugin_dir = plugin_dir
        self.requests: list[pb.RegisterRequest] = []
        self.registered = asyncio.Event()
        self._server: grpc.aio.Server | None = None
        self._channel: grpc.aio.Channel | None = None

    @property
    def socket(self) -> Path:
        return self.plugin_dir / "kubelet.sock"

    async def start(self) -> None:
        self.registered = asyncio.Event()
        self._server = grpc.aio.server()
        pb_grpc.add_RegistrationServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix://{self.socket}")
        await self._server.start()

    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext) -> pb.Empty:  # type: ignore[override]
        self.requests.append(request)
        self.registered.set()
        return pb.Empty()

    def plugin(self) -> pb_grpc.DevicePluginStub:
        """A client to the plugin that registered last, through the endpoint it gave."""
        endpoint = self.requests[-1].endpoint
        self._channel = grpc.aio.insecure_channel(f"unix://{self.plugin_dir / endpoint}")
        return pb_grpc.DevicePluginStub(self._channel)

    async def stop(self, *, remove_plugin_sockets: bool = False) -> None:
        """Stop; with ``remove_plugin_sockets`` behave like a restarting kubelet, which clears the directory."""
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        if self._server is not None:
            await self._server.stop(0)
            self._server = None
        self.socket.unlink(missing_ok=True)
        if remove_plugin_sockets:
            for p in self.plugin_dir.glob("*.sock"):
                p.unlink()
