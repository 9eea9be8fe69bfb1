"""The ``auto`` mechanism choice: which GPUs can host one share of a request, and as what.

Rules (DESIGN §2):
- whole GPUs (no share asked, or ``exclusive``) → an idle GPU, exclusively;
- ``hardware`` isolation → its own MIG instance: the smallest profile that fits memory and compute at a free
  valid placement; on a model without MIG, a whole GPU (the only other way to keep faults out);
- ``fault`` isolation → time-slicing: its own CUDA context, which a neighbour's fault does not end (an MPS
  neighbour's does: measured on an H200), with nothing enforced;
- ``memory`` isolation → MPS with enforced limits, or a MIG instance shared through MPS where MPS can't go; a share
  on several GPUs goes to MIG instances, since a process is the client of one MPS daemon and each unit has its own;
- ``none`` → time-slicing or MPS: it joins a GPU already shared either way (both serve it), and opens an idle
  GPU as MPS where the model has MPS, since an MPS GPU can later take memory-isolated shares too (it fragments
  less), and as time-slicing where it has not. A share on several GPUs stays on time-slicing (a process is the
  client of one MPS daemon).

One mechanism per GPU (or per MIG instance) is a ledger invariant, and so is the MPS daemon count: a share joins its
tenant's daemon on a unit (sharegpu.model.tenant) or opens one, at most ``MpsTenancy.daemons_per_unit`` per unit,
each taking its server's memory. The filter a scheduler keeps per request shape assumes the share opens a daemon
(the cap and the daemon's memory both apply); :func:`tenant_gpus` adds the units at the cap that run the share's own
tenant, so that one cached filter serves every pod of a shape whoever it runs as. Joining a daemon of its tenant
needs no daemon memory, which the per-shape filter still asks for: it can turn away a share whose memory fits its
tenant's unit within a daemon's 66 MiB, never offer one that does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sharegpu.ledger import MPS_MAX_CLIENTS, GpuMode, Ledger, MigInstanceState, Unit, slot_mask
from sharegpu.model.assignment import GpuShare, Mechanism, MigSlot
from sharegpu.model.catalog import GpuModel, MigProfile
from sharegpu.model.request import FULL_MILLI, GpuRequest, Isolation, Sharing
from sharegpu.partition.planner import best_start

BoolMatrix = npt.NDArray[np.bool_]


class Route:
    """How a request may be hosted, independent of any GPU's state."""

    WHOLE = "whole"
    SHARE = "share"  # time-slicing / MPS on a whole GPU
    MIG = "mig"


def route_for(req: GpuRequest, model: GpuModel) -> str | None:
    """The route a request takes on ``model``, or None where the model cannot host it at all."""
    if not req.allows_model(model.name):
        return None
    if req.is_whole:
        return Route.WHOLE
    s, iso = req.sharing, req.isolation
    if s is Sharing.MIG or req.mig_profile is not None:
        return Route.MIG if model.mig_capable else None
    if s is Sharing.MPS:
        return Route.SHARE if model.mps_capable else None
    if s is Sharing.TIME_SLICING:
        return Route.SHARE
    if iso is Isolation.HARDWARE:
        return Route.MIG if model.mig_capable else Route.WHOLE
    if iso is Isolation.MEMORY:
        if model.mps_capable and req.gpu_count == 1:
            return Route.SHARE
        return Route.MIG if model.mig_capable else None
    return Route.SHARE


def share_modes(req: GpuRequest, model: GpuModel) -> tuple[GpuMode, ...]:
    """GPU modes a (non-MIG) share of ``req`` may join on ``model``; the first opens an idle GPU."""
    if req.sharing is Sharing.TIME_SLICING or req.isolation is Isolation.FAULT:
        return (GpuMode.TIME_SLICING,)
    if req.sharing is Sharing.MPS or req.isolation is Isolation.MEMORY:
        return (GpuMode.MPS,)
    if model.mps_capable and req.gpu_count == 1:
        return (GpuMode.MPS, GpuMode.TIME_SLICING)
    return (GpuMode.TIME_SLICING,)


def mig_profiles_for(req: GpuRequest, model: GpuModel) -> list[MigProfile]:
    """Profiles of ``model`` that fit the request, smallest first (fewest compute slices, then memory)."""
    if req.mig_profile is not None:
        return [p for p in model.mig_profiles if p.name == req.mig_profile]
    fits = []
    for p in model.mig_profiles:
        if req.memory_mib is not None and p.memory_mib < req.memory_mib:
            continue
        if req.compute_milli is not None and p.compute_slices * FULL_MILLI < req.compute_milli * model.compute_slices:
            continue
        fits.append(p)
    return sorted(fits, key=lambda p: (p.compute_slices, p.memory_mib, p.memory_slots))


