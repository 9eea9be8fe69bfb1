"""The assume cache: placements this process made that the API server does not show yet, and the room it keeps.

Like the kube-scheduler's assumed pods, a placement is accounted before the API server confirms it: prioritize
*holds* its pick for the pod's bind (the kube-scheduler binds asynchronously, and the pods filtered meanwhile must
see the share taken), the bind *reserves* it while the Binding is written, and it stays until the watch shows the
pod bound, gone, or changed past the lost Binding's precondition. Each entry is in one :class:`Phase`.

Two more kinds of entry hold room that no pod holds yet, each typed and kept apart from the pods' placements:
:class:`KeptRoom`, what preemption keeps for a preemptor while its victims leave, and :class:`SteerHold`, the node
DRA steering chose for a pod whose claim the kube-scheduler has not allocated yet. This module holds the entries and
their transitions and nothing else — the ledger view (:mod:`sharegpu.k8s.cache.ledger_view`) and the DRA ledger
(:mod:`sharegpu.k8s.cache.dra_ledger`) account them in their ledgers.
"""

from __future__ import annotations

import enum
from collections.abc import KeysView
from dataclasses import dataclass, replace

from sharegpu.kube.informer import older
from sharegpu.kube.schema import Pod
from sharegpu.ledger import LedgerConflict
from sharegpu.model.assignment import Assignment


class Phase(enum.Enum):
    """Where a placement of this process stands that the API server does not show yet."""

    HELD = "held"  # prioritize chose it; kept until the pod's bind or a short deadline
    BINDING = "binding"  # the Binding (node and assignment in one write) is being created
    BOUND = "bound"  # the Binding was created; kept until the watch shows the pod bound, or gone
    UNKNOWN = "unknown"  # the Binding's answer was lost: it may or may not have been applied


class Outcome(enum.Enum):
    """How a bind ended, as far as the binder knows."""

    BOUND = "bound"
    FAILED = "failed"  # known not to be bound: what it reserved is released
    UNKNOWN = "unknown"  # not known: what it reserved is kept until the API server tells


@dataclass(frozen=True, slots=True)
class Assumed:
    """A placement of this process, accounted in the ledger before (and until) the API server shows it.

    A reservation is released only when the pod is known not to hold it: an UNKNOWN one stays until the watch (or a
    read-back) shows the pod bound, gone, or changed past :attr:`rv` — the resourceVersion precondition the Binding
    carried, after which that Binding can never be applied.
    """

    assignment: Assignment
    uid: str
    phase: Phase
    rv: str = ""  # UNKNOWN: the Binding's resourceVersion precondition
    expires: float = 0.0  # HELD: when the hold lapses (time.monotonic())
    deleted: bool = False  # a DELETED event came while the Binding was being written


@dataclass(frozen=True, slots=True)
class KeptRoom:
    """Room preemption keeps on a node for ``preemptor`` (a pod key) while its victims leave: the share of a victim
    already gone (``victim``: its key), so that no lower-priority pod takes it meanwhile, or the part of the
    preemptor's room that is free already (``victim`` None: the victims' controllers recreate them at once, and a
    replica would otherwise take that part beside its terminating original)."""

    preemptor: str
    victim: str | None
    assignment: Assignment  # what is kept, on the preemptor's node
    expires: float  # time.monotonic()

    @property
    def ledger_name(self) -> str:
        return room_ledger_name(self.preemptor, self.victim)


def room_ledger_name(preemptor: str, victim: str | None) -> str:
    """The name the ledger accounts kept room under: never a pod's key ("#" is not allowed in a pod's name), so no
    pod's filter, bind or relist can take it for its own."""
    return f"{victim or 'free'}#kept-for-{preemptor}"


