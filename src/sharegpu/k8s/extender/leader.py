"""Leader election on a ``coordination.k8s.io/v1`` Lease, so that several extender replicas run and only one binds.

The protocol is client-go's (``k8s.io/client-go/tools/leaderelection``), which the kube-scheduler and
kube-controller-manager use: a Lease names its holder and when it last renewed; the holder renews every
``retry_s``; another replica takes the Lease over once it has seen the same record, unchanged, for
``lease_s`` (measured on its own clock, so clocks need not agree); every write carries the Lease's
resourceVersion, so of two replicas racing for it one wins and the other gets a conflict.

A leader counts as one only while its last successful renewal is younger than ``renew_deadline_s`` (shorter than
``lease_s``): a leader cut off from the API server stops binding before anyone else can take the Lease over, and
the binder's own requests time out sooner than the margin between the two.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime

from sharegpu.kube.errors import Conflict, KubeError, NotFound
from sharegpu.kube.lease import LeaseApi, LeaseRecord

log = logging.getLogger(__name__)

LEASE_S = 10.0
RENEW_DEADLINE_S = 6.0
RETRY_S = 1.5


class LeaderElector:
    def __init__(
        self,
        api: LeaseApi,
        namespace: str,
        name: str,
        identity: str,
        lease_s: float = LEASE_S,
        renew_deadline_s: float = RENEW_DEADLINE_S,
        retry_s: float = RETRY_S,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        if not retry_s < renew_deadline_s < lease_s:
            raise ValueError(f"need retry {retry_s}s < renew deadline {renew_deadline_s}s < lease {lease_s}s")
        self.api, self.namespace, self.name, self.identity = api, namespace, name, identity
        self.lease_s, self.renew_deadline_s, self.retry_s = lease_s, renew_deadline_s, retry_s
        self.clock = clock
        self.on_change = on_change
        self._renewed_at: float | None = None  # when this replica last renewed the Lease as its holder
        self._observed: LeaseRecord | None = None
        self._observed_at = 0.0  # when the observed record last changed, on this replica's clock
        self._was_leader = False
        self.holder = ""  # the holder last seen (shown by status and metrics)

    def is_leader(self) -> bool:
        return self._renewed_at is not None and self.clock() - self._renewed_at < self.renew_deadline_s

    async def run(self, stop: asyncio.Event) -> None:
        """Try to acquire, then renew, every ``retry_s`` until ``stop``; give the Lease up on the way out."""
        try:
            while not stop.is_set():
                await self.try_once()
                self._notify()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.retry_s)
        finally:
            await self._release()
            self._notify()

    async def try_once(self) -> bool:
        """One round of client-go's tryAcquireOrRenew; True when this replica holds the Lease after it."""
        now = self.clock()
        wall = datetime.now(UTC)
        try:
            current: LeaseRecord | None = await self.api.get_lease(self.namespace, self.name)
        except NotFound:
            current = None
        except KubeError as e:
            log.warning("leader election: cannot read lease %s/%s: %s", self.namespace, self.name, e)
            return False
        mine = LeaseRecord(self.identity, round(self.lease_s), wall, wall, 0)
        try:
            if current is None:
                record = await self.api.create_lease(self.namespace, self.name, mine)
            else:
                if current != self._observed:
                    self._observed, self._observed_at = current, now
                self.holder = current.holder
                if current.holder and current.holder != self.identity and now < self._observed_at + self.lease_s:
                    return False  # held by another replica that renewed within the lease
                if current.holder == self.identity:
                    mine = replace(mine, acquired=current.acquired, transitions=current.transitions)
                else:
                    mine = replace(mine, transitions=current.transitions + 1)
                record = await self.api.update_lease(
                    self.namespace, self.name, replace(mine, resource_version=current.resource_version)
                )
        except Conflict:
            return False  # another replica wrote it first
        except KubeError as e:
            log.warning("leader election: cannot write lease %s/%s: %s", self.namespace, self.name, e)
            return False
        self._observed, self._observed_at = record, now
        self._renewed_at = now
        self.holder = self.identity
        return True

    async def _release(self) -> None:
        """Step down at once (an empty holder), so a replica that stops cleanly does not make the others wait."""
        if not self.is_leader() or self._observed is None:
            self._renewed_at = None
            return
        self._renewed_at = None
        with contextlib.suppress(KubeError):
            await self.api.update_lease(
                self.namespace, self.name, replace(self._observed, holder="", lease_s=1, renewed=datetime.now(UTC))
            )

    def _notify(self) -> None:
        leader = self.is_leader()
        if leader != self._was_leader:
            self._was_leader = leader
            log.info(
                "leader election: %s %s the leader (lease %s/%s)",
                self.identity,
                "is now" if leader else "is no longer",
                self.namespace,
                self.name,
            )
            if self.on_change is not None:
                self.on_change(leader)
