"""The DRA nodes' ledger: their GPUs (from the driver's ResourceSlices), what the allocated ResourceClaims take, the
cpu and memory of the pods bound there, and DRA steering's holds — derived from the cluster cache's objects.

A GPU is handed out by one path only: a node labelled ``sharegpu.io/device-path=dra`` is left out of the
device-plugin ledger (:mod:`sharegpu.k8s.cache.ledger_view`) and accounted here, where DRA steering
(:mod:`sharegpu.k8s.extender.dra_steer`) decides. Every object is parsed once, when its event arrives, and the
ledger follows the claims, pods and holds incrementally (a release and a place per change); only a change of a DRA
node's GPUs (its slices) or of its allocatable cpu and memory rebuilds it. Steering's holds are the assume cache's
:class:`~sharegpu.k8s.cache.assume.SteerHold` entries: one assume cache for everything this process placed.

MPS daemons are counted as on the device-plugin path (:class:`~sharegpu.ledger.MpsTenancy`: at most the cap per GPU,
each with its server's memory): an allocated claim's MPS share joins the daemon of its tenant
(:mod:`sharegpu.model.tenant`), which is the tenant of the first pod in its ``reservedFor`` whose containers use it, as
the node's driver prepares it (:func:`~sharegpu.k8s.dra_objects.claim_tenant`), or the claim's own where none does;
on a node whose devices say ``mpsMultiUser`` one daemon per unit serves them all. The allocator counts only the
claims' capacities, so a claim it put on a GPU that the daemons' servers leave too little memory for is counted up to
what is left (the GPU is full), and one that opens a daemon beyond the cap is recorded as it is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TypeVar

from sharegpu.k8s.cache.assume import AssumeCache, SteerHold
from sharegpu.k8s.dra_objects import claim_tenant, claimed_mib, claimed_percent, is_dra_node, slice_devices
from sharegpu.k8s.pod_request import PERCENT_MILLI, cpu_and_memory
from sharegpu.kube.api import DELETED
from sharegpu.kube.quantity import capacity_mib, capacity_milli, quantity_or_zero
from sharegpu.kube.schema import Node, Pod, ResourceClaim, ResourceSlice
from sharegpu.ledger import Ledger, LedgerError, MpsTenancy
from sharegpu.model.assignment import Assignment, GpuShare, Mechanism, MigSlot
from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog
from sharegpu.model.contract import DEVICE_TYPE_GPU, DRIVER, mig_profile_token, parse_device_name
from sharegpu.model.inventory import GpuDevice, NodeSpec
from sharegpu.model.request import FULL_MILLI, GpuRequest, InvalidRequest, Sharing
from sharegpu.model.tenant import TenantConflict, own_tenant
from sharegpu.placement.mechanism import make_share

log = logging.getLogger(__name__)

V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class ClaimUse:
    """What one allocated claim holds: per device, (GPU index, whole GPU?, memory MiB, compute milli, MIG
    partition as (profile, start) or None)."""

    node: str
    devices: tuple[tuple[int, bool, int, int, tuple[str, int] | None], ...]


class DraLedger:
    """The ledger of the DRA nodes, kept in step with the cluster cache's Nodes, Pods, slices and claims."""

    def __init__(
        self, assumed: AssumeCache, catalog: Catalog = DEFAULT_CATALOG, tenancy: MpsTenancy | None = None
    ) -> None:
        self.catalog = catalog
        self.tenancy = tenancy or MpsTenancy()  # the MPS daemon cap and memory, as the device-plugin ledger counts
        self._assumed = assumed
        self.claims: dict[str, ResourceClaim] = {}  # ns/name → claim (its spec is read when its pod is steered)
        self.slices: dict[
            str, ResourceSlice
        ] = {}  # name → the driver's slice, as listed (status shows its MIG devices)
        self._nodes: dict[str, tuple[int, int]] = {}  # DRA node → allocatable (cpu milli, memory MiB)
        # slice → (node, its GPUs, whether its devices say the node runs one multi-user MPS daemon per unit)
        self._slices: dict[str, tuple[str, tuple[GpuDevice, ...], bool]] = {}
        self._uses: dict[str, ClaimUse] = {}  # claim key → what its allocation holds
        self._tenants: dict[str, str] = {}  # claim key → the MPS tenant its accounted allocation was counted under
        self._pods: dict[str, tuple[str, int, int]] = {}  # pod key → (node, cpu, memory) of pods bound to a node
        # pod key → (UID, claim name → the pod's tenant as a user of it) of the pods that use claims
        self._pod_tenants: dict[str, tuple[str, dict[str, str]]] = {}
        self._ledger: Ledger | None = None

    def counts(self) -> tuple[int, int, int]:
        """(DRA nodes, driver slices, claims) seen."""
        return len(self._nodes), len(self._slices), len(self.claims)

    # ----- changes (from the cluster cache) ------------------------------------------------------------------------
    def reset(
        self,
        nodes: Iterable[Node],
        pods: Iterable[Pod],
        slices: Iterable[ResourceSlice],
        claims: Iterable[ResourceClaim],
    ) -> None:
        """Replace everything with a fresh list."""
        self._nodes.clear()
        self._slices.clear()
        self.slices.clear()
        self.claims.clear()
        self._uses.clear()
        self._tenants.clear()
        self._pods.clear()
        self._pod_tenants.clear()
        self._ledger = None
        for n in nodes:
            self.apply_node("ADDED", n)
        for s in slices:
            self.apply_slice("ADDED", s)
        for c in claims:
            self.apply_claim("ADDED", c)
        for p in pods:
            self.apply_pod("ADDED", p)

    def apply_node(self, event: str, node: Node) -> None:
        name = node.metadata.name
        cap = None
        if event != DELETED and is_dra_node(node.metadata.labels):
            alloc = node.status.allocatable
            # What the node has: rounded down.
            cap = (
                capacity_milli(quantity_or_zero(alloc.get("cpu", "0"))),
                capacity_mib(quantity_or_zero(alloc.get("memory", "0"))),
            )
        if self._nodes.get(name) != cap:
            _set(self._nodes, name, cap)
            self._ledger = None

    def apply_slice(self, event: str, obj: ResourceSlice) -> None:
        parsed = None if event == DELETED else self._parse_slice(obj)
        name = obj.metadata.name
        _set(self.slices, name, obj if parsed is not None else None)
        if self._slices.get(name) != parsed:
            _set(self._slices, name, parsed)
            self._ledger = None

    def apply_claim(self, event: str, claim: ResourceClaim) -> None:
        key = claim.key
        gone = event == DELETED
        _set(self.claims, key, None if gone else claim)
        use = None if gone else parse_use(claim, self.catalog)
        if use is not None:
            # The allocation is seen: it accounts the GPU from now on. The hold goes first, or the two would count
            # the pod twice and the allocation would not fit beside its own hold.
            for h in self._assumed.steered_by_claim(key):
                self.drop_hold(h.uid)
        if self._uses.get(key) != use or (use is not None and self._claim_tenant(claim) != self._tenants.get(key)):
            _set(self._uses, key, use)
            if use is None:
                self._tenants.pop(key, None)
            self._account(f"claim:{key}", self._claim_assignment(key, use) if use is not None else None)

    def apply_pod(self, event: str, pod: Pod) -> None:
        key = pod.key
        node = pod.spec.node_name
        use_pod = None
        if event != DELETED and node and not pod.finished:
            cpu, mem = _pod_cpu_memory(pod)
            use_pod = (node, cpu, mem)
        if self._pods.get(key) != use_pod:
            _set(self._pods, key, use_pod)
            a = Assignment(f"pod:{key}", node, (), use_pod[1], use_pod[2]) if use_pod is not None else None
            self._account(f"pod:{key}", a)
        tenants = None if event == DELETED else _pod_tenants(pod)
        old = self._pod_tenants.get(key)
        if old != tenants:
            _set(self._pod_tenants, key, tenants)
            # The claims it uses (or used) may be counted under another tenant now.
            for name in {*(old[1] if old else ()), *(tenants[1] if tenants else ())}:
                ckey = f"{pod.metadata.namespace}/{name}"
                claim, use = self.claims.get(ckey), self._uses.get(ckey)
                if claim is not None and use is not None and self._claim_tenant(claim) != self._tenants.get(ckey):
                    self._account(f"claim:{ckey}", self._claim_assignment(ckey, use))

    def _parse_slice(self, obj: ResourceSlice) -> tuple[str, tuple[GpuDevice, ...], bool] | None:
        if obj.spec.driver != DRIVER:
            return None
        node = obj.node
        gpus = []
        multi_user = False
        for d in slice_devices(obj):
            if d.type != DEVICE_TYPE_GPU or not self.catalog.known(d.model):
                continue
            uuid = f"{node}-gpu-{d.index}" if d.uuid is None else d.uuid
            gpus.append(GpuDevice(d.index, uuid, d.model, memory_mib=capacity_mib(quantity_or_zero(d.memory))))
            multi_user = multi_user or d.mps_multi_user
        return node, tuple(gpus), multi_user

    # ----- the ledger ------------------------------------------------------------------------------------------
    def ledger(self, now: float | None = None) -> Ledger:
        now = time.monotonic() if now is None else now
        for h in self._assumed.lapsed_steered(now):
            self.drop_hold(h.uid)
        if self._ledger is None:
            self._ledger = self._build()
        return self._ledger

    def _build(self) -> Ledger:
        gpus: dict[str, dict[int, GpuDevice]] = {}
        multi_user: set[str] = set()
        for node, devices, multi in self._slices.values():
            for g in devices:
                gpus.setdefault(node, {})[g.index] = g
            if multi:
                multi_user.add(node)
        specs = [
            NodeSpec(
                name,
                *self._nodes[name],
                tuple(gpus[name][i] for i in sorted(gpus[name])),
                mps_multi_user=name in multi_user,
            )
            for name in sorted(gpus)
            if name in self._nodes
        ]
        led = Ledger(specs, self.catalog, self.tenancy)
        self._ledger = led
        for key, use in self._uses.items():
            self._account(f"claim:{key}", self._claim_assignment(key, use))
        for key, (node, cpu, mem) in self._pods.items():
            self._account(f"pod:{key}", Assignment(f"pod:{key}", node, (), cpu, mem))
        for h in self._assumed.steered():
            self._account(h.ledger_name, h.assignment)
        return led

    def _claim_assignment(self, key: str, use: ClaimUse) -> Assignment | None:
        led = self._ledger
        if led is None or use.node not in led.index:
            return None
        n = led.index[use.node]
        position = {g.index: k for k, g in enumerate(led.nodes[n].gpus)}
        shares = []
        for index, whole, mem, compute, mig in use.devices:
            g = position.get(index)
            if g is None:
                continue
            gpu = led.nodes[n].gpus[g]
            if mig is not None:
                try:
                    profile = led.gpu_model(n, g).profile(mig[0])
                except ValueError:
                    pass  # a profile this model lacks: the GPU counts as taken
                else:
                    shares.append(
                        GpuShare(g, gpu.uuid, Mechanism.MIG, FULL_MILLI, profile.memory_mib,
                                 MigSlot(profile.name, mig[1]), Mechanism.EXCLUSIVE)
                    )  # fmt: skip
                    continue
            total = gpu.memory_mib
            if whole or (mem >= total and compute >= FULL_MILLI):
                req = GpuRequest(f"claim:{key}", 1)  # a partition or the whole GPU: nothing else can share it
            else:
                req = GpuRequest(f"claim:{key}", 1, compute_milli=compute, memory_mib=mem)
            try:
                shares.append(make_share(led, n, g, req))
            except (ValueError, InvalidRequest) as e:
                log.debug("claim %s: not modelled on %s: %s", key, use.node, e)
        claim = self.claims.get(key)
        tenant = self._claim_tenant(claim) if claim is not None else own_tenant(key)
        self._tenants[key] = tenant
        if not shares:
            return None
        # The tenant goes with MPS shares only, as placement writes it: it names the daemon they join.
        mps = any(s.sharing is Mechanism.MPS for s in shares)
        return Assignment(f"claim:{key}", use.node, tuple(shares), tenant=tenant if mps else None)

    def _claim_tenant(self, claim: ResourceClaim) -> str:
        """The MPS tenant whose daemon serves ``claim``: that of the first pod it is reserved for whose containers use
        it (the node prepares it for the pods reserved then, and refuses pods of several tenants), or the claim's own
        where none does (a workload reserving it, or no pod seen), as the node's driver decides."""
        own = own_tenant(claim.metadata.uid or claim.key)
        ns, name = claim.metadata.namespace, claim.metadata.name
        for r in claim.status.reserved_for:
            if r.resource != "pods":
                return own
            seen = self._pod_tenants.get(f"{ns}/{r.name}")
            if seen is None or (r.uid and seen[0] and seen[0] != r.uid):
                continue  # not seen yet, or another pod of that name
            tenant = seen[1].get(name)
            if tenant is not None:
                return tenant
        return own

    def _account(self, name: str, a: Assignment | None) -> None:
        """Make the ledger hold ``a`` under ``name`` (nothing: ``a`` is None), replacing what it held there."""
        led = self._ledger
        if led is None:
            return  # built from the parsed objects when next needed
        if name in led.assignments:
            led.release(name)
        if a is None or a.node not in led.index:
            return
        if a.pod != name:
            a = replace(a, pod=name)
        try:
            try:
                led.place(a, check_health=False)
            except LedgerError:
                fitted = _within_free_memory(led, a)
                if fitted is None:
                    raise
                led.place(fitted, check_health=False)
        except LedgerError as e:
            # The API objects disagree with the model for a moment (e.g. a slice republished): the decision goes on
            # without this one rather than not at all.
            log.warning("DRA ledger: %s not accounted: %s", name, e)

    # ----- steering's holds (the assume cache's SteerHold entries) ---------------------------------------------
    def hold(self, uid: str, a: Assignment, claims: tuple[str, ...], expires: float) -> None:
        """Count ``a`` for the pod of UID ``uid`` until one of ``claims`` is seen allocated, or ``expires``."""
        h = SteerHold(uid, a, claims, expires)
        self._assumed.steer(h)
        self._account(h.ledger_name, a)

    def holds(self) -> list[SteerHold]:
        """Steering's holds counted now (those whose claims are not seen allocated yet)."""
        return self._assumed.steered()

    def drop_hold(self, uid: str) -> None:
        h = self._assumed.drop_steered(uid)
        if h is not None:
            self._account(h.ledger_name, None)

    def requests(self) -> list[GpuRequest]:
        """The allocated claims as requests (the workload's shapes when the operator fixed none)."""
        out = []
        for key, use in self._uses.items():
            if use.devices:
                _, whole, mem, compute, mig = use.devices[0]
                n = len(use.devices)
                if mig is not None:
                    try:
                        out.append(GpuRequest(key, n, mig_profile=mig[0], sharing=Sharing.MIG))
                        continue
                    except InvalidRequest:
                        pass
                out.append(GpuRequest(key, n) if whole else GpuRequest(key, n, compute_milli=compute, memory_mib=mem))
        return out

    def allocated(self) -> int:
        """How many claims are seen allocated (what the steering workload's drift is counted in)."""
        return len(self._uses)


