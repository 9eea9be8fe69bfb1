"""Cluster accounting: nodes → GPUs → shares and MIG instances, with invariants checked on every change.

The ledger keeps its per-GPU state in numpy arrays (nodes × GPU slots) because placement reads all of it on
every decision; the per-instance MIG detail lives in small dicts beside them. Every change goes through
:meth:`Ledger.place` and :meth:`Ledger.release`, which are atomic: a change that would break an invariant
raises :class:`LedgerConflict` and leaves the ledger exactly as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import numpy.typing as npt

from sharegpu.model.assignment import Assignment, GpuShare, Mechanism
from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog, GpuModel, MigProfile
from sharegpu.model.inventory import NodeSpec
from sharegpu.model.request import FULL_MILLI

MPS_MAX_CLIENTS = 48  # per MPS server (Volta and later)
# Who an MPS unit (GPU or MIG instance) serves: an MPS server serves one Unix UID at a time, and a client of another
# UID waits in CUDA initialisation until every client of the running server has exited. A known UID is its own key;
# a client whose UID the pod does not declare holds its unit alone, since it might be anyone.
NO_MPS_USER = -1  # the unit has no MPS client
SOLE_MPS_USER = -2  # its one MPS client's UID is unknown: nobody may join
NEVER_JOINS = -3  # the key of a request of unknown UID: matches no unit


def mps_user_key(user: int | None) -> int:
    """The key a share of ``user`` puts on the MPS unit it opens."""
    return SOLE_MPS_USER if user is None else user


def mps_join_key(user: int | None) -> int:
    """The unit key a share of ``user`` may join (a unit of unknown user is joined by nobody)."""
    return NEVER_JOINS if user is None else user


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
    mps_user: int = NO_MPS_USER  # see mps_user_key


def slot_mask(start: int, size: int) -> int:
    return ((1 << size) - 1) << start


class Ledger:
    """Accounting for one cluster. Nodes are kept in name order: index order is the tie-break order."""

    def __init__(self, nodes: Iterable[NodeSpec], catalog: Catalog = DEFAULT_CATALOG) -> None:
        self.catalog = catalog
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
        # See mps_user_key; a unit recorded with clients of several users (place(check_health=False)) is keyed
        # SOLE_MPS_USER: closed to new MPS clients.
        self.mps_user = np.full((n_nodes, width), NO_MPS_USER, dtype=np.int64)
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
        their other GPUs and nothing else is placed there; and MPS clients of several Unix users on one unit (placed
        before the ledger knew users, or by hand) are recorded as they are, the unit closed to new MPS clients.
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
                self._apply(n, s, check_health, a.user, record=not check_health)
                done.append(s)
        except LedgerConflict as e:
            for s in reversed(done):
                self._unapply(n, s)
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
            self._unapply(n, s)
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

    def _apply(
        self, n: int, s: GpuShare, check_health: bool = True, user: int | None = None, record: bool = False
    ) -> None:
        model = self._check_gpu(n, s, check_health)
        g = s.gpu_index
        mode = GpuMode(int(self.mode[n, g]))
        if s.mechanism is Mechanism.MIG:
            self._apply_mig(n, g, model, mode, s, user, record)
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
        mixed = False
        if want is GpuMode.MPS:
            if not model.mps_capable:
                raise LedgerConflict(f"{model.name} does not support MPS")
            if self.clients[n, g] >= MPS_MAX_CLIENTS:
                raise LedgerConflict(f"GPU {s.gpu_uuid} already has {MPS_MAX_CLIENTS} MPS clients")
            mixed = self.clients[n, g] > 0 and _mps_user_conflict(int(self.mps_user[n, g]), user)
            if mixed and not record:
                _check_mps_user(f"GPU {s.gpu_uuid}", int(self.mps_user[n, g]), user)
        if s.compute_milli > self.free_milli[n, g] or s.memory_mib > self.free_mem[n, g]:
            raise LedgerConflict(
                f"GPU {s.gpu_uuid} has {self.free_milli[n, g]} milli and {self.free_mem[n, g]}Mi free; "
                f"asked {s.compute_milli} milli and {s.memory_mib}Mi"
            )
        self.free_milli[n, g] -= s.compute_milli
        self.free_mem[n, g] -= s.memory_mib
        if want is GpuMode.MPS and self.clients[n, g] == 0:
            self.mps_user[n, g] = mps_user_key(user)
        elif want is GpuMode.MPS and mixed:
            self.mps_user[n, g] = SOLE_MPS_USER
        self.clients[n, g] += 1
        self.mode[n, g] = want

    def _unapply(self, n: int, s: GpuShare) -> None:
        g = s.gpu_index
        if s.mechanism is Mechanism.MIG:
            self._unapply_mig(n, g, s)
            return
        self.free_milli[n, g] += s.compute_milli
        self.free_mem[n, g] += s.memory_mib
        self.clients[n, g] -= 1
        if self.clients[n, g] == 0:
            self.mode[n, g] = GpuMode.FREE
            self.mps_user[n, g] = NO_MPS_USER

    def _apply_mig(
        self,
        n: int,
        g: int,
        model: GpuModel,
        mode: GpuMode,
        s: GpuShare,
        user: int | None = None,
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
        try:
            if inst.profile.name != profile.name:
                raise LedgerConflict(f"the instance at slot {s.mig.start} of {s.gpu_uuid} is {inst.profile.name}")
            if inst.inner is not None and (inst.inner is not s.inner or s.inner is Mechanism.EXCLUSIVE):
                raise LedgerConflict(f"the {profile.name} instance at slot {s.mig.start} is used as {inst.inner}")
            if s.inner is Mechanism.EXCLUSIVE and (s.compute_milli != FULL_MILLI or s.memory_mib != profile.memory_mib):
                raise LedgerConflict("an exclusive MIG share takes its whole instance")
            if s.inner is Mechanism.MPS and inst.clients >= MPS_MAX_CLIENTS:
                raise LedgerConflict(f"the instance already has {MPS_MAX_CLIENTS} MPS clients")
            mixed = s.inner is Mechanism.MPS and inst.clients > 0 and _mps_user_conflict(inst.mps_user, user)
            if mixed and not record:
                _check_mps_user(f"the {profile.name} instance at slot {s.mig.start}", inst.mps_user, user)
            if s.compute_milli > inst.free_milli or s.memory_mib > inst.free_mem:
                raise LedgerConflict(
                    f"the {profile.name} instance has {inst.free_milli} milli and {inst.free_mem}Mi free; "
                    f"asked {s.compute_milli} milli and {s.memory_mib}Mi"
                )
        except LedgerConflict:
            if created:
                self._destroy_instance(n, g, model, s.mig.start)
            raise
        inst.free_milli -= s.compute_milli
        inst.free_mem -= s.memory_mib
        if s.inner is Mechanism.MPS and inst.clients == 0:
            inst.mps_user = mps_user_key(user)
        elif mixed:
            inst.mps_user = SOLE_MPS_USER
        inst.clients += 1
        inst.inner = s.inner

    def _unapply_mig(self, n: int, g: int, s: GpuShare) -> None:
        assert s.mig is not None
        inst = self.instances[(n, g)][s.mig.start]
        inst.free_milli += s.compute_milli
        inst.free_mem += s.memory_mib
        inst.clients -= 1
        if inst.clients == 0:
            inst.inner = None
            inst.mps_user = NO_MPS_USER
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
        users: dict[tuple[int, int, int | None], list[int | None]] = {}
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
                    users.setdefault(unit, []).append(a.user)
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
        for unit, us in users.items():
            n, g, start = unit
            # One declared user keys the unit; an undeclared user, or several users (recorded as they ran), close it.
            key = mps_user_key(us[0]) if len(set(us)) == 1 and (us[0] is not None or len(us) == 1) else SOLE_MPS_USER
            inst = self.instances_on(n, g).get(start) if start is not None else None
            held = int(self.mps_user[n, g]) if start is None else (inst.mps_user if inst else key)
            if held != key:
                raise InvariantViolation(f"MPS unit {unit} is keyed to user {held}; its clients' users {us} make {key}")
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
            mem = sum(s.memory_mib for s in shares)
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
            "mps_user": self.mps_user.tolist(),
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
                    i.mps_user,
                )
                for (n, g), insts in self.instances.items()
                for start, i in insts.items()
            ),
        }

    def free_units(self, n: int) -> npt.NDArray[np.int64]:
        """Free milli per GPU of node ``n`` (0 for GPUs that are unhealthy or absent)."""
        return np.where(self.healthy[n], self.free_milli[n], 0)


def _mps_user_conflict(held: int, user: int | None) -> bool:
    return held == SOLE_MPS_USER or user is None or user != held


def _check_mps_user(unit: str, held: int, user: int | None) -> None:
    if held == SOLE_MPS_USER:
        raise LedgerConflict(
            f"{unit} serves an MPS client whose Unix user is unknown, and an MPS server serves one user at a time"
        )
    if user is None or user != held:
        who = "a pod whose Unix user is unknown" if user is None else f"user {user}"
        raise LedgerConflict(
            f"{unit} serves MPS clients of user {held}; {who} would wait for all of them to exit (one MPS server "
            "serves one Unix user at a time)"
        )


def replay(nodes: Sequence[NodeSpec], assignments: Iterable[Assignment], catalog: Catalog = DEFAULT_CATALOG) -> Ledger:
    """A ledger rebuilt from inventories and existing assignments alone (what a restart does)."""
    ledger = Ledger(nodes, catalog)
    for a in assignments:
        ledger.place(a, check_health=False)
    return ledger
