"""Why each pending pod waits: one judgement, shown by ``sharegpu status``, counted by the extender's metrics
(``sharegpu_cluster_pending_pods``), and the candidate rule of preemption and consolidation (a pod that waits for GPU
room).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.pod_request import asks_for_sharegpu, pod_request
from sharegpu.model.request import GpuRequest, InvalidRequest
from sharegpu.placement.framework import Scheduler
from sharegpu.placement.policies import PolicyContext, make_policy
from sharegpu.placement.reasons import PENDING_REASONS, ReasonKind

# The values of the ``reason`` label of sharegpu_cluster_pending_pods, most actionable first (docs/metrics.md).
REASON_CLASSES = tuple(r.value for r in PENDING_REASONS)
# The framework's kinds of node reasons, nearest miss first: a pending pod waits for the first that any node gives.
_NEAREST_MISS_FIRST = (
    ReasonKind.GPU_ROOM,
    ReasonKind.HOST_MEMORY,
    ReasonKind.CPU,
    ReasonKind.NO_ALLOWED_MODEL,
    ReasonKind.NO_GPUS,
)


@dataclass(frozen=True, slots=True)
class PendingPod:
    pod: str  # namespace/name
    reason: ReasonKind  # one of PENDING_REASONS
    detail: str  # the words a user can act on (the framework's summary over all nodes)


def pending_pods(view: ClusterView) -> list[PendingPod]:
    """Pods that ask for sharegpu and are neither bound nor reserved, each with why it waits now.

    Judged on the ledger as it is (the same filter the extender runs), so the reason is current even where the
    pod's last FailedScheduling event is old. Pods of one request shape are judged once.
    """
    led = view.ledger
    sched: Scheduler | None = None
    judged: dict[GpuRequest, tuple[ReasonKind, str]] = {}
    out = []
    for pod in view.pods():
        if pod.spec.node_name or pod.finished or pod.metadata.deletion_timestamp:
            continue
        key = pod.key
        if key in led.assignments:
            continue  # reserved: a bind is in flight
        req = view.request(key)  # parsed once, when the view took the pod in
        if req is None:
            if not asks_for_sharegpu(pod):
                continue
            try:
                req = pod_request(pod, view.catalog)  # only an invalid request lands here: say why
            except InvalidRequest as e:
                out.append(PendingPod(key, ReasonKind.INVALID_REQUEST, str(e)))
                continue
            if req is None:
                continue
        shape = dataclasses.replace(req, name="")
        if shape not in judged:
            if sched is None:
                # Feasibility and reasons do not depend on the policy: a policy-free scheduler leaves the
                # extender's own (and its caches) untouched.
                sched = Scheduler(led, make_policy("bestfit", PolicyContext()))
            judged[shape] = _judge(sched, shape)
        reason, detail = judged[shape]
        out.append(PendingPod(key, reason, detail))
    out.sort(key=lambda p: p.pod)
    return out


def _judge(sched: Scheduler, req: GpuRequest) -> tuple[ReasonKind, str]:
    ok, usable = sched.feasible(req)
    if ok.any():
        return ReasonKind.FITS, f"{int(ok.sum())} node(s) have room for it now"
    why = sched.explain(req, usable)
    for kind in _NEAREST_MISS_FIRST:
        if kind in why.kinds:
            return kind, why.reason
    return ReasonKind.NO_GPUS, why.reason  # no sharegpu node at all
