"""Steering the kube-scheduler's placement of DRA pods: the extender's ``/dra/filter`` leaves it sharegpu's node.

On the DRA path the kube-scheduler allocates the claims itself (its DynamicResources plugin: first fit on the
chosen node) and, left alone, picks the node by cpu and memory only (LeastAllocated spreads). With steering on,
the chart's scheduler profile calls a second extender entry, ``<extender>/dra``, with a filter verb only and no
``managedResources`` (so the kube-scheduler calls it for every pod of the profile: an extender with managed
resources is called only for pods whose containers ask one of them, and a DRA pod asks none). Its filter returns
the one candidate node that the ``dra-steered`` policy picks (:mod:`sharegpu.placement.dra_steer`): sharegpu's
score of the device the allocator's first fit takes there. Filter rather than prioritize: an extender's 0–10 score
would be quantised, and LeastAllocated would still spread among the ties.

Verified on the rig (Kubernetes v1.36.2): the binding extender (the first entry, with managedResources) is not
called at all for such a pod, so the default binder binds it; the kube-scheduler's DRA plugin allocates the claim
on the node the filter left (and has written the allocation before any bind). Nothing here binds or reserves.

What the filter knows is the cluster view's DRA ledger (:mod:`sharegpu.k8s.cache.dra_ledger`), derived by the view's
one informer from the driver's ResourceSlices (the GPUs of every DRA node), allocated ResourceClaims (what their
devices hold), Nodes (allocatable cpu and memory) and the pods bound to DRA nodes (their cpu and memory). A pod
steered but whose claim is not yet seen allocated is *held* on its node for a few seconds (a typed entry of the
view's assume cache), so that the next pods' filters count it (the scheduler allocates on its own, asynchronously).

The filter never makes a pod unschedulable: every node it is given already passed the kube-scheduler's own DRA
filter, and when steering cannot judge the pod (no sharegpu claim, several requests, claims not yet seen,
state not synced) it passes every node and the stock placement applies.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

from sharegpu.k8s.cache.dra_ledger import DraLedger
from sharegpu.k8s.dra_objects import claim_tenant, claimed_mib, claimed_percent
from sharegpu.k8s.pod_request import PERCENT_MILLI, cpu_and_memory
from sharegpu.kube.schema import Pod, ResourceClaim
from sharegpu.model.assignment import Assignment
from sharegpu.model.contract import ATTR_PROFILE, MIG_CLASS, SHARED_CLASS, WHOLE_CLASS
from sharegpu.model.request import GpuRequest, InvalidRequest, Sharing
from sharegpu.model.tenant import TenantConflict, own_tenant
from sharegpu.placement.dra_steer import beyond_cap, dra_steered_policy
from sharegpu.placement.fragmentation import Workload, workload_drifted
from sharegpu.placement.framework import Scheduler

log = logging.getLogger(__name__)

STEERED_CLASSES = (SHARED_CLASS, WHOLE_CLASS, MIG_CLASS)
# The profile a MIG claim selects: a CEL selector on the device's ``profile`` attribute, as docs/dra.md shows.
_PROFILE_SELECTOR = re.compile(rf"""\.{ATTR_PROFILE}\s*==\s*["']([^"']+)["']""")
HOLD_S = 10.0  # how long a steered pod's choice counts before its claim is seen allocated


class NotSteered(Exception):
    """Steering cannot judge this pod; the message says why (the stock placement applies)."""


# ----- reading the objects ---------------------------------------------------------------------------------------
def claim_names(pod: Pod) -> list[str]:
    """The ResourceClaims a pod uses, by name (:meth:`Pod.claim_name`). Raises :class:`NotSteered` while one made
    from a template is not made yet."""
    out = []
    for rc in pod.spec.resource_claims:
        name = pod.claim_name(rc)
        if not name:
            if rc.resource_claim_template_name:
                raise NotSteered(f"the claim of {rc.name!r} is not made from its template yet")
            continue
        out.append(name)
    return out


def claim_request(key: str, claims: Iterable[ResourceClaim], cpu_milli: int, host_memory_mib: int) -> GpuRequest:
    """The pod's GPU ask as a :class:`GpuRequest`, from its claims' device requests. Steered: exactly one request,
    of a shared-GPU class (``capacity.requests`` memory and compute, per device; one left out is the whole
    capacity, as the driver's request policy defaults say) or of the whole-GPU class, ExactCount."""
    requests = [r for c in claims for r in c.spec.devices.requests]
    if not requests:
        raise NotSteered("its claims request no device")
    if len(requests) > 1:
        raise NotSteered("its claims hold several device requests (steering handles one)")
    (r,) = requests
    exact = r.exactly
    if exact is None:
        raise NotSteered("its device request is not 'exactly' (firstAvailable is not steered)")
    cls = exact.device_class_name
    if cls not in STEERED_CLASSES:
        raise NotSteered(f"device class {cls!r} is not one of {', '.join(STEERED_CLASSES)}")
    if exact.allocation_mode != "ExactCount":
        raise NotSteered("allocationMode All is not steered")
    count = exact.count or 1
    asked = exact.capacity.requests if exact.capacity is not None else {}
    try:
        if cls == MIG_CLASS:
            profiles = {
                m.group(1)
                for sel in exact.selectors
                for m in [_PROFILE_SELECTOR.search(sel.cel.expression if sel.cel is not None else "")]
                if m is not None
            }
            if len(profiles) != 1:
                raise NotSteered("a MIG claim is steered when one CEL selector names its profile")
            (profile,) = profiles
            return GpuRequest(
                key,
                count,
                mig_profile=profile,
                sharing=Sharing.MIG,
                cpu_milli=cpu_milli,
                host_memory_mib=host_memory_mib,
            )
        if cls == WHOLE_CLASS or not asked:
            return GpuRequest(key, count, cpu_milli=cpu_milli, host_memory_mib=host_memory_mib)
        # Asks, rounded up: the scheduler rounds a claim's ask up to the device's step (1Mi, 1 percent), and the
        # extender rounds a pod's the same way, so both paths model a "10G" share as 9537 MiB.
        memory = claimed_mib(asked)
        compute = claimed_percent(asked) * PERCENT_MILLI
        return GpuRequest(
            key, count, compute_milli=compute, memory_mib=memory, cpu_milli=cpu_milli, host_memory_mib=host_memory_mib
        )
    except InvalidRequest as e:
        raise NotSteered(f"its request cannot be modelled: {e}") from None


def request_tenant(pod: Pod, claims: Iterable[ResourceClaim]) -> str:
    """The MPS tenant the pod's claim would be prepared into (:func:`~sharegpu.k8s.dra_objects.claim_tenant`): the
    pod's, as a user of the claim that holds the device request, else the claim's own, as the node's driver decides.
    Raises :class:`NotSteered` when the containers that use it declare different UIDs (the driver refuses it)."""
    for c in claims:
        if not c.spec.devices.requests:
            continue
        try:
            tenant = claim_tenant(pod, c.metadata.name)
        except TenantConflict as e:
            raise NotSteered(str(e)) from None
        return tenant if tenant is not None else own_tenant(c.metadata.uid or c.key)
    raise NotSteered("its claims request no device")


@dataclass(frozen=True, slots=True)
class Steer:
    """The filter's answer: the node(s) to keep, and why (for the log)."""

    keep: list[str]
    why: str
    assignment: Assignment | None = None


class DraSteering:
    """The ``dra-steered`` decision over the cluster cache's DRA ledger. It owns its scheduler (and the scheduler's
    per-node memo), kept until the ledger is rebuilt or the claims seen drift from those its workload was taken at."""

    def __init__(self, dra: DraLedger, seed: int = 0, hold_s: float = HOLD_S) -> None:
        self.dra = dra
        self.seed = seed
        self.hold_s = hold_s
        self._scheduler: tuple[Scheduler, int] | None = None  # and the claim count its workload was taken at

    def scheduler(self, req: GpuRequest, workload: Workload | None) -> Scheduler:
        led = self.dra.ledger()
        n = self.dra.allocated()
        kept = self._scheduler
        if kept is not None and kept[0].ledger is led and (workload is not None or not workload_drifted(kept[1], n)):
            return kept[0]
        shapes = workload or Workload.from_requests([*self.dra.requests(), req])
        sched = Scheduler(led, dra_steered_policy(shapes), self.seed)
        self._scheduler = (sched, n)
        return sched

    def steer(self, pod: Pod, candidates: list[str], workload: Workload | None = None, synced: bool = True) -> Steer:
        """The candidates to keep for ``pod``: the ``dra-steered`` pick, or all of them (and why) when steering
        cannot judge the pod (``synced`` False: the cluster cache lost the API server)."""
        if not pod.spec.resource_claims:
            return Steer(candidates, "no resource claims")
        if not synced:
            return Steer(candidates, "DRA state not synced")
        try:
            names = claim_names(pod)
            ns = pod.metadata.namespace
            claims = []
            for name in names:
                c = self.dra.claims.get(f"{ns}/{name}")
                if c is None:
                    raise NotSteered(f"claim {ns}/{name} not seen yet")
                claims.append(c)
            cpu, mem = cpu_and_memory(pod)
            req = replace(claim_request(pod.key, claims, cpu, mem), tenant=request_tenant(pod, claims))
        except NotSteered as e:
            return Steer(candidates, str(e))
        uid = pod.metadata.uid or pod.key
        self.dra.drop_hold(uid)  # scheduled again: its earlier choice must not count against it
        sched = self.scheduler(req, workload)
        led = sched.ledger
        ok, usable = sched.feasible(req)
        idx = np.array([led.index.get(n, -1) for n in candidates], dtype=np.int64)
        known = idx[idx >= 0]
        cand = np.unique(known[ok[known]])
        if len(cand) == 0:
            # Why, as the extender says it (e.g. the GPUs with room already run the most MPS daemons a GPU may).
            why = sched.explain(req, usable).reason
            return Steer(candidates, f"no candidate fits in sharegpu's model of the DRA nodes: {why}")
        beyond = beyond_cap(led, req, usable, cand)
        if beyond.all():
            return Steer(
                candidates,
                f"on every candidate the allocator's first fit is a GPU that already runs "
                f"{led.tenancy.daemons_per_unit} MPS daemon(s), the most a GPU may, none of this pod's tenant",
            )
        cand = cand[~beyond]
        state = sched.cycle(req, usable)
        best = sched.pick(cand, sched.scores(state, cand))
        a = sched.assignment_on(state, best)
        self.dra.hold(uid, a, tuple(f"{ns}/{n}" for n in names), time.monotonic() + self.hold_s)
        return Steer([led.nodes[best].name], f"dra-steered pick among {len(cand)} node(s)", a)
