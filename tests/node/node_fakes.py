"""Test doubles for the node agent: an in-memory Kubernetes API, a kubelet peer over real gRPC, the kubelet's records
of who holds which device IDs (its pod-resources API over real gRPC and its device-manager checkpoint), pod builders."""

from __future__ import annotations

import asyncio
import base64
import json
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from sharegpu.kube.errors import KubeError
from sharegpu.model.assignment import Assignment, GpuShare, Mechanism, MigSlot
from sharegpu.model.contract import ASSIGNMENT_ANNOTATION, GPU_RESOURCE, cdi_allocation_name
from sharegpu.node.agent import AgentConfig, NodeAgent
from sharegpu.node.allocation import AllocateAnswer, Allocator, ContainerGrant
from sharegpu.node.attribution import CHECKPOINT_FILE, Attributor, PodResourcesClient
from sharegpu.node.device_plugin import answer_to_response
from sharegpu.node.kube import ContainerInfo, NodeInfo, PodInfo
from sharegpu.node.proto import deviceplugin_pb2 as pb
from sharegpu.node.proto import deviceplugin_pb2_grpc as pb_grpc
from sharegpu.node.proto import podresources_v1_pb2 as pr
from sharegpu.node.proto import podresources_v1_pb2_grpc as pr_grpc

SIM_YAML = "gpus: [{model: H100-80GB, count: 2}, {model: A30-24GB, count: 1}]\n"


class FakeKube:
    """The API server, in memory. ``honour_field_selector=False`` plays a server that returns every pod."""

    def __init__(self, *nodes: NodeInfo, honour_field_selector: bool = True) -> None:
        self.nodes = {n.name: n for n in nodes}
        self.pods: dict[str, PodInfo] = {}
        self.patches: list[tuple[str, dict[str, str | None], dict[str, str | None]]] = []
        self.honour_field_selector = honour_field_selector
        self.fail_lists = 0
        self.node_events: list[tuple[str, str, str, str]] = []  # (node, reason, message, component)
        self.fail_events = 0

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

    async def create_node_event(self, node: str, reason: str, message: str, component: str) -> None:
        if self.fail_events:
            self.fail_events -= 1
            raise KubeError("events is forbidden")
        self.node_events.append((node, reason, message, component))

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
    init: tuple[ContainerInfo, ...] = (),
    uid: str = "",
    user: int | None = None,
    host_users: bool | None = None,
    labels: Mapping[str, str] | None = None,
) -> PodInfo:
    """A pod; ``user``: the runAsUser its containers declare (None: the image decides, a tenant of its own)."""
    annotations = {}
    if isinstance(annotation, Assignment):
        annotations[ASSIGNMENT_ANNOTATION] = annotation.to_json()
    elif annotation is not None:
        annotations[ASSIGNMENT_ANNOTATION] = annotation
    return PodInfo(
        namespace=namespace,
        name=name,
        uid=uid or f"uid-{namespace}-{name}",
        node_name=node,
        phase=phase,
        created=created,
        annotations=annotations,
        containers=tuple(ContainerInfo(f"c{i}", n, user=user) for i, n in enumerate(gpus)),
        init_containers=init,
        host_users=host_users,
        labels=dict(labels or {}),
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

    async def run_container(
        self, record: KubeletRecord, pod: PodInfo, container: str, device_ids: Sequence[str]
    ) -> pb.ContainerAllocateResponse:
        """Start one container as the kubelet does: Allocate (at admission), record who holds the IDs, then
        PreStartContainer (the plugin asked for it). Returns Allocate's answer; PreStartContainer's errors raise."""
        stub = self.plugin()
        ids = list(device_ids)
        resp = await stub.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]), timeout=10
        )
        (answer,) = resp.container_responses
        record.hold(pod, container, ids, answer)
        await stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=ids), timeout=10)
        return answer


# ----- the kubelet's records: who holds which device IDs ---------------------------------------------------------------
@dataclass
class _Hold:
    pod: PodInfo
    ids: dict[str, tuple[str, ...]] = field(default_factory=dict)  # container → device IDs
    responses: dict[str, bytes] = field(default_factory=dict)  # container → its ContainerAllocateResponse


