"""bench/k8s_throughput.py --burst (issue 34, item 3): its pods are valid sharegpu requests of the tenants asked for,
it counts a pod's failed scheduling attempts from the kube-scheduler's log, and (where a k8s-rig is given) a burst
onto a cluster too small for it ends with every pod that fits bound and the rest judged unable to fit."""

from __future__ import annotations

import calendar
import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from sharegpu.k8s.pod_request import pod_request
from sharegpu.kube.schema import Pod

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "k8s_throughput.py"


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("k8s_throughput", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["k8s_throughput"] = module
    spec.loader.exec_module(module)
    return module


def test_burst_pods_are_valid_requests_of_the_tenants_asked_for() -> None:
    bench = _bench()
    namespaces = ["t0", "t1", "t2", "t3"]
    items = bench.burst_pods("b0", 1000, 0, namespaces, [60, 20, 20], 3, 0.25)
    assert len({(ns, p["metadata"]["name"]) for ns, p in items}) == 1000
    assert {ns for ns, _ in items} == set(namespaces)
    users = Counter((p["spec"].get("securityContext") or {}).get("runAsUser") for _, p in items)
    assert set(users) == {None, 1000, 1001, 1002}
    assert 200 <= users[None] <= 300
    kinds: Counter[str] = Counter()
    for ns, p in items:
        p["metadata"]["namespace"] = ns
        req = pod_request(Pod.model_validate(p))
        assert req is not None and req.gpu_count == 1
        kinds[p["metadata"]["name"].split("-")[1]] += 1
        if req.memory_mib is None:
            assert p["metadata"]["name"].split("-")[1] == "whole"
    assert 540 <= kinds["mps"] <= 660 and 150 <= kinds["whole"] <= 250 and 150 <= kinds["mig"] <= 250


def test_failed_attempts_are_counted_per_pod_from_the_scheduler_log() -> None:
    bench = _bench()
    log = "\n".join(
        [
            'I1128 23:08:44.662690   14120 schedule_one.go:481] "Successfully bound pod to node" pod="t3/b0-mps-0000" '
            'node="n-a30-0010" evaluatedNodes=1 feasibleNodes=1',
            'I1128 23:09:07.644625   14765 schedule_one.go:1239] "Unable to schedule pod; no fit; waiting" '
            'pod="t1/b0-whole-0049" err="0/5 nodes are available: 5 idle GPUs: 0 < 1 asked (whole GPUs need idle ones)."',
            'I1128 23:09:08.644625   14765 schedule_one.go:1239] "Unable to schedule pod; no fit; waiting" '
            'pod="t1/b0-whole-0049" err="0/5 nodes are available"',
            'E1128 23:09:25.437201   14765 schedule_one.go:1243] "Error scheduling pod; retrying" err="cannot bind '
            't1/b0-whole-0061: pods \\"b0-whole-0061\\" not found" logger="UnhandledError" pod="t1/b0-whole-0061"',
        ]
    )
    assert bench.failed_attempts(log) == Counter({"t1/b0-whole-0049": 2, "t1/b0-whole-0061": 1})
    after = calendar.timegm((2026, 11, 28, 23, 9, 8, 0, 0, 0))  # klog's time of day is UTC on the rig's machines
    assert bench.failed_attempts(log, after) == Counter({"t1/b0-whole-0049": 1, "t1/b0-whole-0061": 1})
    assert bench.failed_attempts(log, after + 3600) == Counter()
    assert bench.failed_attempts(log, after - 86400 + 10) == Counter({"t1/b0-whole-0061": 1})  # the day before


def test_percentile_by_rank() -> None:
    bench = _bench()
    xs = [float(x) for x in range(1, 101)]
    assert bench.pct(xs, 50) == 50.0
    assert bench.pct(xs, 99) == 99.0
    assert bench.pct([3.0], 99) == 3.0


@pytest.mark.skipif(not os.environ.get("SHAREGPU_TEST_KUBECONFIG"), reason="needs a k8s-rig (SHAREGPU_TEST_KUBECONFIG)")
def test_burst_onto_a_cluster_too_small_binds_every_pod_that_fits(tmp_path: Path) -> None:
    # Two H100 nodes (14 GPUs outside MIG mode, 2 in it) and 40 pods, half of them whole GPUs: some cannot fit.
    out = tmp_path / "burst.json"
    argv = [sys.executable, str(SCRIPT), "--burst", "--pods", "40", "--nodes", "2", "--mix", "1,2,1", "--rounds", "1"]
    argv += ["--quiet-s", "10", "--json", str(out)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    (share,) = [x for x in report["rounds"] if x["kind"] == "sharegpu"]
    assert share["pending"] > 0 and share["bound"] == share["with_room"] == 40 - share["pending"]
    assert set(share["pending_reasons"]) == {"gpu-busy"}, share["pending_reasons"]  # no GPU with room left
    assert share["over_allocations"] == [] and share["status_disagreements"] == [] and share["idle_gpus"] == 0
    assert share["failed_attempts_10s_after_last_bind"] == 0
    assert {x["kind"]: x["bound"] for x in report["rounds"] if x["kind"] != "sharegpu"} == {
        "plain": 40,
        "plain-fast": 40,
    }
    assert report["summary"]["violations"] == []
