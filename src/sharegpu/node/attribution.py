"""Whose container is starting? The kubelet's own record of which pod holds a set of device IDs.

The device plugin API names no pod: Allocate and PreStartContainer carry device IDs only. sharegpu's device IDs are
interchangeable tokens, so the pod cannot be read off them, and guessing it from the API (the oldest pending pod
that asks for as many GPUs) hands pods each other's shares when a burst reaches the kubelet out of creation order.
But by the time the kubelet calls PreStartContainer it has recorded the allocation, and it gives each device ID to
one pod at a time. So the owner is looked up, never guessed:

1. the kubelet's **pod-resources API** (``List`` on ``<kubelet root>/pod-resources/kubelet.sock``, public and GA):
   every active pod's app containers and native sidecars with the device IDs they hold. An ordinary init container
   is not listed, but when later containers ask for GPUs it hands its device IDs on to them, so one of its IDs
   names the pod.
2. the kubelet's **device-manager checkpoint** (``kubelet_internal_checkpoint`` in the device-plugin directory,
   written before PreStartContainer is called): every container's device IDs with the pod's UID, init containers
   included. It is the kubelet's internal format, so it is read defensively; it also confirms the UID of a pod that
   step 1 names only by namespace and name.

Anything else (no holder, several pods, a record that cannot be read) is an :class:`AttributionError`: the caller
refuses the container with its message rather than guess.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from sharegpu.node.errors import NodeError
from sharegpu.node.proto import podresources_v1_pb2 as pr

log = logging.getLogger(__name__)

DEFAULT_POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
CHECKPOINT_FILE = "kubelet_internal_checkpoint"
_LIST_TIMEOUT_S = 5.0
_RATE_LIMIT_RETRIES = 6  # 20 ms doubling: about 1.3 s in all


class AttributionError(NodeError):
    """The kubelet's records do not name exactly one pod for these device IDs; the message says what they show."""


@dataclass(frozen=True, slots=True)
class Holder:
    """A container the kubelet gave device IDs to. ``uid`` is empty when known by name only, and ``namespace`` and
    ``name`` when known by UID only."""

    namespace: str
    name: str
    uid: str
    container: str
    device_ids: frozenset[str]

    @property
    def pod(self) -> str:
        return f"{self.namespace}/{self.name}" if self.name else f"UID {self.uid}"


@dataclass(frozen=True, slots=True)
class Owner:
    """The pod whose container holds the device IDs; ``containers`` are the candidates (an app container and the init
    container whose IDs it took over can hold the same set)."""

    namespace: str
    name: str
    uid: str
    containers: tuple[str, ...]

    @property
    def pod(self) -> str:
        return f"{self.namespace}/{self.name}" if self.name else f"UID {self.uid}"

    @property
    def container(self) -> str:
        return "|".join(self.containers) or "?"


class PodResourcesClient:
    """``v1.PodResourcesLister/List`` over the kubelet's unix socket."""

    def __init__(self, socket: Path = DEFAULT_POD_RESOURCES_SOCKET, timeout_s: float = _LIST_TIMEOUT_S) -> None:
        self.socket = socket
        self._timeout_s = timeout_s

    async def holders(self, resource: str) -> list[Holder]:
        try:
            resp = await self._list()
        except grpc.aio.AioRpcError as e:
            raise AttributionError(
                f"the kubelet's pod-resources API at {self.socket} did not answer ({e.code().name}: {e.details()}); "
                "is --pod-resources-socket right and mounted into the agent?"
            ) from None
        out: list[Holder] = []
        for p in resp.pod_resources:
            for c in p.containers:
                ids = frozenset(i for d in c.devices if d.resource_name == resource for i in d.device_ids)
                if ids:
                    out.append(Holder(p.namespace, p.name, "", c.name, ids))
        return out

    async def _list(self) -> pr.ListPodResourcesResponse:
        # The kubelet rate-limits this API (100 calls/s, bursts of 10): a refusal for the rate is waited out.
        delay = 0.02
        async with grpc.aio.insecure_channel(f"unix://{self.socket}") as channel:
            call = channel.unary_unary(
                "/v1.PodResourcesLister/List",
                request_serializer=pr.ListPodResourcesRequest.SerializeToString,
                response_deserializer=pr.ListPodResourcesResponse.FromString,
            )
            for attempt in range(_RATE_LIMIT_RETRIES + 1):
                try:
                    return await call(pr.ListPodResourcesRequest(), timeout=self._timeout_s)
                except grpc.aio.AioRpcError as e:
                    if e.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED or attempt == _RATE_LIMIT_RETRIES:
                        raise
                await asyncio.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")


