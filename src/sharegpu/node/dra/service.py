"""``sharegpu dra-driver`` at run time: label the node as a DRA node, serve the kubelet, keep the slices current.

Every ``interval_s`` it republishes the slices if the GPUs changed or the API server lost some, releases what no
prepared claim needs (a MIG instance whose process has only now exited, a daemon left by a failed Prepare), and runs
the node agent's enforcement audit and MPS fault watch on the pods bound to the node (:mod:`sharegpu.node.dra.watch`).
When the
kubelet registers the plugin (on every kubelet start, after which the kubelet deletes the node's slices) it checks at
once and a few times in the next seconds, so the slices are back within about a second. A restart recovers from the
checkpoint: prepared claims keep their MIG instances and MPS daemons, and the kubelet's retries get the same answers.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from sharegpu.kube.errors import KubeError
from sharegpu.model.contract import DEVICE_PATH_DRA, DEVICE_PATH_LABEL
from sharegpu.node.backends.base import BackendError
from sharegpu.node.dra.driver import DraDriver
from sharegpu.node.dra.kube import DraKube
from sharegpu.node.dra.plugin import DraPluginServer
from sharegpu.node.dra.publisher import SlicePublisher
from sharegpu.node.dra.watch import DraWatch

log = logging.getLogger(__name__)

REGISTRATION_RECHECKS_S = (0.5, 1.0, 2.0, 4.0)  # after a (re)registration: check the slices again this much later


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
        watch: DraWatch | None = None,
    ) -> None:
        self.config = config
        self.driver = driver
        self.server = server
        self.kube = kube
        self.publisher = publisher
        self.watch = watch

    async def run(self, stop: asyncio.Event) -> None:
        # The label first: the extender must stop counting this node's GPUs before any claim lands on them.
        await self.kube.label_node(self.config.node_name, {DEVICE_PATH_LABEL: DEVICE_PATH_DRA})
        await self.driver.recover()
        registered = asyncio.Event()
        self.server.on_registered = registered.set
        await self.server.start()
        # After a registration, a few quick checks besides the one at once: a restarted kubelet deletes the node's
        # slices in the background at start, possibly just after our first republish.
        soon: list[float] = []
        loop = asyncio.get_running_loop()
        try:
            while not stop.is_set():
                await self.tick()
                now = loop.time()
                soon = [t for t in soon if t > now]
                wait_s = min([self.config.interval_s, *(t - now for t in soon)])
                waiters = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(registered.wait())}
                try:
                    await asyncio.wait(waiters, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waiters:
                        w.cancel()
                if registered.is_set():
                    registered.clear()
                    now = loop.time()
                    soon = [now + d for d in REGISTRATION_RECHECKS_S]
                    log.info("the kubelet (re)registered the plugin: republishing the ResourceSlices now")
        finally:
            await self.server.stop()

    async def tick(self) -> None:
        try:
            await self.publisher.publish(self.driver.backend.devices())
        except (KubeError, BackendError) as e:
            log.warning("publishing ResourceSlices failed: %s; retrying", e)
        await self.driver.reconcile()
        if self.watch is not None:
            try:
                pods = await self.kube.pods_on_node(self.config.node_name)
            except KubeError as e:
                log.warning("the audit cannot list the node's pods: %s; retrying", e)
                return
            await self.watch.check(pods)
