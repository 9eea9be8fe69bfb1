"""bench/online_floor.py as the README runs it (issue 33: its example passed a file to write as --report, which
reads, and died with a traceback), and a bad --report, --traces or --json path as a message, not a traceback."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from proc_helpers import MAIN

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "online_floor.py"
DATA = ROOT.parent / "shared" / "data" / "openb"
needs_trace = pytest.mark.skipif(not (DATA / "openb_pod_list_default.csv").exists(), reason="no openb trace data")


def _floor(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (None, "no such file. --report reads a `sharegpu sim` JSON report"),
        ("name,cpu_milli\n", "cannot read it as JSON"),
        ("[1, 2]", "not a `sharegpu sim` JSON report"),
        ('{"summary": [{"policy": "fgd"}]}', "not a `sharegpu sim` JSON report (KeyError"),
    ],
)
def test_a_bad_report_is_a_message_and_exit_2(tmp_path: Path, content: str | None, words: str) -> None:
    report = tmp_path / "variant.json"
    if content is not None:
        report.write_text(content)
    r = _floor(tmp_path, "--traces", "x.csv", "--report", str(report))  # the report is read before anything else
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert f"online_floor.py: error: --report {report}: " in r.stderr and words in r.stderr, r.stderr


def test_a_missing_trace_or_json_folder_is_a_message_and_exit_2(tmp_path: Path) -> None:
    r = _floor(tmp_path, "--data", str(DATA), "--traces", str(tmp_path / "nope.csv"))
    if DATA.is_dir():  # without the data, --data is what is said
        assert r.returncode == 2 and f"--traces: {tmp_path / 'nope.csv'} does not exist" in r.stderr, r.stderr
    r = _floor(tmp_path, "--data", str(tmp_path))
    assert r.returncode == 2 and "openb_node_list_gpu_node.csv is not there" in r.stderr, r.stderr
    r = _floor(tmp_path, "--data", str(DATA), "--traces", "default", "--json", str(tmp_path / "no" / "f.json"))
    if DATA.is_dir():
        assert r.returncode == 2 and f"its directory {tmp_path / 'no'} does not exist" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def _readme_commands() -> list[str]:
    """The README's commands of the floor section: the `trace vary` that makes multigpu40.csv, then the block that
    runs online_floor.py on it (continuation lines joined)."""
    text = (ROOT / "README.md").read_text()
    blocks = [b.replace("\\\n", " ") for b in re.findall(r"```bash\n(.*?)```", text, re.S)]
    lines = [ln.split("  #")[0].strip() for b in blocks for ln in b.splitlines() if ln.strip()]
    vary = [ln for ln in lines if "trace vary" in ln and "-o multigpu40.csv" in ln]
    floor = next(b for b in blocks if "bench/online_floor.py --traces" in b)
    return vary + [ln.split("  #")[0].strip() for ln in floor.splitlines() if "--traces" in ln or " sim " in ln]


@needs_trace
@pytest.mark.trace
def test_the_readme_floor_of_a_variant_runs_as_written(tmp_path: Path) -> None:
    commands = _readme_commands()
    assert [c.split()[3:5] for c in commands] == [
        ["trace", "vary"],
        ["sim", "--nodes"],
        ["bench/online_floor.py", "--traces"],
    ]
    # The README's layout: the repository beside ../shared; a working folder of its own here.
    work = tmp_path / "work"
    work.mkdir()
    (work / "bench").symlink_to(ROOT / "bench")
    (tmp_path / "shared").symlink_to(ROOT.parent / "shared")
    results = []
    for command in commands:
        words = shlex.split(command)
        assert words[:2] == ["uv", "run"], command
        # One seed and FGD only for the sim (what the floor reads of it): the README's three seeds of two policies
        # take minutes; the commands are the README's otherwise.
        words = [("42" if w == "42-44" else "fgd" if w == "fgd,sharegpu" else w) for w in words[2:]]
        argv = [sys.executable, "-c", MAIN, *words[1:]] if words[0] == "sharegpu" else [sys.executable, *words[1:]]
        r = subprocess.run(
            argv, capture_output=True, text=True, cwd=work, timeout=600, env=os.environ | {"COLUMNS": "200"}
        )
        assert r.returncode == 0 and "Traceback" not in r.stderr, (command, r.stdout[-2000:], r.stderr[-2000:])
        results.append(r)
    assert "multigpu40 | " in results[-1].stdout and "(report)" in results[-1].stdout, results[-1].stdout
    (row,) = json.loads((work / "floor.json").read_text())["rows"]
    assert row["trace"] == "multigpu40" and row["fgd_source"] == "report" and row["floor_over_fgd"] is not None
