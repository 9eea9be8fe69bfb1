"""Room being freed for preemptors, kept for them as it frees: the reservations of preemption (and of
consolidation, which moves pods through it).

A reservation is made before the first eviction. While its victims terminate they keep their share (a terminating
pod holds its assignment); a victim already gone leaves its share kept for the preemptor, and so does the part of the
preemptor's room that is free already (the cluster view's kept room: typed entries of its assume cache); once the
last victim is gone the room is held for the preemptor (a HELD placement, as filter's own) until it binds or the
hold lapses. :meth:`Reservations.settle` moves every reservation along and says which ended and how; the
controller counts and logs them.

MPS daemons (issue 32): a unit shared through MPS runs a daemon per tenant, each with its server's memory, at most
the cap. A gone victim's MPS share is kept as the preemptor's tenant where the preemptor's own share on that unit is
an MPS client too, so the ledger counts the daemon that will run there (not a daemon of a tenant that left, which a
pod of that tenant could join meanwhile); the part of the room free already includes the preemptor's daemon memory
where its tenant runs none there once the victims are gone.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from dataclasses import dataclass, field, replace

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.extender.schedulers import Schedulers
from sharegpu.ledger import Ledger, LedgerError
from sharegpu.model.assignment import Assignment, GpuShare, Mechanism
from sharegpu.placement.framework import Decision
from sharegpu.placement.preemption import copy_ledger

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Reservation:
    """Room being freed on ``node`` for pod ``pod``: its ``victims`` must leave the ledger first."""

    pod: str
    uid: str
    priority: int
    node: str
    assignment: Assignment | None  # the planner's choice; decided afresh when it no longer fits
    victims: frozenset[str]
    started: float
    freed_at: float | None = None  # when the last victim was seen gone
    # The victims' assignments: a victim that is gone while others still terminate leaves its share kept in the
    # view's assume cache (a KeptRoom for the victim), so that a lower-priority pod cannot take the part of the room
    # already freed. The part of the pod's room that is free already is kept too while the victims terminate (a
    # KeptRoom without a victim): as the kube-scheduler counts a nominated pod on its node for pods of lower priority.
    kept: dict[str, Assignment] = field(default_factory=dict)


class Settled(enum.Enum):
    """How a reservation ended."""

    GONE = "gone"  # its preemptor was deleted, replaced, finished or is terminating
    BOUND = "bound"  # its preemptor is bound
    VICTIMS_STAYED = "victims-stayed"  # its victims did not leave within victims_timeout_s
    NOT_BOUND = "not-bound"  # the room was free, but the preemptor did not bind within reserve_s


@dataclass(frozen=True, slots=True)
class Ended:
    reservation: Reservation
    how: Settled
    at: float  # the clock when it was seen


class Reservations:
    """The reservations in progress, by preemptor, and the room they keep in the cluster view."""

    def __init__(self, view: ClusterView, schedulers: Schedulers, victims_timeout_s: float, reserve_s: float) -> None:
        self.view = view
        self.schedulers = schedulers  # a freed room that no longer fits the planned share is decided afresh
        self.victims_timeout_s = victims_timeout_s
        self.reserve_s = reserve_s
        self._by_pod: dict[str, Reservation] = {}

    def __len__(self) -> int:
        return len(self._by_pod)

    def __contains__(self, key: object) -> bool:
        return key in self._by_pod

    def nodes(self) -> dict[str, str]:
        """Preemptor → nominated node."""
        return {k: r.node for k, r in self._by_pod.items()}

    def add(self, r: Reservation) -> None:
        self._by_pod[r.pod] = r

    def end(self, key: str) -> Reservation | None:
        """Forget pod ``key``'s reservation and release the room it kept."""
        r = self._by_pod.pop(key, None)
        if r is not None:
            self.view.unkeep_room(r.pod)
        return r

    def clear(self) -> None:
        for key in list(self._by_pod):
            self.end(key)

    def settle(self, now: float) -> list[Ended]:
        """Keep or hold the room of each reservation as its victims leave; end those that are done (returned)."""
        view = self.view
        ended: list[Ended] = []
        for key, r in list(self._by_pod.items()):
            pod = view.pod(key)
            if pod is None or (r.uid and pod.metadata.uid != r.uid) or pod.finished or pod.metadata.deletion_timestamp:
                ended.append(self._ended(r, Settled.GONE, now))
                continue
            if pod.spec.node_name:
                ended.append(self._ended(r, Settled.BOUND, now))
                continue
            if view.in_flight(key):
                continue  # held (by this reservation or its own filter) or being bound
            leaving = [v for v in r.victims if self._present(v)]
            if leaving:
                if now - r.started > self.victims_timeout_s:
                    ended.append(self._ended(r, Settled.VICTIMS_STAYED, now))
                    continue
                for v in r.victims:
                    if v not in leaving:
                        self._keep(r, v, r.started + self.victims_timeout_s)
                self._keep_free(r, r.started + self.victims_timeout_s)
                continue
            view.unkeep_room(r.pod)
            if r.freed_at is None:
                r.freed_at = now
            if now - r.freed_at > self.reserve_s:
                ended.append(self._ended(r, Settled.NOT_BOUND, now))
                continue
            self._hold(r, r.freed_at + self.reserve_s)
        return ended

    def _ended(self, r: Reservation, how: Settled, now: float) -> Ended:
        self.end(r.pod)
        return Ended(r, how, now)

    def future_ledger(self) -> Ledger:
        """The ledger once what is leaving has left: terminating pods gone, every reservation's room taken."""
        view = self.view
        led = copy_ledger(view.ledger)
        # Our own victims count as leaving even before the watch shows them terminating.
        evicted = {v for r in self._by_pod.values() for v in r.victims}
        for key in list(led.assignments):
            pod = view.pod(key)
            leaving = pod is not None and bool(pod.metadata.deletion_timestamp) and bool(pod.spec.node_name)
            if leaving or key in evicted:
                led.release(key)
        for r in self._by_pod.values():
            for room in view.room_for(r.pod):  # kept for this very reservation: its own room is placed just below
                if room.ledger_name in led.assignments:
                    led.release(room.ledger_name)
            if r.pod in led.assignments or r.assignment is None:
                continue
            with contextlib.suppress(LedgerError):
                led.place(r.assignment, check_health=False)
        return led

    def _present(self, key: str) -> bool:
        pod = self.view.pod(key)
        return pod is not None and not pod.finished and key in self.view.ledger.assignments

    def _keep(self, r: Reservation, victim: str, expires: float) -> None:
        a = r.kept.get(victim)
        if a is None or self.view.kept_room(r.pod, victim) is not None:
            return
        mine = _as_preemptors(r, a)
        try:
            self.view.keep_room(r.pod, victim, mine, expires)
            return
        except LedgerError as e:
            if mine is a:  # its room was taken in the same step: the preemptor's hold will say so
                log.info("cannot keep the room of %s for %s: %s", victim, r.pod, e)
                return
        try:
            # As the victim held it: its tenant's daemon on the unit still serves others, and the preemptor's would
            # need memory that is not free yet.
            self.view.keep_room(r.pod, victim, a, expires)
        except LedgerError as e:
            log.info("cannot keep the room of %s for %s: %s", victim, r.pod, e)

    def _keep_free(self, r: Reservation, expires: float) -> None:
        """Hold what ``r``'s pod needs on its GPUs beyond what its victims hold (see :class:`Reservation`), MPS
        daemons counted: its tenant's daemon where that runs none on the GPU once the victims are gone. Held from
        the free memory if it can be; else counting on the victims' daemons that close as their last clients leave
        (a pod of a victim's tenant that joins the daemon meanwhile keeps it open: the room is then short of it)."""
        if r.assignment is None or self.view.kept_room(r.pod, None) is not None:
            return
        led = self.view.ledger
        n = led.index.get(r.node)
        if n is None:
            return
        tenant = r.assignment.tenant
        last: Exception | None = None
        for count_closing in (False, True):
            shares = _free_part(led, n, r, count_closing)
            if shares is None:
                return  # a MIG instance is had whole or not at all: nothing partial to hold
            if not shares:
                return
            try:
                # As the preemptor's tenant: the ledger counts its daemon on each GPU, as it will run there.
                self.view.keep_room(r.pod, None, Assignment(r.pod, r.node, tuple(shares), tenant=tenant), expires)
                return
            except (LedgerError, ValueError) as e:
                last = e
        # Taken in the same step: the pod's own hold will say so.
        log.info("cannot hold the free part of %s's room on %s: %s", r.pod, r.node, last)

    def _hold(self, r: Reservation, expires: float) -> None:
        view = self.view
        a = r.assignment
        if a is not None:
            try:
                view.hold(a, r.uid, expires)
                return
            except LedgerError:
                pass  # something changed on the node since the plan (e.g. a GPU's mechanism): decide afresh
        req = view.request(r.pod)
        n = view.ledger.index.get(r.node)
        if req is None or n is None:
            return
        decision = self.schedulers.placement().decide_on(req, n)
        if isinstance(decision, Decision):
            try:
                view.hold(decision.assignment, r.uid, expires)
                r.assignment = decision.assignment
            except LedgerError as e:
                log.info("cannot hold room for %s on %s yet: %s", r.pod, r.node, e)


