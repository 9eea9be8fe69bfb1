"""``sharegpu dra-driver`` at run time: label the node as a DRA node, serve the kubelet, keep the slices current.

Every ``interval_s`` it republishes the slices if the GPUs changed and releases what no prepared claim needs (a MIG
instance whose process has only now exited, a daemon left by a failed Prepare). A restart recovers from the
checkpoint: prepared claims keep their MIG instances and MPS daemons, and the kubelet's retries get the same answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from sharegpu.node.backends.base import BackendError
from sharegpu.node.dra.driver import DraDriver
from sharegpu.node.dra.kube import DraKube
from sharegpu.node.dra.plugin import DraPluginServer
from sharegpu.node.dra.publisher import SlicePublisher
from sharegpu.node.kube import KubeError

log = logging.getLogger(__name__)

DEVICE_PATH_LABEL = "sharegpu.io/device-path"  # "dra": this node's GPUs are handed out through DRA only
DEVICE_PATH_DRA = "dra"


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    node_name: str
    interval_s: float = 10.0


class DraDriverService:
    def __init__(
        self,
        config: ServiceConfig,
        driver: DraDriver,
        server: DraPluginServer,
        kube: DraKube,
        publisher: SlicePublisher,
    ) -> None:
        self.config = config
        self.driver = driver
        self.server = server
        self.kube = kube
        self.publisher = publisher

    async def run(self, stop: asyncio.Event) -> None:
        # The label first: the extender must stop counting this node's GPUs before any claim lands on them.
        await self.kube.label_node(self.config.node_name, {DEVICE_PATH_LABEL: DEVICE_PATH_DRA})
        await self.driver.recover()
        await self.server.start()
        try:
            while not stop.is_set():
                await self.tick()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.config.interval_s)
        finally:
            await self.server.stop()

    async def tick(self) -> None:
        try:
            await self.publisher.publish(self.driver.backend.devices())
        except (KubeError, BackendError) as e:
            log.warning("publishing ResourceSlices failed: %s; retrying", e)
        await self.driver.reconcile()