def read_checkpoint(path: Path, resource: str) -> list[Holder]:
    """The device manager's checkpoint → holders of ``resource`` (known by pod UID)."""
    try:
        data: Any = json.loads(path.read_text())
        entries = data["Data"]["PodDeviceEntries"] or []
        out: list[Holder] = []
        for e in entries:
            if e["ResourceName"] != resource:
                continue
            per_numa = e["DeviceIDs"] or {}
            ids = frozenset(str(i) for group in per_numa.values() for i in (group or ()))
            out.append(Holder("", "", str(e["PodUID"]), str(e["ContainerName"]), ids))
    except FileNotFoundError:
        raise AttributionError(f"the kubelet's device-manager checkpoint {path} does not exist") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise AttributionError(f"the kubelet's device-manager checkpoint {path} cannot be read: {e!r}") from None
    return out


class Attributor:
    def __init__(self, resource: str, pod_resources: PodResourcesClient, checkpoint: Path) -> None:
        self.resource = resource
        self.pod_resources = pod_resources
        self.checkpoint = checkpoint

    async def owner(self, device_ids: Iterable[str]) -> Owner:
        ids = frozenset(device_ids)
        if not ids:
            raise AttributionError("the kubelet named no device IDs")
        listed: list[Holder] | None = None
        why: list[str] = []
        try:
            listed = [h for h in await self.pod_resources.holders(self.resource) if h.device_ids & ids]
        except AttributionError as e:
            why.append(str(e))
        recorded: list[Holder] | None = None
        try:
            recorded = [h for h in read_checkpoint(self.checkpoint, self.resource) if h.device_ids & ids]
        except AttributionError as e:
            why.append(str(e))
        by_uid = _one_pod(recorded, ids, "the kubelet's checkpoint") if recorded else None
        if listed:
            by_name = _one_pod(listed, ids, "the kubelet's pod-resources API")
            # The checkpoint, when readable, pins the UID: a pod replaced under the same name is not taken for it.
            return Owner(
                by_name.namespace,
                by_name.name,
                by_name.uid or (by_uid.uid if by_uid else ""),
                _containers(listed, recorded, ids),
            )
        if by_uid is not None:
            return Owner("", "", by_uid.uid, _containers([], recorded, ids))
        detail = "; ".join(why) if why else "neither its pod-resources API nor its checkpoint lists them"
        raise AttributionError(
            f"no pod on this node holds device IDs {_ids(ids)} according to the kubelet ({detail}); refusing to guess "
            "whose container this is"
        )


def _one_pod(holders: list[Holder], ids: frozenset[str], source: str) -> Holder:
    pods = sorted({h.pod for h in holders})
    if len(pods) > 1:
        raise AttributionError(
            f"device IDs {_ids(ids)} are held by several pods according to {source} ({', '.join(pods)}); "
            "refusing to guess whose container this is"
        )
    return holders[0]


def _containers(listed: list[Holder], recorded: list[Holder] | None, ids: frozenset[str]) -> tuple[str, ...]:
    exact = [h.container for h in (*listed, *(recorded or ())) if h.device_ids == ids]
    return tuple(dict.fromkeys(exact))


def _ids(ids: frozenset[str]) -> str:
    shown = sorted(ids)
    return ", ".join(shown[:4]) + (f" and {len(shown) - 4} more" if len(shown) > 4 else "")
