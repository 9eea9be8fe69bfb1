"""The kubelet's DRA health stream (``/v1alpha1.DRAResourceHealth/NodeWatchResources``) on the service socket.

With the ResourceHealthStatus feature (beta, on in kubelet v1.36) the kubelet opens this stream once it has
registered the plugin, and shows each device's health in the status of the containers whose claims use it
(``status.containerStatuses[].allocatedResourcesStatus``). Devices are named as in the ResourceSlices (pool = the
node, device = ``gpu-<i>`` or a MIG placement's name); a GPU's MIG devices share its health.

The stream sends every device at once, then again whenever the GPU backend reports a change (polled every
``poll_s``), and again every ``resend_s`` even without a change: the kubelet takes a device whose last report is
older than its health timeout (30 s unless a report says otherwise) to be Unknown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import grpc

from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog
from sharegpu.node.backends.base import BackendError, DeviceInfo
from sharegpu.node.dra.slices import node_devices
from sharegpu.node.proto import dra_health_v1alpha1_pb2 as pb

log = logging.getLogger(__name__)

SERVICE = "v1alpha1.DRAResourceHealth"
MAX_MESSAGE = 1024  # the kubelet's limit on a device's message
DEFAULT_POLL_S = 1.0
DEFAULT_RESEND_S = 10.0
DEFAULT_TIMEOUT_S = 30  # told to the kubelet: Unknown after this long without a report (3 resends missed)


class Health(Enum):
    UNKNOWN = pb.UNKNOWN
    HEALTHY = pb.HEALTHY
    UNHEALTHY = pb.UNHEALTHY


@dataclass(frozen=True, slots=True)
class DeviceHealth:
    pool: str
    device: str
    health: Health
    message: str = ""


def device_health(
    node: str, gpus: tuple[DeviceInfo, ...], catalog: Catalog = DEFAULT_CATALOG
) -> tuple[DeviceHealth, ...]:
    """Every device the node publishes or once published for its GPUs, with the GPU's health."""
    by_index = {g.index: g for g in gpus}
    out: list[DeviceHealth] = []
    for name, pub in sorted(node_devices(gpus, catalog, healthy_only=False).items()):
        gpu = by_index[pub.gpu_index]
        if gpu.healthy:
            out.append(DeviceHealth(node, name, Health.HEALTHY))
        else:
            why = f"GPU {gpu.index} ({gpu.uuid}) is unhealthy; it is withdrawn from the pool"
            out.append(DeviceHealth(node, name, Health.UNHEALTHY, why[:MAX_MESSAGE]))
    return tuple(out)


class HealthService:
    """Serves NodeWatchResources from ``devices()``, a callable that returns the backend's GPUs."""

    def __init__(
        self,
        node: str,
        devices: Callable[[], tuple[DeviceInfo, ...]],
        catalog: Catalog = DEFAULT_CATALOG,
        poll_s: float = DEFAULT_POLL_S,
        resend_s: float = DEFAULT_RESEND_S,
        timeout_s: int = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.node = node
        self._devices = devices
        self._catalog = catalog
        self.poll_s = poll_s
        self.resend_s = resend_s
        self.timeout_s = timeout_s
        self.streams = 0  # open streams (the kubelet keeps one)

    def snapshot(self, last: tuple[DeviceHealth, ...]) -> tuple[DeviceHealth, ...]:
        try:
            return device_health(self.node, self._devices(), self._catalog)
        except BackendError as e:
            # The driver cannot say: every device it knew is Unknown until it can again.
            why = f"the GPU backend cannot be read: {e}"[:MAX_MESSAGE]
            return tuple(DeviceHealth(d.pool, d.device, Health.UNKNOWN, why) for d in last)

    def response(self, devices: tuple[DeviceHealth, ...]) -> pb.NodeWatchResourcesResponse:
        now = int(time.time())
        return pb.NodeWatchResourcesResponse(
            devices=[
                pb.DeviceHealth(
                    device=pb.DeviceIdentifier(pool_name=d.pool, device_name=d.device),
                    health=d.health.value,
                    last_updated_time=now,
                    health_check_timeout_seconds=self.timeout_s,
                    message=d.message,
                )
                for d in devices
            ]
        )

    async def watch(self, request: pb.NodeWatchResourcesRequest, context: Any) -> AsyncIterator[Any]:
        loop = asyncio.get_running_loop()
        self.streams += 1
        last: tuple[DeviceHealth, ...] = ()
        sent_at: float | None = None
        try:
            while True:
                current = self.snapshot(last)
                if sent_at is None or current != last or loop.time() - sent_at >= self.resend_s:
                    if current != last:
                        # One line per change, naming the GPUs (their MIG devices share their health).
                        gpus = sorted(
                            {d.device for d in current if "-mig-" not in d.device and d.health is not Health.HEALTHY}
                        )
                        log.info(
                            "device health to the kubelet: %d device(s), not healthy: %s",
                            len(current),
                            ", ".join(gpus) or "none",
                        )
                    yield self.response(current)
                    last, sent_at = current, loop.time()
                await asyncio.sleep(self.poll_s)
        finally:
            self.streams -= 1

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "NodeWatchResources": grpc.unary_stream_rpc_method_handler(
                    self.watch,
                    pb.NodeWatchResourcesRequest.FromString,
                    pb.NodeWatchResourcesResponse.SerializeToString,
                )
            },
        )