def _set(store: dict[str, V], key: str, value: V | None) -> None:
    if value is None:
        store.pop(key, None)
    else:
        store[key] = value


def _within_free_memory(led: Ledger, a: Assignment) -> Assignment | None:
    """``a`` with each of its MPS shares on a whole GPU cut to the memory the GPU has left beside the daemon it opens
    (None: nothing to cut). The allocator counts the claims' capacities only: claims may fill a GPU whose MPS servers
    take memory too, and such a GPU is then full, not one claim less used."""
    n = led.index[a.node]
    shares = []
    for s in a.shares:
        if s.mechanism is Mechanism.MPS:
            opens = led.opens_daemon((n, s.gpu_index, None), a.tenant)
            room = int(led.free_mem[n, s.gpu_index]) - (led.tenancy.daemon_memory_mib if opens else 0)
            if s.memory_mib > room >= 0:
                s = replace(s, memory_mib=room)
        shares.append(s)
    return replace(a, shares=tuple(shares)) if tuple(shares) != a.shares else None


def _pod_tenants(pod: Pod) -> tuple[str, dict[str, str]] | None:
    """(UID, claim name → the pod's MPS tenant as a user of it) for a pod that uses claims (None: it uses none)."""
    out: dict[str, str] = {}
    for pc in pod.spec.resource_claims:
        name = pod.claim_name(pc)
        if not name:
            continue
        try:
            tenant = claim_tenant(pod, name)
        except TenantConflict:
            tenant = own_tenant(pod.metadata.uid or pod.key)  # the node refuses the claim; counted as the pod alone
        if tenant is not None:
            out[name] = tenant
    return (pod.metadata.uid, out) if out else None


