"""docs/metrics.md names each node-agent metric's labels as the agent exports them (issue 33: the MPS daemon, server
and fault metrics gained `tenant` with a daemon per tenant, and the page still listed the old labels)."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from sharegpu.node.audit import Finding, FindingKind, MpsUnitUsage
from sharegpu.node.enforcement import WatchCounts
from sharegpu.node.metrics import GpuSample, MetricsSnapshot, MigSample, PodUsage, ShareSample, new_registry
from sharegpu.node.mps import MpsDaemonStatus

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def _exported() -> dict[str, set[str]]:
    """Every sharegpu_* metric the agent exports, with its labels, from a snapshot with one of everything."""
    from prometheus_client import generate_latest

    t = "team-a/uid-1000"
    snap = MetricsSnapshot(
        "node-a",
        (GpuSample(0, "GPU-0", "H100-80GB", True, False, 81559, 100, 5, 1),),
        (PodUsage("ns", "p", 0, "GPU-0", 500, 30),),
        (ShareSample("ns", "p", 0, "GPU-0", "gpu", "mps", 8192, 500, True, False),),
        (MigSample(0, "MIG-0", "3g.40gb", 4, True),),
        (MpsDaemonStatus("GPU-0", True, 1, t),),
        0,
        0,
        (MpsUnitUsage(0, "GPU-0", 30, 1, t),),
        (Finding(FindingKind.NO_POD, 0, "GPU-0", "", "", "", (9,), "x"),),
        WatchCounts((("no-pod", 0, 1),), (("wrong-unit", 1),), ((0, "GPU-0", t, 1),), ((0, "GPU-0", 31, 1),)),
    )
    text = generate_latest(new_registry(lambda: snap)).decode()
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("sharegpu_") and not sample.name.endswith("_created"):
                out.setdefault(sample.name, set()).update(sample.labels)
    return out


def _documented() -> dict[str, set[str]]:
    """The node agents' section's metrics with labels: table rows ``| `name` | `a`, `b` | …`` and figures written
    ``| `name` (labels `a`, `b`) | …``."""
    section = DOC.read_text().split("## The node agents' metrics", 1)[1].split("\n## ", 1)[0]
    out: dict[str, set[str]] = {}
    for line in section.splitlines():
        row = re.match(r"^\| `(sharegpu_\w+)` \| ([^|]*) \|", line) or re.match(
            r"^\| `(sharegpu_\w+)` \(labels ([^)]*)\) \|", line
        )
        if row and "`" in row.group(2):
            out[row.group(1)] = set(re.findall(r"`(\w+)`", row.group(2)))
    return out


def test_every_metric_the_page_lists_with_labels_has_those_labels() -> None:
    exported, documented = _exported(), _documented()
    for name, labels in documented.items():
        assert name in exported, f"{name} is documented but not exported"
        assert labels == exported[name], (
            f"{name}: the page says {sorted(labels)}, the agent exports {sorted(exported[name])}"
        )
    assert {"sharegpu_mps_daemon_up", "sharegpu_mps_faults_total", "sharegpu_mps_unit_sm_utilization_percent"} <= set(
        documented
    )


def test_the_finding_kinds_the_page_lists_are_the_audits() -> None:
    section = DOC.read_text().split("## The node agents' metrics", 1)[1]
    row = next(line for line in section.splitlines() if line.startswith("| `sharegpu_audit_findings` |"))
    assert set(re.findall(r"`([a-z-]+)`", row.split("|")[3])) == {k.value for k in FindingKind}
