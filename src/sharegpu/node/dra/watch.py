"""The DRA driver's enforcement audit and MPS fault telling: the node agent's (issue 33), on the claims prepared here.

Every pass of the service (:mod:`sharegpu.node.dra.service`) reads each GPU once (:func:`sharegpu.node.audit.read_gpu`;
:func:`~sharegpu.node.audit.attribute` ties each process to its pod and each MPS client to the daemon it reaches) and
holds the processes against what the prepared claims give the node's pods, with the agent's own code:
:func:`~sharegpu.node.audit.audit` finds a process on a unit its pod holds no claim of, an MPS client outside its
daemon or at another tenant's, memory above the claim's share, a process of no pod; the MPS fault watch
(:class:`~sharegpu.node.mps_faults.MpsLogWatch` over each daemon's logs, :class:`~sharegpu.node.mps_faults.ServerWatch`,
the backend's Xid events) finds the daemons whose clients died of a fault; :class:`~sharegpu.node.enforcement.
EnforcementWatch` tells both as the agent does (a Warning Event on each pod concerned, counters, an eviction where
``--evict-on-audit`` asks for it), and a daemon whose clients died is checked and restarted if it no longer answers.

What differs from the agent is only where a pod's shares come from: the prepared claims its containers use (the
checkpoint's devices and units), not an assignment annotation; and the daemon a pod reaches is its claim's. One more
finding exists on this path alone: the kubelet prepares a claim once and gives a pod that joins it later the devices
prepared for the first ones, without asking the driver again, so a pod of another tenant can join an MPS claim after
its Prepare. It is told from the pods' specs (an ``mps-other-tenant`` finding without pids): its clients reach a
daemon of another tenant, where they wait while that server serves another Unix user, and share its fault domain.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from sharegpu.kube.schema import Pod
from sharegpu.model.assignment import Mechanism
from sharegpu.model.tenant import MULTI_USER_TENANT, TenantConflict, describe
from sharegpu.node.audit import (
    Finding,
    FindingKind,
    GpuReading,
    ProcView,
    Role,
    UnitShare,
    attribute,
    audit,
    read_gpu,
)
from sharegpu.node.backends.base import BackendError
from sharegpu.node.dra.claims import ClaimPlan
from sharegpu.node.dra.driver import DraDriver, claim_tenant
from sharegpu.node.enforcement import EnforcementWatch, MpsFault, PodNotifier
from sharegpu.node.kube import PodInfo, pod_info
from sharegpu.node.mps import DaemonKey, MpsError
from sharegpu.node.mps_faults import MpsLogWatch, ServerWatch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ClaimUse:
    """What the prepared claims give the node's pods, as the audit and the fault watch read it."""

    shares: Mapping[str, tuple[UnitShare, ...]]  # pod UID → the units of the prepared claims its containers use
    tenants: Mapping[str, str]  # pod UID → the tenant of the MPS daemon its claims reach (pods with one such tenant)
    findings: tuple[Finding, ...] = ()  # pods whose MPS claim was prepared into another tenant's daemon


def claim_use(pods: Iterable[Pod], claims: Iterable[tuple[ClaimPlan, tuple[str, ...]]], multi_user: bool) -> ClaimUse:
    """Each pod's units from the prepared ``claims`` (each with the unit UUID of each device) its containers use.

    A claim is the pod's when one of its ``spec.resourceClaims`` entries names it (directly or through its template's
    claim in the pod's status) and a container uses that entry: the kubelet gives a claim's devices only to those.
    """
    by_name = {(p.namespace, p.name): (p, units) for p, units in claims}
    shares: dict[str, tuple[UnitShare, ...]] = {}
    tenants: dict[str, set[str]] = {}
    findings: list[Finding] = []
    for pod in pods:
        uid, ns = pod.metadata.uid, pod.metadata.namespace
        held: list[UnitShare] = []
        for entry in pod.spec.resource_claims:
            name = pod.claim_name(entry)
            found = by_name.get((ns, name)) if name else None
            if found is None or name is None or not pod.claim_containers(name):
                continue
            plan, units = found
            for d, unit in zip(plan.devices, units, strict=True):
                label = f"GPU {d.gpu_index}" + (f" MIG {d.mig_profile}@{d.mig_start}" if d.on_mig else "")
                held.append(UnitShare(unit, d.gpu_index, d.mechanism, d.memory_mib, label))
                if d.mechanism is not Mechanism.MPS:
                    continue
                tenants.setdefault(uid, set()).add(plan.tenant)
                if not multi_user and (why := _other_tenant(pod, plan)):
                    findings.append(
                        Finding(
                            FindingKind.MPS_OTHER_TENANT,
                            d.gpu_index,
                            unit,
                            ns,
                            pod.metadata.name,
                            uid,
                            (),
                            why,
                        )
                    )
        if held:
            shares[uid] = tuple(dict.fromkeys(held))  # a claim named by two entries counts once
    one = {uid: next(iter(ts)) for uid, ts in tenants.items() if len(ts) == 1}
    return ClaimUse(shares, one, tuple(findings))


def _other_tenant(pod: Pod, plan: ClaimPlan) -> str:
    """Why ``pod`` must not be a client of the daemon ``plan`` was prepared into ("" when it may)."""
    try:
        own = claim_tenant(pod, plan.name)
    except TenantConflict as e:
        return f"this pod uses MPS claim {plan.key}, prepared into the MPS daemon of {describe(plan.tenant)}, and {e}"
    if own is None or own == plan.tenant or plan.tenant == MULTI_USER_TENANT:
        return ""
    return (
        f"this pod ({describe(own)}) uses MPS claim {plan.key}, which was prepared into the MPS daemon of "
        f"{describe(plan.tenant)} before this pod joined it; the kubelet gives a claim's later pods the devices "
        "prepared for its first, so this pod's MPS clients reach that daemon: they share its server and fault domain "
        "with another tenant and, as another Unix user, wait until its other clients have exited. Give the pod a "
        "claim of its own (a ResourceClaimTemplate), or the runAsUser of the claim's other pods"
    )


