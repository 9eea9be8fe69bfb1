"""The node agent: one loop that keeps the node's inventory, MIG instances, MPS daemons and metrics current.

Every ``interval_s`` it reads the GPUs, lists the pods bound to this node, reconciles MIG instances and MPS
daemons with their assignments, publishes the inventory and refreshes the metrics. The device plugin serves
the kubelet beside it. A restarted agent adopts what it finds (MIG instances it recorded as its own, MPS daemons
that still answer, containers already allocated) and changes nothing a running pod depends on.

MPS daemons are kept per (unit, tenant) (:mod:`sharegpu.model.tenant`; one per unit in multi-user mode): a daemon
runs while a pod of its tenant holds an MPS share of its unit, with limits from its tenant's shares there, and its
health, logs and server are watched apart from the unit's other daemons.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from sharegpu.kube.errors import KubeError
from sharegpu.model.assignment import Assignment, GpuShare, InvalidAssignment, Mechanism
from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog
from sharegpu.model.contract import ASSIGNMENT_ANNOTATION, GPU_RESOURCE
from sharegpu.model.tenant import TenantConflict
from sharegpu.node.allocation import Allocator
from sharegpu.node.attribution import CHECKPOINT_FILE, DEFAULT_POD_RESOURCES_SOCKET, Attributor, PodResourcesClient
from sharegpu.node.audit import GpuReading, MpsUnitUsage, ProcView, pod_usage, unit_shares
from sharegpu.node.backends.base import BackendError, GpuBackend
from sharegpu.node.cdi import DEFAULT_CDI_DIR, CdiError, CdiWriter
from sharegpu.node.device_plugin import TOKENS_PER_GPU, DevicePluginServer, device_tokens
from sharegpu.node.enforcement import MpsFault, PodNotifier
from sharegpu.node.kube import KubeApi, PodInfo
from sharegpu.node.metrics import (
    GpuSample,
    MetricsServer,
    MetricsSnapshot,
    MigSample,
    PodUsage,
    ShareSample,
    new_registry,
)
from sharegpu.node.mig import MigManager, MigNeed
from sharegpu.node.mps import DaemonKey, MpsDaemon, MpsLimits, MpsManager
from sharegpu.node.publish import InventoryPublisher, build_node_spec
from sharegpu.node.state import AgentState, StateError
from sharegpu.node.watch import NodeWatch, read_gpus

log = logging.getLogger(__name__)

STATE_FILE = "agent-state.json"


@dataclass(frozen=True, slots=True)
class AgentConfig:
    node_name: str
    plugin_dir: Path
    state_dir: Path  # MPS pipe/log directories and the agent's state; a host path that pods can mount
    metrics_listen: tuple[str, int] | None = None
    interval_s: float = 10.0
    tokens_per_gpu: int = TOKENS_PER_GPU
    allocate_wait_s: float = 10.0  # under the kubelet's 30 s for a PreStartContainer, queueing included
    grant_grace_s: float = 120.0  # how long a fresh grant counts as needed whatever a pod list says
    pod_resources_socket: Path = DEFAULT_POD_RESOURCES_SOCKET  # the kubelet's record of whose container starts
    cdi_dir: Path = DEFAULT_CDI_DIR  # where PreStartContainer writes each container's CDI spec
    evict_on_audit: bool = False  # evict a pod the enforcement audit finds breaking its share (Eviction API)
    # One -M daemon per unit serving every user (checked Volta or later by the CLI), instead of a daemon per tenant.
    mps_multi_user: bool = False
    # The namespace the agent runs in, sharegpu's own ($POD_NAMESPACE): `sharegpu bench`'s Job pod is recognised
    # there only (its processes are no finding); empty: nowhere.
    namespace: str = ""


@dataclass(frozen=True, slots=True)
class ReconcileResult:
    assignments: tuple[Assignment, ...]
    invalid: tuple[str, ...] = ()  # one message per pod whose assignment cannot be used
    errors: tuple[str, ...] = ()
    published: bool = False
    faults: tuple[MpsFault, ...] = ()  # MPS units whose clients died of a fault, noticed in this reconcile


@dataclass(slots=True)
class _Desired:
    mig: set[MigNeed] = field(default_factory=set)
    non_mig_users: dict[int, set[str]] = field(default_factory=dict)  # GPU index → pods that use it without MIG
    # (GPU UUID or MIG instance, tenant of the daemon) → the MPS shares its daemon serves
    mps: dict[tuple[str | MigNeed, str], list[GpuShare]] = field(default_factory=dict)


class NodeAgent:
    def __init__(
        self,
        config: AgentConfig,
        backend: GpuBackend,
        kube: KubeApi,
        mps_daemon: MpsDaemon,
        catalog: Catalog = DEFAULT_CATALOG,
        notifier: PodNotifier | None = None,
    ) -> None:
        """``notifier`` posts the audit's and the fault watch's Events (and evictions); without it they are logged
        and counted only."""
        self.config = config
        self.backend = backend
        self.kube = kube
        self.catalog = catalog
        self.state = AgentState(config.state_dir / STATE_FILE)
        self.mig = MigManager(backend, self.state, catalog)
        self.mps = MpsManager(config.state_dir / "mps", mps_daemon, multi_user=config.mps_multi_user)
        attributor = Attributor(
            GPU_RESOURCE, PodResourcesClient(config.pod_resources_socket), config.plugin_dir / CHECKPOINT_FILE
        )
        self.allocator = Allocator(
            config.node_name,
            backend,
            kube,
            self.mig,
            self.mps,
            self.state,
            attributor,
            CdiWriter(config.cdi_dir),
            wait_s=config.allocate_wait_s,
            grant_grace_s=config.grant_grace_s,
        )
        self.plugin = DevicePluginServer(config.plugin_dir, self.allocator)
        self.publisher = InventoryPublisher(kube, config.node_name)
        self.snapshot = MetricsSnapshot(config.node_name)
        self.registry = new_registry(lambda: self.snapshot)
        self._recovered = False
        self._absent_before: set[str] = set()  # allocated pods missing from the previous pod list
        self.notifier = notifier
        # The audit and the MPS fault watch; a process of no pod is told on the Node, through the agent's own client.
        self.node_watch = NodeWatch(
            backend,
            self.mps,
            notifier,
            node=config.node_name,
            node_events=kube,
            evict=config.evict_on_audit,
            namespace=config.namespace,
        )
        self.watch = self.node_watch.enforcement
        self.metrics_server: MetricsServer | None = None

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop``; MIG instances and MPS daemons are left running for the next agent."""
        metrics = None
        if self.config.metrics_listen is not None:
            metrics = MetricsServer(self.registry, *self.config.metrics_listen)
            await metrics.start()
            self.metrics_server = metrics
        plugin_task = asyncio.create_task(self.plugin.run(stop))
        try:
            while not stop.is_set():
                try:
                    await self.reconcile_once()
                except (KubeError, BackendError, StateError) as e:
                    log.warning("reconcile failed, retrying in %gs: %s", self.config.interval_s, e)
                await self._sleep(stop)
        finally:
            stop.set()
            await plugin_task
            if metrics is not None:
                await metrics.close()

    async def _sleep(self, stop: asyncio.Event) -> None:
        """Until the next reconcile: the interval, or sooner when a grant waits on room that finished pods hold."""
        wanted = self.allocator.reconcile_wanted
        waits = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(wanted.wait())}
        try:
            await asyncio.wait(waits, timeout=self.config.interval_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        wanted.clear()

    async def reconcile_once(self) -> ReconcileResult:
        if not self._recovered:
            await self.mps.recover()
            await self._drop_orphan_specs()
            self._recovered = True
        devices = self.backend.devices()
        await self.plugin.set_devices(device_tokens(devices, self.config.tokens_per_gpu))
        node = await self.kube.get_node(self.config.node_name)
        listed_at = time.monotonic()
        pods = [p for p in await self.kube.pods_on_node(self.config.node_name) if p.node_name == self.config.node_name]
        live = [p for p in pods if not p.finished]
        assignments, invalid = self._assignments(live)
        tenants = self._tenants(live, assignments, invalid)
        # Everything below destroys, stops or forgets. It runs under the allocator's lock, so no Allocate runs in
        # between, and it counts what Allocate handed out since (or just before) ``pods`` was listed: that list
        # can predate a grant, and must never undo one.
        async with self.allocator.lock:
            errors = await self._reconcile_units(pods, listed_at, assignments, invalid, tenants)
        spec = build_node_spec(
            self.config.node_name,
            self.backend,
            self.mig.is_managed,
            self.mig.mig_mode_ours,
            node.cpu_milli,
            node.memory_mib,
            self.catalog,
            mps_multi_user=self.config.mps_multi_user,
        )
        published = await self.publisher.publish(spec, node.labels, node.annotations)
        readings, views = read_gpus(self.backend, self.mps)
        faults = await self._enforce(readings, views, live, assignments, errors, tenants)
        self.snapshot = self._snapshot(pods, assignments, readings, views, len(invalid), len(errors))
        return ReconcileResult(tuple(assignments), tuple(invalid), tuple(errors), published, tuple(faults))

    def _tenants(self, live: list[PodInfo], assignments: list[Assignment], invalid: list[str]) -> dict[str, str]:
        """Per pod key, the tenant of the daemon that serves its MPS shares on this node (pods with MPS shares only);
        a pod whose GPU containers declare different UIDs has none (it is refused at PreStartContainer)."""
        by_key = {p.key: p for p in live}
        out: dict[str, str] = {}
        for a in assignments:
            p = by_key.get(a.pod)
            if p is None or not any(s.sharing is Mechanism.MPS for s in a.shares):
                continue
            try:
                out[a.pod] = self.mps.tenant_key(p.tenant)
            except TenantConflict as e:
                invalid.append(f"pod {a.pod}: {e}")
                log.warning("pod %s: %s", a.pod, e)
        return out

    async def _enforce(
        self,
        readings: list[GpuReading],
        views: dict[int, tuple[ProcView, ...]],
        live: list[PodInfo],
        assignments: list[Assignment],
        errors: list[str],
        tenants: dict[str, str],
    ) -> tuple[MpsFault, ...]:
        """The enforcement audit and the MPS fault watch (:class:`~sharegpu.node.watch.NodeWatch`) on the pods'
        assignments: each pod's units from its assignment, its daemon's tenant from ``tenants`` (by pod key)."""
        uid_of = {p.key: p.uid for p in live}
        instances = {r.device.index: r.instances for r in readings}
        shares = {uid_of[a.pod]: unit_shares(a, instances) for a in assignments if a.pod in uid_of}
        tenant_by_uid = {uid_of[k]: t for k, t in tenants.items() if k in uid_of}
        result = await self.node_watch.check(readings, views, live, shares, tenant_by_uid)
        errors += result.errors
        return result.faults

    async def _reconcile_units(
        self,
        pods: list[PodInfo],
        listed_at: float,
        assignments: list[Assignment],
        invalid: list[str],
        tenants: dict[str, str],
    ) -> list[str]:
        # A grant counts only when it is newer than the start of this pod list (a list is a quorum read, so one that
        # started after a grant shows its pod, unless the pod is already gone). Once such a list exists, the lists
        # decide: a pod that finished, or was deleted before any list saw it, frees its MIG room and GPU mode at
        # once, as the scheduler frees its share. (Counting grants until a list *showed* their pod kept a GPU out of
        # MIG mode for the whole grace period after a pod that ran, finished and was deleted between two lists.)
        recent = tuple(g for g in self.allocator.recent_grants() if g.at >= listed_at)
        desired = self._desired(assignments, invalid, tenants)
        granted_mps: dict[DaemonKey, MpsLimits] = {}
        for g in recent:
            desired.mig |= g.mig
            for gpu in g.non_mig_gpus:
                desired.non_mig_users.setdefault(gpu, set()).add(f"pod {g.pod_key} (just granted)")
            for key, limits in g.mps:
                granted_mps[key] = limits.union(granted_mps.get(key))
        errors = list(self.mig.reconcile(desired.mig, desired.non_mig_users).errors)
        instances: dict[MigNeed, str] = {}
        for d in self.backend.devices():
            if not d.mig_enabled:
                continue
            try:
                instances |= {MigNeed(d.index, i.start, i.profile): i.uuid for i in self.backend.mig_instances(d.index)}
            except BackendError as e:  # a lost GPU: the others are still served
                errors.append(f"GPU {d.index}: cannot list MIG instances: {e}")
        # Each daemon's limits: the largest of its tenant's shares on the unit, each capped against the others.
        mps_limits: dict[DaemonKey, MpsLimits] = {}
        for (place, tenant), held in sorted(desired.mps.items(), key=lambda kv: str(kv[0])):
            if isinstance(place, MigNeed):
                if place not in instances:
                    errors.append(f"GPU {place.gpu_index}: no {place.profile} instance at slot {place.start} for MPS")
                    continue
                unit = instances[place]
            else:
                unit = place
            together = sum(s.compute_milli for s in held)
            key = DaemonKey(unit, tenant)
            for s in held:
                mps_limits[key] = MpsLimits.of_share(s.compute_milli, s.memory_mib, together).union(mps_limits.get(key))
        for key, limits in granted_mps.items():
            mps_limits[key] = limits.union(mps_limits.get(key))
        errors += await self.mps.reconcile(
            set(mps_limits), mps_limits, holders=self._mps_holders(assignments, pods, instances)
        )
        # Forget a pod's allocations only when two lists in a row lack it and no recent grant is its: a list
        # that predates the pod (or lags behind it) must not make its containers allocatable again.
        keep = {p.uid for p in pods} | {g.pod_uid for g in recent}
        absent = self.state.known_pods() - keep
        for name in self.state.forget_pods(absent & self._absent_before):
            try:
                self.allocator.cdi.remove_allocation(name)
            except CdiError as e:
                errors.append(str(e))
        self._absent_before = absent
        return errors

    @staticmethod
    def _mps_holders(
        assignments: list[Assignment], pods: list[PodInfo], instances: dict[MigNeed, str]
    ) -> dict[str, set[str]]:
        """Per GPU or MIG instance (``instances``: the node's, by place), the UIDs of the live pods assigned an MPS
        share there: a unit's legacy daemon (:meth:`~sharegpu.node.mps.MpsManager.recover`) is kept while one it
        served before the upgrade is among them."""
        uid_of = {p.key: p.uid for p in pods if not p.finished}
        out: dict[str, set[str]] = {}
        for a in assignments:
            for s in a.shares:
                if a.pod not in uid_of or s.sharing is not Mechanism.MPS:
                    continue
                unit = s.gpu_uuid if s.mig is None else instances.get(MigNeed(s.gpu_index, s.mig.start, s.mig.profile))
                if unit is not None:
                    out.setdefault(unit, set()).add(uid_of[a.pod])
        return out

    async def _drop_orphan_specs(self) -> None:
        """CDI specs of device-plugin allocations that the state does not know (a pod gone while the agent was down,
        or a state moved away) are removed; a running container keeps what was applied to it."""
        async with self.allocator.lock:
            cdi = self.allocator.cdi
            for name in cdi.allocation_names() - self.state.all_cdi_specs():
                try:
                    cdi.remove_allocation(name)
                except CdiError as e:
                    log.warning("%s", e)

    def _assignments(self, pods: list[PodInfo]) -> tuple[list[Assignment], list[str]]:
        out: list[Assignment] = []
        invalid: list[str] = []
        for p in pods:
            text = p.annotations.get(ASSIGNMENT_ANNOTATION)
            if text is None:
                continue
            try:
                a = Assignment.from_json(text)
            except InvalidAssignment as e:
                invalid.append(f"pod {p.key}: {e}")
                continue
            if a.node != self.config.node_name or a.pod != p.key:
                invalid.append(f"pod {p.key}: its assignment is for {a.pod} on node {a.node}; ignored")
                continue
            out.append(a)
        for message in invalid:
            log.warning("%s", message)
        return out, invalid

    def _desired(self, assignments: list[Assignment], invalid: list[str], tenants: dict[str, str]) -> _Desired:
        by_index = {d.index: d for d in self.backend.devices()}
        want = _Desired()
        for a in assignments:
            for s in a.shares:
                dev = by_index.get(s.gpu_index)
                if dev is None or dev.uuid != s.gpu_uuid:
                    invalid.append(f"pod {a.pod}: names GPU {s.gpu_index} ({s.gpu_uuid}), which this node lacks")
                    continue
                place: str | MigNeed = s.gpu_uuid
                if s.mig is not None:
                    place = MigNeed(s.gpu_index, s.mig.start, s.mig.profile)
                    want.mig.add(place)
                else:
                    want.non_mig_users.setdefault(s.gpu_index, set()).add(f"pod {a.pod}")
                if s.sharing is Mechanism.MPS and a.pod in tenants:
                    want.mps.setdefault((place, tenants[a.pod]), []).append(s)
        return want

    def _gpu_fraction(self, gpu_index: int, profile: str | None) -> float:
        if profile is None:
            return 1.0
        try:
            model = self.catalog.get(next(d.model for d in self.backend.devices() if d.index == gpu_index))
            return model.profile(profile).compute_slices / model.compute_slices
        except (StopIteration, ValueError, ZeroDivisionError):
            return 0.0

    def _snapshot(
        self,
        pods: list[PodInfo],
        assignments: list[Assignment],
        readings: list[GpuReading],
        views: dict[int, tuple[ProcView, ...]],
        invalid: int,
        errors: int,
    ) -> MetricsSnapshot:
        by_uid = {p.uid: p for p in pods}
        gpus: list[GpuSample] = []
        usage: list[PodUsage] = []
        mig: list[MigSample] = []
        units: list[MpsUnitUsage] = []
        for r in readings:
            d = r.device
            gpus.append(
                GpuSample(
                    d.index,
                    d.uuid,
                    d.model,
                    d.healthy,
                    d.mig_enabled,
                    d.memory_mib,
                    r.memory_used_mib,
                    r.utilization.gpu_percent,
                    r.utilization.memory_percent,
                )
            )
            mig += [MigSample(d.index, i.uuid, i.profile, i.start, self.mig.is_managed(i.uuid)) for i in r.instances]
            # Unknown, not 0, after an NVML error, and where a GPU in MIG mode kept no figures (GpuReading.sm_known).
            rows, mps_units = pod_usage(views[d.index], r.sm_percent, by_uid, r.sm_known)
            units += mps_units
            for row in rows:
                owner = by_uid[row.pod_uid]
                usage.append(
                    PodUsage(owner.namespace, owner.name, d.index, row.unit_uuid, row.memory_mib, row.sm_percent)
                )
        shares = [
            ShareSample(
                a.pod.split("/", 1)[0],
                a.pod.split("/", 1)[-1],
                s.gpu_index,
                s.gpu_uuid,
                f"{s.mig.profile}@{s.mig.start}" if s.mig else "gpu",
                s.sharing.value,
                s.memory_mib,
                s.compute_milli,
                s.memory_enforced,
                s.compute_enforced,
                self._gpu_fraction(s.gpu_index, s.mig.profile if s.mig else None),
            )
            for a in assignments
            for s in a.shares
        ]
        return MetricsSnapshot(
            self.config.node_name,
            tuple(gpus),
            tuple(usage),
            tuple(shares),
            tuple(mig),
            self.mps.status(),
            invalid,
            errors,
            tuple(units),
            tuple(self.watch.active.values()),
            self.watch.counts(),
        )
