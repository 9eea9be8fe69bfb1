"""bench/gpu_node_check.py's own logic without a GPU: its use of the agent's usage rule and audit, on a reading shaped
as the H200 reported it (the MPS server's pid in the plain list with 66 MiB and the only SM figure; the clients in the
MPS-aware list); the daemon sweep's arithmetic (summaries, the table, the recommended cap and daemon memory) on
recorded numbers; its test client and start barrier against a stand-in CuPy; its arguments; and its refusal to run
where it cannot (not root, no MPS control, no GPU)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from sharegpu.node.audit import GpuReading
from sharegpu.node.backends.base import DeviceInfo, ProcessInfo, Utilization

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_node_check.py"
UNIT = "GPU-0000"
SERVER = "nvidia-cuda-mps-server"


@pytest.fixture(scope="module")
def check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_node_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_node_check"] = mod
    spec.loader.exec_module(mod)
    return mod


def reading(procs: dict[int, int], mps: set[int], sm: dict[int, int], used: int = 2000) -> GpuReading:
    dev = DeviceInfo(0, UNIT, "NVIDIA H200", "H200-141GB", 143771, 132, False)
    plain = tuple(ProcessInfo(pid, 0, UNIT, mib) for pid, mib in procs.items())
    return GpuReading(dev, Utilization(40, 10), used, plain, frozenset(mps), sm)


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


# ----- arguments ----------------------------------------------------------------------------------------------------
def test_arguments_default_to_the_full_sweep_and_take_ks_and_a_window(check: ModuleType) -> None:
    args = check.parse_args([])
    assert (args.gpu, args.ks, args.window_s, args.skip_sweep, args.only_sweep) == (
        0,
        (1, 2, 4, 8, 16),
        3.0,
        False,
        False,
    )
    assert args.out == Path("gpu-node-check")
    args = check.parse_args(["--ks", "16, 4,4,1", "--window-s", "2.5", "--gpu", "1", "--skip-sweep", "--out", "x"])
    assert (args.gpu, args.ks, args.window_s, args.skip_sweep, args.out) == (1, (1, 4, 16), 2.5, True, Path("x"))
    assert check.parse_args(["--only-sweep"]).only_sweep and not check.parse_args([]).only_sweep


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--ks", "0,4"], "from 1 to 48"),
        (["--ks", "49"], "from 1 to 48"),
        (["--ks", "two"], "comma-separated"),
        (["--ks", ""], "from 1 to 48"),
        (["--window-s", "0"], "more than 0"),
        (["--window-s", "soon"], "number of seconds"),
        (["--skip-sweep", "--only-sweep"], "not allowed with"),
    ],
)
def test_bad_arguments_exit_2_saying_why(
    check: ModuleType, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    with pytest.raises(SystemExit) as e:
        check.parse_args(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


# ----- the sweep's arithmetic on recorded numbers -------------------------------------------------------------------
def client(tflops: float | None, cuda_s: float = 0.9, uid: int = 1001, **more: Any) -> dict[str, Any]:
    r: dict[str, Any] = {"ok": True, "pid": 1, "uid": uid, "cuda_s": cuda_s, "late_s": 0.0, "init_s": cuda_s + 1}
    if tflops is not None:
        r["tflops"] = tflops
    return r | more


def config(total: float, k: int, cuda_s: float = 0.9, servers: list[int] | None = None, **more: Any) -> dict[str, Any]:
    """One configuration of k clients sharing ``total`` TFLOP/s, as summarize and nvml_view would give it."""
    mib = servers if servers is not None else []
    out = {**summarize_of(total, k, cuda_s), "servers": len(mib), "server_mib": mib, "mps_clients": k if mib else 0}
    return out | more


def summarize_of(total: float, k: int, cuda_s: float) -> dict[str, Any]:
    return {
        "clients": k,
        "ran": k,
        "tflops": total,
        "cuda_init_max_s": cuda_s,
        "cuda_init_median_s": cuda_s,
        "errors": [],
    }


def row(check: ModuleType, k: int, daemons: float, one: float, sliced: float, **kw: Any) -> dict[str, Any]:
    cuda = kw.pop("cuda_s", 0.9)
    mib = kw.pop("server_mib", 66)
    return check.sweep_row(
        k,
        config(daemons, k, cuda, [mib] * k, **kw),
        config(one, k, 0.9, [66]),
        config(sliced, k),
        daemon_start_s=0.1 * k,
    )


def test_summarize_counts_the_clients_that_ran_their_window_and_their_cuda_init(check: ModuleType) -> None:
    results = [
        client(320.5, 0.84),
        client(318.0, 1.2, uid=1002),
        client(12.0, 0.9, uid=1003, died="CUDARuntimeError: cudaErrorIllegalAddress"),
        {"ok": False, "error": "CUDARuntimeError: cudaErrorInitializationError", "uid": 1004, "cuda_s": 0.1},
        {"hung": True, "stderr": "waiting"},
    ]
    s = check.summarize(results)
    assert (s["clients"], s["ran"], s["tflops"]) == (5, 2, 638.5)
    assert s["cuda_init_max_s"] == 1.2 and s["cuda_init_median_s"] == 0.87
    assert s["uids"] == [1001, 1002, 1003, 1004]
    assert s["errors"] == [
        "CUDARuntimeError: cudaErrorIllegalAddress",
        "CUDARuntimeError: cudaErrorInitializationError",
        "hung: waiting",
    ]
    empty = check.summarize([])
    assert (empty["ran"], empty["tflops"], empty["cuda_init_max_s"]) == (0, 0, None)


def test_the_servers_memory_is_read_by_the_agents_rule(check: ModuleType) -> None:
    # Two daemons, a server each (66 and 68 MiB), two clients; a third process that is neither (its own context).
    r = reading({700: 66, 710: 68, 801: 300, 802: 310, 950: 500}, {801, 802}, {}, used=1900)
    names = {700: SERVER, 710: SERVER[:15], 801: "python3", 802: "python3", 950: "python3"}
    view = check.nvml_view(r, [801, 802], names.get)
    assert view == {"servers": 2, "server_mib": [66, 68], "mps_clients": 2, "gpu_used_mib": 1900}
    # A client that NVML's MPS-aware list lacks fell back to a context of its own: counted, not a server.
    view = check.nvml_view(reading({700: 66, 801: 300, 802: 300}, {801}, {}), [801, 802], names.get)
    assert (view["servers"], view["mps_clients"]) == (1, 1)
    assert check.nvml_view(None, [801], names.get) == {"nvml_error": None}
    assert "NVMLError" in check.nvml_view(type("NVMLError", (Exception,), {})("gone"), [], names.get)["nvml_error"]


def test_the_cap_is_the_largest_k_whose_daemons_keep_up_with_one_daemon_and_every_smaller_k_too(
    check: ModuleType,
) -> None:
    rows = [
        row(check, 1, 650, 652, 655),
        row(check, 2, 640, 660, 610),
        row(check, 4, 600, 650, 605),  # 92 %: within 10 %
        row(check, 8, 560, 648, 600),  # 86 %: short
        row(check, 16, 600, 640, 590, server_mib=70),  # 94 %, but k = 8 fell short: not the cap
    ]
    assert rows[2]["vs_one_daemon"] == 0.923 and rows[2]["vs_time_slicing"] == 0.992
    rec = check.recommend(rows)
    assert rec["daemons_per_unit"] == 4
    assert rec["daemon_memory_mib"] == 70  # the largest server NVML listed
    assert rec["swept"] == [1, 2, 4, 8, 16]
    assert list(rec["shortfalls"]) == ["8"]
    assert "86% of one daemon's 648" in rec["shortfalls"]["8"][0]
    assert rec["text"].startswith("daemon cap 4 (k = 8 fell short); 70 MiB per daemon")
    # A looser rule takes k = 8 and so 16; rows may come in any order.
    loose = check.recommend(list(reversed(rows)), within=0.15)
    assert loose["daemons_per_unit"] == 16 and loose["text"].startswith("daemon cap at least 16")


def test_a_slow_cuda_init_or_a_failed_client_keeps_k_out_of_the_cap(check: ModuleType) -> None:
    slow = [row(check, 1, 650, 650, 650), row(check, 2, 640, 650, 640), row(check, 4, 640, 650, 640, cuda_s=7.5)]
    rec = check.recommend(slow)
    assert rec["daemons_per_unit"] == 2
    assert rec["shortfalls"] == {"4": ["a client's CUDA init took 7.5 s (bound 5 s)"]}
    assert check.recommend(slow, init_bound_s=8.0)["daemons_per_unit"] == 4

    failed = row(check, 4, 480, 650, 640)
    failed["daemons"] |= {"ran": 3, "errors": ["CUDARuntimeError: cudaErrorDevicesUnavailable"], "mps_clients": 3}
    reasons = check.shortfalls(failed)
    assert reasons[0] == "1 of 4 clients on their own daemons failed (CUDARuntimeError: cudaErrorDevicesUnavailable)"
    assert "only 3 of 4 clients were MPS clients (NVML)" in reasons

    broken_reference = row(check, 2, 640, 0, 640)
    broken_reference["one_daemon"] |= {"ran": 0}
    assert check.shortfalls(broken_reference) == ["the reference, one daemon with 2 clients, had 2 fail"]


def test_no_cap_when_the_smallest_k_falls_short_and_no_memory_when_no_server_was_read(check: ModuleType) -> None:
    r = row(check, 1, 100, 650, 650, server_mib=66)
    r["daemons"]["server_mib"] = []
    r["one_daemon"]["server_mib"] = []
    rec = check.recommend([r])
    assert (rec["daemons_per_unit"], rec["daemon_memory_mib"]) == (None, None)
    assert rec["text"] == "no cap measured: the smallest k swept fell short; no MPS server memory read"
    assert check.recommend([])["daemons_per_unit"] is None


def test_the_table_has_a_line_per_k_with_its_verdict(check: ModuleType) -> None:
    rows = [row(check, 16, 560, 648, 600, server_mib=66), row(check, 1, 650, 652, 655)]
    rows[0]["daemons"]["server_mib"] = [66, 68, 66]
    lines = check.table(rows)
    assert len(lines) == 4 and lines[0].split()[0] == "k" and set(lines[1]) == {"-"}
    one, sixteen = lines[2], lines[3]
    assert one.split("|")[0].strip() == "1" and one.endswith("| ok")
    assert "100%" in one and "66" in one
    assert sixteen.split("|")[0].strip() == "16" and "66-68" in sixteen and "86%" in sixteen
    assert "below 90%" in sixteen.split("|")[-1]
    # Nothing measured prints dashes, not an error.
    empty = check.sweep_row(2, {"tflops": 0}, {"tflops": 0}, {"tflops": 0})
    assert "–" in check.table([empty])[2]


# ----- the client and the start barrier, against a stand-in CuPy ---------------------------------------------------
FAKE_CUPY = """
float16 = uint8 = None
class _Array:
    def __matmul__(self, other):
        return self