@dataclass(frozen=True, slots=True)
class SteerHold:
    """DRA steering's choice for a pod (by UID) whose claims the kube-scheduler has not allocated yet: counted on
    the DRA ledger until one of ``claims`` is seen allocated, or ``expires``."""

    uid: str
    assignment: Assignment
    claims: tuple[str, ...]  # namespace/name of the pod's claims
    expires: float  # time.monotonic()

    @property
    def ledger_name(self) -> str:
        return f"hold:{self.uid}"


class AssumeCache:
    """The assumed placements by pod key, the room kept for preemptors and DRA steering's holds. Every method only
    moves entries; none touches a ledger."""

    def __init__(self) -> None:
        self._entries: dict[str, Assumed] = {}
        self._room: dict[tuple[str, str | None], KeptRoom] = {}  # (preemptor, victim) → what is kept
        self._steered: dict[str, SteerHold] = {}  # pod UID → steering's hold

    # ----- kept room (preemption) ------------------------------------------------------------------------------
    def keep(self, room: KeptRoom) -> None:
        self._room[(room.preemptor, room.victim)] = room

    def kept(self, preemptor: str, victim: str | None) -> KeptRoom | None:
        return self._room.get((preemptor, victim))

    def room(self) -> list[KeptRoom]:
        return list(self._room.values())

    def unkeep(self, preemptor: str) -> list[KeptRoom]:
        """Forget all the room kept for ``preemptor``; what was kept."""
        gone = [r for k, r in self._room.items() if k[0] == preemptor]
        for r in gone:
            del self._room[(r.preemptor, r.victim)]
        return gone

    def expire_room(self, now: float) -> list[KeptRoom]:
        """Forget the room kept past its time; what was forgotten (its ledger accounting is the caller's)."""
        gone = [r for r in self._room.values() if r.expires <= now]
        for r in gone:
            del self._room[(r.preemptor, r.victim)]
        return gone

    # ----- DRA steering's holds --------------------------------------------------------------------------------
    def steer(self, hold: SteerHold) -> None:
        self._steered[hold.uid] = hold

    def steered(self) -> list[SteerHold]:
        return list(self._steered.values())

    def drop_steered(self, uid: str) -> SteerHold | None:
        return self._steered.pop(uid, None)

    def steered_by_claim(self, claim: str) -> list[SteerHold]:
        return [h for h in self._steered.values() if claim in h.claims]

    def lapsed_steered(self, now: float) -> list[SteerHold]:
        return [h for h in self._steered.values() if h.expires <= now]

    # ----- reading ---------------------------------------------------------------------------------------------
    def get(self, key: str) -> Assumed | None:
        return self._entries.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> KeysView[str]:
        return self._entries.keys()

    def keys_by_uid(self) -> dict[str, str]:
        """Pod keys by UID, of the entries that know their pod's UID."""
        return {a.uid: k for k, a in self._entries.items() if a.uid}

    def phase(self, key: str) -> Phase | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.phase

    def held(self, key: str) -> Assignment | None:
        """What prioritize holds for pod ``key``, if anything."""
        entry = self._entries.get(key)
        return entry.assignment if entry is not None and entry.phase is Phase.HELD else None

    def unknown(self, key: str) -> tuple[Assignment | None, str, str]:
        """(assignment, pod UID, the lost Binding's resourceVersion) of a bind of unknown outcome, or (None, "", "")."""
        entry = self._entries.get(key)
        if entry is None or entry.phase is not Phase.UNKNOWN:
            return None, "", ""
        return entry.assignment, entry.uid, entry.rv

    def held_keys(self) -> list[str]:
        return [k for k, a in self._entries.items() if a.phase is Phase.HELD]

    def lapsed(self, now: float) -> list[str]:
        """The holds whose bind never came by ``now`` (the scheduler chose another node, or gave up)."""
        return [k for k, a in self._entries.items() if a.phase is Phase.HELD and a.expires <= now]

    def holds(self) -> int:
        return sum(a.phase is Phase.HELD for a in self._entries.values())

    def barred(self, key: str) -> bool:
        """Whether pod ``key`` was deleted while its Binding was being written: no copy of it may come back."""
        entry = self._entries.get(key)
        return entry is not None and entry.deleted

    # ----- transitions -----------------------------------------------------------------------------------------
    def add(self, entry: Assumed) -> None:
        """Take in a placement the caller has just accounted in the ledger."""
        self._entries[entry.assignment.pod] = entry

    def drop_hold(self, key: str) -> bool:
        """Forget pod ``key``'s hold; False when it has none (an entry of another phase is kept)."""
        entry = self._entries.get(key)
        if entry is None or entry.phase is not Phase.HELD:
            return False
        del self._entries[key]
        return True

    def bind_held(self, a: Assignment, uid: str) -> bool:
        """Move the pod's hold to BINDING when it is the placement ``a`` being bound (True); False when it has no hold
        or holds another placement. Raises :class:`LedgerConflict` when a bind of the pod is already in progress."""
        entry = self._entries.get(a.pod)
        if entry is None:
            return False
        if entry.phase is not Phase.HELD:
            raise LedgerConflict(f"a bind of pod {a.pod} is already in progress ({entry.phase.value})")
        if entry.assignment != a or entry.uid != uid:
            return False
        self._entries[a.pod] = replace(entry, phase=Phase.BINDING)
        return True

    def settle(self, key: str, outcome: Outcome, rv: str = "") -> bool:
        """A bind of ``key`` ended with ``outcome``: BOUND and UNKNOWN are kept (the latter with ``rv``, the Binding's
        precondition) until the API server shows the pod; FAILED is forgotten. False when the pod was deleted while
        its Binding was written: it holds nothing, and no copy of it may come back."""
        entry = self._entries.get(key)
        if entry is None or entry.phase not in (Phase.BINDING, Phase.UNKNOWN):
            return True
        if entry.deleted:
            del self._entries[key]
            return False
        if outcome is Outcome.FAILED:
            del self._entries[key]
        else:
            self._entries[key] = replace(entry, phase=Phase.BOUND if outcome is Outcome.BOUND else Phase.UNKNOWN, rv=rv)
        return True

    def seen_bound(self, key: str, pod: Pod) -> None:
        """Pod ``key``'s BOUND entry ends where ``pod``, the copy the view already holds, shows it bound as this
        process bound it: the watch event that ends such an entry (:meth:`observed`) came while the Binding was still
        being written, and may be the last event the pod ever has (a node whose pods' status never changes)."""
        entry = self._entries.get(key)
        if (
            entry is not None
            and entry.phase is Phase.BOUND
            and (not entry.uid or entry.uid == pod.metadata.uid)
            and pod.spec.node_name == entry.assignment.node
        ):
            del self._entries[key]

    def forget(self, key: str) -> None:
        """Pod ``key`` is gone: its entry goes, except a Binding being written, which settles without the pod."""
        entry = self._entries.get(key)
        if entry is None:
            return
        if entry.phase is Phase.BINDING:
            self._entries[key] = replace(entry, deleted=True)
        else:
            del self._entries[key]

    def observed(self, key: str, pod: Pod) -> None:
        """The API server's copy of pod ``key`` may end a placement of this process that it now shows (or rules out)."""
        entry = self._entries.get(key)
        if entry is None or entry.phase in (Phase.HELD, Phase.BINDING):
            return  # still this process's to settle
        if entry.uid and pod.metadata.uid and pod.metadata.uid != entry.uid:
            del self._entries[key]  # another pod of that name: the one placed is gone
        elif pod.spec.node_name or pod.finished:
            del self._entries[key]  # bound: from now on its own assignment annotation accounts for it
        elif entry.phase is Phase.UNKNOWN and entry.rv and older(entry.rv, pod.metadata.resource_version):
            del self._entries[key]  # changed past the Binding's precondition, unbound: that Binding never applies
