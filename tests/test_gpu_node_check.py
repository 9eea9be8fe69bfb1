"""bench/gpu_node_check.py's own logic without a GPU: its use of the agent's usage rule and audit, on a reading shaped
as the H200 reported it (the MPS server's pid in the plain list with 66 MiB and the only SM figure; the clients in the
MPS-aware list), and its refusal to run where it cannot."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from sharegpu.node.audit import GpuReading
from sharegpu.node.backends.base import DeviceInfo, ProcessInfo, Utilization

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_node_check.py"
UNIT = "GPU-0000"


@pytest.fixture(scope="module")
def check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_node_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_node_check"] = mod
    spec.loader.exec_module(mod)
    return mod


def reading(procs: dict[int, int], mps: set[int], sm: dict[int, int]) -> GpuReading:
    dev = DeviceInfo(0, UNIT, "NVIDIA H200", "H200-141GB", 143771, 132, False)
    plain = tuple(ProcessInfo(pid, 0, UNIT, mib) for pid, mib in procs.items())
    return GpuReading(dev, Utilization(40, 10), 2000, plain, frozenset(mps), sm)


def test_usage_under_mps_is_the_servers_figure_for_one_client_and_unknown_for_two(check: ModuleType) -> None:
    two = reading({900: 66, 901: 500, 902: 730}, {901, 902}, {900: 46})
    rows, units = check.usage(two, {901: "pod-a", 902: "pod-b"})
    assert {(r.pod_uid, r.memory_mib, r.sm_percent) for r in rows} == {("pod-a", 500, None), ("pod-b", 730, None)}
    assert [(u.sm_percent, u.client_pods) for u in units] == [(46, 2)]
    one = reading({900: 66, 901: 500}, {901}, {900: 36})
    rows, _ = check.usage(one, {901: "pod-a"})
    assert [(r.pod_uid, r.sm_percent) for r in rows] == [("pod-a", 36)]


def test_the_audit_finds_the_client_that_bypassed_mps_and_only_it(check: ModuleType) -> None:
    r = reading({900: 66, 901: 1100, 950: 1100}, {901}, {})
    found = check.audit_of(r, {"pod-bypass": 950, "pod-inside": 901}, UNIT, 0)
    assert {(f.kind.value, f.pod) for f in found} == {("mps-bypass", "pod-bypass")}


def test_it_refuses_to_run_without_root_or_the_mps_control(check: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check.os, "geteuid", lambda: 1000)
    assert check.main(["--out", "/nonexistent"]) == 2
    monkeypatch.setattr(check.os, "geteuid", lambda: 0)
    monkeypatch.setattr(check.shutil, "which", lambda _: None)
    assert check.main(["--out", "/nonexistent"]) == 2


def test_it_imports_on_a_gpu_machine_without_the_kubernetes_client() -> None:
    # A bare GPU machine has NVML, numpy and CuPy or PyTorch, not lightkube, pydantic or PyYAML (the H200's image had
    # none of them): the check and the node code it drives must import without them.
    import subprocess

    code = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in ('lightkube', 'pydantic', 'yaml'):
            raise ImportError('not on a bare GPU machine: ' + name)
sys.meta_path.insert(0, Block())
sys.path.insert(0, {str(SCRIPT.parent)!r})
import gpu_node_check
from sharegpu.node.audit import read_gpu
from sharegpu.node.backends.nvml import NvmlBackend
from sharegpu.node.mps import MpsManager
from sharegpu.node.mps_faults import fault_lines
from sharegpu.placement.policies import make_policy
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
