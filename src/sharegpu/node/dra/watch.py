"""The DRA driver's enforcement audit and MPS fault telling: the node agent's (issue 33), on the claims prepared here.

Every pass of the service (:mod:`sharegpu.node.dra.service`) reads each GPU once (:func:`sharegpu.node.watch.read_gpus`:
each process tied to its pod, each MPS client to the daemon it reaches) and runs the agent's own pass on it
(:class:`~sharegpu.node.watch.NodeWatch`): :func:`~sharegpu.node.audit.audit` finds a process on a unit its pod holds no
claim of, an MPS client outside its daemon or at another tenant's, memory above the claim's share, a process of no pod
(told on the Node); the pod of ``sharegpu bench``'s Job in sharegpu's namespace, holding no claim, is not audited; the
MPS fault watch finds the daemons whose clients died of a fault; both are told as the agent tells them (a Warning Event
on each pod concerned, posted as ``sharegpu-dra-driver``, counters, an eviction where ``--evict-on-audit`` asks for
it), and a daemon whose clients died is checked and restarted if it no longer answers (under the driver's lock).

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
from sharegpu.node.audit import Finding, FindingKind, UnitShare
from sharegpu.node.dra.claims import ClaimPlan
from sharegpu.node.dra.driver import DraDriver, claim_tenant
from sharegpu.node.dra.kube import FIELD_MANAGER
from sharegpu.node.enforcement import NodeEvents, PodNotifier
from sharegpu.node.kube import pod_info
from sharegpu.node.watch import NodeWatch, WatchResult, read_gpus

log = logging.getLogger(__name__)

COMPONENT = FIELD_MANAGER  # the driver's Events name it, as its writes do ("sharegpu-dra-driver")


@dataclass(frozen=True, slots=True)
class ClaimUse:
    """What the prepared claims give the node's pods, as the audit and the fault watch read it."""

    shares: Mapping[str, tuple[UnitShare, ...]]  # pod UID → the units of the prepared claims its containers use
    tenants: Mapping[str, str]  # pod UID → the tenant of the MPS daemon its claims reach (pods with one such tenant)
    findings: tuple[Finding, ...] = ()  # pods whose MPS claim was prepared into another tenant's daemon
    # pod UID → the UIDs of its prepared MPS claims: the holders the driver names to its MpsManager (a unit's legacy
    # daemon serves the pods of the claims prepared into it before an upgrade)
    claims: Mapping[str, frozenset[str]] = field(default_factory=dict)


def claim_use(pods: Iterable[Pod], claims: Iterable[tuple[ClaimPlan, tuple[str, ...]]], multi_user: bool) -> ClaimUse:
    """Each pod's units from the prepared ``claims`` (each with the unit UUID of each device) its containers use.

    A claim is the pod's when one of its ``spec.resourceClaims`` entries names it (directly or through its template's
    claim in the pod's status) and a container uses that entry: the kubelet gives a claim's devices only to those.
    """
    by_name = {(p.namespace, p.name): (p, units) for p, units in claims}
    shares: dict[str, tuple[UnitShare, ...]] = {}
    tenants: dict[str, set[str]] = {}
    findings: list[Finding] = []
    mps_claims: dict[str, set[str]] = {}
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
                mps_claims.setdefault(uid, set()).add(plan.uid)
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
    return ClaimUse(shares, one, tuple(findings), {uid: frozenset(c) for uid, c in mps_claims.items()})


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


class DraWatch:
    """The audit and the MPS fault watch of a DRA node: the node agent's (:class:`~sharegpu.node.watch.NodeWatch`),
    with its pods' shares taken from the driver's prepared claims."""

    def __init__(
        self,
        driver: DraDriver,
        notifier: PodNotifier | None,
        *,
        evict: bool = False,
        namespace: str = "",
        node_events: NodeEvents | None = None,
    ) -> None:
        """``notifier`` posts the Events (and evictions), as :data:`COMPONENT`; without it they are logged and
        counted only. ``node_events`` posts the Event of a process of no pod on the driver's Node (where a notifier
        is given, as the agent does); ``namespace``: sharegpu's own, where the pod of ``sharegpu bench``'s Job is
        recognised and not audited (empty: nowhere)."""
        self.driver = driver
        self.notifier = notifier
        self.node_watch = NodeWatch(
            driver.backend,
            driver.mps,
            notifier,
            component=COMPONENT,
            node=driver.node_name,
            node_events=node_events,
            evict=evict,
            namespace=namespace,
            lock=driver.lock,  # Prepare and Unprepare change the daemons too
        )
        self.watch = self.node_watch.enforcement

    async def check(self, pods: Iterable[Pod]) -> WatchResult:
        """One pass over ``pods`` (the node's, as listed now): audit, fault watch, telling."""
        # A finished pod holds nothing any more: a process still tied to it is no pod's.
        alive = [p for p in pods if not p.finished and p.metadata.uid]
        mps, checkpoint = self.driver.mps, self.driver.checkpoint
        use = claim_use(alive, [(p, checkpoint.units[uid]) for uid, p in checkpoint.claims.items()], mps.multi_user)
        readings, views = read_gpus(self.driver.backend, mps)
        live = [pod_info(p) for p in alive]
        result = await self.node_watch.check(
            readings, views, live, use.shares, use.tenants, use.findings, holders=use.claims
        )
        for message in result.errors:
            log.warning("%s", message)
        return result
