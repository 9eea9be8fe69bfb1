"""Cluster accounting: nodes → GPUs → shares and MIG instances, with invariants checked on every change.

The ledger keeps its per-GPU state in numpy arrays (nodes × GPU slots) because placement reads all of it on
every decision; the per-instance MIG detail lives in small dicts beside them. Every change goes through
:meth:`Ledger.place` and :meth:`Ledger.release`, which are atomic: a change that would break an invariant
raises :class:`LedgerConflict` and leaves the ledger exactly as it was.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from enum import IntEnum

import numpy as np
import numpy.typing as npt

from sharegpu.model.assignment import Assignment, GpuShare, Mechanism
from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog, GpuModel, MigProfile
from sharegpu.model.inventory import NodeSpec
from sharegpu.model.request import FULL_MILLI
from sharegpu.model.tenant import MULTI_USER_TENANT, NO_TENANT, describe

MPS_MAX_CLIENTS = 48  # per MPS server (Volta and later)
# Daemons per MPS unit (one per tenant, sharegpu.model.tenant): across daemons the GPU time-slices (H200: two daemons
# took turns), so each is one more context in the GPU's rotation. 16 is the largest k of the GPU check's sweep
# (bench/gpu_node_check.py, k = 1..16) and lets a GPU take as many undeclared pods as the densest workload the rig
# tests (100 small shares on 8 GPUs: 13 per GPU); configurable (the extender's and sim's --mps-daemons-per-gpu).
DEFAULT_DAEMONS_PER_UNIT = 16
# GPU memory an MPS server takes of its unit before any client: 66 MiB on an H200, driver 580 (NVML's process list,
# ../shared/gpu-evidence/h200-2026-11-26). Each daemon of a unit has its server, so each one counts.
MPS_DAEMON_MEMORY_MIB = 66
MAX_DAEMON_MEMORY_MIB = 4096  # a server takes tens of MiB; more is a typo (GiB meant as MiB)


def daemon_memory_problem(mib: int) -> str | None:
    """What is wrong with ``mib`` as the GPU memory an MPS daemon's server takes (None: nothing), in words a flag's
    message can start with."""
    if 0 <= mib <= MAX_DAEMON_MEMORY_MIB:
        return None
    return (
        f"{mib} is out of range: 0 to {MAX_DAEMON_MEMORY_MIB:,} MiB of GPU memory an MPS daemon's server takes (an "
        f"H200's took {MPS_DAEMON_MEMORY_MIB}; bench/gpu_node_check.py measures a GPU's)"
    )


@dataclass(frozen=True, slots=True)
class MpsTenancy:
    """How the ledger counts MPS daemons: at most ``daemons_per_unit`` per GPU or MIG instance, each taking
    ``daemon_memory_mib`` of its unit's memory. ``daemons_per_unit=1`` is the rule before tenants (one user per
    unit); a node in multi-user mode (NodeSpec.mps_multi_user) has one daemon per unit whatever this says."""

    daemons_per_unit: int = DEFAULT_DAEMONS_PER_UNIT
    daemon_memory_mib: int = MPS_DAEMON_MEMORY_MIB

    def __post_init__(self) -> None:
        if not 1 <= self.daemons_per_unit <= MPS_MAX_CLIENTS:
            raise ValueError(
                f"MPS daemons per GPU {self.daemons_per_unit} must be from 1 to {MPS_MAX_CLIENTS} (each daemon "
                "serves at least one client, and a unit has at most that many)"
            )
        if self.daemon_memory_mib < 0:
            raise ValueError(f"MPS daemon memory {self.daemon_memory_mib} MiB must not be negative")


Unit = tuple[int, int, int | None]  # node, GPU, MIG instance start (None: the whole GPU)
_NO_UNITS: frozenset[Unit] = frozenset()


class GpuMode(IntEnum):
    FREE = 0
    EXCLUSIVE = 1
    TIME_SLICING = 2
    MPS = 3
    MIG = 4


MODE_OF = {
    Mechanism.EXCLUSIVE: GpuMode.EXCLUSIVE,
    Mechanism.TIME_SLICING: GpuMode.TIME_SLICING,
    Mechanism.MPS: GpuMode.MPS,
    Mechanism.MIG: GpuMode.MIG,
}


class LedgerError(Exception):
    """Base of ledger errors; messages say what conflicts."""


class LedgerConflict(LedgerError):
    """A change that would break an invariant (over-allocation, overlap, mixed mechanisms)."""


class UnknownNode(LedgerError):
    pass


class UnknownPod(LedgerError):
    pass


class InvariantViolation(AssertionError):
    """The ledger's state disagrees with its assignments: a bug, never a user error."""


