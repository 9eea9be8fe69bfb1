"""Every bench script answers ``--help`` with its usage, at once, and writes nothing: issue 21 (a bare ``%`` in an
argparse help string made ``bench/online_floor.py --help`` die with ``TypeError: %o format``) and issue 28
(``bench/metrics_hook_cost.py --help`` and ``bench/cli_sweep.py --help`` ignored it: the sweep ran whole and left
its files behind)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))


def test_every_bench_script_is_checked() -> None:
    names = {p.name for p in SCRIPTS}
    assert {"online_floor.py", "upper_bound.py", "sim_speed.py", "metrics_hook_cost.py", "cli_sweep.py"} <= names


def _files(d: Path) -> set[Path]:
    return {p for p in d.rglob("*") if "__pycache__" not in p.parts}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bench_script_help(script: Path, tmp_path: Path) -> None:
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    bench_before = _files(BENCH)
    env = os.environ | {"TMPDIR": str(tmp), "BIN": "false"}  # a sweep that ran anyway would run nothing
    # The timeout guards against a script that runs instead of answering; it is no speed target.
    r = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout.startswith("usage:"), r.stdout[:200]
    assert f"{script.name}" in r.stdout.splitlines()[0]
    assert not _files(cwd) and not _files(tmp), "--help wrote files"
    assert _files(BENCH) == bench_before, "--help wrote files in bench/"
