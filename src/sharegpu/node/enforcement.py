"""Telling people what the audit and the fault signals found: Kubernetes Events, counters, and (if asked) evictions.

:class:`EnforcementWatch` runs once per pass (:class:`~sharegpu.node.watch.NodeWatch`, of the node agent or the DRA
driver) on what was read. A finding (:mod:`sharegpu.node.audit`) gets a Warning Event on its pod when it first appears,
not on every pass while it persists; once gone, a recurrence is told again; a process of no pod gets one on the Node
instead, with what to do. With ``evict`` (``--evict-on-audit`` of ``sharegpu node-agent`` and ``sharegpu dra-driver``,
off by default) a pod with a finding is evicted through the Eviction API, which honours its PodDisruptionBudget. An MPS
fault (:mod:`sharegpu.node.mps_faults`) gets a Warning Event on every pod of the daemon whose clients it ended (a unit
runs a daemon per tenant; the others' clients run on) and one count per incident: signals of one daemon within
``fault_window_s`` of each other are one incident. Every Event names the component that posts it (:data:`COMPONENT`,
the node agent's, unless told otherwise).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from sharegpu.kube.api import PodEvent
from sharegpu.kube.errors import EvictionBlocked, KubeError, NotFound
from sharegpu.node.audit import Finding, FindingKind
from sharegpu.node.backends.base import XidEvent
from sharegpu.node.kube import PodInfo
from sharegpu.node.mps import DaemonKey
from sharegpu.node.mps_faults import FaultSignal
from sharegpu.node.xid import XidKind, classify

log = logging.getLogger(__name__)

COMPONENT = "sharegpu-node-agent"
FAULT_REASON = "GpuMpsFault"
FAULT_MESSAGE = (
    "GPU fault on the MPS server you share: a fault in one MPS client ends every client of that server (the pods of "
    "your tenant on this GPU); ask for isolation hardware (MIG) or sharing time-slicing to keep faults apart"
)
FINDING_REASONS: Mapping[FindingKind, str] = {
    FindingKind.WRONG_UNIT: "GpuAuditWrongGpu",
    FindingKind.MPS_BYPASS: "GpuAuditMpsBypassed",
    FindingKind.MPS_OTHER_TENANT: "GpuAuditMpsOtherTenant",
    FindingKind.MEMORY_OVER_SHARE: "GpuAuditMemoryOverShare",
}
EVICTED_REASON = "GpuAuditEvicted"
# A finding of no pod is told on the Node (there is no pod to tell), for the node's operator.
NODE_FINDING_REASONS: Mapping[FindingKind, str] = {FindingKind.NO_POD: "GpuAuditProcessOfNoPod"}


def no_pod_message(f: Finding) -> str:
    """A process of no pod, told on the Node: what was found, and what to do."""
    return (
        f"{f.message}; on the node, `ps -o pid,user,args -p {','.join(map(str, f.pids))}` (or nvidia-smi) shows what "
        "they are: stop them, or run that work as a pod that asks for sharegpu.io/gpu. A pod's process the agent "
        "cannot tie to its pod (/proc/<pid>/cgroup unreadable: the agent needs hostPID) is counted here too"
    )


class PodNotifier(Protocol):
    """What the watch asks of the API server (:class:`sharegpu.kube.api.LightkubeClusterApi` has both)."""

    async def create_event(self, event: PodEvent, component: str) -> None: ...

    async def evict_pod(self, namespace: str, name: str, uid: str = "") -> None: ...

    async def close(self) -> None: ...


class NodeEvents(Protocol):
    """Where Events about the Node go (:class:`sharegpu.node.kube.LightkubeApi` has it)."""

    async def create_node_event(self, node: str, reason: str, message: str, component: str) -> None: ...


@dataclass(frozen=True, slots=True)
class MpsFault:
    """One incident: an MPS daemon whose server's clients died of a fault, and the pods that shared it."""

    gpu_index: int
    unit_uuid: str
    sources: tuple[str, ...]  # log, xid, server-gone
    details: tuple[str, ...]
    pods: tuple[str, ...]  # namespace/name of every pod told
    tenant: str = ""  # the daemon's tenant

    @property
    def daemon(self) -> DaemonKey:
        return DaemonKey(self.unit_uuid, self.tenant)


@dataclass(frozen=True, slots=True)
class WatchCounts:
    """The watch's counters since the agent started, for the metrics snapshot."""

    findings: tuple[tuple[str, int, int], ...] = ()  # (kind, GPU index, new findings)
    evictions: tuple[tuple[str, int], ...] = ()  # (kind, pods evicted)
    faults: tuple[tuple[int, str, str, int], ...] = ()  # (GPU index, unit UUID, tenant, incidents)
    xids: tuple[tuple[int, str, int, int], ...] = ()  # (GPU index, unit UUID, Xid, events)


