"""The cluster view: the ledger view (:mod:`sharegpu.k8s.cache.ledger_view`) kept in step with the API server.

The kube-scheduler's split: an informer lists and watches (:class:`~sharegpu.kube.informer.Informer`: the idle
deadline, tombstones, bounded cancellation), its event handlers feed the cache (here a full list replaces the ledger
view's objects, a watch event changes one), and the cache holds the nodes, the pods and the assumed placements
(:mod:`sharegpu.k8s.cache.ledger_view`, :mod:`sharegpu.k8s.cache.assume`). What this module adds is whether the view is in
sync, which the extender checks before every placement: a view that lost the API server places nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from sharegpu.k8s.cache.ledger_view import LedgerView
from sharegpu.kube.api import ClusterApi
from sharegpu.kube.informer import WATCH_CLOSE_S, WATCH_TIMEOUT_S, Informer, Source, Timing
from sharegpu.kube.schema import Node, Pod
from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog
from sharegpu.placement.fragmentation import Workload

log = logging.getLogger(__name__)

# What a placement refused while the view is out of sync says: the view may lack what another replica bound.
NOT_SYNCED = "sharegpu has lost the API server and is reconnecting; no new placements until its view is back in sync"


class ClusterView(LedgerView):
    def __init__(
        self,
        policy: str = "sharegpu",
        catalog: Catalog = DEFAULT_CATALOG,
        seed: int = 0,
        workload: Workload | None = None,
        watch_timeout_s: tuple[int, int] = WATCH_TIMEOUT_S,
        watch_idle_s: float | None = None,
        scheduler_name: str | None = None,
        watch_close_s: float = WATCH_CLOSE_S,
    ) -> None:
        super().__init__(policy, catalog, seed, workload)
        # Only this scheduler's pods are listed and watched: it is the only one that binds sharegpu pods (the webhook
        # gives them its name), and a busy cluster's other pods would cost the view an event each for nothing.
        self.scheduler_name = scheduler_name
        # How the view follows the API server (sharegpu.kube.informer): each watch's server-side timeout, the
        # silence after which its connection is taken for dead, the time a cancelled watch may take to close.
        self.timing = Timing(watch_timeout_s, watch_idle_s, watch_close_s)
        self.synced = False  # True while the view follows the API server (listed and watching)
        self._informer: Informer | None = None  # while follow() runs
        self.relists = 0  # issue 10: full lists taken from the API server (sharegpu_cluster_view_relists_total)

    # ----- following the API server ----------------------------------------------------------------------------
    def resync(self) -> None:
        """List everything afresh before the next bind (a replica that just became the leader: what the previous
        leader bound must be in its ledger, not only on its way through the watch)."""
        self.synced = False
        if self._informer is not None:
            self._informer.relist()

    async def follow(self, api: ClusterApi, stop: asyncio.Event, max_backoff_s: float = 30.0) -> None:
        """List, then watch Nodes and Pods until ``stop``; on any API error relist after a backoff, for ever (the
        loop, its watch deadlines and its bounded cancellation are :class:`~sharegpu.kube.informer.Informer`'s).
        A relist that fails marks the view out of sync."""

        def listed(lists: Mapping[str, Sequence[Any]]) -> None:
            self.reset(lists["node"], lists["pod"])
            self.relists += 1  # issue 10
            log.log(
                logging.DEBUG if self.synced else logging.INFO,
                "cluster view in sync: %d sharegpu node(s), %d pod(s) with assignments",
                len(self._specs),
                len(self.ledger),
            )
            self.synced = True

        def lost(e: Exception, retry_s: float) -> None:
            if self.synced:
                log.warning("lost the API server (%s); no new binds until the view is back in sync", e)
            else:
                log.warning("cannot sync with the API server (%s); retrying in %.1fs", e, retry_s)
            self.synced = False

        def identity(obj: Node | Pod) -> tuple[str, str]:
            meta = obj.metadata
            return (f"{meta.namespace}/{meta.name}" if meta.namespace else meta.name), meta.resource_version

        sources: list[Source[Any]] = [
            Source("node", api.list_nodes, api.watch_nodes, self.apply_node, identity),
            Source(
                "pod",
                lambda: api.list_pods(self.scheduler_name),
                lambda rv, timeout_s: api.watch_pods(rv, timeout_s, self.scheduler_name),
                self.apply_pod,
                identity,
            ),
        ]
        timing = replace(self.timing, max_backoff_s=max_backoff_s)
        informer = self._informer = Informer("cluster view", sources, listed, lost, timing)
        try:
            await informer.run(stop)
        finally:
            self._informer = None
            self.synced = False
