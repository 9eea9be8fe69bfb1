"""Every command's ``--help`` is readable at 80 columns (issue 33: ``sharegpu scheduler-extender --help`` cut
``--consolidation-moves-per-minute`` to ``--consolidation-moves-per-min…``): no text is cut short with "…", and every
option's name appears whole. Run through typer's CliRunner with COLUMNS=80, as a terminal of that width reads it."""

from __future__ import annotations

from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from sharegpu.cli import app

runner = CliRunner()


def _commands() -> list[tuple[list[str], Any]]:
    out: list[tuple[list[str], Any]] = []

    def walk(path: list[str], cmd: Any) -> None:
        out.append((path, cmd))
        for name, sub in sorted((getattr(cmd, "commands", None) or {}).items()):
            walk([*path, name], sub)

    walk([], typer.main.get_command(app))
    return out


COMMANDS = _commands()


def test_every_command_is_checked() -> None:
    names = {" ".join(path) for path, _ in COMMANDS}
    assert {"", "sim", "scheduler-extender", "node-agent", "dra-driver", "webhook", "status", "bench"} <= names
    assert {"trace", "trace vary", "trace describe"} <= names


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=[" ".join(p) or "sharegpu" for p, _ in COMMANDS])
def test_help_at_80_columns_cuts_nothing(path: list[str], command: Any) -> None:
    r = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert max(len(line) for line in lines) <= 80, r.output
    assert "…" not in r.output, r.output
    names = [o for p in command.params if not getattr(p, "hidden", False) for o in (*p.opts, *p.secondary_opts)]
    for name in names:
        if name.startswith("--"):
            # whole: followed by a space, a comma or the table's edge, not by more of a longer name
            assert any(
                f"{name} " in line or f"{name}," in line or line.rstrip(" │").endswith(name) for line in lines
            ), (name, r.output)