class KubeletRecord(pr_grpc.PodResourcesListerServicer):
    """What the kubelet records of the device IDs it handed out, in the two forms the agent reads:

    - its pod-resources API, ``v1.PodResourcesLister/List`` over gRPC on a unix socket: every active pod by namespace
      and name, with its app containers and its restartable init containers (native sidecars), each with the device
      IDs it holds; ordinary init containers are not listed (as upstream);
    - its device manager's checkpoint (``kubelet_internal_checkpoint`` in the device-plugin directory): one entry per
      container that holds devices, init containers included, by pod UID, written on every change.

    ``list_error`` makes List fail with that code; ``write_checkpoint=False`` leaves the file alone.
    """

    def __init__(self, socket: Path, plugin_dir: Path, resource: str = GPU_RESOURCE) -> None:
        self.socket = socket
        self.checkpoint = plugin_dir / CHECKPOINT_FILE
        self.resource = resource
        self.pods: dict[str, _Hold] = {}  # pod UID → what it holds, in admission order
        self.list_error: grpc.StatusCode | None = None
        self.write_checkpoint = True
        self.lists = 0
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        assert len(str(self.socket).encode()) < 108, f"{self.socket} does not fit in sun_path"
        self._server = grpc.aio.server()
        pr_grpc.add_PodResourcesListerServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix://{self.socket}")
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)
            self._server = None
        self.socket.unlink(missing_ok=True)

    def attributor(self) -> Attributor:
        return Attributor(self.resource, PodResourcesClient(self.socket, timeout_s=2.0), self.checkpoint)

    # ----- what the kubelet does ------------------------------------------------------------------------------------
    def hold(
        self,
        pod: PodInfo,
        container: str,
        device_ids: Sequence[str],
        answer: pb.ContainerAllocateResponse | None = None,
    ) -> None:
        """The kubelet gave ``container`` of ``pod`` these device IDs (and Allocate answered ``answer``)."""
        assert pod.container(container) is not None, f"pod {pod.key} has no container {container}"
        h = self.pods.setdefault(pod.uid, _Hold(pod))
        h.pod = pod
        h.ids[container] = tuple(device_ids)
        h.responses[container] = (answer or pb.ContainerAllocateResponse()).SerializeToString()
        self.save()

    def release(self, pod_uid: str) -> None:
        """The pod is gone: the kubelet drops it from its records."""
        self.pods.pop(pod_uid, None)
        self.save()

    def save(self) -> None:
        if not self.write_checkpoint:
            return
        entries = [
            {
                "PodUID": uid,
                "ContainerName": c,
                "ResourceName": self.resource,
                "DeviceIDs": {"-1": list(ids)},  # NUMA node -1: devices without topology
                "AllocResp": base64.b64encode(h.responses[c]).decode(),
            }
            for uid, h in self.pods.items()
            for c, ids in h.ids.items()
        ]
        registered = sorted({i for h in self.pods.values() for ids in h.ids.values() for i in ids})
        data: dict[str, Any] = {"PodDeviceEntries": entries or None, "RegisteredDevices": {self.resource: registered}}
        checksum = zlib.crc32(json.dumps(data, sort_keys=True).encode())
        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        self.checkpoint.write_text(json.dumps({"Data": data, "Checksum": checksum}))

    # ----- v1.PodResourcesLister -----------------------------------------------------------------------------------
    async def List(  # type: ignore[override]
        self, request: pr.ListPodResourcesRequest, context: grpc.aio.ServicerContext
    ) -> pr.ListPodResourcesResponse:
        self.lists += 1
        if self.list_error is not None:
            await context.abort(self.list_error, "kubelet pod-resources: not serving")
        out = []
        for h in self.pods.values():
            listed = [c for c in h.pod.init_containers if c.sidecar] + list(h.pod.containers)
            containers = []
            for c in listed:
                ids = h.ids.get(c.name, ())
                devices = [pr.ContainerDevices(resource_name=self.resource, device_ids=list(ids))] if ids else []
                containers.append(pr.ContainerResources(name=c.name, devices=devices))
            out.append(pr.PodResources(name=h.pod.name, namespace=h.pod.namespace, containers=containers))
        return pr.ListPodResourcesResponse(pod_resources=out)


async def start_container(
    target: NodeAgent | Allocator, record: KubeletRecord, pod: PodInfo, container: str, device_ids: Sequence[str]
) -> ContainerGrant:
    """Start one container as the kubelet does: Allocate, record the hold, PreStartContainer."""
    allocator = target.allocator if isinstance(target, NodeAgent) else target
    answer = allocator.allocate(device_ids)
    assert answer == AllocateAnswer(
        f"sharegpu.io/gpu={cdi_allocation_name(device_ids)}", {"NVIDIA_VISIBLE_DEVICES": "void"}
    )
    record.hold(pod, container, device_ids, answer_to_response(answer))
    return await allocator.prestart(device_ids)


def cdi_spec(cdi_dir: Path, device_ids: Sequence[str]) -> dict[str, Any]:
    """The CDI spec written for these device IDs, as the runtime reads it: env (as a dict, but SHAREGPU_SHARES, which
    is under ``shares``), mounts, device nodes."""
    name = cdi_allocation_name(device_ids)
    spec = json.loads((cdi_dir / f"sharegpu.io-dp_{name}.json").read_text())
    assert spec["kind"] == "sharegpu.io/gpu"
    (device,) = spec["devices"]
    assert device["name"] == name
    edits = device["containerEdits"]
    env = dict(e.split("=", 1) for e in edits["env"])
    return {
        "shares": env.pop("SHAREGPU_SHARES", None),  # the shares in words, for the container's log
        "env": env,
        "mounts": edits["mounts"],
        "deviceNodes": [n["path"] for n in edits["deviceNodes"]],
    }


def agent_config(tmp: Path, sock_dir: Path, **kw: Any) -> AgentConfig:
    """An agent config whose paths all lie in the test's directories (never the host's /var/run/cdi)."""
    kw.setdefault("allocate_wait_s", 0.3)
    return AgentConfig(
        "node-a",
        kw.pop("plugin_dir", tmp / "dp"),
        kw.pop("state_dir", tmp / "state"),
        pod_resources_socket=sock_dir / "pr" / "kubelet.sock",
        cdi_dir=tmp / "cdi",
        **kw,
    )


def record_for(config: AgentConfig) -> KubeletRecord:
    return KubeletRecord(config.pod_resources_socket, config.plugin_dir)
