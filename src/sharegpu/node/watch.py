"""One pass of the enforcement audit and the MPS fault watch, for both of the node's device paths (issue 33).

The node agent (:class:`~sharegpu.node.agent.NodeAgent`, the device plugin's path) and the DRA driver
(:class:`~sharegpu.node.dra.watch.DraWatch`) read every GPU once per pass (:func:`read_gpus`) and differ only in where a
pod's shares come from: its assignment annotation, or the prepared claims its containers use. :class:`NodeWatch` takes
them as each path reads them (each live pod's units and the tenant of the MPS daemon it reaches, by pod UID) and runs
the rest the same on both:

- :func:`~sharegpu.node.audit.audit` over the GPUs' processes, except those of ``sharegpu bench``'s own Job pod
  (:func:`~sharegpu.node.audit.bench_pods`, in sharegpu's namespace only, holding no share);
- the MPS fault watch per daemon: each daemon's logs (:class:`~sharegpu.node.mps_faults.MpsLogWatch`), its server
  (:class:`~sharegpu.node.mps_faults.ServerWatch`) and the backend's Xid events;
- a unit's legacy daemon (the one daemon per unit of an agent from before tenants, adopted after an upgrade:
  :meth:`~sharegpu.node.mps.MpsManager.legacy`) serves the pods that held an MPS share there when it was adopted,
  whatever their tenants: their clients there are its clients (no ``mps-other-tenant``), and its faults are theirs;
- :class:`~sharegpu.node.enforcement.EnforcementWatch` to tell both (Events on the pods concerned, labelled with the
  path's component; a process of no pod on the Node; counts; evictions where asked);
- a daemon whose clients died of a fault is checked, and restarted if it no longer answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sharegpu.model.assignment import Mechanism
from sharegpu.node.audit import (
    Finding,
    GpuReading,
    ProcView,
    Role,
    UnitShare,
    attribute,
    audit,
    bench_pods,
    read_gpu,
)
from sharegpu.node.backends.base import BackendError, GpuBackend
from sharegpu.node.enforcement import COMPONENT, EnforcementWatch, MpsFault, NodeEvents, PodNotifier
from sharegpu.node.kube import PodInfo
from sharegpu.node.mps import DaemonKey, MpsError, MpsManager
from sharegpu.node.mps_faults import MpsLogWatch, ServerWatch

log = logging.getLogger(__name__)


def read_gpus(backend: GpuBackend, mps: MpsManager) -> tuple[list[GpuReading], dict[int, tuple[ProcView, ...]]]:
    """Every GPU read once, and its processes with their roles, pods and daemons (each MPS client and server tied to
    the daemon of ``mps`` it reaches by its pipe directory), by GPU index. A GPU that cannot be read is left out with a
    warning and the others are still served."""
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


@dataclass(frozen=True, slots=True)
class WatchResult:
    findings: tuple[Finding, ...] = ()
    faults: tuple[MpsFault, ...] = ()
    errors: tuple[str, ...] = ()  # daemons that could not be restarted after a fault


class NodeWatch:
    """The audit and the MPS fault watch of a node, pass after pass (it remembers what it told and read)."""

    def __init__(
        self,
        backend: GpuBackend,
        mps: MpsManager,
        notifier: PodNotifier | None,
        *,
        component: str = COMPONENT,
        node: str = "",
        node_events: NodeEvents | None = None,
        evict: bool = False,
        namespace: str = "",
        lock: asyncio.Lock | None = None,
    ) -> None:
        """``notifier`` posts the Events (and evictions) as ``component``; without it they are logged and counted
        only. A process of no pod is told on Node ``node`` through ``node_events``, wherever Events are posted.
        ``namespace``: sharegpu's own, the only one where the bench Job's pod is recognised (empty: nowhere).
        ``lock``: held while a daemon is restarted after a fault (the DRA driver's, whose Prepare changes daemons)."""
        self.backend = backend
        self.mps = mps
        self.namespace = namespace
        self.enforcement = EnforcementWatch(
            notifier,
            evict=evict,
            component=component,
            node=node,
            node_events=node_events if notifier is not None else None,
        )
        self._lock = lock
        self._bench_seen: frozenset[str] = frozenset()
        self.mps_logs = MpsLogWatch()
        self.mps_servers = ServerWatch()
        self._sharers_before: dict[DaemonKey, dict[str, PodInfo]] = {}  # daemon → the pods it served, last pass
        self._daemons_before: dict[DaemonKey, int] = {}

    async def check(
        self,
        readings: Iterable[GpuReading],
        views: Mapping[int, tuple[ProcView, ...]],
        live: Iterable[PodInfo],
        shares: Mapping[str, tuple[UnitShare, ...]],
        tenants: Mapping[str, str],
        extra: Iterable[Finding] = (),
        holders: Mapping[str, Iterable[str]] | None = None,
    ) -> WatchResult:
        """One pass: audit, fault watch, telling, restarts.

        ``readings`` and ``views``: :func:`read_gpus`'s; ``live``: the node's pods that hold what they were given
        (not finished); ``shares``: per pod UID, the units it holds; ``tenants``: per pod UID, the tenant of the MPS
        daemon that serves it (pods with MPS shares, one tenant each); ``extra``: findings the path made itself;
        ``holders``: per pod UID, the holders of MPS shares it stands for as the path told the
        :class:`~sharegpu.node.mps.MpsManager` (the DRA path's claim UIDs; None: each pod is its own, by UID).
        """
        readings = list(readings)
        by_uid = {p.uid: p for p in live}
        procs = [p for r in readings for p in views[r.device.index]]
        known = {r.device.index: r.mps_clients is not None for r in readings}
        # sharegpu bench's own Job pod uses the node's GPUs by design; one that holds a share is audited as any pod.
        bench = bench_pods(by_uid.values(), self.namespace).difference(shares)
        for uid in bench - self._bench_seen:
            log.info("pod %s is sharegpu bench's: its use of the GPUs is not audited", by_uid[uid].key)
        self._bench_seen = bench
        legacy = self._legacy_pods(shares, holders)
        served: dict[str, set[DaemonKey]] = {}
        for key, pods in legacy.items():
            for uid in pods:
                served.setdefault(uid, set()).add(key)
        found = {f.key: f for f in audit(procs, by_uid, shares, known, tenants, exempt=bench, served=served)}
        found |= {f.key: f for f in extra}
        await self.enforcement.findings(found.values())
        faults = await self._faults(procs, by_uid, shares, tenants, legacy)
        return WatchResult(tuple(found.values()), tuple(faults), tuple(await self._restart(faults)))

    def _legacy_pods(
        self, shares: Mapping[str, tuple[UnitShare, ...]], holders: Mapping[str, Iterable[str]] | None
    ) -> dict[DaemonKey, dict[str, int]]:
        """Per legacy daemon, the pods it may serve (pod UID → GPU index): those with an MPS share on its unit that
        are (or use) one of the holders it was adopted with (any, while those are not fixed yet)."""
        out: dict[DaemonKey, dict[str, int]] = {}
        for key, serves in self.mps.legacy().items():
            for uid, held in shares.items():
                ids = {uid} if holders is None else set(holders.get(uid, ()))
                if serves is not None and not serves & ids:
                    continue
                for s in held:
                    if s.sharing is Mechanism.MPS and s.unit_uuid == key.unit_uuid:
                        out.setdefault(key, {})[uid] = s.gpu_index
        return out

    async def _faults(
        self,
        procs: list[ProcView],
        by_uid: Mapping[str, PodInfo],
        shares: Mapping[str, tuple[UnitShare, ...]],
        tenants: Mapping[str, str],
        legacy: Mapping[DaemonKey, Mapping[str, int]],
    ) -> list[MpsFault]:
        """The MPS fault watch, per daemon: a fault is told to the pods of the daemon it came from only (a legacy
        daemon's: ``legacy``, the pods it may serve)."""
        sharers_now: dict[DaemonKey, dict[str, PodInfo]] = {}
        daemons_now: dict[DaemonKey, int] = {}
        for uid, held in shares.items():
            if uid not in tenants:
                continue
            for s in held:
                if s.sharing is Mechanism.MPS:
                    key = self.mps.key(s.unit_uuid, tenants[uid])
                    sharers_now.setdefault(key, {})[uid] = by_uid[uid]
                    daemons_now[key] = s.gpu_index
        for key, pods in legacy.items():
            for uid, gpu_index in pods.items():
                sharers_now.setdefault(key, {})[uid] = by_uid[uid]
                daemons_now[key] = gpu_index
        # Pods whose clients just died may be finished already: those of the last pass are told too.
        daemons = self._daemons_before | daemons_now
        sharers = {k: [*(self._sharers_before.get(k, {}) | sharers_now.get(k, {})).values()] for k in daemons}
        self._sharers_before, self._daemons_before = sharers_now, daemons_now
        running = self.mps.running()
        log_dirs = {}
        for k in set(daemons) | running:
            try:
                log_dirs[k] = self.mps.spec_of(k).log_dir
            except MpsError:
                continue
        servers: dict[DaemonKey, list[int]] = {}
        for p in procs:
            if p.role is not Role.SERVER:
                continue
            key_of: DaemonKey | None = p.daemon
            if key_of is None:  # its pipe directory unread: the unit's one daemon, where it runs one
                here = [k for k in running if k.unit_uuid == p.unit_uuid]
                key_of = here[0] if len(here) == 1 else None
            if key_of is not None:
                servers.setdefault(key_of, []).append(p.pid)
        signals = self.mps_logs.scan(log_dirs) + self.mps_servers.update(servers, running, daemons)
        try:
            xids = self.backend.xid_events()
        except BackendError as e:
            log.warning("cannot read Xid events: %s", e)
            xids = ()
        return await self.enforcement.faults(signals, xids, daemons, sharers)

    async def _restart(self, faults: Iterable[MpsFault]) -> list[str]:
        """Each faulted daemon that still runs checked, and restarted if it no longer answers; what failed."""
        errors: list[str] = []
        async with self._lock or contextlib.nullcontext():
            for f in faults:
                try:
                    await self.mps.after_fault(f.daemon)
                except MpsError as e:
                    errors.append(f"after a fault on {f.daemon}: {e}")
        return errors
