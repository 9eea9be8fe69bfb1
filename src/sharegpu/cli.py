"""The ``sharegpu`` command line."""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

from sharegpu.k8s.cli import scheduler_extender, status, webhook
from sharegpu.kube.kubeconfig import quiet_http_logging
from sharegpu.node.cli import dra_driver, node_agent
from sharegpu.sim.cli import sim
from sharegpu.sim.trace_cli import trace_app
from sharegpu.strategybench.cli import bench


def _names_never_cut() -> None:
    """Help tables that never cut an option's or a command's name: every column but the last (the help text) is
    no-wrap, so at a narrow terminal only the help text wraps. typer's options table lets rich shrink all its columns
    alike, and at 80 columns it cut ``--consolidation-moves-per-minute`` to ``--consolidation-moves-per-min…`` (a
    name of more than about 29 characters cannot fit beside a help column at least as wide). Applied when help is
    printed (typer imports its rich help module, about 170 ms, only then)."""
    from rich.table import Table
    from typer import rich_utils

    if getattr(getattr(rich_utils, "Table", None), "names_never_cut", False):
        return

    class HelpTable(Table):
        names_never_cut = True

        def add_row(self, *renderables: Any, **kwargs: Any) -> None:
            super().add_row(*renderables, **kwargs)
            for column in self.columns[:-1]:
                column.no_wrap = True

    setattr(rich_utils, "Table", HelpTable)  # noqa: B010  (not a name typer exports: mypy refuses the plain form)


class _Command(TyperCommand):
    def format_help(self, ctx: Any, formatter: Any) -> None:
        _names_never_cut()
        super().format_help(ctx, formatter)


class _Group(TyperGroup):
    def format_help(self, ctx: Any, formatter: Any) -> None:
        _names_never_cut()
        super().format_help(ctx, formatter)


app = typer.Typer(
    cls=_Group,
    help="sharegpu: GPU sharing for Kubernetes — ask for memory, compute and isolation; sharegpu picks "
    "time-slicing, MPS or MIG and places the share without fragmenting the cluster.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"sharegpu {version('sharegpu')}")
        raise typer.Exit()


@app.callback()
def root(
    show_version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """GPU sharing for Kubernetes."""
    quiet_http_logging()  # for every command: the node agent and the DRA driver talk to the API server too


app.command("sim", cls=_Command)(sim)
app.add_typer(trace_app, name="trace", cls=_Group)
app.command("node-agent", cls=_Command)(node_agent)
app.command("dra-driver", cls=_Command)(dra_driver)
app.command("scheduler-extender", cls=_Command)(scheduler_extender)
app.command("webhook", cls=_Command)(webhook)
app.command("status", cls=_Command)(status)
app.command("bench", cls=_Command)(bench)


def main() -> None:
    app()