class EnforcementWatch:
    def __init__(
        self,
        notifier: PodNotifier | None,
        *,
        evict: bool = False,
        fault_window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        node: str = "",
        node_events: NodeEvents | None = None,
        component: str = COMPONENT,
    ) -> None:
        """``node_events`` (with ``node``, the node's name) posts the findings of no pod on the Node; without it
        they are logged and counted only. ``component``: who posts the Events (their source), the node agent by
        default; the DRA driver names itself."""
        self._notifier = notifier
        self.component = component
        self._node = node
        self._node_events = node_events
        self.evict = evict
        self._window = fault_window_s
        self._clock = clock
        self.active: dict[tuple[str, str, str], Finding] = {}
        self._told: set[tuple[str, str, str]] = set()
        self._evicted: set[str] = set()
        self._findings_total: Counter[tuple[str, int]] = Counter()
        self._evictions_total: Counter[str] = Counter()
        self._faults_total: Counter[tuple[int, str, str]] = Counter()
        self._xids_total: Counter[tuple[int, str, int]] = Counter()
        self._last_fault: dict[DaemonKey, float] = {}

    def counts(self) -> WatchCounts:
        return WatchCounts(
            tuple((k, g, n) for (k, g), n in sorted(self._findings_total.items())),
            tuple(sorted(self._evictions_total.items())),
            tuple((g, u, t, n) for (g, u, t), n in sorted(self._faults_total.items())),
            tuple((g, u, x, n) for (g, u, x), n in sorted(self._xids_total.items())),
        )

    async def findings(self, findings: Iterable[Finding]) -> None:
        """Take this reconcile's findings: count and tell the new ones, evict where asked, forget those gone."""
        now = {f.key: f for f in findings}
        for key, f in now.items():
            if key not in self.active:
                self._findings_total[(f.kind.value, f.gpu_index)] += 1
                log.warning(
                    "GPU audit: %s: %s%s", f.kind.value, f"pod {f.namespace}/{f.pod}: " if f.pod else "", f.message
                )
        self.active = now
        self._told &= set(now)
        todo = [f for k, f in now.items() if k not in self._told and (f.kind in FINDING_REASONS or self._on_node(f))]
        results = await asyncio.gather(*(self._tell(f) for f in todo))
        self._told |= {f.key for f, ok in zip(todo, results, strict=True) if ok}
        if self.evict:
            for f in sorted(now.values(), key=lambda f: f.key):
                if f.pod_uid and f.kind in FINDING_REASONS and f.pod_uid not in self._evicted:
                    await self._evict(f)

    async def faults(
        self,
        signals: Iterable[FaultSignal],
        xids: Iterable[XidEvent],
        daemons: Mapping[DaemonKey, int],
        sharers: Mapping[DaemonKey, Iterable[PodInfo]],
    ) -> list[MpsFault]:
        """Turn this reconcile's signals into incidents and tell every pod of each daemon.

        ``daemons``: daemon → GPU index of every daemon that pods share; ``sharers``: daemon → the pods that shared it
        (live now or at the last reconcile). A log line or a vanished server is its daemon's own sign. An Xid that
        ends no process (:mod:`sharegpu.node.xid`: Xid 45, the driver cleaning up after a process that ended, e.g. a
        deleted pod's; an Xid the table does not know) is counted and logged only. One that does names a unit (a MIG
        instance, else the whole GPU: then every daemon on the GPU), not a daemon: it is the fault of the one daemon
        there where there is one; where there are several it only adds to those with a sign of their own in this
        reconcile, and is otherwise counted and logged without telling anyone, since a fault in one tenant's client
        ends only its own daemon's clients (H200) and the Xid cannot say whose it was.
        """
        per_daemon: dict[DaemonKey, list[FaultSignal]] = {}
        for s in signals:
            if s.daemon is not None:
                per_daemon.setdefault(s.daemon, []).append(s)
        for x in xids:
            self._xids_total[(x.gpu_index, x.unit_uuid, x.xid)] += 1
            info = classify(x.xid)
            if not info.told:
                # The driver's cleanup after a process ended (Xid 45: a deleted pod), a state report, a hardware
                # condition that ends no process, or a number the table does not know: nobody's clients ended.
                level = logging.INFO if info.kind is XidKind.NOT_A_FAULT else logging.WARNING
                log.log(level, "GPU %d (%s): %s: not told to pods", x.gpu_index, x.unit_uuid, info.describe())
                continue
            log.warning("GPU %d (%s): critical %s", x.gpu_index, x.unit_uuid, info.describe())
            if x.unit_uuid.startswith("MIG-"):
                candidates = [k for k in daemons if k.unit_uuid == x.unit_uuid]
            else:
                candidates = [k for k, g in daemons.items() if g == x.gpu_index]
            if len(candidates) > 1:
                signed = [k for k in candidates if k in per_daemon]
                if not signed:
                    log.warning(
                        "critical %s on GPU %d names %s, where %d MPS daemons run and none shows a fault of its "
                        "own: not told to any (it cannot say whose client faulted)",
                        info.describe(),
                        x.gpu_index,
                        x.unit_uuid,
                        len(candidates),
                    )
                candidates = signed
            for k in candidates:
                detail = f"critical {info.describe()} on GPU {x.gpu_index}"
                per_daemon.setdefault(k, []).append(FaultSignal(k.unit_uuid, "xid", detail, k.tenant))
        out: list[MpsFault] = []
        now = self._clock()
        for key, sigs in sorted(per_daemon.items()):
            if key not in daemons:
                continue  # a daemon no pod shares (any more): nobody to tell
            last = self._last_fault.get(key)
            self._last_fault[key] = now
            if last is not None and now - last < self._window:
                log.info("MPS daemon %s: more signs of the same fault: %s", key, "; ".join(s.detail for s in sigs))
                continue
            gpu = daemons[key]
            pods = sorted({p.uid: p for p in sharers.get(key, ())}.values(), key=lambda p: p.key)
            self._faults_total[(gpu, key.unit_uuid, key.tenant)] += 1
            sources = tuple(sorted({s.source for s in sigs}))
            details = tuple(s.detail for s in sigs)
            log.warning(
                "MPS daemon %s on GPU %d: its server's clients died of a fault (%s); telling %s",
                key,
                gpu,
                "; ".join(details),
                ", ".join(p.key for p in pods) or "no pod",
            )
            text = f"{FAULT_MESSAGE} (GPU {gpu}, {key.unit_uuid}: {'; '.join(details)[:400]})"
            await asyncio.gather(
                *(self._post(PodEvent(p.namespace, p.name, p.uid, FAULT_REASON, text, "Warning")) for p in pods)
            )
            out.append(MpsFault(gpu, key.unit_uuid, sources, details, tuple(p.key for p in pods), key.tenant))
        return out

    def _on_node(self, f: Finding) -> bool:
        return f.kind in NODE_FINDING_REASONS and self._node_events is not None and bool(self._node)

    async def _tell(self, f: Finding) -> bool:
        if f.kind in NODE_FINDING_REASONS:
            return await self._post_on_node(NODE_FINDING_REASONS[f.kind], no_pod_message(f))
        return await self._post(PodEvent(f.namespace, f.pod, f.pod_uid, FINDING_REASONS[f.kind], f.message, "Warning"))

    async def _post_on_node(self, reason: str, message: str) -> bool:
        if self._node_events is None:
            return True
        try:
            await self._node_events.create_node_event(self._node, reason, message, self.component)
        except KubeError as e:
            log.info("cannot record event %s on node %s (retrying next reconcile): %s", reason, self._node, e)
            return False
        return True

    async def _post(self, event: PodEvent) -> bool:
        if self._notifier is None:
            return True  # no API to tell: the log line and the metric are all there is
        try:
            await self._notifier.create_event(event, self.component)
        except KubeError as e:
            log.info(
                "cannot record event %s on %s/%s (retrying next reconcile): %s",
                event.reason,
                event.namespace,
                event.pod,
                e,
            )
            return False
        return True

    async def _evict(self, f: Finding) -> None:
        if self._notifier is None:
            return
        try:
            await self._notifier.evict_pod(f.namespace, f.pod, f.pod_uid)
        except NotFound:
            self._evicted.add(f.pod_uid)  # gone already (or replaced: the UID precondition spared the new one)
            return
        except EvictionBlocked as e:
            log.warning("GPU audit: pod %s/%s not evicted now, retrying: %s", f.namespace, f.pod, e)
            return
        except KubeError as e:
            log.warning("GPU audit: evicting pod %s/%s failed, retrying: %s", f.namespace, f.pod, e)
            return
        self._evicted.add(f.pod_uid)
        self._evictions_total[f.kind.value] += 1
        log.warning("GPU audit: evicted pod %s/%s (%s)", f.namespace, f.pod, f.kind.value)
        await self._post(
            PodEvent(
                f.namespace,
                f.pod,
                f.pod_uid,
                EVICTED_REASON,
                # "the sharegpu node agent", "the sharegpu dra driver"
                f"evicted by the {self.component.replace('-', ' ')} (--evict-on-audit): {f.message}",
                "Warning",
            )
        )
