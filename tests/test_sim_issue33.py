"""The simulator's cases of issue 33's new user's sweep, one test per case; each fails on the code before its fix."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sharegpu.cli import app

runner = CliRunner()
NODES = "sn,cpu_milli,memory_mib,gpu,model\nn0,32000,131072,2,V100M16\nn1,32000,131072,4,T4\n"
PODS = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time\n" + "".join(
    f"p{i:03d},2000,4096,1,{300 + 50 * (i % 10)},,LS,Running,{10 * i},{10 * i + 95}\n" for i in range(12)
)


def sim(tmp_path: Path, *args: str):  # type: ignore[no-untyped-def]
    n, p = tmp_path / "nodes.csv", tmp_path / "pods.csv"
    n.write_text(NODES, encoding="utf-8")
    p.write_text(PODS, encoding="utf-8")
    return runner.invoke(app, ["sim", "--nodes", str(n), "--pods", str(p), "--jobs", "1", "--seeds", "1", *args])


def test_sim_never_overwrites_a_file_that_is_not_its_report_without_force(tmp_path: Path) -> None:
    notes, picture = tmp_path / "notes.txt", tmp_path / "notes.png"
    notes.write_text("my notes\n")
    picture.write_bytes(b"\x89PNG\r\n\x1a\nsomeone else's picture")
    r = sim(tmp_path, "--json", str(notes))
    assert r.exit_code == 2, r.output
    err = " ".join(r.stderr.split())
    assert err.startswith("error: --json") and "not a sharegpu report" in err and "--force" in err, err
    assert "Traceback" not in r.output and r.stdout == ""
    assert notes.read_text() == "my notes\n" and picture.read_bytes().endswith(b"someone else's picture")

    # The plot alone is refused too: notes.png is not a sharegpu plot.
    notes.unlink()
    r = sim(tmp_path, "--json", str(notes))
    assert r.exit_code == 2 and "the plot" in r.stderr and not notes.exists(), r.output

    # --force overwrites both; a rerun then replaces its own report and plot without it.
    r = sim(tmp_path, "--json", str(notes), "--force")
    assert r.exit_code == 0, r.output
    assert json.loads(notes.read_text())["runs"] and not picture.read_bytes().endswith(b"picture")
    r = sim(tmp_path, "--json", str(notes))
    assert r.exit_code == 0, r.output

    # A report folder from before plots were marked: the plot beside an earlier JSON report is replaced.
    folder = tmp_path / "earlier"
    folder.mkdir()
    (folder / "report.json").write_text(notes.read_text())
    (folder / "allocation.png").write_bytes(b"\x89PNG\r\n\x1a\nan unmarked plot")
    r = sim(tmp_path, "--out", str(folder))
    assert r.exit_code == 0, r.output

    # Under --out, a file at report.json that is not a report is refused the same way.
    (folder / "report.json").write_text("[1, 2]")
    r = sim(tmp_path, "--out", str(folder))
    assert r.exit_code == 2 and "the JSON report" in r.stderr and (folder / "report.json").read_text() == "[1, 2]"


def test_ctrl_c_during_a_parallel_run_is_one_line_and_exit_130(tmp_path: Path) -> None:
    # As a terminal's Ctrl-C: SIGINT to the whole process group, the command and each of its workers.
    report = tmp_path / "r.json"
    args = ["sim", "--seeds", "1-20", "--jobs", "4", "--json", str(report)]
    code = "import sys; from sharegpu.cli import app; sys.argv[0] = 'sharegpu'; app()"
    p = subprocess.Popen(
        [sys.executable, "-c", code, *args], stderr=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True
    )
    assert p.stderr is not None
    first = p.stderr.readline().decode()  # "simulating …": the workers are about to start
    assert first.startswith("simulating"), first
    time.sleep(2)
    assert p.poll() is None, "the run ended before the interrupt"
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=60)
    text = err.decode()
    assert p.returncode == 130, text
    assert "Traceback" not in text and "Error" not in text, text
    assert text.strip().splitlines() == [f"interrupted: no report written to {report}"], text
    assert not report.exists() and out == b""
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):  # no worker outlives the command
        os.killpg(p.pid, 0)


def test_every_process_of_a_parallel_run_starts_with_ctrl_c_blocked(tmp_path: Path) -> None:
    """The pool's workers (and the progress queue's manager) ignore SIGINT from their very start: they are forked
    with it blocked, and unblock it once they ignore it. Before, a Ctrl-C between a worker's fork and its initializer
    killed the worker with a traceback (the test above flaked under load). Each fork is recorded as it happens."""
    forks = tmp_path / "forks"
    forks.mkdir()
    n, p = tmp_path / "nodes.csv", tmp_path / "pods.csv"
    n.write_text(NODES, encoding="utf-8")
    p.write_text(PODS, encoding="utf-8")
    code = (
        "import os, signal, sys\n"
        "def mark():\n"
        f"    with open(os.path.join({str(forks)!r}, str(os.getpid())), 'w') as f:\n"
        "        f.write(str(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])))\n"
        "os.register_at_fork(after_in_child=mark)\n"
        "from sharegpu.cli import app; sys.argv[0] = 'sharegpu'; app()\n"
    )
    args = ["sim", "--nodes", str(n), "--pods", str(p), "--seeds", "1-4", "--jobs", "2", "--json", str(tmp_path / "r")]
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    blocked = {f.name: f.read_text() for f in forks.iterdir()}
    assert len(blocked) >= 2, blocked  # two workers at least
    assert set(blocked.values()) == {"True"}, blocked


def test_stopping_a_pool_mid_run_returns_once_its_manager_thread_has_ended() -> None:
    """After Ctrl-C the command stops its pool (sim.runner._stop) and exits. The pool's manager thread, left running,
    closed its wake-up pipe while the interpreter's exit wrote to it: a "Bad file descriptor" traceback after the
    one line (the Ctrl-C test above flaked so under load). _stop returns once that thread has ended."""
    from concurrent.futures import ProcessPoolExecutor

    from sharegpu.sim.runner import _ignore_interrupts, _stop

    pool = ProcessPoolExecutor(max_workers=2, initializer=_ignore_interrupts)
    futures = [pool.submit(time.sleep, 60) for _ in range(3)]
    manager, wakeup = pool._executor_manager_thread, pool._executor_manager_thread_wakeup  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30
    while not all(f.running() for f in futures[:2]):
        assert time.monotonic() < deadline, "the workers never started"
        time.sleep(0.05)
    started = time.monotonic()
    _stop(pool)
    assert time.monotonic() - started < 15  # the running sleeps were ended, not waited for
    assert manager is not None and not manager.is_alive()
    assert wakeup._closed  # what the interpreter's exit checks before it writes
    assert all(f.done() for f in futures)  # none is left to run: cancelled, or failed with the pool


REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(
    not (REPO.parent / "shared/data/openb/openb_pod_list_default.csv").exists(), reason="the openb trace is not there"
)
def test_placement_md_sim_replay_example_is_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The doc's own command, as written (paths relative to the repository root), checked up to the runs.
    text = " ".join((REPO / "docs/placement.md").read_text().split())
    command = re.search(r"`sharegpu (sim [^`]*--arrivals 20000)`", text)
    assert command is not None, "placement.md has no sim example with --arrivals 20000"
    started: list[object] = []
    monkeypatch.setattr("sharegpu.sim.cli.run_experiment", lambda *a, **k: started.append(a) or [])
    monkeypatch.chdir(REPO)
    r = runner.invoke(app, [*command.group(1).split(), "--out", str(tmp_path / "o")])
    assert started, r.output  # every option was accepted and the runs began


def test_a_pod_table_holds_one_string_per_distinct_value(tmp_path: Path) -> None:
    # 500,000 rows held millions of equal strings ("LS", "Running", "0", ""): about 200 MiB of a 1 GB peak.
    from sharegpu.sim.openb import read_pod_table

    pods = tmp_path / "pods.csv"
    pods.write_text(PODS, encoding="utf-8")
    rows = read_pod_table(pods).rows
    for column in ("qos", "pod_phase", "gpu_spec", "num_gpu", "cpu_milli"):
        assert len({id(r[column]) for r in rows}) == len({r[column] for r in rows}), column
