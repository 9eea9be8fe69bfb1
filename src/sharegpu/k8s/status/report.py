"""``sharegpu status``: per node and GPU, the model, mechanism, used and free memory and compute, the MIG layout,
the MPS daemons (one per tenant: who, and how many clients each serves) and the pods that share it — built from the
API server exactly as the extender builds its ledger — and a cluster summary: GPUs in use, allocation and
fragmentation as the simulator measures them, pending pods and why.

The report is the one source of the terminal table, ``--json``, the live page (:mod:`sharegpu.k8s.status.page`) and the
extender's cluster metrics (:mod:`sharegpu.k8s.extender.metrics`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.pending import PendingPod, pending_pods
from sharegpu.k8s.status.bench_note import InvalidBenchNote, parse_note
from sharegpu.k8s.status.dra import dra_status
from sharegpu.kube.api import ClusterApi
from sharegpu.ledger import GpuMode, Ledger, Unit
from sharegpu.model.request import FULL_MILLI
from sharegpu.model.tenant import describe, own_tenant
from sharegpu.placement.fragmentation import FragmentationModel, Workload, fragmentation_of
from sharegpu.placement.reasons import fmt_mib

log = logging.getLogger(__name__)

MODE_NAMES = {
    GpuMode.FREE: "free",
    GpuMode.EXCLUSIVE: "exclusive",
    GpuMode.TIME_SLICING: "time-slicing",
    GpuMode.MPS: "mps",
    GpuMode.MIG: "mig",
}


def fragmentation_milli(ledger: Ledger, workload: Workload | None) -> float | None:
    """The simulator's fragmentation measure (``sharegpu sim``'s fragmentation_pct × capacity): free GPU milli
    the workload's typical shapes cannot use. None without a workload (no sharegpu pod seen yet)."""
    if workload is None:
        return None
    return fragmentation_of(FragmentationModel(workload))(ledger)


def cluster_summary(view: ClusterView, pending: list[PendingPod]) -> dict[str, Any]:
    led = view.ledger
    total = led.total_gpu_milli
    # In use: a pod holds some of it. Not the GPU's mode: a GPU kept in MIG mode (static instances, or a layout the
    # node keeps) with no pod on it is idle, and counting it was the gap issue 28 found.
    held = {(led.index[a.node], s.gpu_index) for a in led.assignments.values() for s in a.shares}
    in_use = sum(1 for n, g in held if led.present[n, g])
    frag = fragmentation_milli(led, view.workload())
    reasons = Counter(p.reason for p in pending)
    return {
        "nodes": len(led.nodes),
        "gpus_total": int(led.present.sum()),
        "gpus_in_use": in_use,
        "gpus_unhealthy": int((led.present & ~led.healthy).sum()),
        "allocation_pct": round(100 * led.allocated_gpu_milli / total, 2) if total else 0.0,
        "fragmentation_pct": None if frag is None or not total else round(100 * frag / total, 2),
        "memory_mib_total": int(led.gpu_mem_total.sum()),
        "memory_mib_promised": sum(s.memory_mib for a in led.assignments.values() for s in a.shares),
        # MPS daemons running (one per tenant on each GPU or MIG instance shared through MPS), the most one unit may
        # run (--mps-daemons-per-gpu) and the GPU memory each one's server takes (in memory_mib_used beside its pods').
        "mps_daemons": sum(len(clients) for clients in led.unit_tenants.values()),
        "mps_daemons_per_gpu": led.tenancy.daemons_per_unit,
        "mps_daemon_memory_mib": led.tenancy.daemon_memory_mib,
        "pods_placed": len(led),
        "pending": len(pending),
        "pending_reasons": [{"reason": r.value, "pods": c} for r, c in reasons.most_common()],
    }


