"""Why a node cannot host a request: typed filter reasons, one rule table.

Like the kube-scheduler's framework Status (a code, ``UnschedulableAndUnresolvable`` or not, and the reasons for
people; ``InsufficientResource`` for what is short), a rejected node gets a :class:`FilterReason`: a code saying
which rule it failed, whether anything evicted could ever make it fit, and the words a user reads. The extender's
per-node answers, ``sharegpu status`` and the simulator's report all read the code; none parses the words.

The rules run most fundamental first (no GPU of an allowed model before "GPUs are busy"); the first that holds is
the node's reason. Each rule belongs to a :class:`ReasonKind`, the coarser class a summary counts nodes by; the
kinds, with a request's outcomes beyond its nodes' (an invalid request, a full queue), are the one vocabulary of why
a request is not placed: one machine name and one sentence each, defined here only. A kind's
gate is written once over numpy arrays, so that counting a request that fits nowhere over every node (vectorised)
and explaining one node agree by construction; the finer rules inside a kind only word the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from enum import Enum

import numpy as np
import numpy.typing as npt

from sharegpu.ledger import MPS_MAX_CLIENTS, GpuMode, Ledger
from sharegpu.model.request import GpuRequest
from sharegpu.placement.mechanism import UsablePlan, mig_choice

BoolArray = npt.NDArray[np.bool_]
IntArray = npt.NDArray[np.int64]


class ReasonKind(Enum):
    """Why a request is not placed: the one vocabulary of ``sharegpu status`` (its ``reason``, the ``reason`` label
    of sharegpu_cluster_pending_pods) and the simulator (the keys of its ``failures_by_reason``). The value is the
    stable machine name; :attr:`sentence` says it for people (docs/metrics.md lists both).

    The first five are the classes of a node's reason, in the order the rules run (a summary counts nodes per kind);
    the rest are a request's outcomes that no node's rules give.
    """

    NO_ALLOWED_MODEL = "no-allowed-model"
    NO_GPUS = "no-gpus"
    CPU = "cpu"
    HOST_MEMORY = "host-memory"
    GPU_ROOM = "gpu-busy"  # fewer GPUs with room for the share than the request asks
    INVALID_REQUEST = "invalid-request"
    FITS = "fits"
    NO_NODES = "no-nodes"
    QUEUE_FULL = "queue-full"
    STILL_PENDING = "still-pending"

    @classmethod
    def named(cls, name: str) -> ReasonKind | None:
        """The kind of a machine name (None for a name this version does not know, e.g. from a newer extender)."""
        try:
            return cls(name)
        except ValueError:
            return None

    @property
    def sentence(self) -> str:
        """The kind for people, said of a request over the whole cluster."""
        return _SENTENCES[self]

    def summary(self, req: GpuRequest) -> str:
        """The kind in the words of a summary over nodes ("3 node(s): not enough CPU")."""
        if self is ReasonKind.GPU_ROOM:
            return f"fewer than {req.gpu_count} GPU(s) with room for the share"
        return _NODE_WORDS.get(self, self.sentence)

    @property
    def model_mismatch(self) -> bool:
        """The node has no GPU the request may use at all: it says nothing about room or fragmentation."""
        return self in (ReasonKind.NO_ALLOWED_MODEL, ReasonKind.NO_GPUS)


_SENTENCES = {
    ReasonKind.NO_ALLOWED_MODEL: "no node has a GPU of an allowed model",
    ReasonKind.NO_GPUS: "no sharegpu node has GPUs",
    ReasonKind.CPU: "no node with a fitting GPU has enough free CPU",
    ReasonKind.HOST_MEMORY: "no node with a fitting GPU has enough free host memory",
    ReasonKind.GPU_ROOM: "GPUs of an allowed model exist but none has room for the share now",
    ReasonKind.INVALID_REQUEST: "the pod's sharegpu request can never be valid",
    ReasonKind.FITS: "sharegpu has room now; the pod waits on the kube-scheduler (queue, back-off, taints, affinity)",
    ReasonKind.NO_NODES: "no nodes",
    ReasonKind.QUEUE_FULL: "pending queue full",
    ReasonKind.STILL_PENDING: "still pending at the end of the trace",
}
# A node's kinds in the words of a count over nodes (the extender's answers: their bytes are fixed).
_NODE_WORDS = {
    ReasonKind.NO_ALLOWED_MODEL: "no GPU of an allowed model",
    ReasonKind.NO_GPUS: "no GPUs",
    ReasonKind.CPU: "not enough CPU",
    ReasonKind.HOST_MEMORY: "not enough host memory",
}

# The reasons a pod waits in a cluster (``sharegpu status``, the metric's label values), most actionable first.
PENDING_REASONS = (
    ReasonKind.GPU_ROOM,
    ReasonKind.HOST_MEMORY,
    ReasonKind.CPU,
    ReasonKind.NO_ALLOWED_MODEL,
    ReasonKind.NO_GPUS,
    ReasonKind.INVALID_REQUEST,
    ReasonKind.FITS,
)


class ReasonCode(Enum):
    """The rule a node failed (finer than its kind: the words differ per code)."""

    NO_ALLOWED_MODEL = "no-allowed-model"
    NO_GPUS = "no-gpus"
    CPU = "cpu"
    HOST_MEMORY = "host-memory"
    TOO_FEW_HEALTHY = "too-few-healthy"
    SHARE_MEMORY = "share-memory"
    SHARE_COMPUTE = "share-compute"
    TOO_FEW_IDLE = "too-few-idle"
    NO_ROOM_FOR_MECHANISM = "no-room-for-mechanism"
    TOO_FEW_WITH_ROOM = "too-few-with-room"
    FITS = "fits"  # a node that passes these rules (another filter rejected it)


@dataclass(frozen=True, slots=True)
class NodeRoom:
    """What one node's reason depends on, for one request: GPUs of an allowed model (present; and healthy), GPUs
    with room for the share, the largest free memory and compute on one healthy allowed GPU (-1: none), and the
    node's free CPU (milli) and host memory (MiB). Nodes alike in these share their reason."""

    n_allowed: int
    n_healthy: int
    n_usable: int
    free_mem: int
    free_milli: int
    cpu_free: int
    mem_free: int