@dataclass(frozen=True, slots=True)
class MigChoice:
    profile: MigProfile
    start: int
    existing: bool  # joins an instance that is already there


def mig_choice(ledger: Ledger, n: int, g: int, req: GpuRequest, tenant: bool = True) -> MigChoice | None:
    """Where a MIG share of ``req`` goes on GPU (n, g): an instance to share (memory isolation) or a new one.

    An MPS share prefers an instance that runs its tenant's daemon. A new instance goes where the partition planner
    says: at the free valid start that keeps the most MIG layouts reachable, since the driver's own choice can leave
    no aligned room for a later 3g. ``tenant=False`` decides for any tenant (the per-shape filter): an MPS share
    then joins an instance only where it could open a daemon.
    """
    model = ledger.gpu_model(n, g)
    mode = GpuMode(int(ledger.mode[n, g]))
    if mode not in (GpuMode.FREE, GpuMode.MIG):
        return None
    inner = _mig_inner(req)
    insts = ledger.instances_on(n, g)
    profiles = mig_profiles_for(req, model)
    names = {p.name for p in profiles}
    fresh = _fresh_profiles(ledger, req, profiles)
    joinable: list[tuple[bool, int, MigInstanceState]] = []
    for start, inst in sorted(insts.items()):
        if inst.profile.name not in names:
            continue
        if inst.clients == 0 and inst.inner is None:
            if inst.profile in fresh:
                joinable.append((False, start, inst))
            continue
        if inner is Mechanism.EXCLUSIVE or inst.inner is not inner:
            continue
        compute = _mig_compute(req, model, inst.profile)
        mem = req.memory_mib or 0
        if inst.free_milli < compute or inst.clients >= MPS_MAX_CLIENTS:
            continue
        if inner is not Mechanism.MPS:
            if inst.free_mem >= mem:
                joinable.append((False, start, inst))
            continue
        unit = (n, g, start)
        if tenant and not ledger.opens_daemon(unit, req.tenant):
            if inst.free_mem >= mem:
                joinable.append((True, start, inst))
        elif _daemon_room(ledger, unit) and inst.free_mem >= mem + ledger.tenancy.daemon_memory_mib:
            joinable.append((False, start, inst))
    if joinable:
        # Its tenant's daemon first (true MPS concurrency), else the first in slot order as before.
        _, start, inst = min(joinable, key=lambda j: (not j[0], j[1]))
        return MigChoice(inst.profile, start, True)
    used = int(ledger.mig_slots_used[n, g])
    free_slices = model.compute_slices - int(ledger.mig_slices_used[n, g])
    for p in fresh:
        if p.compute_slices > free_slices:
            continue
        starts = [s for s in p.starts if not used & slot_mask(s, p.memory_slots)]
        if starts:
            existing = [(i.profile.name, st) for st, i in insts.items()]
            return MigChoice(p, best_start(model, existing, p, starts), False)
    return None


def _fresh_profiles(ledger: Ledger, req: GpuRequest, profiles: list[MigProfile]) -> list[MigProfile]:
    """The profiles an empty instance for ``req`` may have: an MPS share's first client also brings its daemon's
    server, which takes memory of the instance."""
    if _mig_inner(req) is not Mechanism.MPS or req.memory_mib is None:
        return profiles
    return [p for p in profiles if p.memory_mib >= req.memory_mib + ledger.tenancy.daemon_memory_mib]


def _daemon_room(ledger: Ledger, unit: Unit) -> bool:
    """Whether ``unit`` can run one more MPS daemon (on a multi-user node, whether its one daemon is there or can be)."""
    daemons = ledger.daemons_on(unit)
    if ledger.multi_user[unit[0]]:
        return True  # one daemon for every user: a share joins it or opens the first
    return daemons < ledger.tenancy.daemons_per_unit


def _mig_inner(req: GpuRequest) -> Mechanism:
    # Hardware isolation wants an instance of its own; memory isolation (or MPS asked by name) may share one through
    # MPS, on one GPU only (a process is the client of one MPS daemon, and each instance has its own).
    if (req.isolation is Isolation.MEMORY or req.sharing is Sharing.MPS) and req.gpu_count == 1:
        return Mechanism.MPS
    return Mechanism.EXCLUSIVE


