"""Room being freed for preemptors, kept for them as it frees: the reservations of preemption (and of
consolidation, which moves pods through it).

A reservation is made before the first eviction. While its victims terminate they keep their share (a terminating
pod holds its assignment); a victim already gone leaves its share kept for the preemptor, and so does the part of the
preemptor's room that is free already (the cluster view's kept room: typed entries of its assume cache); once the
last victim is gone the room is held for the preemptor (a HELD placement, as filter's own) until it binds or the
hold lapses. :meth:`Reservations.settle` moves every reservation along and says which ended and how; the
controller counts and logs them.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from dataclasses import dataclass, field, replace

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.extender.schedulers import Schedulers
from sharegpu.ledger import Ledger, LedgerError
from sharegpu.model.assignment import Assignment
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
        try:
            self.view.keep_room(r.pod, victim, a, expires)
        except LedgerError as e:  # its room was taken in the same step: the preemptor's hold will say so
            log.info("cannot keep the room of %s for %s: %s", victim, r.pod, e)

    def _keep_free(self, r: Reservation, expires: float) -> None:
        """Hold what ``r``'s pod needs on its GPUs beyond what its victims hold (see :class:`Reservation`)."""
        if r.assignment is None or self.view.kept_room(r.pod, None) is not None:
            return
        memory: dict[int, int] = {}
        milli: dict[int, int] = {}
        for a in r.kept.values():
            if a.node != r.node:
                continue
            for s in a.shares:
                memory[s.gpu_index] = memory.get(s.gpu_index, 0) + s.memory_mib
                milli[s.gpu_index] = milli.get(s.gpu_index, 0) + s.compute_milli
        shares = []
        for s in r.assignment.shares:
            if s.mig is not None:
                return  # a MIG instance is had whole or not at all: nothing partial to hold
            mem = s.memory_mib - memory.get(s.gpu_index, 0)
            compute = s.compute_milli - milli.get(s.gpu_index, 0)
            if mem > 0 or compute > 0:
                shares.append(replace(s, memory_mib=max(mem, 0), compute_milli=max(compute, 1)))
        if not shares:
            return
        try:
            # The preemptor's user goes with the part it holds: an MPS unit serves one user (ledger).
            self.view.keep_room(
                r.pod, None, Assignment(r.pod, r.node, tuple(shares), tenant=r.assignment.tenant), expires
            )
        except (LedgerError, ValueError) as e:  # taken in the same step: the pod's own hold will say so
            log.info("cannot hold the free part of %s's room on %s: %s", r.pod, r.node, e)

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
