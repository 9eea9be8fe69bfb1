"""Prometheus metrics of one node: GPU and per-pod use, and what was promised against what is there.

GPU-level series use the DCGM exporter's names and labels (``DCGM_FI_DEV_GPU_UTIL``, ``DCGM_FI_DEV_FB_USED`` …)
so existing dashboards work; everything sharegpu adds is ``sharegpu_*``. The agent builds an immutable
:class:`MetricsSnapshot` on every reconcile; the collector renders whatever snapshot is current, so a scrape
never touches the GPU driver or the API server. The registry is the agent's own, not the process-global one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from sharegpu.kube.quantity import MIB
from sharegpu.node.audit import Finding, MpsUnitUsage
from sharegpu.node.enforcement import WatchCounts
from sharegpu.node.errors import NodeError
from sharegpu.node.mps import MpsDaemonStatus

log = logging.getLogger(__name__)


class MetricsError(NodeError):
    """The metrics endpoint cannot listen; the message names the address."""


@dataclass(frozen=True, slots=True)
class GpuSample:
    index: int
    uuid: str
    model: str
    healthy: bool
    mig_enabled: bool
    memory_total_mib: int
    memory_used_mib: int
    gpu_util_percent: int
    mem_copy_util_percent: int


@dataclass(frozen=True, slots=True)
class PodUsage:
    namespace: str
    pod: str
    gpu_index: int
    unit_uuid: str
    memory_used_mib: int
    sm_util_percent: int | None  # None: unknown (the pod shares its MPS server with other pods); never a false 0


@dataclass(frozen=True, slots=True)
class ShareSample:
    """One share of an assignment on this node: what was promised to a pod."""

    namespace: str
    pod: str
    gpu_index: int
    gpu_uuid: str
    unit: str  # "gpu" or the MIG instance as "<profile>@<start>"
    mechanism: str  # how the unit is shared: exclusive, time-slicing or mps
    memory_mib: int
    compute_milli: int
    memory_enforced: bool
    compute_enforced: bool
    gpu_fraction: float = 1.0  # the unit's part of its GPU's compute: 1 for a GPU, 3/7 for a 3g instance


@dataclass(frozen=True, slots=True)
class MigSample:
    gpu_index: int
    uuid: str
    profile: str
    start: int
    managed: bool


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    node: str
    gpus: tuple[GpuSample, ...] = ()
    pod_usage: tuple[PodUsage, ...] = ()
    shares: tuple[ShareSample, ...] = ()
    mig: tuple[MigSample, ...] = ()
    mps: tuple[MpsDaemonStatus, ...] = ()
    invalid_assignments: int = 0
    reconcile_errors: int = 0
    mps_units: tuple[MpsUnitUsage, ...] = ()
    findings: tuple[Finding, ...] = ()
    counts: WatchCounts = field(default_factory=WatchCounts)


class SnapshotCollector:
    def __init__(self, snapshot: Callable[[], MetricsSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        return list(_render(self._snapshot()))


def new_registry(snapshot: Callable[[], MetricsSnapshot]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot))
    return registry


def _render(s: MetricsSnapshot) -> Iterator[Metric]:
    dcgm = ["gpu", "UUID", "modelName", "Hostname"]

    def gpu_labels(g: GpuSample) -> list[str]:
        return [str(g.index), g.uuid, g.model, s.node]

    util = GaugeMetricFamily("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", labels=dcgm)
    copy = GaugeMetricFamily("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).", labels=dcgm)
    used = GaugeMetricFamily("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", labels=dcgm)
    free = GaugeMetricFamily("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", labels=dcgm)
    healthy = GaugeMetricFamily("sharegpu_gpu_healthy", "1 when the GPU is healthy.", labels=dcgm)
    mig_mode = GaugeMetricFamily("sharegpu_gpu_mig_enabled", "1 when the GPU is in MIG mode.", labels=dcgm)
    mem_present = GaugeMetricFamily(
        "sharegpu_gpu_memory_present_bytes", "GPU memory the device has.", labels=["gpu", "UUID"]
    )
    for g in s.gpus:
        lv = gpu_labels(g)
        util.add_metric(lv, g.gpu_util_percent)
        copy.add_metric(lv, g.mem_copy_util_percent)
        used.add_metric(lv, g.memory_used_mib)
        free.add_metric(lv, max(0, g.memory_total_mib - g.memory_used_mib))
        healthy.add_metric(lv, 1 if g.healthy else 0)
        mig_mode.add_metric(lv, 1 if g.mig_enabled else 0)
        mem_present.add_metric([str(g.index), g.uuid], g.memory_total_mib * MIB)
    yield from (util, copy, used, free, healthy, mig_mode, mem_present)

    pod_labels = ["namespace", "pod", "gpu", "UUID"]
    pod_mem = GaugeMetricFamily(
        "sharegpu_pod_gpu_memory_used_bytes", "GPU memory a pod's processes use.", labels=pod_labels
    )
    pod_sm = GaugeMetricFamily(
        "sharegpu_pod_gpu_sm_utilization_percent",
        "SM utilisation of a pod's processes (in %); absent where unknown (several pods on one MPS server).",
        labels=pod_labels,
    )
    for u in s.pod_usage:
        lv = [u.namespace, u.pod, str(u.gpu_index), u.unit_uuid]
        pod_mem.add_metric(lv, u.memory_used_mib * MIB)
        if u.sm_util_percent is not None:
            pod_sm.add_metric(lv, u.sm_util_percent)
    yield from (pod_mem, pod_sm)

    # One MPS server per daemon, a daemon per tenant: "tenant" is its daemon's ("" where it could not be read).
    unit_labels = ["gpu", "UUID", "tenant"]
    unit_sm = GaugeMetricFamily(
        "sharegpu_mps_unit_sm_utilization_percent",
        "SM utilisation of an MPS server (one per tenant's daemon on the unit): all its clients together (in %).",
        labels=unit_labels,
    )
    unit_pods = GaugeMetricFamily(
        "sharegpu_mps_unit_client_pods",
        "Pods with a client on the MPS server of a tenant's daemon.",
        labels=unit_labels,
    )
    for mu in s.mps_units:
        unit_sm.add_metric([str(mu.gpu_index), mu.unit_uuid, mu.tenant or ""], mu.sm_percent)
        unit_pods.add_metric([str(mu.gpu_index), mu.unit_uuid, mu.tenant or ""], mu.client_pods)
    yield from (unit_sm, unit_pods)

    findings = GaugeMetricFamily(
        "sharegpu_audit_findings",
        "What the enforcement audit finds now (kind: wrong-unit, mps-bypass, mps-other-tenant, memory-over-share, "
        "no-pod).",
        labels=["kind", "namespace", "pod", "gpu", "UUID"],
    )
    now: dict[tuple[str, str, str, str, str], int] = {}
    for f in s.findings:
        key = (f.kind.value, f.namespace, f.pod, str(f.gpu_index), f.unit_uuid)
        now[key] = now.get(key, 0) + 1
    for key, n in sorted(now.items()):
        findings.add_metric(list(key), n)
    found = CounterMetricFamily(
        "sharegpu_audit_findings_seen", "Findings of the enforcement audit as they appeared.", labels=["kind", "gpu"]
    )
    for kind, gpu, n in s.counts.findings:
        found.add_metric([kind, str(gpu)], n)
    evicted = CounterMetricFamily(
        "sharegpu_audit_evictions", "Pods evicted for an audit finding (--evict-on-audit).", labels=["kind"]
    )
    for kind, n in s.counts.evictions:
        evicted.add_metric([kind], n)
    faults = CounterMetricFamily(
        "sharegpu_mps_faults",
        "Faults that ended the clients of an MPS server (of one tenant's daemon).",
        labels=["gpu", "UUID", "tenant"],
    )
    for gpu, unit, tenant, n in s.counts.faults:
        faults.add_metric([str(gpu), unit, tenant], n)
    xids = CounterMetricFamily(
        "sharegpu_gpu_xid_errors",
        "Xid errors the driver reported, told to pods or not (sharegpu.node.xid).",
        labels=["gpu", "UUID", "xid"],
    )
    for gpu, unit, xid, n in s.counts.xids:
        xids.add_metric([str(gpu), unit, str(xid)], n)
    yield from (findings, found, evicted, faults, xids)

    share_labels = ["namespace", "pod", "gpu", "UUID", "unit", "mechanism", "enforced"]
    limit_mem = GaugeMetricFamily(
        "sharegpu_pod_gpu_memory_promised_bytes", "GPU memory promised to a pod on one GPU.", labels=share_labels
    )
    limit_compute = GaugeMetricFamily(
        "sharegpu_pod_gpu_compute_promised_ratio",
        "Share of a GPU's (or instance's) compute promised.",
        labels=share_labels,
    )
    per_gpu: dict[tuple[int, str], list[ShareSample]] = {}
    for sh in s.shares:
        enforced = (
            "memory+compute"
            if sh.memory_enforced and sh.compute_enforced
            else ("memory" if sh.memory_enforced else ("compute" if sh.compute_enforced else "none"))
        )
        lv = [sh.namespace, sh.pod, str(sh.gpu_index), sh.gpu_uuid, sh.unit, sh.mechanism, enforced]
        limit_mem.add_metric(lv, sh.memory_mib * MIB)
        limit_compute.add_metric(lv, sh.compute_milli / 1000)
        per_gpu.setdefault((sh.gpu_index, sh.gpu_uuid), []).append(sh)
    yield from (limit_mem, limit_compute)

    shares = GaugeMetricFamily("sharegpu_gpu_shares", "Shares assigned on the GPU.", labels=["gpu", "UUID"])
    promised_mem = GaugeMetricFamily(
        "sharegpu_gpu_memory_promised_bytes", "GPU memory promised to pods, all shares summed.", labels=["gpu", "UUID"]
    )
    promised_compute = GaugeMetricFamily(
        "sharegpu_gpu_compute_promised_ratio",
        "Compute promised to pods in whole GPUs (MIG shares count their instance's part of the GPU).",
        labels=["gpu", "UUID"],
    )
    for g in s.gpus:
        on = per_gpu.get((g.index, g.uuid), [])
        shares.add_metric([str(g.index), g.uuid], len(on))
        promised_mem.add_metric([str(g.index), g.uuid], sum(x.memory_mib for x in on) * MIB)
        promised_compute.add_metric([str(g.index), g.uuid], sum(x.compute_milli * x.gpu_fraction for x in on) / 1000)
    yield from (shares, promised_mem, promised_compute)

    mig = GaugeMetricFamily(
        "sharegpu_mig_instance",
        "A MIG instance present on the GPU.",
        labels=["gpu", "UUID", "profile", "start", "managed"],
    )
    for m in s.mig:
        mig.add_metric([str(m.gpu_index), m.uuid, m.profile, str(m.start), "true" if m.managed else "false"], 1)
    yield mig

    up = GaugeMetricFamily(
        "sharegpu_mps_daemon_up", "1 while the MPS daemon of a tenant on the unit answers.", labels=["UUID", "tenant"]
    )
    restarts = CounterMetricFamily(
        "sharegpu_mps_daemon_restarts", "MPS daemon restarts after a failure.", labels=["UUID", "tenant"]
    )
    for d in s.mps:
        up.add_metric([d.unit_uuid, d.tenant], 1 if d.up else 0)
        restarts.add_metric([d.unit_uuid, d.tenant], d.restarts)
    yield from (up, restarts)

    agent = GaugeMetricFamily(
        "sharegpu_node_invalid_assignments", "Pods on this node whose assignment the agent cannot use.", labels=["node"]
    )
    agent.add_metric([s.node], s.invalid_assignments)
    errors = GaugeMetricFamily("sharegpu_node_reconcile_errors", "Errors met by the last reconcile.", labels=["node"])
    errors.add_metric([s.node], s.reconcile_errors)
    yield from (agent, errors)


class MetricsServer:
    """A minimal HTTP endpoint on the agent's event loop: ``GET /metrics`` renders the registry."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._registry = registry
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._handle, self.host, self.port)
        except OSError as e:
            raise MetricsError(f"cannot serve metrics on {self.host}:{self.port}: {e.strerror or e}") from None
        self.port = self._server.sockets[0].getsockname()[1]  # the real one when 0 asked for any
        log.info("metrics on http://%s:%d/metrics", self.host, self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 10)
            while (await asyncio.wait_for(reader.readline(), 10)) not in (b"\r\n", b"\n", b""):
                pass
            parts = request.decode("latin-1").split()
            if len(parts) >= 2 and parts[0] in ("GET", "HEAD") and parts[1].split("?")[0] in ("/metrics", "/"):
                body = generate_latest(self._registry)
                status, ctype = "200 OK", CONTENT_TYPE_LATEST
            else:
                body, status, ctype = b"not found; metrics are at /metrics\n", "404 Not Found", "text/plain"
            head = f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            writer.write(head.encode() + (body if parts and parts[0] != "HEAD" else b""))
            await writer.drain()
        except (TimeoutError, ConnectionError) as e:
            log.debug("metrics request dropped: %s", e)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9402`` for IPv6; ``:9402`` for every address)."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise MetricsError(f"--metrics-listen {value!r} is not HOST:PORT, e.g. 0.0.0.0:9402")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port_text)