@dataclass(frozen=True, slots=True)
class RoomArrays:
    """The numbers the kinds' gates read, one entry per node."""

    n_allowed: IntArray
    n_usable: IntArray
    cpu_free: IntArray
    mem_free: IntArray


def fmt_mib(mib: int) -> str:
    """Memory as a user writes it: 12Gi, 1.5Gi or 512Mi."""
    if mib >= 1024:
        return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib / 1024:.1f}Gi"
    return f"{mib}Mi"


@dataclass(frozen=True, slots=True)
class _Rule:
    code: ReasonCode
    kind: ReasonKind | None
    unresolvable: bool  # no eviction can make the node fit (kube-scheduler: UnschedulableAndUnresolvable)
    applies: Callable[[GpuRequest, NodeRoom], bool]  # within its kind, once the kind's gate holds
    words: Callable[[GpuRequest, NodeRoom], str]


def _always(req: GpuRequest, r: NodeRoom) -> bool:
    return True


# The kinds' gates, in order; each holds for a node that no earlier gate took.
_GATES: tuple[tuple[ReasonKind, Callable[[GpuRequest, RoomArrays], BoolArray]], ...] = (
    (ReasonKind.NO_ALLOWED_MODEL, lambda q, a: (a.n_allowed == 0) & (q.gpu_count > 0 and bool(q.allowed_models))),
    (ReasonKind.NO_GPUS, lambda q, a: (a.n_allowed == 0) & (q.gpu_count > 0 and not q.allowed_models)),
    (ReasonKind.CPU, lambda q, a: a.cpu_free < q.cpu_milli),
    (ReasonKind.HOST_MEMORY, lambda q, a: a.mem_free < q.host_memory_mib),
    (ReasonKind.GPU_ROOM, lambda q, a: (a.n_usable < q.gpu_count) & (q.gpu_count > 0)),
)

# The rule table: within a kind, the first rule that applies words the reason.
RULES: tuple[_Rule, ...] = (
    _Rule(
        ReasonCode.NO_ALLOWED_MODEL,
        ReasonKind.NO_ALLOWED_MODEL,
        True,
        _always,
        lambda q, r: f"no GPU of an allowed model ({', '.join(sorted(q.allowed_models))})",
    ),
    _Rule(ReasonCode.NO_GPUS, ReasonKind.NO_GPUS, True, _always, lambda q, r: "no sharegpu GPUs"),
    _Rule(
        ReasonCode.CPU, ReasonKind.CPU, False, _always, lambda q, r: f"free CPU {r.cpu_free}m < {q.cpu_milli}m asked"
    ),
    _Rule(
        ReasonCode.HOST_MEMORY,
        ReasonKind.HOST_MEMORY,
        False,
        _always,
        lambda q, r: f"free memory {fmt_mib(r.mem_free)} < {fmt_mib(q.host_memory_mib)} asked",
    ),
    _Rule(
        ReasonCode.TOO_FEW_HEALTHY,
        ReasonKind.GPU_ROOM,
        True,  # evicting frees room, never GPUs
        lambda q, r: r.n_healthy < q.gpu_count,
        # Worded to follow the count the kube-scheduler puts in front of a reason ("0/3 nodes are available: 1 …").
        lambda q, r: f"healthy GPUs of an allowed model: {r.n_healthy} < {q.gpu_count} asked",
    ),
    _Rule(
        ReasonCode.SHARE_MEMORY,
        ReasonKind.GPU_ROOM,
        False,
        lambda q, r: q.memory_mib is not None and r.free_mem < q.memory_mib,
        lambda q, r: f"largest free share {fmt_mib(r.free_mem)} < {fmt_mib(q.memory_mib or 0)} asked",
    ),
    _Rule(
        ReasonCode.SHARE_COMPUTE,
        ReasonKind.GPU_ROOM,
        False,
        lambda q, r: q.compute_milli is not None and r.free_milli < q.compute_milli,
        lambda q, r: f"most free compute {r.free_milli / 10:g}% < {(q.compute_milli or 0) / 10:g}% asked",
    ),
    _Rule(
        ReasonCode.TOO_FEW_IDLE,
        ReasonKind.GPU_ROOM,
        False,
        lambda q, r: q.is_whole,
        lambda q, r: f"idle GPUs: {r.n_usable} < {q.gpu_count} asked (whole GPUs need idle ones)",
    ),
    _Rule(
        ReasonCode.NO_ROOM_FOR_MECHANISM,
        ReasonKind.GPU_ROOM,
        False,
        lambda q, r: r.n_usable == 0,
        lambda q, r: (
            "no GPU has room for this share as its mechanism needs (GPUs with room are shared another way, run "
            "the most MPS daemons a GPU may, or no free MIG placement fits)"
        ),
    ),
    _Rule(
        ReasonCode.TOO_FEW_WITH_ROOM,
        ReasonKind.GPU_ROOM,
        False,
        _always,
        lambda q, r: f"GPUs with room for the share: {r.n_usable} < {q.gpu_count} asked",
    ),
    _Rule(ReasonCode.FITS, None, False, _always, lambda q, r: "fits"),
)
_BY_CODE = {r.code: r for r in RULES}