def status_report(view: ClusterView) -> dict[str, Any]:
    """The report of everything the view follows: the device-plugin nodes from its ledger, the DRA nodes (when it
    follows them) from the driver's slices and the claims allocated on them."""
    led = view.ledger
    names = view.pod_keys_by_uid()
    daemon_mib = led.tenancy.daemon_memory_mib

    def daemons(unit: Unit) -> list[dict[str, Any]]:
        return mps_daemons(led, unit, names)

    users: dict[tuple[int, int], list[str]] = {}
    inst_users: dict[tuple[int, int, int], list[str]] = {}
    for key, a in sorted(led.assignments.items()):
        n = led.index[a.node]
        for s in a.shares:
            users.setdefault((n, s.gpu_index), []).append(key)
            if s.mig is not None:
                inst_users.setdefault((n, s.gpu_index, s.mig.start), []).append(key)
    nodes = []
    for n, spec in enumerate(led.nodes):
        gpus = []
        for g in spec.gpus:
            model = led.gpu_model(n, g.index)
            total = int(led.gpu_mem_total[n, g.index])
            free_mem = int(led.free_mem[n, g.index])
            free_milli = int(led.free_milli[n, g.index])
            mig = [
                {
                    "profile": inst.profile.name,
                    "start": start,
                    "slots": inst.profile.memory_slots,
                    "inner": str(inst.inner) if inst.inner is not None else "idle",
                    "memory_mib_total": inst.profile.memory_mib,
                    "memory_mib_used": inst.profile.memory_mib - inst.free_mem,
                    "compute_pct_used": round((FULL_MILLI - inst.free_milli) / 10, 1),
                    "static": inst.persistent,
                    "mps_daemons": daemons((n, g.index, start)),
                    "memory_mib_daemons": led.daemons_on((n, g.index, start)) * daemon_mib,
                    "pods": inst_users.get((n, g.index, start), []),
                }
                for start, inst in sorted(led.instances_on(n, g.index).items())
            ]
            gpus.append(
                {
                    "index": g.index,
                    "uuid": g.uuid,
                    "model": model.name,
                    "healthy": bool(led.healthy[n, g.index]),
                    "mechanism": MODE_NAMES[GpuMode(int(led.mode[n, g.index]))],
                    "mig_slots": model.memory_slots,  # width of the MIG memory-slot axis; 0: no MIG
                    "memory_mib_total": total,
                    "memory_mib_used": total - free_mem,
                    "memory_mib_free": free_mem,
                    "compute_pct_used": round((FULL_MILLI - free_milli) / 10, 1),
                    "compute_pct_free": round(free_milli / 10, 1),
                    "mig": mig,
                    "mps_daemons": daemons((n, g.index, None)),
                    # Of memory_mib_used: what the MPS daemons' servers take (each daemon_memory_mib), not a pod.
                    "memory_mib_daemons": led.daemons_on((n, g.index, None)) * daemon_mib,
                    "pods": users.get((n, g.index), []),
                }
            )
        nodes.append({"name": spec.name, "gpus": gpus, "bench": bench_of(view.bench_note(spec.name))})
    pending = pending_pods(view)
    dra = [] if view.dra is None else dra_status(view.dra.slices.values(), view.dra.claims.values())
    dra_gpus = [g for n in dra for g in n["gpus"]]
    summary = cluster_summary(view, pending) | {
        # The DRA path's GPUs are outside the ledger (allocation and fragmentation above are the device plugin's).
        "dra_nodes": len(dra),
        "dra_gpus_total": len(dra_gpus),
        "dra_gpus_in_use": sum(1 for g in dra_gpus if g["claims"]),
        "dra_claims": len({c for g in dra_gpus for c in g["claims"]}),
    }
    return {
        "summary": summary,
        "nodes": nodes,
        "pending": [{"pod": p.pod, "reason": p.reason.value, "detail": p.detail} for p in pending],
        "dra_nodes": dra,  # nodes on the DRA path, from sharegpu.k8s.status.dra.dra_status
        "problems": [{"kind": p.kind, "name": p.name, "reason": p.reason} for p in view.problems]
        + ([{"kind": "dra", "name": "resource.k8s.io", "reason": view.dra_unavailable}] if view.dra_forbidden else []),
    }