def _profile_names(catalog: Catalog) -> dict[str, str]:
    """MIG profile names by their token in device names ("3g.40gb" → "3g40gb"), over the catalog's models."""
    return {mig_profile_token(p.name): p.name for m in catalog for p in m.mig_profiles}


def parse_use(claim: ResourceClaim, catalog: Catalog = DEFAULT_CATALOG) -> ClaimUse | None:
    """What an allocated claim holds of this driver's GPUs (None: not allocated, or nothing of ours)."""
    alloc = claim.status.allocation
    if alloc is None:
        return None
    devices = []
    node = ""
    profiles = _profile_names(catalog)
    for r in alloc.devices.results:
        if r.driver != DRIVER:
            continue
        name = parse_device_name(r.device)
        if name is None:
            continue
        node = r.pool
        consumed = r.consumed_capacity
        part = None
        if name.mig_token is not None and name.mig_start is not None and name.mig_token in profiles:
            part = (profiles[name.mig_token], name.mig_start)
        whole = name.is_mig or not consumed
        mem = claimed_mib(consumed)
        mem = 1 << 40 if mem is None else mem  # left out: the whole memory
        compute = claimed_percent(consumed) * PERCENT_MILLI
        devices.append((name.gpu_index, whole, mem, compute, part))
    return ClaimUse(node, tuple(devices)) if devices else None


def _pod_cpu_memory(p: Pod) -> tuple[int, int]:
    try:
        return cpu_and_memory(p)
    except (InvalidRequest, ValueError):
        return 0, 0