@dataclass(slots=True)
class MigInstanceState:
    profile: MigProfile
    free_milli: int
    free_mem: int
    inner: Mechanism | None  # how the instance is shared; None while empty
    clients: int
    persistent: bool  # exists outside sharegpu's wishes (static layout): kept when empty


def slot_mask(start: int, size: int) -> int:
    return ((1 << size) - 1) << start


class Ledger:
    """Accounting for one cluster. Nodes are kept in name order: index order is the tie-break order."""

    def __init__(
        self, nodes: Iterable[NodeSpec], catalog: Catalog = DEFAULT_CATALOG, tenancy: MpsTenancy | None = None
    ) -> None:
        self.catalog = catalog
        self.tenancy = tenancy or MpsTenancy()
        self.nodes: tuple[NodeSpec, ...] = tuple(sorted(nodes, key=lambda n: n.name))
        self.index: dict[str, int] = {}
        for i, n in enumerate(self.nodes):
            if n.name in self.index:
                raise LedgerConflict(f"node {n.name!r} is listed twice")
            self.index[n.name] = i
        n_nodes = len(self.nodes)
        width = max((len(n.gpus) for n in self.nodes), default=0)
        self.model_names: list[str] = []
        self.models: list[GpuModel] = []
        model_ids: dict[str, int] = {}

        self.cpu_total = np.array([n.cpu_milli for n in self.nodes], dtype=np.int64)
        self.mem_total = np.array([n.memory_mib for n in self.nodes], dtype=np.int64)
        self.gpu_count = np.array([len(n.gpus) for n in self.nodes], dtype=np.int64)
        self.present = np.zeros((n_nodes, width), dtype=bool)
        self.healthy = np.zeros((n_nodes, width), dtype=bool)
        self.model_id = np.full((n_nodes, width), -1, dtype=np.int16)
        self.gpu_mem_total = np.zeros((n_nodes, width), dtype=np.int64)
        # GPUs an administrator put in MIG mode: they stay in MIG mode when empty, so no non-MIG share lands there.
        self.mig_pinned = np.zeros((n_nodes, width), dtype=bool)
        for i, n in enumerate(self.nodes):
            for g in n.gpus:
                model = catalog.get(g.model)
                if model.name not in model_ids:
                    model_ids[model.name] = len(self.models)
                    self.models.append(model)
                    self.model_names.append(model.name)
                self.present[i, g.index] = True
                self.healthy[i, g.index] = g.healthy
                self.model_id[i, g.index] = model_ids[model.name]
                self.gpu_mem_total[i, g.index] = model.memory_mib
                self.mig_pinned[i, g.index] = g.mig_pinned
        # A node's model, for nodes of one model (the common case): -1 for none, the first GPU's otherwise.
        self.node_model_id = np.where(self.gpu_count > 0, self.model_id[:, 0] if width else -1, -1)

        self.cpu_free = self.cpu_total.copy()
        self.mem_free = self.mem_total.copy()
        self.free_milli = np.where(self.present, FULL_MILLI, 0).astype(np.int64)
        self.free_mem = self.gpu_mem_total.copy()
        self.mode = np.where(self.mig_pinned, GpuMode.MIG, GpuMode.FREE).astype(np.int8)
        # Pins come from the node specs and never change in a ledger's life; most clusters (and every simulated one)
        # have none, so the filters skip the pin check on every decision.
        self.any_mig_pinned = bool(self.mig_pinned.any())
        self.clients = np.zeros((n_nodes, width), dtype=np.int16)
        # MPS daemons per whole GPU (a MIG instance's are len(unit_tenants[unit])): one per tenant on the unit.
        self.daemons = np.zeros((n_nodes, width), dtype=np.int16)
        self.multi_user = np.array([n.mps_multi_user for n in self.nodes], dtype=bool)
        self.unit_tenants: dict[Unit, dict[str, int]] = {}  # MPS clients per tenant on each unit
        self.tenant_units: dict[str, set[Unit]] = {}  # the units that run a daemon of each tenant
        self.full_units: set[Unit] = set()  # units that run as many daemons as the cap allows: open to their tenants
        self.mig_slots_used = np.zeros((n_nodes, width), dtype=np.int16)  # bitmask on the memory-slot axis
        self.mig_slices_used = np.zeros((n_nodes, width), dtype=np.int8)
        self.version = np.zeros(n_nodes, dtype=np.int64)  # bumped on every change of a node
        self.instances: dict[tuple[int, int], dict[int, MigInstanceState]] = {}
        self.assignments: dict[str, Assignment] = {}
        self.node_pods: list[set[str]] = [set() for _ in self.nodes]  # pods per node, for per-node reads

        for i, n in enumerate(self.nodes):
            for g in n.gpus:
                for slot in g.mig_instances:
                    self._create_instance(i, g.index, self.gpu_model(i, g.index), slot.profile, slot.start, True)

    # ----- reading -------------------------------------------------------------------------------------------
    def gpu_model(self, node: int, gpu: int) -> GpuModel:
        return self.models[int(self.model_id[node, gpu])]

    def node_of(self, name: str) -> int:
        try:
            return self.index[name]
        except KeyError:
            raise UnknownNode(f"node {name!r} is not in the cluster") from None

    def __contains__(self, pod: str) -> bool:
        return pod in self.assignments

    def __len__(self) -> int:
        return len(self.assignments)

    def instances_on(self, node: int, gpu: int) -> dict[int, MigInstanceState]:
        return self.instances.get((node, gpu), {})

    def pods_on(self, node: str) -> Iterator[Assignment]:
        return (self.assignments[p] for p in sorted(self.node_pods[self.node_of(node)]))

    @property
    def total_gpu_milli(self) -> int:
        return int(self.present.sum()) * FULL_MILLI

    @property
    def allocated_gpu_milli(self) -> int:
        """GPU compute promised to pods, in milli-GPU (a MIG share counts its instance's part of the GPU)."""
        return sum(self.gpu_milli_of(a) for a in self.assignments.values())

    def gpu_milli_of(self, a: Assignment) -> int:
        """GPU compute an assignment holds in milli-GPU; a MIG share holds its part of its instance's slices."""
        n = self.node_of(a.node)
        total = 0
        for s in a.shares:
            if s.mig is None:
                total += s.compute_milli
            else:
                model = self.gpu_model(n, s.gpu_index)
                total += s.compute_milli * model.profile(s.mig.profile).compute_slices // model.compute_slices
        return total

    # ----- changing ------------------------------------------------------------------------------------------
    def place(self, a: Assignment, check_health: bool = True) -> None:
        """Account for ``a`` or raise :class:`LedgerConflict` and change nothing.

        ``check_health=False`` accounts for an assignment that already exists (a running pod seen again after a
        restart): a GPU that turned unhealthy since still holds the shares placed on it, so that its pods keep
        their other GPUs and nothing else is placed there; and a unit that runs more MPS daemons than the cap allows
        (placed under a larger cap) is recorded as it is, open to its own tenants only.
        """
        if a.pod in self.assignments:
            raise LedgerConflict(f"pod {a.pod} is already placed on {self.assignments[a.pod].node}")
        n = self.node_of(a.node)
        if a.cpu_milli > self.cpu_free[n] or a.host_memory_mib > self.mem_free[n]:
            raise LedgerConflict(
                f"node {a.node} has {self.cpu_free[n]}m CPU and {self.mem_free[n]}Mi memory free; "
                f"{a.pod} needs {a.cpu_milli}m and {a.host_memory_mib}Mi"
            )
        done: list[GpuShare] = []
        try:
            for s in a.shares:
                self._apply(n, s, check_health, a.tenant, record=not check_health)
                done.append(s)
        except LedgerConflict as e:
            for s in reversed(done):
                self._unapply(n, s, a.tenant)
            raise LedgerConflict(f"cannot place {a.pod} on {a.node}: {e}") from None
        self.cpu_free[n] -= a.cpu_milli
        self.mem_free[n] -= a.host_memory_mib
        self.assignments[a.pod] = a
        self.node_pods[n].add(a.pod)
        self.version[n] += 1

    def release(self, pod: str) -> Assignment:
        try:
            a = self.assignments.pop(pod)
        except KeyError:
            raise UnknownPod(f"pod {pod} holds no GPU share in the ledger") from None
        n = self.index[a.node]
        self.node_pods[n].discard(pod)
        for s in reversed(a.shares):
            self._unapply(n, s, a.tenant)
        self.cpu_free[n] += a.cpu_milli
        self.mem_free[n] += a.host_memory_mib
        self.version[n] += 1
        return a

    def _check_gpu(self, n: int, s: GpuShare, check_health: bool) -> GpuModel:
        node = self.nodes[n]
        if s.gpu_index >= len(node.gpus):
            raise LedgerConflict(f"node {node.name} has no GPU {s.gpu_index}")
        if node.gpus[s.gpu_index].uuid != s.gpu_uuid:
            raise LedgerConflict(f"GPU {s.gpu_index} of {node.name} is {node.gpus[s.gpu_index].uuid}, not {s.gpu_uuid}")
        if check_health and not self.healthy[n, s.gpu_index]:
            raise LedgerConflict(f"GPU {s.gpu_uuid} is unhealthy")
        return self.gpu_model(n, s.gpu_index)

    def copy(self) -> Ledger:
        """An independent copy to plan on: the immutable parts (catalog, node specs, assignments, which are frozen) are
        shared, every mutable container copied. Far cheaper than rebuilding by replay (one place per pod)."""
        out = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, np.ndarray):
                setattr(out, name, value.copy())
        out.instances = {key: {s: replace(i) for s, i in insts.items()} for key, insts in self.instances.items()}
        out.assignments = dict(self.assignments)
        out.node_pods = [set(p) for p in self.node_pods]
        out.unit_tenants = {unit: dict(clients) for unit, clients in self.unit_tenants.items()}
        out.tenant_units = {tenant: set(units) for tenant, units in self.tenant_units.items()}
        out.full_units = set(self.full_units)
        return out

    # ----- MPS tenants ----------------------------------------------------------------------------------------
    def tenant_key(self, n: int, tenant: str | None) -> str:
        """The daemon a share of ``tenant`` belongs to on node ``n``: its tenant's, or the one multi-user daemon."""
        if self.multi_user[n]:
            return MULTI_USER_TENANT
        return NO_TENANT if tenant is None else tenant

    def daemons_on(self, unit: Unit) -> int:
        """MPS daemons running on ``unit`` (one per tenant with a client there)."""
        return len(self.unit_tenants.get(unit, ()))

    def opens_daemon(self, unit: Unit, tenant: str | None) -> bool:
        """Whether an MPS share of ``tenant`` on ``unit`` needs a daemon of its own there (its tenant runs none)."""
        return self.tenant_key(unit[0], tenant) not in self.unit_tenants.get(unit, {})

    def units_of(self, tenant: str | None) -> AbstractSet[Unit]:
        """The units that run a daemon of ``tenant`` (as its key on each node); the ledger's own set, to be read only."""
        return self.tenant_units.get(NO_TENANT if tenant is None else tenant, _NO_UNITS)

    def _mps_room(self, unit: Unit, tenant: str, clients: int, what: str, record: bool) -> int:
        """The GPU memory a new MPS client of ``tenant`` takes on ``unit`` beyond its share (its daemon's, when it
        opens one), or raise when the unit can take no more clients or daemons."""
        if clients >= MPS_MAX_CLIENTS:
            raise LedgerConflict(f"{what} already has {MPS_MAX_CLIENTS} MPS clients")
        if tenant in self.unit_tenants.get(unit, {}):
            return 0
        cap = self.tenancy.daemons_per_unit
        if not record and self.daemons_on(unit) >= cap:
            raise LedgerConflict(
                f"{what} already runs {cap} MPS daemons (one per tenant: pods of one namespace and runAsUser, or a "
                f"pod alone); a share of {describe(tenant)} would open another"
            )
        return self.tenancy.daemon_memory_mib

    def _join(self, unit: Unit, tenant: str) -> None:
        clients = self.unit_tenants.setdefault(unit, {})
        clients[tenant] = clients.get(tenant, 0) + 1
        self.tenant_units.setdefault(tenant, set()).add(unit)
        if len(clients) >= self.tenancy.daemons_per_unit:
            self.full_units.add(unit)

    def _leave(self, unit: Unit, tenant: str) -> bool:
        """Forget one MPS client of ``tenant`` on ``unit``; True when its daemon has no client left."""
        clients = self.unit_tenants[unit]
        clients[tenant] -= 1
        if clients[tenant]:
            return False
        del clients[tenant]
        if len(clients) < self.tenancy.daemons_per_unit:
            self.full_units.discard(unit)
        if not clients:
            del self.unit_tenants[unit]
        units = self.tenant_units[tenant]
        units.discard(unit)
        if not units:
            del self.tenant_units[tenant]
        return True

    def _apply(
        self, n: int, s: GpuShare, check_health: bool = True, tenant: str | None = None, record: bool = False
    ) -> None:
        model = self._check_gpu(n, s, check_health)
        g = s.gpu_index
        mode = GpuMode(int(self.mode[n, g]))
        if s.mechanism is Mechanism.MIG:
            self._apply_mig(n, g, model, mode, s, tenant, record)
            return
        want = MODE_OF[s.mechanism]
        if self.mig_pinned[n, g]:
            raise LedgerConflict(
                f"GPU {s.gpu_uuid} is in MIG mode by an administrator's choice: only MIG shares can go there"
            )
        if mode not in (GpuMode.FREE, want) or (want is GpuMode.EXCLUSIVE and mode is not GpuMode.FREE):
            raise LedgerConflict(f"GPU {s.gpu_uuid} is in use as {mode.name.lower()}, not {s.mechanism}")
        if want is GpuMode.EXCLUSIVE and (s.compute_milli != FULL_MILLI or s.memory_mib != model.memory_mib):
            raise LedgerConflict("an exclusive share takes the whole GPU: all its compute and memory")
        daemon_mem = 0
        key = self.tenant_key(n, tenant)
        if want is GpuMode.MPS:
            if not model.mps_capable:
                raise LedgerConflict(f"{model.name} does not support MPS")
            daemon_mem = self._mps_room((n, g, None), key, int(self.clients[n, g]), f"GPU {s.gpu_uuid}", record)
        if s.compute_milli > self.free_milli[n, g] or s.memory_mib + daemon_mem > self.free_mem[n, g]:
            daemon = f" and {daemon_mem}Mi for its MPS daemon" if daemon_mem else ""
            raise LedgerConflict(
                f"GPU {s.gpu_uuid} has {self.free_milli[n, g]} milli and {self.free_mem[n, g]}Mi free; "
                f"asked {s.compute_milli} milli and {s.memory_mib}Mi{daemon}"
            )
        self.free_milli[n, g] -= s.compute_milli
        self.free_mem[n, g] -= s.memory_mib + daemon_mem
        if want is GpuMode.MPS:
            if key not in self.unit_tenants.get((n, g, None), {}):
                self.daemons[n, g] += 1
            self._join((n, g, None), key)
        self.clients[n, g] += 1
        self.mode[n, g] = want

    def _unapply(self, n: int, s: GpuShare, tenant: str | None = None) -> None:
        g = s.gpu_index
        if s.mechanism is Mechanism.MIG:
            self._unapply_mig(n, g, s, tenant)
            return
        self.free_milli[n, g] += s.compute_milli
        self.free_mem[n, g] += s.memory_mib
        if s.mechanism is Mechanism.MPS and self._leave((n, g, None), self.tenant_key(n, tenant)):
            self.daemons[n, g] -= 1
            self.free_mem[n, g] += self.tenancy.daemon_memory_mib
        self.clients[n, g] -= 1
        if self.clients[n, g] == 0:
            self.mode[n, g] = GpuMode.FREE

    def _apply_mig(
        self,
        n: int,
        g: int,
        model: GpuModel,
        mode: GpuMode,
        s: GpuShare,
        tenant: str | None = None,
        record: bool = False,
    ) -> None:
        assert s.mig is not None and s.inner is not None
        if mode not in (GpuMode.FREE, GpuMode.MIG):
            raise LedgerConflict(f"GPU {s.gpu_uuid} is in use as {mode.name.lower()}; MIG needs it idle or in MIG mode")
        try:
            profile = model.profile(s.mig.profile)
        except ValueError as e:
            raise LedgerConflict(str(e)) from None
        inst = self.instances_on(n, g).get(s.mig.start)
        created = False
        if inst is None:
            inst = self._create_instance(n, g, model, profile.name, s.mig.start, False)
            created = True
        unit = (n, g, s.mig.start)
        key = self.tenant_key(n, tenant)
        try:
            if inst.profile.name != profile.name:
                raise LedgerConflict(f"the instance at slot {s.mig.start} of {s.gpu_uuid} is {inst.profile.name}")
            if inst.inner is not None and (inst.inner is not s.inner or s.inner is Mechanism.EXCLUSIVE):
                raise LedgerConflict(f"the {profile.name} instance at slot {s.mig.start} is used as {inst.inner}")
            if s.inner is Mechanism.EXCLUSIVE and (s.compute_milli != FULL_MILLI or s.memory_mib != profile.memory_mib):
                raise LedgerConflict("an exclusive MIG share takes its whole instance")
            daemon_mem = 0
            if s.inner is Mechanism.MPS:
                what = f"the {profile.name} instance at slot {s.mig.start}"
                daemon_mem = self._mps_room(unit, key, inst.clients, what, record)
            if s.compute_milli > inst.free_milli or s.memory_mib + daemon_mem > inst.free_mem:
                daemon = f" and {daemon_mem}Mi for its MPS daemon" if daemon_mem else ""
                raise LedgerConflict(
                    f"the {profile.name} instance has {inst.free_milli} milli and {inst.free_mem}Mi free; "
                    f"asked {s.compute_milli} milli and {s.memory_mib}Mi{daemon}"
                )
        except LedgerConflict:
            if created:
                self._destroy_instance(n, g, model, s.mig.start)
            raise
        inst.free_milli -= s.compute_milli
        inst.free_mem -= s.memory_mib + daemon_mem
        if s.inner is Mechanism.MPS:
            self._join(unit, key)
        inst.clients += 1
        inst.inner = s.inner

    def _unapply_mig(self, n: int, g: int, s: GpuShare, tenant: str | None = None) -> None:
        assert s.mig is not None
        inst = self.instances[(n, g)][s.mig.start]
        inst.free_milli += s.compute_milli
        inst.free_mem += s.memory_mib
        if s.inner is Mechanism.MPS and self._leave((n, g, s.mig.start), self.tenant_key(n, tenant)):
            inst.free_mem += self.tenancy.daemon_memory_mib
        inst.clients -= 1
        if inst.clients == 0:
            inst.inner = None
            if not inst.persistent:
                self._destroy_instance(n, g, self.gpu_model(n, g), s.mig.start)

    def _create_instance(
        self, n: int, g: int, model: GpuModel, profile_name: str, start: int, persistent: bool
    ) -> MigInstanceState:
        try:
            profile = model.profile(profile_name)
        except ValueError as e:
            raise LedgerConflict(str(e)) from None
        if start not in profile.starts:
            raise LedgerConflict(
                f"{profile.name} cannot start at slot {start} on {model.name}; valid starts: {list(profile.starts)}"
            )
        mask = slot_mask(start, profile.memory_slots)
        if int(self.mig_slots_used[n, g]) & mask:
            raise LedgerConflict(f"{profile.name} at slot {start} overlaps a MIG instance already on the GPU")
        if int(self.mig_slices_used[n, g]) + profile.compute_slices > model.compute_slices:
            raise LedgerConflict(f"{profile.name} needs {profile.compute_slices} compute slices; too few are free")
        if GpuMode(int(self.mode[n, g])) not in (GpuMode.FREE, GpuMode.MIG):
            raise LedgerConflict("the GPU is in use outside MIG")
        inst = MigInstanceState(profile, FULL_MILLI, profile.memory_mib, None, 0, persistent)
        self.instances.setdefault((n, g), {})[start] = inst
        self.mig_slots_used[n, g] |= mask
        self.mig_slices_used[n, g] += profile.compute_slices
        self.mode[n, g] = GpuMode.MIG
        self._refresh_mig_free(n, g, model)
        return inst

    def _destroy_instance(self, n: int, g: int, model: GpuModel, start: int) -> None:
        insts = self.instances[(n, g)]
        inst = insts.pop(start)
        self.mig_slots_used[n, g] &= ~slot_mask(start, inst.profile.memory_slots)
        self.mig_slices_used[n, g] -= inst.profile.compute_slices
        if not insts:
            del self.instances[(n, g)]
            self.mode[n, g] = GpuMode.MIG if self.mig_pinned[n, g] else GpuMode.FREE
        self._refresh_mig_free(n, g, model)

    def _refresh_mig_free(self, n: int, g: int, model: GpuModel) -> None:
        """A MIG GPU's free compute and memory are what no instance covers."""
        if GpuMode(int(self.mode[n, g])) is GpuMode.FREE:
            self.free_milli[n, g] = FULL_MILLI
            self.free_mem[n, g] = model.memory_mib
            return
        free_slices = model.compute_slices - int(self.mig_slices_used[n, g])
        free_slots = model.memory_slots - int(self.mig_slots_used[n, g]).bit_count()
        self.free_milli[n, g] = free_slices * FULL_MILLI // model.compute_slices
        self.free_mem[n, g] = free_slots * model.memory_mib // model.memory_slots

    # ----- checking ------------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Recompute every GPU's use from the assignments alone and compare with the incremental state."""
        use_milli = np.zeros_like(self.free_milli)
        use_mem = np.zeros_like(self.free_mem)
        cpu = np.zeros_like(self.cpu_free)
        mem = np.zeros_like(self.mem_free)
        mechs: dict[tuple[int, int, int | None], set[Mechanism]] = {}
        tenants: dict[Unit, dict[str, int]] = {}
        inst_use: dict[tuple[int, int, int], list[GpuShare]] = {}
        plain: dict[tuple[int, int], list[GpuShare]] = {}
        for a in self.assignments.values():
            n = self.index[a.node]
            cpu[n] += a.cpu_milli
            mem[n] += a.host_memory_mib
            for s in a.shares:
                unit = (n, s.gpu_index, s.mig.start if s.mig else None)
                mechs.setdefault(unit, set()).add(s.sharing)
                if s.sharing is Mechanism.MPS:
                    clients = tenants.setdefault(unit, {})
                    key = self.tenant_key(n, a.tenant)
                    clients[key] = clients.get(key, 0) + 1
                if s.mig is None:
                    plain.setdefault((n, s.gpu_index), []).append(s)
                    use_milli[n, s.gpu_index] += s.compute_milli
                    use_mem[n, s.gpu_index] += s.memory_mib
                else:
                    inst_use.setdefault((n, s.gpu_index, s.mig.start), []).append(s)
        if (cpu > self.cpu_total).any() or (mem > self.mem_total).any():
            raise InvariantViolation("a node's CPU or memory is over-allocated")
        if not np.array_equal(self.cpu_total - cpu, self.cpu_free) or not np.array_equal(
            self.mem_total - mem, self.mem_free
        ):
            raise InvariantViolation("free CPU or memory disagrees with the assignments")
        for unit, ms in mechs.items():
            if len(ms) > 1 or (Mechanism.EXCLUSIVE in ms and self._unit_clients(unit, inst_use) > 1):
                raise InvariantViolation(f"GPU unit {unit} mixes mechanisms {sorted(ms)}")
        if tenants != self.unit_tenants:
            raise InvariantViolation("the MPS clients per tenant of a unit disagree with the assignments")
        indexed: dict[str, set[Unit]] = {}
        for unit, clients in tenants.items():
            for key in clients:
                indexed.setdefault(key, set()).add(unit)
        if indexed != self.tenant_units:
            raise InvariantViolation("the units of an MPS tenant disagree with the assignments")
        cap = self.tenancy.daemons_per_unit
        if {u for u, clients in tenants.items() if len(clients) >= cap} != self.full_units:
            raise InvariantViolation("the units at the MPS daemon cap disagree with the assignments")
        daemon_mem = self.tenancy.daemon_memory_mib
        for (n, g, start), clients in tenants.items():
            if start is None:
                use_mem[n, g] += len(clients) * daemon_mem
        daemons = np.zeros_like(self.daemons)
        for n, g, start in tenants:
            if start is None:
                daemons[n, g] = len(tenants[(n, g, None)])
        if not np.array_equal(daemons, self.daemons):
            raise InvariantViolation("MPS daemons per GPU disagree with the assignments")
        non_mig_units = {(n, g) for (n, g, start) in mechs if start is None}
        for n, node in enumerate(self.nodes):
            for dev in node.gpus:
                g = dev.index
                model = self.gpu_model(n, g)
                insts = self.instances_on(n, g)
                if (n, g) in non_mig_units and insts:
                    raise InvariantViolation(f"GPU {dev.uuid} has MIG instances and non-MIG shares")
                if insts:
                    self._check_mig_gpu(n, g, model, insts, inst_use)
                    if GpuMode(int(self.mode[n, g])) is not GpuMode.MIG or self.clients[n, g] != 0:
                        raise InvariantViolation(f"GPU {dev.uuid} holds MIG instances but is not in MIG mode")
                    free_slices = model.compute_slices - int(self.mig_slices_used[n, g])
                    free_slots = model.memory_slots - int(self.mig_slots_used[n, g]).bit_count()
                    if (
                        self.free_milli[n, g] != free_slices * FULL_MILLI // model.compute_slices
                        or self.free_mem[n, g] != free_slots * model.memory_mib // model.memory_slots
                    ):
                        raise InvariantViolation(f"free compute or memory of MIG GPU {dev.uuid} disagrees")
                    continue
                shares = plain.get((n, g), [])
                if self.mig_pinned[n, g] and shares:
                    raise InvariantViolation(f"GPU {dev.uuid} is pinned in MIG mode but holds non-MIG shares")
                idle = GpuMode.MIG if self.mig_pinned[n, g] else GpuMode.FREE
                expect_mode = MODE_OF[shares[0].mechanism] if shares else idle
                if self.mode[n, g] != expect_mode or self.clients[n, g] != len(shares):
                    raise InvariantViolation(f"mode or client count of {dev.uuid} disagrees with its shares")
                if use_milli[n, g] > FULL_MILLI or use_mem[n, g] > model.memory_mib:
                    raise InvariantViolation(f"GPU {dev.uuid} is over-allocated")
                if self.free_milli[n, g] != FULL_MILLI - use_milli[n, g] or self.free_mem[n, g] != (
                    model.memory_mib - use_mem[n, g]
                ):
                    raise InvariantViolation(f"free compute or memory of {dev.uuid} disagrees with its shares")
        for n, g, start in inst_use:
            if start not in self.instances_on(n, g):
                raise InvariantViolation(f"a share sits on a MIG instance at slot {start} that does not exist")

    def _unit_clients(
        self, unit: tuple[int, int, int | None], inst_use: dict[tuple[int, int, int], list[GpuShare]]
    ) -> int:
        n, g, start = unit
        if start is not None:
            return len(inst_use.get((n, g, start), []))
        return int(self.clients[n, g])

    def _check_mig_gpu(
        self,
        n: int,
        g: int,
        model: GpuModel,
        insts: dict[int, MigInstanceState],
        inst_use: dict[tuple[int, int, int], list[GpuShare]],
    ) -> None:
        covered = 0
        slices = 0
        for start, inst in insts.items():
            if start not in inst.profile.starts or inst.profile not in model.mig_profiles:
                raise InvariantViolation(
                    f"{inst.profile.name} at slot {start} is not a valid placement on {model.name}"
                )
            mask = slot_mask(start, inst.profile.memory_slots)
            if covered & mask:
                raise InvariantViolation(f"MIG instances overlap at slot {start} on node {self.nodes[n].name} GPU {g}")
            covered |= mask
            slices += inst.profile.compute_slices
            shares = inst_use.get((n, g, start), [])
            if not shares and not inst.persistent:
                raise InvariantViolation(f"an unused MIG instance at slot {start} was left behind")
            milli = sum(s.compute_milli for s in shares)
            mem = sum(s.memory_mib for s in shares) + self.daemons_on((n, g, start)) * self.tenancy.daemon_memory_mib
            if milli > FULL_MILLI or mem > inst.profile.memory_mib:
                raise InvariantViolation(f"the MIG instance at slot {start} is over-allocated")
            if inst.free_milli != FULL_MILLI - milli or inst.free_mem != inst.profile.memory_mib - mem:
                raise InvariantViolation(f"free compute or memory of the instance at slot {start} disagrees")
            if len(shares) != inst.clients:
                raise InvariantViolation(f"client count of the instance at slot {start} disagrees")
        if slices > model.compute_slices:
            raise InvariantViolation(f"MIG instances take {slices} of {model.compute_slices} compute slices")
        if covered != int(self.mig_slots_used[n, g]) or slices != int(self.mig_slices_used[n, g]):
            raise InvariantViolation("MIG slot or slice accounting disagrees with the instances")

    def state(self) -> dict[str, object]:
        """A canonical, comparable picture of the whole state (for restart equality and tests)."""
        return {
            "assignments": sorted(a.to_json() for a in self.assignments.values()),
            "cpu_free": self.cpu_free.tolist(),
            "mem_free": self.mem_free.tolist(),
            "free_milli": self.free_milli.tolist(),
            "free_mem": self.free_mem.tolist(),
            "mode": self.mode.tolist(),
            "clients": self.clients.tolist(),
            "daemons": self.daemons.tolist(),
            "mps_tenants": sorted((unit, sorted(c.items())) for unit, c in self.unit_tenants.items()),
            "mig": sorted(
                (
                    n,
                    g,
                    start,
                    i.profile.name,
                    i.free_milli,
                    i.free_mem,
                    str(i.inner),
                    i.clients,
                    i.persistent,
                )
                for (n, g), insts in self.instances.items()
                for start, i in insts.items()
            ),
        }

    def free_units(self, n: int) -> npt.NDArray[np.int64]:
        """Free milli per GPU of node ``n`` (0 for GPUs that are unhealthy or absent)."""
        return np.where(self.healthy[n], self.free_milli[n], 0)


def replay(
    nodes: Sequence[NodeSpec],
    assignments: Iterable[Assignment],
    catalog: Catalog = DEFAULT_CATALOG,
    tenancy: MpsTenancy | None = None,
) -> Ledger:
    """A ledger rebuilt from inventories and existing assignments alone (what a restart does)."""
    ledger = Ledger(nodes, catalog, tenancy)
    for a in assignments:
        ledger.place(a, check_health=False)
    return ledger
