"""``sharegpu status``: per node and GPU, the model, mechanism, used and free memory and compute, the MIG layout
and the pods that share it — built from the API server exactly as the extender builds its ledger."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from sharegpu.k8s.view import ClusterView
from sharegpu.ledger import GpuMode
from sharegpu.model.request import FULL_MILLI
from sharegpu.placement.framework import fmt_mib

MODE_NAMES = {
    GpuMode.FREE: "free",
    GpuMode.EXCLUSIVE: "exclusive",
    GpuMode.TIME_SLICING: "time-slicing",
    GpuMode.MPS: "mps",
    GpuMode.MIG: "mig",
}


def status_report(view: ClusterView, dra_nodes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    led = view.ledger
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
                    "inner": str(inst.inner) if inst.inner is not None else "idle",
                    "memory_mib_total": inst.profile.memory_mib,
                    "memory_mib_used": inst.profile.memory_mib - inst.free_mem,
                    "compute_pct_used": round((FULL_MILLI - inst.free_milli) / 10, 1),
                    "static": inst.persistent,
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
                    "memory_mib_total": total,
                    "memory_mib_used": total - free_mem,
                    "memory_mib_free": free_mem,
                    "compute_pct_used": round((FULL_MILLI - free_milli) / 10, 1),
                    "compute_pct_free": round(free_milli / 10, 1),
                    "mig": mig,
                    "pods": users.get((n, g.index), []),
                }
            )
        nodes.append({"name": spec.name, "gpus": gpus})
    return {
        "nodes": nodes,
        "dra_nodes": dra_nodes or [],  # nodes on the DRA path, from sharegpu.k8s.dra_view.dra_status
        "problems": [{"kind": p.kind, "name": p.name, "reason": p.reason} for p in view.problems],
    }


def print_status(console: Console, report: dict[str, Any]) -> None:
    if not report["nodes"] and not report.get("dra_nodes"):
        console.print("no node has a sharegpu inventory (is the sharegpu node agent running?)")
    for node in report["nodes"]:
        table = Table(title=f"node {node['name']}", title_justify="left", expand=False)
        for col in ("GPU", "model", "mechanism", "memory used / total", "compute used", "MIG layout", "pods"):
            table.add_column(col)
        for g in node["gpus"]:
            layout = "\n".join(
                f"{m['profile']}@{m['start']} {m['inner']}{' (static)' if m['static'] else ''}" for m in g["mig"]
            )
            table.add_row(
                f"{g['index']} {g['uuid']}" + ("" if g["healthy"] else " [red](unhealthy)[/]"),
                g["model"],
                g["mechanism"],
                f"{fmt_mib(g['memory_mib_used'])} / {fmt_mib(g['memory_mib_total'])}",
                f"{g['compute_pct_used']:g}%",
                layout or "-",
                "\n".join(g["pods"]) or "-",
            )
        console.print(table)
    print_dra_nodes(console, report.get("dra_nodes") or [])
    for p in report["problems"]:
        console.print(f"[yellow]warning:[/] {p['reason']}", highlight=False)


def print_dra_nodes(console: Console, nodes: list[dict[str, Any]]) -> None:
    for node in nodes:
        table = Table(title=f"node {node['name']} (DRA)", title_justify="left", expand=False)
        for col in ("GPU", "model", "mechanism", "memory claimed / total", "compute claimed", "MIG layout", "claims"):
            table.add_column(col)
        for g in node["gpus"]:
            table.add_row(
                f"{g['index']} {g['uuid']}",
                g["model"],
                g["mechanism"],
                f"{fmt_mib(g['memory_mib_used'])} / {fmt_mib(g['memory_mib_total'])}",
                f"{g['compute_pct_used']:g}%",
                "\n".join(f"{m['profile']}@{m['start']}" for m in g["mig"]) or "-",
                "\n".join(g["claims"]) or "-",
            )
        console.print(table)
