"""The cluster view: one cache of the API server's objects, followed by one informer, with both ledgers derived.

The kube-scheduler's split: one informer lists and watches Nodes and Pods — and, with DRA steering on, the driver's
ResourceSlices and every ResourceClaim — (:class:`~sharegpu.kube.informer.Informer`: the idle deadline, tombstones,
bounded cancellation); its event handlers feed the ledgers derived from those objects: the device-plugin nodes'
ledger (:mod:`sharegpu.k8s.cache.ledger_view`, which this class is) and the DRA nodes' ledger
(:mod:`sharegpu.k8s.cache.dra_ledger`), with one assume cache (:mod:`sharegpu.k8s.cache.assume`) for what this process
placed or holds that the API server does not show yet. What this module adds is whether the view is in sync, which
the extender checks before every placement (a view that lost the API server places nothing), and the listeners told
of every pod change (preemption holds freed room in the same step that frees it, before any filter call can run).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from sharegpu.k8s.cache.dra_ledger import DraLedger
from sharegpu.k8s.cache.ledger_view import LedgerView
from sharegpu.kube.api import ClusterApi, DraApi
from sharegpu.kube.errors import Forbidden, NotFound
from sharegpu.kube.informer import WATCH_CLOSE_S, WATCH_TIMEOUT_S, Informer, Source, Timing
from sharegpu.kube.schema import Node, Pod, ResourceClaim, ResourceSlice
from sharegpu.ledger import MpsTenancy
from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog
from sharegpu.model.contract import DRIVER

log = logging.getLogger(__name__)

# What a placement refused while the view is out of sync says: the view may lack what another replica bound.
NOT_SYNCED = "sharegpu has lost the API server and is reconnecting; no new placements until its view is back in sync"


class ClusterView(LedgerView):
    def __init__(
        self,
        catalog: Catalog = DEFAULT_CATALOG,
        watch_timeout_s: tuple[int, int] = WATCH_TIMEOUT_S,
        watch_idle_s: float | None = None,
        scheduler_name: str | None = None,
        watch_close_s: float = WATCH_CLOSE_S,
        follow_dra: bool = False,
        tenancy: MpsTenancy | None = None,
    ) -> None:
        super().__init__(catalog, tenancy=tenancy)
        # The DRA nodes' ledger, fed by the same informer (None: no slice or claim is followed; the extender follows
        # them for DRA steering, ``sharegpu status`` to show the DRA nodes).
        self.dra: DraLedger | None = DraLedger(self._assumed, catalog, self.tenancy) if follow_dra else None
        # Why the DRA objects cannot be followed ("": they can): resource.k8s.io/v1 not served, or not readable with
        # these credentials. The view then follows Nodes and Pods alone.
        self.dra_unavailable = ""
        self.dra_forbidden = False  # the credentials may not read them (a cluster without DRA is not an error)
        self.pod_listeners: list[Callable[[], None]] = []  # told after every pod change applied (watch or relist)
        # Only this scheduler's pods are accounted: it is the only one that binds sharegpu pods (the webhook gives them
        # its name). Without DRA steering only they are listed and watched (a busy cluster's other pods would cost an
        # event each for nothing); with it every pod is, for the cpu and memory of those bound to DRA nodes.
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

    # ----- the informer's event handlers -------------------------------------------------------------------------
    def apply_pod(self, event: str, pod: Pod) -> None:
        if self.dra is not None:
            self.dra.apply_pod(event, pod)
        if self.scheduler_name is None or pod.spec.scheduler_name == self.scheduler_name:
            super().apply_pod(event, pod)
        self._pods_changed()

    def apply_node(self, event: str, node: Node) -> None:
        if self.dra is not None:
            self.dra.apply_node(event, node)
        super().apply_node(event, node)

    def apply_slice(self, event: str, obj: ResourceSlice) -> None:
        if self.dra is not None:
            self.dra.apply_slice(event, obj)

    def apply_claim(self, event: str, obj: ResourceClaim) -> None:
        if self.dra is not None:
            self.dra.apply_claim(event, obj)

    def reset(self, nodes: Iterable[Node], pods: Iterable[Pod]) -> None:
        super().reset(nodes, pods)
        self._pods_changed()

    def relisted(
        self,
        nodes: Sequence[Node],
        pods: Sequence[Pod],
        slices: Sequence[ResourceSlice] = (),
        claims: Sequence[ResourceClaim] = (),
    ) -> None:
        """A full list of everything the view follows: both ledgers start again from it."""
        if self.dra is not None:
            self.dra.reset(nodes, pods, slices, claims)
        name = self.scheduler_name
        self.reset(nodes, [p for p in pods if name is None or p.spec.scheduler_name == name])

    async def load(self, api: ClusterApi) -> None:
        """List everything the view follows once, as the informer's first list does (``sharegpu status``)."""
        nodes, _ = await api.list_nodes()
        pods, _ = await api.list_pods(self._pods_of())
        slices: list[ResourceSlice] = []
        claims: list[ResourceClaim] = []
        if self.dra is not None and isinstance(api, DraApi):
            try:
                claims, _ = await api.list_claims()
                slices, _ = await api.list_slices(DRIVER)
            except (NotFound, Forbidden) as e:
                self._dra_refused(e)
        self.relisted(nodes, pods, slices, claims)

    def _pods_of(self) -> str | None:
        """The scheduler whose pods are listed and watched (None: every pod; the DRA ledger counts them all)."""
        return self.scheduler_name if self.dra is None else None

    def _pods_changed(self) -> None:
        for listener in self.pod_listeners:
            listener()

    # ----- following the API server ----------------------------------------------------------------------------
    async def follow(self, api: ClusterApi, stop: asyncio.Event, max_backoff_s: float = 30.0) -> None:
        """List, then watch Nodes and Pods (and with DRA steering the driver's slices and every claim) until
        ``stop``; on any API error relist after a backoff, for ever (the loop, its watch deadlines and its bounded
        cancellation are :class:`~sharegpu.kube.informer.Informer`'s). A relist that fails marks the view out of
        sync."""

        def listed(lists: Mapping[str, Sequence[Any]]) -> None:
            self.relisted(lists["node"], lists["pod"], lists.get("slice", ()), lists.get("claim", ()))
            self.relists += 1  # issue 10
            dra = "" if self.dra is None else ", DRA: {} node(s), {} slice(s), {} claim(s)".format(*self.dra.counts())
            log.log(
                logging.DEBUG if self.synced else logging.INFO,
                "cluster view in sync: %d sharegpu node(s), %d pod(s) with assignments%s",
                len(self._specs),
                len(self.ledger),
                dra,
            )
            self.synced = True

        def lost(e: Exception, retry_s: float) -> None:
            if self.synced:
                log.warning("lost the API server (%s); no new binds until the view is back in sync", e)
            else:
                log.warning("cannot sync with the API server (%s); retrying in %.1fs", e, retry_s)
            self.synced = False

        def identity(obj: Node | Pod | ResourceSlice | ResourceClaim) -> tuple[str, str]:
            meta = obj.metadata
            return (f"{meta.namespace}/{meta.name}" if meta.namespace else meta.name), meta.resource_version

        pods_of = self._pods_of()
        sources: list[Source[Any]] = [
            Source("node", api.list_nodes, api.watch_nodes, self.apply_node, identity),
            Source(
                "pod",
                lambda: api.list_pods(pods_of),
                lambda rv, timeout_s: api.watch_pods(rv, timeout_s, pods_of),
                self.apply_pod,
                identity,
            ),
        ]
        if self.dra is not None:
            if not isinstance(api, DraApi):
                raise TypeError("DRA steering needs a ClusterApi that also lists ResourceSlices and ResourceClaims")
            if await self._dra_readable(api):
                dra_api = api
                sources += [
                    Source(
                        "slice",
                        lambda: dra_api.list_slices(DRIVER),
                        lambda rv, timeout_s: dra_api.watch_slices(rv, timeout_s, DRIVER),
                        self.apply_slice,
                        identity,
                    ),
                    Source("claim", dra_api.list_claims, dra_api.watch_claims, self.apply_claim, identity),
                ]
        timing = replace(self.timing, max_backoff_s=max_backoff_s)
        informer = self._informer = Informer("cluster view", sources, listed, lost, timing)
        try:
            await informer.run(stop)
        finally:
            self._informer = None
            self.synced = False

    async def _dra_readable(self, api: DraApi) -> bool:
        """Whether the DRA objects can be followed: where the API server does not serve resource.k8s.io/v1, or the
        credentials may not list them, the view follows Nodes and Pods alone (DRA steering judges nothing, status
        shows no DRA node) rather than never syncing. Said once, in :attr:`dra_unavailable` and the log."""
        try:
            await api.list_claims()
        except (NotFound, Forbidden) as e:
            self._dra_refused(e)
            return False
        except Exception:  # any other error: the informer's own retries report it
            return True
        return True

    def _dra_refused(self, e: NotFound | Forbidden) -> None:
        if isinstance(e, NotFound):
            self.dra_unavailable = "the API server does not serve resource.k8s.io/v1 (no DRA)"
        else:
            self.dra_forbidden = True
            self.dra_unavailable = (
                f"{e}; grant list on resourceslices and resourceclaims (resource.k8s.io) to these credentials "
                "(and watch, to follow them)"
            )
        log.warning("not following DRA ResourceSlices and ResourceClaims: %s", self.dra_unavailable)