def mps_into_mig(req: GpuRequest, model: GpuModel) -> bool:
    """Whether an MPS share of ``req`` may go into a MIG instance of a GPU an administrator keeps in MIG mode: such a
    GPU takes only MIG shares, and an MPS share inside an instance is one (docs/placement.md)."""
    return (
        model.mig_capable
        and route_for(req, model) == Route.SHARE
        and share_modes(req, model) == (GpuMode.MPS,)
        and _mig_inner(req) is Mechanism.MPS
    )


def _mig_compute(req: GpuRequest, model: GpuModel, profile: MigProfile) -> int:
    """Compute of the instance a share takes: the request's GPU share rescaled to the instance."""
    if _mig_inner(req) is Mechanism.EXCLUSIVE or req.compute_milli is None:
        return FULL_MILLI if _mig_inner(req) is Mechanism.EXCLUSIVE else _mem_fraction(req, profile)
    scaled = -(-req.compute_milli * model.compute_slices // profile.compute_slices)
    return max(1, min(FULL_MILLI, scaled))


def _mem_fraction(req: GpuRequest, profile: MigProfile) -> int:
    if req.memory_mib is None:
        return FULL_MILLI
    return max(1, min(FULL_MILLI, -(-req.memory_mib * FULL_MILLI // profile.memory_mib)))


_NONE, _WHOLE, _SHARE, _MIG = 0, 1, 2, 3
_ROUTE_CODE = {None: _NONE, Route.WHOLE: _WHOLE, Route.SHARE: _SHARE, Route.MIG: _MIG}


@dataclass(frozen=True)
class UsablePlan:
    """How one request shape meets each GPU model of a ledger, as tables indexed by model id (the last row is
    "no GPU"), so that which GPUs can host a share is a few array operations over any set of nodes.

    It depends on the request's shape and the ledger's models only, never on GPU state: a scheduler builds it
    once per shape.
    """

    route: npt.NDArray[np.int8]  # (models + 1,) route code per model
    compute: npt.NDArray[np.int64]  # (models + 1,) compute a share reserves on the model
    mode_ok: BoolMatrix  # (models + 1, modes) may a share join a GPU in this mode
    mps_limit: npt.NDArray[np.bool_]  # (models + 1,) the MPS client limit applies to a share on the model
    memory: int
    mig_models: tuple[int, ...]  # model ids reached through MIG (checked per model: placements differ)
    least_compute: int  # a lower bound of the free compute a GPU needs to host a share, on any model
    mps_into_mig: tuple[int, ...]  # model ids whose MIG-pinned GPUs take the share inside an instance (mps_into_mig)

    @classmethod
    def of(cls, ledger: Ledger, req: GpuRequest) -> UsablePlan:
        k = len(ledger.models) + 1
        route = np.zeros(k, dtype=np.int8)
        compute = np.zeros(k, dtype=np.int64)
        mode_ok = np.zeros((k, len(GpuMode)), dtype=bool)
        mps_limit = np.zeros(k, dtype=bool)
        mig: list[int] = []
        into_mig: list[int] = []
        if req.gpu_count > 0:
            for mid, model in enumerate(ledger.models):
                r = route_for(req, model)
                route[mid] = _ROUTE_CODE[r]
                if r == Route.SHARE:
                    compute[mid] = req.compute_on(model)
                    modes = share_modes(req, model)
                    mode_ok[mid, GpuMode.FREE] = True
                    for m in modes:
                        mode_ok[mid, m] = True
                    mps_limit[mid] = GpuMode.MPS in modes
                    if mps_into_mig(req, model):
                        into_mig.append(mid)
                elif r == Route.MIG:
                    mig.append(mid)
        # A whole GPU is free only when all its compute is; a MIG GPU's free compute says little (0: no bound).
        needs = [FULL_MILLI if r == _WHOLE else int(c) for r, c in zip(route[:-1], compute[:-1], strict=True) if r]
        least = 0 if mig else min(needs, default=FULL_MILLI + 1)
        if into_mig and ledger.any_mig_pinned:
            least = 0  # a MIG GPU's free compute says little
        return cls(
            route,
            compute,
            mode_ok,
            mps_limit,
            req.memory_mib or 0,
            tuple(mig),
            least,
            tuple(into_mig),
        )

    def usable(self, ledger: Ledger, req: GpuRequest, nodes: npt.NDArray[np.int64]) -> BoolMatrix:
        """(len(nodes) × GPU slots): the GPUs of ``nodes`` that can host one share of ``req`` now."""
        mid = ledger.model_id[nodes]
        route = self.route[mid]
        mode = ledger.mode[nodes]
        base = ledger.present[nodes] & ledger.healthy[nodes]
        usable: BoolMatrix = base & (route == _WHOLE) & (mode == GpuMode.FREE)
        share = base & (route == _SHARE)
        if share.any():
            free_mem = ledger.free_mem[nodes]
            usable |= (
                share
                & (ledger.free_milli[nodes] >= self.compute[mid])
                & (free_mem >= self.memory)
                & self.mode_ok[mid, mode]
                & (~self.mps_limit[mid] | (mode == GpuMode.TIME_SLICING) | self._opens(ledger, nodes, free_mem))
            )
        for m in self.mig_models:
            on_model = base & (mid == m)
            if on_model.any():
                candidates = on_model & ((mode == GpuMode.FREE) | (mode == GpuMode.MIG))
                mig_ok = _mig_usable(ledger, req, ledger.models[m], candidates, nodes)
                if ledger.any_mig_pinned:
                    pinned = mig_ok & ledger.mig_pinned[nodes]
                    rows = pinned.any(axis=1)
                    # On a node with a GPU an administrator keeps in MIG mode, a MIG share goes there: opening a free
                    # GPU for it would take that GPU from whole and MPS shares, which the pinned one never serves.
                    mig_ok[rows] = pinned[rows]
                usable |= mig_ok
        if ledger.any_mig_pinned:
            for m in self.mps_into_mig:
                pinned = base & (mid == m) & ledger.mig_pinned[nodes]
                if pinned.any():
                    usable |= _mig_usable(ledger, req, ledger.models[m], pinned, nodes)
        return usable

    def _opens(self, ledger: Ledger, nodes: npt.NDArray[np.int64], free_mem: npt.NDArray[np.int64]) -> BoolMatrix:
        """GPUs (free or MPS) where an MPS share could open a daemon: fewer clients and daemons than the caps, and
        room for the share and its server (on a multi-user node, its one daemon is shared once it runs)."""
        daemons = ledger.daemons[nodes]
        ok: BoolMatrix = (
            (ledger.clients[nodes] < MPS_MAX_CLIENTS)
            & (daemons < ledger.tenancy.daemons_per_unit)
            & (free_mem >= self.memory + ledger.tenancy.daemon_memory_mib)
        )
        multi = ledger.multi_user[nodes]
        if multi.any():
            ok[multi] |= (ledger.clients[nodes][multi] < MPS_MAX_CLIENTS) & (daemons[multi] > 0)
        return ok


def tenant_gpus(ledger: Ledger, req: GpuRequest, plan: UsablePlan) -> list[tuple[int, int]]:
    """GPUs (node, GPU) that a share of ``req`` can take only because its tenant already runs a daemon there: units at
    the daemon cap, which the per-shape filter closes to every share (few: the cap is 16 daemons by default)."""
    if not req.may_use_mps or not ledger.full_units:
        return []
    mine = ledger.units_of(req.tenant)
    if not mine:
        return []
    full = ledger.full_units
    units = [u for u in mine if u in full] if len(mine) <= len(full) else [u for u in full if u in mine]
    out = []
    for n, g, start in units:
        if not (ledger.present[n, g] and ledger.healthy[n, g]):
            continue
        mid = int(ledger.model_id[n, g])
        if start is not None:
            # Into an instance only where the share goes through MIG on this GPU (make_share decides the same way).
            via_mig = mid in plan.mig_models or (mid in plan.mps_into_mig and ledger.mig_pinned[n, g])
            if via_mig and mig_choice(ledger, n, g, req) is not None:
                out.append((n, g))
            continue
        if _mps_room(ledger, plan, n, g):
            out.append((n, g))
    return out


def capped_gpus(ledger: Ledger, req: GpuRequest, plan: UsablePlan) -> list[tuple[int, int]]:
    """Whole GPUs (node, GPU) at the daemon cap where a share of ``req``'s shape has room by capacity alone, whoever
    its tenant: closed to a tenant that runs no daemon there, yet what an allocator that knows no tenants (the DRA
    path's first fit) may still take."""
    if not req.may_use_mps or not ledger.full_units:
        return []
    return sorted(
        (n, g)
        for n, g, start in ledger.full_units
        if start is None and ledger.present[n, g] and ledger.healthy[n, g] and _mps_room(ledger, plan, n, g)
    )


def _mps_room(ledger: Ledger, plan: UsablePlan, n: int, g: int) -> bool:
    """Whether GPU ``g`` of node ``n``, shared through MPS, has room for one more client of ``plan``'s share (its
    compute, memory and the client limit), its daemons aside."""
    mid = int(ledger.model_id[n, g])
    return bool(
        plan.route[mid] == _SHARE
        and plan.mps_limit[mid]
        and ledger.mode[n, g] == GpuMode.MPS
        and ledger.free_milli[n, g] >= plan.compute[mid]
        and ledger.free_mem[n, g] >= plan.memory
        and ledger.clients[n, g] < MPS_MAX_CLIENTS
    )


def usable_gpus(ledger: Ledger, req: GpuRequest, nodes: npt.NDArray[np.int64] | None = None) -> BoolMatrix:
    """(nodes × GPU slots) mask of the GPUs that can host one share of ``req`` now; rows of ``nodes`` only when
    given (a node's row depends on that node's state alone, so callers may refresh the rows that changed), with the
    units at the daemon cap that run its tenant."""
    if nodes is None:
        nodes = np.arange(ledger.present.shape[0], dtype=np.int64)
    plan = UsablePlan.of(ledger, req)
    usable = plan.usable(ledger, req, nodes)
    row_of = {n: i for i, n in enumerate(nodes.tolist())}
    for n, g in tenant_gpus(ledger, req, plan):
        if n in row_of:
            usable[row_of[n], g] = True
    return usable


def _mig_usable(
    ledger: Ledger, req: GpuRequest, model: GpuModel, candidates: BoolMatrix, nodes: npt.NDArray[np.int64]
) -> BoolMatrix:
    """GPUs among ``candidates`` (rows of ``nodes``) where a MIG share of ``req`` fits: a new instance on free
    slots and slices (vectorised), or an instance already there that it may join (checked one by one: there
    are few)."""
    ok = np.zeros_like(candidates)
    slots_used = ledger.mig_slots_used[nodes]
    free_slices = model.compute_slices - ledger.mig_slices_used[nodes].astype(np.int64)
    for p in _fresh_profiles(ledger, req, mig_profiles_for(req, model)):
        fits = free_slices >= p.compute_slices
        for start in p.starts:
            ok |= fits & ((slots_used & slot_mask(start, p.memory_slots)) == 0)
    ok &= candidates
    if not ledger.instances:
        return ok
    row_of = {n: i for i, n in enumerate(nodes.tolist())}
    for n, g in ledger.instances:
        i = row_of.get(n)
        if i is not None and candidates[i, g] and not ok[i, g]:
            ok[i, g] = mig_choice(ledger, n, g, req, tenant=False) is not None
    return ok


def make_share(ledger: Ledger, n: int, g: int, req: GpuRequest) -> GpuShare:
    """The concrete share of ``req`` on GPU (n, g), which :func:`usable_gpus` said can host it."""
    model = ledger.gpu_model(n, g)
    uuid = ledger.nodes[n].gpus[g].uuid
    route = route_for(req, model)
    mode = GpuMode(int(ledger.mode[n, g]))
    if route == Route.SHARE and ledger.mig_pinned[n, g] and mps_into_mig(req, model):
        route = Route.MIG
    if route == Route.WHOLE:
        return GpuShare(g, uuid, Mechanism.EXCLUSIVE, FULL_MILLI, model.memory_mib)
    if route == Route.SHARE:
        modes = share_modes(req, model)
        chosen = mode if mode in modes else modes[0]
        mech = Mechanism.MPS if chosen is GpuMode.MPS else Mechanism.TIME_SLICING
        return GpuShare(g, uuid, mech, req.compute_on(model), req.memory_mib or 0)
    choice = mig_choice(ledger, n, g, req)
    if choice is None:
        raise ValueError(f"no MIG placement for {req.name} on GPU {uuid}")
    inner = _mig_inner(req)
    if inner is Mechanism.EXCLUSIVE:
        return GpuShare(
            g,
            uuid,
            Mechanism.MIG,
            FULL_MILLI,
            choice.profile.memory_mib,
            MigSlot(choice.profile.name, choice.start),
            inner,
        )
    return GpuShare(
        g,
        uuid,
        Mechanism.MIG,
        _mig_compute(req, model, choice.profile),
        req.memory_mib or 0,
        MigSlot(choice.profile.name, choice.start),
        inner,
    )