@dataclass(frozen=True, slots=True)
class FilterReason:
    """Why one node cannot host a request: the rule it failed and the words for people."""

    code: ReasonCode
    text: str

    @property
    def kind(self) -> ReasonKind | None:
        """None for a node these rules let through."""
        return _BY_CODE[self.code].kind

    @property
    def unresolvable(self) -> bool:
        """Whether no eviction could make the node fit (no GPU of an allowed model, too few healthy ones)."""
        return _BY_CODE[self.code].unresolvable


def node_kinds(req: GpuRequest, room: RoomArrays) -> Iterator[tuple[ReasonKind, BoolArray]]:
    """Each kind with the nodes it takes (a node goes to the first kind whose gate holds; nodes no gate takes
    fit as far as these rules go)."""
    open_: BoolArray = np.ones(len(room.cpu_free), dtype=bool)
    for kind, gate in _GATES:
        mask = gate(req, room) & open_
        open_ &= ~mask
        yield kind, mask


def node_reason(req: GpuRequest, room: NodeRoom, kind: ReasonKind | None) -> FilterReason:
    """The reason of a node of ``kind`` (as :func:`node_kinds` found it; None: it fits as far as these rules go)."""
    for rule in RULES:
        if rule.kind is kind and rule.applies(req, room):
            return FilterReason(rule.code, rule.words(req, room))
    raise AssertionError(f"no rule of kind {kind} applies")  # every kind ends with a rule that always applies


def capped_gpus(ledger: Ledger, req: GpuRequest, plan: UsablePlan) -> list[tuple[int, int]]:
    """GPUs (node, GPU) that would host a share of ``req`` as an MPS client but for the daemon cap: a unit there (the
    GPU, or a MIG instance of it) already runs ``ledger.tenancy.daemons_per_unit`` daemons, none of the share's
    tenant, and has room for the share and one more daemon's server (placement/mechanism.py's daemon rule). Few:
    only units at the cap (``ledger.full_units``) are looked at."""
    if not req.may_use_mps or not ledger.full_units:
        return []
    daemon = ledger.tenancy.daemon_memory_mib
    memory = req.memory_mib or 0
    out: set[tuple[int, int]] = set()
    for unit in ledger.full_units:
        n, g, start = unit
        if (
            (n, g) in out
            or ledger.multi_user[n]  # one daemon serves every user there: the cap closes nothing
            or not (ledger.present[n, g] and ledger.healthy[n, g])
            or not ledger.opens_daemon(unit, req.tenant)
        ):
            continue
        mid = int(ledger.model_id[n, g])
        if start is None:
            if (
                plan.mps_limit[mid]
                and ledger.mode[n, g] == GpuMode.MPS
                and ledger.free_milli[n, g] >= plan.compute[mid]
                and ledger.free_mem[n, g] >= memory + daemon
                and ledger.clients[n, g] < MPS_MAX_CLIENTS
            ):
                out.add((n, g))
            continue
        via_mig = mid in plan.mig_models or (mid in plan.mps_into_mig and ledger.mig_pinned[n, g])
        resident = next(iter(ledger.unit_tenants.get(unit, {})), None)
        inst = ledger.instances_on(n, g).get(start)
        if not via_mig or resident is None or inst is None or inst.free_mem < memory + daemon:
            continue
        # As a share of a tenant the instance runs: whether it joins this instance (profile, compute, clients).
        choice = mig_choice(ledger, n, g, replace(req, tenant=resident))
        if choice is not None and choice.existing and choice.start == start:
            out.add((n, g))
    return sorted(out)