def mps_daemons(led: Ledger, unit: Unit, pod_names: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The MPS daemons of ``unit`` (a GPU, or a MIG instance of it) as the ledger counts them, one per tenant:
    ``tenant`` (its key), ``who`` (in words; a pod that is a tenant of its own by its name, from ``pod_names``: UID →
    namespace/name) and ``clients`` (the MPS shares it serves there)."""
    alone = own_tenant("")
    out = []
    for tenant, clients in sorted(led.unit_tenants.get(unit, {}).items()):
        uid = tenant.removeprefix(alone) if tenant.startswith(alone) else None
        name = pod_names.get(uid) if pod_names is not None and uid is not None else None
        who = describe(own_tenant(name) if name is not None else tenant)
        out.append({"tenant": tenant, "who": who, "clients": clients})
    return out


def daemon_line(daemon: dict[str, Any], where: str = "") -> str:
    """One daemon of the report in words: ``uid 1000 in ml: 2 clients`` (``where``, a MIG instance, before it)."""
    clients = daemon["clients"]
    return f"{where}{daemon['who']}: {clients} client{'s' if clients != 1 else ''}"


def daemon_words(daemons: list[dict[str, Any]], cap: int | None = None, where: str = "") -> list[str]:
    """A unit's daemons in a few lines, ``where`` (a MIG instance) before each: a line per tenant of declared users
    (or the multi-user daemon) with its clients, one for the pods that are tenants of their own (``3 pods alone``: a
    daemon each; the pods column names them), and a last one where the unit runs ``cap`` daemons already (a tenant
    that runs none there cannot join)."""
    alone = own_tenant("")
    lines = [daemon_line(d, where) for d in daemons if not d["tenant"].startswith(alone)]
    if n := sum(1 for d in daemons if d["tenant"].startswith(alone)):
        lines.append(f"{where}{n} pod{'s' if n != 1 else ''} alone")
    if (full := cap_words(daemons, cap, where)) is not None:
        lines.append(full)
    return lines


def cap_words(daemons: list[dict[str, Any]], cap: int | None, where: str = "") -> str | None:
    """``at the cap of 2 daemons`` where a unit runs ``cap`` daemons already; None where it does not."""
    if cap is None or not daemons or len(daemons) < cap:
        return None
    return f"{where}at the cap of {cap} daemon{'s' if cap != 1 else ''}"


def bench_of(text: str | None) -> dict[str, Any] | None:
    """A node's ``sharegpu bench --publish`` result as the report carries it: its picks in words (``text``), the
    GPU and when it was measured — or ``error`` where the annotation cannot be read."""
    if text is None:
        return None
    try:
        note = parse_note(text)
    except InvalidBenchNote as e:
        return {"error": str(e)}
    return {"text": note.text(), "gpu": note.gpu, "unit": note.unit, "measuredAt": note.measured_at}


def gpu_daemon_words(gpu: dict[str, Any], cap: int | None = None) -> list[str]:
    """The MPS daemons of a GPU of the report, on the GPU and in each of its MIG instances, a line each."""
    lines = daemon_words(gpu.get("mps_daemons", []), cap)
    for m in gpu["mig"]:
        lines += daemon_words(m.get("mps_daemons", []), cap, f"{m['profile']}@{m['start']} ")
    return lines


def bench_words(bench: dict[str, Any]) -> str:
    """``bench (NVIDIA H200, 2026-11-26): batch×4: mps +9 %; …``: the line under a node's table."""
    if "error" in bench:
        return f"bench: {bench['error']}"
    return f"bench ({bench['gpu']}, {bench['measuredAt'][:10]}): {bench['text']}"


def summary_line(report: dict[str, Any]) -> str:
    """One line: GPUs in use, allocation, fragmentation, pending pods and their top reasons."""
    s = report["summary"]
    frag = "n/a (no sharegpu pod seen yet)" if s["fragmentation_pct"] is None else f"{s['fragmentation_pct']:g}%"
    line = (
        f"{s['gpus_in_use']}/{s['gpus_total']} GPUs in use on {s['nodes']} node(s) · "
        f"allocation {s['allocation_pct']:g}% · fragmentation {frag} · {s['pods_placed']} pod(s) placed · "
        f"{s['pending']} pending"
    )
    if s["pending_reasons"]:
        top = ", ".join(f"{r['pods']} {r['reason']}" for r in s["pending_reasons"][:3])
        line += f" ({top})"
    if s["gpus_unhealthy"]:
        line += f" · {s['gpus_unhealthy']} GPU(s) unhealthy"
    if s.get("dra_nodes"):
        line += (
            f" · DRA: {s['dra_gpus_in_use']}/{s['dra_gpus_total']} GPUs claimed on {s['dra_nodes']} node(s), "
            f"{s['dra_claims']} claim(s)"
        )
    return line


def print_status(console: Console, report: dict[str, Any]) -> None:
    console.print(status_renderable(report, console.width))


def short_uuid(uuid: str) -> str:
    """A GPU's UUID as a table shows it: enough to tell the GPUs of a node apart (``--json`` has the whole one)."""
    bare = uuid.removeprefix("GPU-").removeprefix("MIG-")
    return bare if len(bare) <= 7 else f"{bare[:6]}…"


GPU_COLUMNS = ("GPU", "model", "mechanism", "memory", "compute", "MIG layout", "MPS daemons")
OPTIONAL_COLUMNS = ("MIG layout", "MPS daemons")  # shown only where a GPU of the table has something in them


def _gpu_table(title: str, used: str, last: str, rows: Sequence[Sequence[str]], width: int | None) -> Table:
    """A node's table (rows: a cell per :data:`GPU_COLUMNS`, then ``last``). In a terminal of ``width`` columns the
    ones a user reads (model, mechanism, the pods or claims) keep their width: the UUID is short, the MIG and MPS
    daemon columns are there only where a GPU has MIG instances or MPS daemons, the figures wrap first and a pod's
    name folds rather than being cut (rich would shrink every column alike)."""
    names = [*GPU_COLUMNS, last]
    keep = [i for i, h in enumerate(names) if h not in OPTIONAL_COLUMNS or any(r[i] != "-" for r in rows)]
    cells = [[r[i] for i in keep] for r in rows]
    headers = [names[i] for i in keep]
    natural = [max([len(h), *(len(line) for c in cells for line in c[i].splitlines())]) for i, h in enumerate(headers)]
    wrapping = ("memory", *OPTIONAL_COLUMNS, last)  # the columns that may wrap; the others keep their width
    widths: dict[str, int] = {}
    gaps = 2 * (len(headers) - 1)  # the cells' padding: no box, two spaces between columns
    if width is not None and sum(natural) + gaps > width:
        # The figures, the MIG layout and the daemons wrap at their longest word; the names get what is left (at
        # least 12).
        for i, h in enumerate(headers):
            if h in wrapping and h != last:
                words = [len(w) for c in cells for w in c[i].split()]
                widths[h] = max([len(h.split()[0]), *words])
        rest = (
            width
            - gaps
            - sum(widths.values())
            - sum(n for h, n in zip(headers, natural, strict=True) if h not in wrapping)
        )
        if "MPS daemons" in widths and rest < natural[-1]:
            # The daemons' words fold before a pod's name does (the pods column names the same pods).
            give = min(natural[-1] - rest, widths["MPS daemons"] - 8)
            if give > 0:
                widths["MPS daemons"] -= give
                rest += give
        widths[last] = max(12, min(natural[-1], rest))
        spare = rest - widths[last]
        for h in ("MPS daemons", "memory", "MIG layout"):  # what is left widens the wrapped columns, most words first
            if h in widths and spare > 0:
                grow = min(spare, natural[headers.index(h)] - widths[h])
                widths[h] += max(grow, 0)
                spare -= max(grow, 0)
    table = Table(
        title=f"{title} · memory and compute {used}",
        title_justify="left",
        expand=False,
        box=None,
        padding=(0, 2, 0, 0),
        pad_edge=False,
        header_style="bold underline",
    )
    for h in headers:
        table.add_column(h, no_wrap=h not in wrapping, overflow="fold", width=widths.get(h))
    for c in cells:
        table.add_row(*c[:-1], Text(c[-1]))
    return table


def status_renderable(report: dict[str, Any], width: int | None = None) -> RenderableType:
    """The summary line, one table per node, the pending pods and the problems (what ``print_status`` prints and
    ``--watch`` redraws), the tables fitted to ``width`` columns where given."""
    parts: list[RenderableType] = [Text(summary_line(report), style="bold")]
    cap = report["summary"].get("mps_daemons_per_gpu")
    if not report["nodes"] and not report.get("dra_nodes"):
        parts.append(Text("no node has a sharegpu inventory (is the sharegpu node agent running?)"))
    for node in report["nodes"]:
        rows = [
            (
                f"{g['index']} {short_uuid(g['uuid'])}" + ("" if g["healthy"] else " [red](unhealthy)[/]"),
                g["model"],
                g["mechanism"],
                f"{fmt_mib(g['memory_mib_used'])} / {fmt_mib(g['memory_mib_total'])}",
                f"{g['compute_pct_used']:g}%",
                "\n".join(
                    f"{m['profile']}@{m['start']} {m['inner']}{' (static)' if m['static'] else ''}" for m in g["mig"]
                )
                or "-",
                "\n".join(gpu_daemon_words(g, cap)) or "-",
                "\n".join(g["pods"]) or "-",
            )
            for g in node["gpus"]
        ]
        parts.append(_gpu_table(f"node {node['name']}", "used / total", "pods", rows, width))
        if node.get("bench"):
            parts.append(Text(bench_words(node["bench"])))  # a line of its own: it would widen the table
    parts.extend(dra_node_tables(report.get("dra_nodes") or [], width))
    if report["pending"]:
        table = Table(title="pending", title_justify="left", expand=False, box=box.SIMPLE_HEAD, pad_edge=False)
        table.add_column("pod", overflow="fold", min_width=16)
        table.add_column("reason", no_wrap=True)
        table.add_column("why")
        for p in report["pending"]:
            table.add_row(Text(p["pod"]), p["reason"], Text(p["detail"]))
        parts.append(table)
    for p in report["problems"]:
        parts.append(Text.from_markup(f"[yellow]warning:[/] {escape(p['reason'])}"))
    return Group(*parts)


def dra_node_tables(nodes: list[dict[str, Any]], width: int | None = None) -> list[Table]:
    tables = []
    for node in nodes:
        rows = [
            (
                f"{g['index']} {short_uuid(g['uuid'])}",
                g["model"],
                g["mechanism"],
                f"{fmt_mib(g['memory_mib_used'])} / {fmt_mib(g['memory_mib_total'])}",
                f"{g['compute_pct_used']:g}%",
                "\n".join(f"{m['profile']}@{m['start']}" for m in g["mig"]) or "-",
                "-",  # the DRA driver keeps its claims' daemons on the node: not in the report
                "\n".join(g["claims"]) or "-",
            )
            for g in node["gpus"]
        ]
        tables.append(_gpu_table(f"node {node['name']} (DRA)", "claimed / total", "claims", rows, width))
    return tables


# ----- following the cluster: ``--watch`` and ``--serve`` ----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StatusSnapshot:
    """One report, whether the view followed the API server when it was taken, and when (time.time())."""

    report: dict[str, Any]
    synced: bool
    taken_at: float


class FollowedStatus:
    """A cluster view kept current by a watch of the API server (as the extender keeps its own), and its report.

    A report is computed at most once per ``min_age_s`` however many readers ask (each page viewer refreshes).
    """

    def __init__(self, view: ClusterView | None = None, min_age_s: float = 1.0) -> None:
        # The DRA nodes come through the same view (its informer follows the driver's slices and the claims).
        self.view = view or ClusterView(follow_dra=True)
        self.min_age_s = min_age_s
        self._last: StatusSnapshot | None = None

    def snapshot(self) -> StatusSnapshot:
        now = time.time()
        last = self._last
        if last is None or now - last.taken_at >= self.min_age_s or last.synced != self.view.synced:
            last = self._last = StatusSnapshot(status_report(self.view), self.view.synced, now)
        return last

    async def run(self, api: ClusterApi, stop: asyncio.Event) -> None:
        """Follow the API server until ``stop`` (relisting after any error, as the extender does)."""
        await self.view.follow(api, stop)


def snapshot_renderable(snap: StatusSnapshot, width: int | None = None) -> RenderableType:
    taken = time.strftime("%H:%M:%S", time.localtime(snap.taken_at))
    head = Text(f"as of {taken}" + ("" if snap.synced else " · NOT IN SYNC with the API server (reconnecting)"))
    if not snap.synced:
        head.stylize("bold yellow")
    return Group(head, status_renderable(snap.report, width))


async def watch_status(
    followed: FollowedStatus, api: ClusterApi, console: Console, interval_s: float, stop: asyncio.Event
) -> None:
    """``sharegpu status --watch``: redraw the status every ``interval_s`` until ``stop`` (or Ctrl-C)."""
    follow = asyncio.ensure_future(followed.run(api, stop))
    if not console.is_terminal:
        # Piped or logged: nothing to redraw in place (rich's Live prints only at its end there); each refresh is
        # printed after the last.
        try:
            while not stop.is_set() and not follow.done():
                if followed.view.synced or followed.view.relists:
                    console.print(snapshot_renderable(followed.snapshot(), console.width))
                    console.print()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), interval_s)
        finally:
            stop.set()
            await follow
        return
    try:
        with Live(console=console, auto_refresh=False, screen=False) as live:
            while not stop.is_set() and not follow.done():
                if followed.view.synced or followed.view.relists:
                    live.update(snapshot_renderable(followed.snapshot(), console.width), refresh=True)
                else:
                    live.update(Text("connecting to the API server…"), refresh=True)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), interval_s)
    finally:
        stop.set()
        await follow