def ones(shape, dtype=None):
    return _Array()
def empty(n, dtype=None):
    return _Array()
class cuda:
    class runtime:
        @staticmethod
        def deviceSynchronize():
            pass
"""


def test_clients_started_together_measure_one_window(
    check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "cupy.py").write_text(FAKE_CUPY)
    monkeypatch.setenv("PYTHONPATH", str(fake))
    work = tmp_path / "work"
    work.mkdir()
    clients = check.Clients(work, UNIT)
    results, seen = clients.together([check.Job(None), check.Job("/nowhere")], 0.3, lambda: "read", read_after_s=0.1)
    assert seen == "read"
    assert all(check.client_ran(r) for r in results), results
    assert {r["pipe"] for r in results} == {"/nonexistent-sharegpu-pipe", "/nowhere"}
    assert all(r["lib"] == "cupy" and r["late_s"] < 0.5 and "cuda_s" in r and "import_s" in r for r in results)
    s = check.summarize(results)
    assert s["ran"] == 2 and s["tflops"] > 0
    # A read that fails costs nothing of the clients' results.
    results, seen = clients.together([check.Job(None)], 0.1, lambda: 1 / 0)
    assert isinstance(seen, ZeroDivisionError) and check.client_ran(results[0])
    # A client that cannot start does not hold the others at the barrier.
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "no-cupy-here"))
    results, _ = clients.together([check.Job(None)], 0.1)
    assert not check.client_ran(results[0]) and results[0]["ok"] is False
    alloc = clients.run("alloc", {"gib": [0.001]}, None)
    assert alloc["ok"] is False  # neither CuPy nor PyTorch here: said, not hung


FAKE_MPS_CONTROL = """#!/bin/sh
# A stand-in nvidia-cuda-mps-control: -d makes the daemon (a file in its pipe directory), quit removes it, any other
# command succeeds while it exists.
if [ "$1" = "-d" ]; then mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" && : > "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0; fi
commands=$(cat)
[ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] || exit 1
case "$commands" in quit*) rm -f "$CUDA_MPS_PIPE_DIRECTORY/control" ;; esac
exit 0
"""


class StandInGpu:
    """NVML as a GPU under MPS would show the check's clients: a client whose pipe directory has a (stand-in) daemon
    is an MPS client of 300 MiB and that directory's one server (66 MiB) is listed while it has clients; any other
    client has a context of its own (500 MiB)."""

    SERVER_PIDS = 10_000_000

    def __init__(self, script: Path) -> None:
        self.script = str(script)

    def _clients(self) -> dict[int, str | None]:
        out: dict[int, str | None] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if self.script.encode() not in argv[:3]:
                continue
            pipe = next((e[24:].decode() for e in environ if e.startswith(b"CUDA_MPS_PIPE_DIRECTORY=")), None)
            out[int(entry.name)] = pipe if pipe and (Path(pipe) / "control").exists() else None
        return out

    def _pipes(self, clients: dict[int, str | None]) -> list[str]:
        return sorted({p for p in clients.values() if p})

    def processes(self, gpu: int) -> tuple[ProcessInfo, ...]:
        clients = self._clients()
        servers = [ProcessInfo(self.SERVER_PIDS + i, gpu, UNIT, 66) for i, _ in enumerate(self._pipes(clients))]
        return (*servers, *(ProcessInfo(pid, gpu, UNIT, 300 if pipe else 500) for pid, pipe in clients.items()))

    def mps_processes(self, gpu: int) -> tuple[ProcessInfo, ...]:
        return tuple(ProcessInfo(pid, gpu, UNIT, 300) for pid, pipe in self._clients().items() if pipe)

    def process_name(self, pid: int) -> str:
        return SERVER if pid >= self.SERVER_PIDS else "python3"

    def utilization(self, gpu: int) -> Utilization:
        return Utilization(90, 10)

    def memory_used_mib(self, gpu: int) -> int:
        return sum(p.used_memory_mib for p in self.processes(gpu))

    def process_utilization(self, gpu: int) -> dict[int, int]:
        return {}


def other_users_can_run_clients(where: Path) -> bool:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return False
    probe = ["setpriv", "--reuid", "1001", "--regid", "1001", "--clear-groups", sys.executable, "-c", "pass"]
    return subprocess.run(probe, capture_output=True, cwd=where, timeout=60).returncode == 0


def test_the_sweep_runs_end_to_end_against_stand_ins(
    check: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The sweep's own orchestration (stage 9, run_sweep) with the manager and daemon the agent uses, the clients as
    # other UIDs and NVML read by the agent's rule; the GPU, its driver's MPS control and CuPy are stand-ins.
    from sharegpu.node.audit import read_gpu
    from sharegpu.node.mps import MpsManager, NvidiaMpsDaemon

    work = Path(tempfile.mkdtemp(prefix="gpu-node-check-"))  # not pytest's tmp_path: other users must reach it
    try:
        os.chmod(work, 0o755)
        if not other_users_can_run_clients(work):
            pytest.skip("needs root, setpriv and a Python that other users can run")
        (work / "py").mkdir()
        (work / "py" / "cupy.py").write_text(FAKE_CUPY)
        (work / "bin").mkdir()
        (work / "bin" / "nvidia-cuda-mps-control").write_text(FAKE_MPS_CONTROL)
        os.chmod(work / "bin" / "nvidia-cuda-mps-control", 0o755)
        monkeypatch.setenv("PYTHONPATH", str(work / "py"))
        monkeypatch.setenv("PATH", f"{work / 'bin'}:{os.environ['PATH']}")
        (work / "clients").mkdir()
        clients = check.Clients(work / "clients", UNIT)
        gpu = StandInGpu(clients.script)
        dev = DeviceInfo(0, UNIT, "NVIDIA H200", "H200-141GB", 143771, 132, False)
        result = check.Check(work / "out")
        manager = MpsManager(work / "mps-sweep", NvidiaMpsDaemon())

        asyncio.run(check.run_sweep(result, manager, clients, gpu, 0, lambda: read_gpu(gpu, dev), (1, 2), 0.6))

        assert [r["check"] for r in result.results] == ["sweep.k1", "sweep.k2", "mps.daemon_sweep"]
        rows = result.data["mps.daemon_sweep"]["rows"]
        two = rows[1]
        assert (two["daemons"]["ran"], two["one_daemon"]["ran"], two["time_slicing"]["ran"]) == (2, 2, 2)
        assert two["daemons"]["uids"] == [1001, 1002] and two["one_daemon"]["uids"] == [1001]
        assert (two["daemons"]["servers"], two["daemons"]["server_mib"], two["daemons"]["mps_clients"]) == (
            2,
            [66, 66],
            2,
        )
        assert (two["one_daemon"]["servers"], two["time_slicing"]["servers"], two["time_slicing"]["mps_clients"]) == (
            1,
            0,
            0,
        )
        rec = result.data["mps.daemon_sweep"]["recommendation"]
        assert rec["daemon_memory_mib"] == 66 and rec["swept"] == [1, 2]
        assert manager.running() == frozenset()  # every daemon it started was stopped
        printed = capsys.readouterr().out
        assert "The daemon sweep" in printed and "[INFO    ] sweep.k2" in printed
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ----- where it cannot run ------------------------------------------------------------------------------------------
def test_it_refuses_to_run_without_root_or_the_mps_control(check: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check.os, "geteuid", lambda: 1000)
    assert check.main(["--out", "/nonexistent"]) == 2
    monkeypatch.setattr(check.os, "geteuid", lambda: 0)
    monkeypatch.setattr(check.shutil, "which", lambda _: None)
    assert check.main(["--out", "/nonexistent"]) == 2


def nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    pynvml.nvmlShutdown()
    return True


def test_without_a_gpu_it_exits_2_saying_so(
    check: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    if nvml_works():
        pytest.skip("this machine has an NVIDIA driver: the no-GPU path cannot be seen here")
    monkeypatch.setattr(check.os, "geteuid", lambda: 0)
    monkeypatch.setattr(check.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert check.main(["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "no NVIDIA GPU is usable here" in err and "NVML" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # it stopped before writing anything


def test_a_gpu_index_nvml_does_not_list_exits_2(
    check: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sharegpu.node.backends.nvml as nvml
    import sharegpu.node.backends.nvml_api as nvml_api

    class OneGpu:
        def __init__(self, api: object) -> None:
            self.closed = False

        def devices(self) -> tuple[DeviceInfo, ...]:
            return (DeviceInfo(0, UNIT, "NVIDIA H200", "H200-141GB", 143771, 132, False),)

        def close(self) -> None:
            self.closed = True

    monkeypatch.setattr(nvml_api, "PynvmlApi", lambda: object())
    monkeypatch.setattr(nvml, "NvmlBackend", OneGpu)
    assert isinstance(check.preflight(0), tuple)
    monkeypatch.setattr(check.os, "geteuid", lambda: 0)
    monkeypatch.setattr(check.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert check.main(["--gpu", "3"]) == 2
    assert "there is no GPU 3 (NVML lists 1 GPU(s), use --gpu)" in capsys.readouterr().err


def test_it_imports_on_a_gpu_machine_without_the_kubernetes_client() -> None:
    # A bare GPU machine has NVML, numpy and CuPy or PyTorch, not lightkube, pydantic or PyYAML (the H200's image had
    # none of them): the check and the node code it drives must import without them.
    code = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in ('lightkube', 'pydantic', 'yaml'):
            raise ImportError('not on a bare GPU machine: ' + name)
sys.meta_path.insert(0, Block())
sys.path.insert(0, {str(SCRIPT.parent)!r})
import gpu_node_check
from sharegpu.ledger import DEFAULT_DAEMONS_PER_UNIT, MPS_DAEMON_MEMORY_MIB, Ledger, MpsTenancy
from sharegpu.model.tenant import user_tenant
from sharegpu.node.audit import read_gpu
from sharegpu.node.backends.nvml import NvmlBackend
from sharegpu.node.mps import MpsLimits, MpsManager, NvidiaMpsDaemon
from sharegpu.node.mps_faults import fault_lines
from sharegpu.placement.framework import Scheduler
from sharegpu.placement.policies import make_policy
assert gpu_node_check.parse_args(["--ks", "2"]).ks == (2,)
assert gpu_node_check.recommend([])["daemons_per_unit"] is None
from pathlib import Path
assert MpsManager(Path("/tmp/x"), NvidiaMpsDaemon(), multi_user=True).spec("GPU-1", user_tenant("ns", 5)).multi_user
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
