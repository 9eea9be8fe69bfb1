"""bench/extender_profile.py (issue 34): its meter counts a coroutine's own CPU only, its remainders add up, and both
subcommands run end to end at a small size (``cycles`` on the openb node list, ``rig`` where a k8s-rig is given)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "extender_profile.py"
DATA = ROOT.parent / "shared" / "data" / "openb"


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("extender_profile", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["extender_profile"] = module
    spec.loader.exec_module(module)
    return module


def _spin(cpu_s: float) -> None:
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def test_timed_counts_its_own_steps_not_what_runs_while_it_waits() -> None:
    bench = _bench()
    spent: list[float] = []

    async def measured() -> str:
        _spin(0.01)
        await asyncio.sleep(0.05)  # the other task spins 30 ms of CPU meanwhile
        _spin(0.01)
        return "done"

    async def other() -> None:
        await asyncio.sleep(0.001)
        _spin(0.03)

    async def main() -> str:
        side = asyncio.ensure_future(other())
        out = await bench.Timed(measured(), lambda dt, _: spent.append(dt))
        await side
        return str(out)

    assert asyncio.run(main()) == "done"
    (cpu,) = spent
    assert 0.02 <= cpu < 0.045, cpu  # its 20 ms, not the other task's 30


def test_timed_passes_exceptions_through() -> None:
    bench = _bench()
    spent: list[float] = []

    async def failing() -> None:
        await asyncio.sleep(0)
        raise KeyError("x")

    async def main() -> None:
        await bench.Timed(failing(), lambda dt, _: spent.append(dt))

    with pytest.raises(KeyError):
        asyncio.run(main())
    assert len(spent) == 1


def test_derive_computes_each_level_remainder() -> None:
    bench = _bench()
    phases = {
        "filter: request": 1.0,
        "filter: receive body": 0.01,
        "filter: decode args": 0.1,
        "filter: handler": 0.6,
        "filter: send answer": 0.2,
        "filter: metrics record": 0.04,
        "filter: pod_request": 0.05,
        "filter: feasibility (per-shape filter)": 0.15,
        "filter: scores and pick": 0.3,
        "filter: hold (GPU choice, ledger)": 0.1,
    }
    out = bench.derive(phases)
    assert out["filter: Starlette, middleware, rest"] == pytest.approx(0.05)
    assert out["filter: handler rest (names, answer body)"] == pytest.approx(0.1)
    assert out["filter: scores and pick"] == pytest.approx(0.2)  # without the hold it makes
    assert out["filter: hold (GPU choice, ledger)"] == pytest.approx(0.1)


@pytest.mark.skipif(not (DATA / "openb_node_list_gpu_node.csv").is_file(), reason="openb trace not found")
def test_cycles_runs_and_reports_every_phase(tmp_path: Path) -> None:
    out = tmp_path / "cycles.json"
    argv = [sys.executable, str(SCRIPT), "cycles", "--scale", "0", "--cycles", "20", "--warmup", "5"]
    argv += ["--full-prioritize-cycles", "5", "--out", str(tmp_path / "prof"), "--top", "5", "--json", str(out)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["nodes"] == 1213
    rows = {row["phase"]: row for row in report["narrow"]["rows"]}
    for phase in ("cycle (filter + prioritize calls)", "filter: decode args", "filter: handler", "prioritize: handler"):
        assert rows[phase]["warm_p50_ms"] > 0, phase
    assert report["narrow"]["cycles"] == report["filter_only"]["cycles"] == 20 and report["full"]["cycles"] == 5
    assert report["top_warm"] and report["top_cold_own"]
    assert (tmp_path / "prof" / "cycles-1213-warm.prof").is_file()


@pytest.mark.skipif(not os.environ.get("SHAREGPU_TEST_KUBECONFIG"), reason="needs a k8s-rig (SHAREGPU_TEST_KUBECONFIG)")
def test_rig_profile_runs_on_the_rig(tmp_path: Path) -> None:
    out = tmp_path / "rig.json"
    argv = [sys.executable, str(SCRIPT), "rig", "--nodes", "6", "--standing", "12", "--pods", "12", "--rounds", "1"]
    argv += ["--profile-pods", "6", "--out", str(tmp_path / "out"), "--top", "5", "--json", str(out)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [x["round"] for x in report["rounds"]] == ["s", "r1", "pg", "pt"]
    assert all(x["bound"] == x["pods"] and x["over_allocations"] == 0 for x in report["rounds"])
    first, later = report["summary"]
    assert "watch: view and ledger apply (create)" in {row["phase"] for row in first["rows"]}
    phases = {row["phase"] for row in later["rows"]}
    assert {"filter: request", "bind: Binding API write (lightkube, aiohttp, TLS)"} <= phases
    assert "watch: view and ledger apply (delete)" in phases
    assert later["total_ms_per_pod"] > 0