def _as_preemptors(r: Reservation, a: Assignment) -> Assignment:
    """A gone victim's assignment ``a`` as the room kept for ``r``'s pod: where every MPS share of it is on a GPU or
    MIG instance where the preemptor's own share is an MPS client too, it is kept as the preemptor's tenant, so that
    the ledger counts the daemon that will run there (the preemptor's) and not one of a victim that is gone; else
    as the victim held it."""
    mine = r.assignment
    if mine is None or a.node != mine.node or a.tenant == mine.tenant:
        return a
    theirs = {(s.gpu_index, s.mig.start if s.mig else None) for s in a.shares if s.sharing is Mechanism.MPS}
    ours = {(s.gpu_index, s.mig.start if s.mig else None) for s in mine.shares if s.sharing is Mechanism.MPS}
    if not theirs or not theirs <= ours:
        return a
    return replace(a, tenant=mine.tenant)


def _free_part(led: Ledger, n: int, r: Reservation, count_closing: bool) -> list[GpuShare] | None:
    """The shares that hold what ``r``'s pod needs on node ``n`` beyond what its victims hold (None: it takes a MIG
    instance, which is held whole or not at all). Where its share is an MPS client of a tenant that runs no daemon on
    the GPU once the victims are gone, it needs that daemon's memory too; ``count_closing``: less the memory of the
    victims' daemons whose every client there is a victim (they close as the victims leave)."""
    assert r.assignment is not None
    daemon = led.tenancy.daemon_memory_mib
    memory: dict[int, int] = {}
    milli: dict[int, int] = {}
    leaving: dict[tuple[int, str], int] = {}  # (GPU, tenant) → the victims' MPS clients there still present
    for victim, a in r.kept.items():
        if a.node != r.node:
            continue
        present = victim in led.assignments
        for s in a.shares:
            memory[s.gpu_index] = memory.get(s.gpu_index, 0) + s.memory_mib
            milli[s.gpu_index] = milli.get(s.gpu_index, 0) + s.compute_milli
            if present and s.mig is None and s.sharing is Mechanism.MPS:
                key = (s.gpu_index, led.tenant_key(n, a.tenant))
                leaving[key] = leaving.get(key, 0) + 1
    mine = led.tenant_key(n, r.assignment.tenant)
    shares = []
    for s in r.assignment.shares:
        if s.mig is not None:
            return None
        g = s.gpu_index
        clients = led.unit_tenants.get((n, g, None), {})
        needs_daemon = s.sharing is Mechanism.MPS and clients.get(mine, 0) <= leaving.get((g, mine), 0)
        closing = sum(1 for t, c in clients.items() if leaving.get((g, t), 0) >= c) if count_closing else 0
        short = s.memory_mib + daemon * (int(needs_daemon) - closing) - memory.get(g, 0)
        compute = s.compute_milli - milli.get(g, 0)
        if short <= 0 and compute <= 0:
            continue
        # A share of the preemptor's tenant where that runs no daemon now opens one: the ledger counts its memory.
        opens = s.sharing is Mechanism.MPS and mine not in clients
        mem = short - daemon if opens else short
        shares.append(replace(s, memory_mib=max(mem, 0), compute_milli=max(compute, 1)))
    return shares
