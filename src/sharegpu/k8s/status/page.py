"""The live "who shares which GPU" page: ``sharegpu status --serve HOST:PORT``.

A small read-only web page over exactly the report of ``sharegpu status`` (:func:`sharegpu.k8s.status.report.status_report`):
the cluster's allocation and fragmentation at the top, then every node and GPU with its mechanism, its MIG layout
drawn to scale on the model's memory-slot axis, memory and compute used, its MPS daemons (one per tenant, with the
clients each serves) and the pods on it, then the pending pods and their reasons. It refreshes itself (a script fetches ``fragment`` every few seconds; without scripts the page is
still complete, only static).

Every route is GET (HEAD) only and changes nothing; the page loads nothing from elsewhere, and its Content Security
Policy allows only its own script and style sheet, so names of pods and nodes (escaped everywhere) can never run as
code. It serves its own port, apart from the extender's API (docs/kubernetes.md: who may reach it).
"""

from __future__ import annotations

import asyncio
import html
import json
import time
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sharegpu.k8s.status.report import FollowedStatus, StatusSnapshot, cap_words, daemon_line, summary_line
from sharegpu.kube.api import ClusterApi
from sharegpu.placement.reasons import ReasonKind, fmt_mib

DEFAULT_REFRESH_S = 5.0

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _sentence(reason: str) -> str:
    """A pending pod's reason for people (empty for a name this version does not know)."""
    kind = ReasonKind.named(reason)
    return "" if kind is None else kind.sentence


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:g}%"


def _bar(pct: float | None, cls: str, label: str) -> str:
    width = 0.0 if pct is None else max(0.0, min(100.0, pct))
    # An SVG bar: its width is an attribute, so the page needs no inline style (the CSP forbids them).
    return (
        f'<svg class="bar {cls}" viewBox="0 0 100 10" preserveAspectRatio="none" role="img" aria-label="{_e(label)}">'
        f'<rect class="track" x="0" y="0" width="100" height="10"/>'
        f'<rect class="fill" x="0" y="0" width="{width:.2f}" height="10"/></svg>'
    )


