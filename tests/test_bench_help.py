"""Every bench script that parses options answers ``--help`` (issue 21: a bare ``%`` in an argparse help string made
``bench/online_floor.py --help`` and ``bench/upper_bound.py --help`` die with ``TypeError: %o format``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
# A script that imports argparse takes options, so it must take --help; the others run as they are.
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if "argparse" in p.read_text(encoding="utf-8"))


def test_the_scripts_that_take_options_are_found() -> None:
    names = {p.name for p in SCRIPTS}
    assert {"online_floor.py", "upper_bound.py", "sim_speed.py"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bench_script_help(script: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120, cwd=BENCH.parent
    )
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout.startswith("usage:"), r.stdout[:200]
    assert f"{script.name}" in r.stdout.splitlines()[0]
