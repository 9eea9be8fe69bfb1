"""Where the simulator's commands write: stdout and stderr consoles (a pipe or a file gets tables at full width,
never cut), error and warning lines, and whether two paths name one file. Shared by ``sim`` and ``trace``."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import typer
from rich.console import Console

# Not a terminal (a pipe, a file): as wide as a table needs, so that no name or number is ever cut to fit.
PIPE_WIDTH = 1000


def err_console() -> Console:
    return Console(stderr=True, width=None if sys.stderr.isatty() else 120)


def out_console() -> Console:
    return Console(width=None if sys.stdout.isatty() else PIPE_WIDTH)


def error(message: str) -> typer.Exit:
    err_console().print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(code=2)


def warn(message: object) -> None:
    err_console().print(f"[yellow]warning:[/] {message}", highlight=False)


def same_file(a: Path, b: Path) -> bool:
    """Whether writing ``a`` would write ``b``: the same path once resolved, or a link to the same file."""
    if a.resolve() == b.resolve():
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def overwrite_refusal(
    flag: str, path: Path, force: bool, ours: Callable[[Path], bool] | None = None, ours_name: str = ""
) -> str | None:
    """The one rule of ``sim`` and ``trace vary`` for an output file that already exists: without ``--force`` it is
    refused, unless ``ours`` tells it as a file the command itself writes (``ours_name``: a sharegpu report, which a
    rerun replaces). Returns the refusal's words, or None to go ahead."""
    if force or not path.exists() or (ours is not None and ours(path)):
        return None
    kept = f" and is not {ours_name}" if ours is not None else ""
    return f"{flag} {path} exists{kept}; give --force to overwrite it"