def _mig_layout(gpu: dict[str, Any]) -> str:
    """The GPU's MIG instances on its memory-slot axis (8 slots on A100/H100/H200, 4 on A30), to scale."""
    slots = int(gpu["mig_slots"])
    if not gpu["mig"] or slots <= 0:
        return '<span class="muted">not partitioned</span>' if slots else '<span class="muted">no MIG</span>'
    parts = [
        f'<svg class="mig" viewBox="0 0 {slots * 40} 58" role="img" '
        f'aria-label="MIG layout of {_e(gpu["uuid"])} on {slots} memory slots">'
    ]
    for i in range(slots):
        parts.append(f'<rect class="slot" x="{i * 40 + 1}" y="1" width="38" height="42"/>')
        parts.append(f'<text class="axis" x="{i * 40 + 20}" y="55">{i}</text>')
    for m in gpu["mig"]:
        x, w = int(m["start"]) * 40, int(m["slots"]) * 40
        pods = ", ".join(m["pods"]) or "no pod"
        cls = "inst used" if m["pods"] else "inst idle"
        # A one-slot box has room for the compute part of the profile name only ("1g" of "1g.10gb").
        label = m["profile"] if int(m["slots"]) > 1 else str(m["profile"]).split(".")[0]
        inner = f"{m['inner']}{' static' if m['static'] else ''}" if int(m["slots"]) > 1 else str(m["inner"])[:4]
        parts.append(
            f'<g class="{cls}" data-profile="{_e(m["profile"])}" data-start="{int(m["start"])}">'
            f"<title>{_e(m['profile'])} at slot {int(m['start'])}: {_e(m['inner'])}; {_e(pods)}</title>"
            f'<rect x="{x + 3}" y="4" width="{w - 6}" height="36" rx="4"/>'
            f'<text x="{x + w / 2:g}" y="20">{_e(label)}</text>'
            f'<text class="small" x="{x + w / 2:g}" y="34">{_e(inner)}</text>'
            "</g>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _pods(names: list[str]) -> str:
    if not names:
        return '<span class="muted">-</span>'
    return '<ul class="pods">' + "".join(f'<li class="pod">{_e(n)}</li>' for n in names) + "</ul>"


def _daemons(g: dict[str, Any], cap: int | None) -> str:
    """The GPU's MPS daemons (on the GPU, and in each MIG instance), one item each: who and how many clients; a
    unit at the daemon cap says so."""
    units = [
        ("", g.get("mps_daemons", [])),
        *((f"{m['profile']}@{m['start']} ", m.get("mps_daemons", [])) for m in g["mig"]),
    ]
    if not any(daemons for _, daemons in units):
        return '<span class="muted">-</span>'
    out = ['<ul class="daemons">']
    for where, daemons in units:
        for d in daemons:  # each one by name: the page has the room the terminal's table lacks
            out.append(
                f'<li class="daemon" data-tenant="{_e(d["tenant"])}" data-clients="{int(d["clients"])}">'
                f"{_e(daemon_line(d, where))}</li>"
            )
        if (full := cap_words(daemons, cap, where)) is not None:
            out.append(f'<li class="cap">{_e(full)}</li>')
    out.append("</ul>")
    return "".join(out)


def _gpu_row(node: str, g: dict[str, Any], cap: int | None = None) -> str:
    mem_pct = 100 * g["memory_mib_used"] / g["memory_mib_total"] if g["memory_mib_total"] else 0.0
    mem = f"{fmt_mib(g['memory_mib_used'])} / {fmt_mib(g['memory_mib_total'])}"
    health = "" if g["healthy"] else ' <span class="bad">unhealthy</span>'
    pods = list(g["pods"])
    return (
        f'<tr class="gpu" data-node="{_e(node)}" data-gpu="{int(g["index"])}" data-uuid="{_e(g["uuid"])}" '
        f'data-mechanism="{_e(g["mechanism"])}">'
        f'<td><span class="idx">{int(g["index"])}</span> <span class="uuid">{_e(g["uuid"])}</span>{health}</td>'
        f"<td>{_e(g['model'])}</td>"
        f'<td><span class="mech mech-{_e(g["mechanism"])}">{_e(g["mechanism"])}</span></td>'
        f'<td class="num">{_bar(mem_pct, "mem", f"memory {mem}")}<span>{_e(mem)}</span></td>'
        f'<td class="num">{_bar(g["compute_pct_used"], "cpu", "compute")}<span>{g["compute_pct_used"]:g}%</span></td>'
        f"<td>{_mig_layout(g)}</td>"
        f"<td>{_daemons(g, cap)}</td>"
        f"<td>{_pods(pods)}</td>"
        "</tr>"
    )


def render_fragment(state: StatusSnapshot) -> str:
    """The page's content (what the script swaps in on each refresh)."""
    report = state.report
    s = report["summary"]
    taken = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(state.taken_at))
    out = []
    if not state.synced:
        out.append(
            '<p class="warn" id="stale">Not in sync with the API server: this is the last state seen; reconnecting.</p>'
        )
    reasons = ", ".join(f"{r['pods']} {_e(r['reason'])}" for r in s["pending_reasons"]) or "none"
    out.append(
        '<section class="summary" id="summary">'
        f'<div class="card"><div class="k">GPUs in use</div><div class="v" id="gpus-in-use">'
        f'{s["gpus_in_use"]} / {s["gpus_total"]}</div><div class="sub">{s["nodes"]} node(s)'
        f"{', ' + str(s['gpus_unhealthy']) + ' unhealthy' if s['gpus_unhealthy'] else ''}</div></div>"
        f'<div class="card"><div class="k">allocation</div><div class="v" id="allocation">{_pct(s["allocation_pct"])}'
        f"</div>{_bar(s['allocation_pct'], 'alloc', 'allocation')}</div>"
        f'<div class="card"><div class="k">fragmentation</div><div class="v" id="fragmentation">'
        f"{_pct(s['fragmentation_pct'])}</div>{_bar(s['fragmentation_pct'], 'frag', 'fragmentation')}</div>"
        f'<div class="card"><div class="k">GPU memory promised</div><div class="v">'
        f"{fmt_mib(s['memory_mib_promised'])} / {fmt_mib(s['memory_mib_total'])}</div></div>"
        f'<div class="card"><div class="k">MPS daemons</div><div class="v" id="mps-daemons">'
        f'{int(s.get("mps_daemons", 0))}</div><div class="sub">at most {_e(s.get("mps_daemons_per_gpu", "-"))} a GPU, '
        f"one per tenant</div></div>"
        f'<div class="card"><div class="k">pods placed</div><div class="v" id="placed">{s["pods_placed"]}</div></div>'
        f'<div class="card"><div class="k">pending</div><div class="v" id="pending-count">{s["pending"]}</div>'
        f'<div class="sub">{reasons}</div></div>'
        "</section>"
        f'<p class="line" id="summary-line">{_e(summary_line(report))}</p>'
        f'<p class="muted">as of {_e(taken)}</p>'
    )
    if not report["nodes"]:
        out.append('<p class="warn">No node has a sharegpu inventory (is the sharegpu node agent running?)</p>')
    for node in report["nodes"]:
        cap = s.get("mps_daemons_per_gpu")
        rows = "".join(_gpu_row(node["name"], g, cap) for g in node["gpus"])
        out.append(
            f'<section class="node" data-node="{_e(node["name"])}"><h2>node {_e(node["name"])}</h2>'
            "<table><thead><tr><th>GPU</th><th>model</th><th>mechanism</th><th>memory used</th>"
            "<th>compute used</th><th>MIG layout</th><th>MPS daemons</th><th>pods</th></tr></thead>"
            f"<tbody>{rows}</tbody></table></section>"
        )
    if report["pending"]:
        rows = "".join(
            f'<tr class="pending" data-pod="{_e(p["pod"])}"><td>{_e(p["pod"])}</td>'
            f'<td title="{_e(_sentence(p["reason"]))}">{_e(p["reason"])}</td><td>{_e(p["detail"])}</td></tr>'
            for p in report["pending"]
        )
        out.append(
            '<section id="pending"><h2>pending</h2><table><thead><tr><th>pod</th><th>reason</th><th>why</th></tr>'
            f"</thead><tbody>{rows}</tbody></table></section>"
        )
    if report["problems"]:
        items = "".join(f'<li class="problem">{_e(p["reason"])}</li>' for p in report["problems"])
        out.append(f'<section id="problems"><h2>not accounted for</h2><ul>{items}</ul></section>')
    return "".join(out)


