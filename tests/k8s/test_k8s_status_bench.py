"""``sharegpu status`` shows a node's ``sharegpu bench --publish`` result beside the node."""

from __future__ import annotations

from k8s_helpers import node_obj, node_spec, nodes, pods
from rich.console import Console

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.status.bench_note import BenchNote, BenchPick, parse_note
from sharegpu.k8s.status.report import print_status, status_report
from sharegpu.kube.api import MODIFIED
from sharegpu.model.contract import BENCH_ANNOTATION

NOTE = BenchNote(
    "NVIDIA H200",
    "GPU-node-b-0",
    "2026-11-26T10:26:00Z",
    (
        BenchPick("light", 4, "mps", 72.9, "time-slicing"),
        BenchPick("heavy", 4, "mps", 5.9, "time-slicing"),
        BenchPick("batch", 4, "mps", 9.9, "time-slicing"),
        BenchPick("memory", 4, "mps-limits"),
    ),
)


def _view(annotation: str | None) -> ClusterView:
    a, b = node_obj(node_spec("node-a", gpus=1)), node_obj(node_spec("node-b", gpus=1))
    if annotation is not None:
        b["metadata"]["annotations"][BENCH_ANNOTATION] = annotation
    view = ClusterView()
    view.reset(nodes([a, b]), pods([]))
    return view


def test_the_node_carrying_the_annotation_shows_its_picks_and_the_others_nothing() -> None:
    report = status_report(_view(NOTE.to_annotation()))
    by = {n["name"]: n for n in report["nodes"]}
    assert by["node-a"]["bench"] is None
    assert by["node-b"]["bench"] == {
        "text": "light×4: mps busy −73 %; heavy×4: mps +6 %; batch×4: mps +10 %; memory×4: mps-limits",
        "gpu": "NVIDIA H200",
        "unit": "GPU-node-b-0",
        "measuredAt": "2026-11-26T10:26:00Z",
    }
    console = Console(record=True, width=200)
    print_status(console, report)
    text = console.export_text()
    lines = text.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("node node-b"))
    assert lines[at + 3] == (
        "bench (NVIDIA H200, 2026-11-26): light×4: mps busy −73 %; heavy×4: mps +6 %; batch×4: mps +10 %; "
        "memory×4: mps-limits"
    )  # under node-b's table (title, header, its GPU)
    assert sum("bench" in x for x in lines) == 1


def test_an_unreadable_annotation_is_shown_as_such_and_markup_in_it_is_text() -> None:
    report = status_report(_view('{"version": 1, "picks": "[bold]x"}'))
    bench = {n["name"]: n for n in report["nodes"]}["node-b"]["bench"]
    assert "cannot be read" in bench["error"] and "rerun sharegpu bench --publish" in bench["error"]
    console = Console(record=True, width=300)
    print_status(console, report)
    assert "bench: sharegpu.io/strategy-bench cannot be read" in console.export_text()


def test_the_note_follows_watch_events_and_round_trips() -> None:
    view = _view(None)
    b = node_obj(node_spec("node-b", gpus=1))
    b["metadata"]["annotations"][BENCH_ANNOTATION] = NOTE.to_annotation()
    b["metadata"]["resourceVersion"] = "2"
    view.apply_node(MODIFIED, nodes([b])[0])
    assert parse_note(view.bench_note("node-b") or "") == NOTE
    del b["metadata"]["annotations"][BENCH_ANNOTATION]
    view.apply_node(MODIFIED, nodes([b])[0])
    assert view.bench_note("node-b") is None
