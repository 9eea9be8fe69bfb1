"""What the image's entry point relies on: the wheel that ``uv build`` makes, installed with uv.lock's dependencies
into a clean virtual environment outside the source tree, runs ``sharegpu --help`` and every subcommand's ``--help``.

Marked ``packaging`` (it builds a wheel and installs about 40 packages, from uv's cache when warm: a few seconds,
more on a cold cache); it runs in CI with the rest. ``-m "not packaging"`` leaves it out.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from sharegpu.cli import app

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.packaging


def _run(cmd: list[str | Path], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH (pip install uv)")
    tmp = tmp_path_factory.mktemp("wheel")
    # No trace of the development environment: not its venv, not the source tree on sys.path.
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    _run([uv, "build", "--wheel", "--out-dir", tmp / "dist"], ROOT, env)
    (wheel,) = (tmp / "dist").glob("sharegpu-*.whl")
    req = tmp / "requirements.txt"
    _run(
        [uv, "export", "--frozen", "--no-dev", "--no-emit-project", "--format", "requirements-txt", "-o", req],
        ROOT,
        env,
    )
    venv = tmp / "venv"
    _run([uv, "venv", "--python", sys.executable, venv], tmp, env)
    python = venv / "bin" / "python"
    _run([uv, "pip", "install", "--python", python, "--require-hashes", "-r", req], tmp, env)
    _run([uv, "pip", "install", "--python", python, "--no-deps", wheel], tmp, env)
    return venv, env


def test_the_installed_package_comes_from_the_wheel(installed: tuple[Path, dict[str, str]]) -> None:
    venv, env = installed
    out = _run([venv / "bin" / "python", "-c", "import sharegpu; print(sharegpu.__file__)"], venv, env)
    assert Path(out.stdout.strip()).is_relative_to(venv), out.stdout


# Run inside the installed environment: every subcommand's --help through click's runner, in one process (each
# separate `sharegpu X --help` would pay the CLI's import time again).
HELP_ALL = """
import json, typer
from typer.testing import CliRunner
import sharegpu.cli as c
out = {}
for name in sorted(typer.main.get_command(c.app).commands):
    r = CliRunner().invoke(c.app, [name, "--help"], prog_name="sharegpu")
    out[name] = [r.exit_code, r.output]
print(json.dumps(out))
"""


def test_sharegpu_and_every_subcommand_answer_help(installed: tuple[Path, dict[str, str]]) -> None:
    venv, env = installed
    out = _run([venv / "bin" / "sharegpu", "--help"], venv, env)  # the console script the image's entry point runs
    assert "Usage: sharegpu" in out.stdout
    helps = json.loads(_run([venv / "bin" / "python", "-c", HELP_ALL], venv, env).stdout)
    # The wheel carries every command of the source tree.
    assert sorted(helps) == sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
    assert {"sim", "status", "scheduler-extender", "webhook", "node-agent"} <= set(helps)
    for name, (code, text) in helps.items():
        assert code == 0 and f"Usage: sharegpu {name}" in " ".join(text.split()), (name, text)