@dataclass(slots=True)
class WatchResult:
    findings: tuple[Finding, ...] = ()
    faults: tuple[MpsFault, ...] = ()
    errors: list[str] = field(default_factory=list)


class DraWatch:
    """The audit and the MPS fault watch of a DRA node: what :class:`~sharegpu.node.agent.NodeAgent` runs after each
    reconcile, with its pods' shares taken from the driver's prepared claims."""

    def __init__(self, driver: DraDriver, notifier: PodNotifier | None, *, evict: bool = False) -> None:
        """``notifier`` posts the Events (and evictions); without it they are logged and counted only."""
        self.driver = driver
        self.notifier = notifier
        self.watch = EnforcementWatch(notifier, evict=evict)
        self.mps_logs = MpsLogWatch()
        self.mps_servers = ServerWatch()
        self._sharers_before: dict[DaemonKey, dict[str, PodInfo]] = {}  # daemon → its pods, last pass
        self._daemons_before: dict[DaemonKey, int] = {}

    def read(self) -> tuple[list[GpuReading], dict[int, tuple[ProcView, ...]]]:
        """Every GPU read once, and its processes with their roles, pods and daemons; a GPU that cannot be read is
        left out with a warning."""
        backend, mps = self.driver.backend, self.driver.mps
        readings: list[GpuReading] = []
        for d in backend.devices():
            try:
                readings.append(read_gpu(backend, d))
            except BackendError as e:
                log.warning("GPU %d: cannot sample: %s", d.index, e)

        def daemon_of(pid: int) -> DaemonKey | None:
            return mps.daemon_of_pipe(backend.mps_pipe_dir(pid))

        views = {r.device.index: attribute(r, backend.pod_uid_of, backend.process_name, daemon_of) for r in readings}
        return readings, views

    async def check(self, pods: Iterable[Pod]) -> WatchResult:
        """One pass over ``pods`` (the node's, as listed now): audit, fault watch, telling."""
        # A finished pod holds nothing any more: a process still tied to it is no pod's.
        alive = [p for p in pods if not p.finished and p.metadata.uid]
        driver, mps = self.driver, self.driver.mps
        checkpoint = driver.checkpoint
        use = claim_use(alive, [(p, checkpoint.units[uid]) for uid, p in checkpoint.claims.items()], mps.multi_user)
        readings, views = self.read()
        live = {p.metadata.uid: pod_info(p) for p in alive}
        procs = [p for r in readings for p in views[r.device.index]]
        known = {r.device.index: r.mps_clients is not None for r in readings}
        found = {f.key: f for f in audit(procs, live, use.shares, known, use.tenants)}
        found |= {f.key: f for f in use.findings}
        await self.watch.findings(found.values())
        result = WatchResult(tuple(found.values()))

        # The MPS fault watch, per daemon: the agent's (NodeAgent._enforce), on the daemons the claims reach.
        sharers_now: dict[DaemonKey, dict[str, PodInfo]] = {}
        daemons_now: dict[DaemonKey, int] = {}
        for uid, held in use.shares.items():
            if uid not in use.tenants:
                continue
            for s in held:
                if s.sharing is Mechanism.MPS:
                    key = mps.key(s.unit_uuid, use.tenants[uid])
                    sharers_now.setdefault(key, {})[uid] = live[uid]
                    daemons_now[key] = s.gpu_index
        # Pods whose clients just died may be finished already: those of the last pass are told too.
        daemons = self._daemons_before | daemons_now
        sharers = {k: [*(self._sharers_before.get(k, {}) | sharers_now.get(k, {})).values()] for k in daemons}
        self._sharers_before, self._daemons_before = sharers_now, daemons_now
        running = mps.running()
        log_dirs = {}
        for k in set(daemons) | running:
            try:
                log_dirs[k] = mps.spec_of(k).log_dir
            except MpsError:
                continue
        servers: dict[DaemonKey, list[int]] = {}
        for p in procs:
            if p.role is not Role.SERVER:
                continue
            key_of = p.daemon
            if key_of is None:  # its pipe directory unread: the unit's one daemon, where it runs one
                here = [k for k in running if k.unit_uuid == p.unit_uuid]
                key_of = here[0] if len(here) == 1 else None
            if key_of is not None:
                servers.setdefault(key_of, []).append(p.pid)
        signals = self.mps_logs.scan(log_dirs) + self.mps_servers.update(servers, running, daemons)
        try:
            xids = driver.backend.xid_events()
        except BackendError as e:
            log.warning("cannot read Xid events: %s", e)
            xids = ()
        faults = await self.watch.faults(signals, xids, daemons, sharers)
        result.faults = tuple(faults)
        async with driver.lock:  # Prepare and Unprepare change the daemons too
            for f in faults:
                if f.daemon not in mps.running():
                    continue
                try:
                    # A daemon that no longer answers is restarted with the limits it enforced; a healthy one keeps
                    # its state: its server serves the next client once the faulting clients have exited.
                    await mps.ensure(f.unit_uuid, f.tenant, mps.limits(f.daemon))
                except MpsError as e:
                    result.errors.append(f"after a fault on {f.daemon}: {e}")
        for message in result.errors:
            log.warning("%s", message)
        return result