def render_page(state: StatusSnapshot, refresh_s: float) -> str:
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        "<title>sharegpu: who shares which GPU</title>"
        '<link rel="stylesheet" href="page.css"></head>'
        f'<body data-refresh="{refresh_s:g}"><header><h1>sharegpu: who shares which GPU</h1>'
        '<span id="conn" class="warn"></span></header>'
        f'<main id="content">{render_fragment(state)}</main>'
        '<script src="page.js"></script></body></html>'
    )


PAGE_JS = """'use strict';
(function () {
  var seconds = Number(document.body.dataset.refresh) || 5;
  var conn = document.getElementById('conn');
  function refresh() {
    fetch('fragment', {cache: 'no-store'}).then(function (r) {
      if (!r.ok) { throw new Error('HTTP ' + r.status); }
      return r.text();
    }).then(function (text) {
      document.getElementById('content').innerHTML = text;
      conn.textContent = '';
    }).catch(function (e) {
      conn.textContent = 'cannot reach the status server (' + e.message + '); retrying';
    }).then(function () { setTimeout(refresh, seconds * 1000); });
  }
  setTimeout(refresh, seconds * 1000);
})();
"""

PAGE_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 0 1.5em 2em; color: #1d2330; background: #fafbfc; }
header { display: flex; align-items: baseline; gap: 1em; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin: 1.2em 0 .4em; }
.summary { display: flex; flex-wrap: wrap; gap: .8em; }
.card { background: #fff; border: 1px solid #d8dde6; border-radius: 6px; padding: .6em .9em; min-width: 11em; }
.card .k { color: #5b6475; font-size: .85em; } .card .v { font-size: 1.5em; font-weight: 600; }
.card .sub { color: #5b6475; font-size: .85em; max-width: 22em; }
table { border-collapse: collapse; background: #fff; width: 100%; }
th, td { border: 1px solid #d8dde6; padding: .3em .5em; text-align: left; vertical-align: top; }
th { background: #eef1f5; font-weight: 600; }
.uuid { color: #5b6475; font-family: ui-monospace, monospace; font-size: .85em; }
.num span { display: block; font-size: .85em; }
.bar { width: 9em; height: .7em; display: block; }
.bar .track { fill: #e6e9ef; } .bar .fill { fill: #3b7dd8; }
.bar.frag .fill { fill: #d8833b; } .bar.mem .fill { fill: #5a9e5a; }
.mech { padding: .05em .45em; border-radius: 3px; background: #e6e9ef; }
.mech-mps { background: #d9e8fb; } .mech-mig { background: #e8dcfb; } .mech-exclusive { background: #fbe1d9; }
.mech-time-slicing { background: #fbf3d0; }
svg.mig { width: 26em; height: 3.6em; display: block; }
svg.mig .slot { fill: #f3f5f8; stroke: #c9cfda; }
svg.mig .inst rect { stroke: #6b4fb3; } svg.mig .inst.used rect { fill: #d9cdf7; } svg.mig .inst.idle rect { fill: #f1edfb; }
svg.mig text { font-size: 11px; text-anchor: middle; fill: #2c2547; } svg.mig text.small { font-size: 9px; }
svg.mig text.axis { font-size: 9px; fill: #8a93a3; }
ul.pods, ul.daemons { margin: 0; padding-left: 1.1em; }
ul.daemons li.cap { list-style: none; color: #a35200; }
.muted { color: #8a93a3; } .warn { color: #a35200; font-weight: 600; } .bad { color: #b3261e; font-weight: 600; }
.line { font-family: ui-monospace, monospace; font-size: .85em; }
"""


def make_page_app(source: Callable[[], StatusSnapshot], refresh_s: float = DEFAULT_REFRESH_S) -> Starlette:
    """The page's routes over ``source`` (called on every request, on the server's event loop)."""

    def respond(body: str | bytes, media_type: str) -> Response:
        return Response(body, media_type=media_type, headers=SECURITY_HEADERS)

    async def page(request: Request) -> Response:
        return respond(render_page(source(), refresh_s), "text/html; charset=utf-8")

    async def fragment(request: Request) -> Response:
        return respond(render_fragment(source()), "text/html; charset=utf-8")

    async def status_json(request: Request) -> Response:
        state = source()
        body = {"synced": state.synced, "taken_at": state.taken_at, **state.report}
        return respond(json.dumps(body), "application/json")

    async def script(request: Request) -> Response:
        return respond(PAGE_JS, "text/javascript; charset=utf-8")

    async def style(request: Request) -> Response:
        return respond(PAGE_CSS, "text/css; charset=utf-8")

    async def healthz(request: Request) -> Response:
        return respond("ok\n", "text/plain")

    return Starlette(
        routes=[
            Route("/", page, methods=["GET"]),
            Route("/fragment", fragment, methods=["GET"]),
            Route("/status.json", status_json, methods=["GET"]),
            Route("/page.js", script, methods=["GET"]),
            Route("/page.css", style, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
        ]
    )


async def serve_page(
    followed: FollowedStatus,
    api: ClusterApi,
    host: str,
    port: int,
    refresh_s: float = DEFAULT_REFRESH_S,
    stop: asyncio.Event | None = None,
) -> None:
    """Follow the API server and serve the page until ``stop`` (or SIGTERM/SIGINT); raises OSError when the address
    cannot be bound."""
    from sharegpu.k8s.serving.server import Listener, Site, serve

    stop = stop or asyncio.Event()
    app = make_page_app(followed.snapshot, refresh_s)
    follow = asyncio.ensure_future(followed.run(api, stop))
    try:
        await serve([Site(app, Listener(host, port), "status page")], stop)
    finally:
        stop.set()
        await follow
