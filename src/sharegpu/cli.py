"""The ``sharegpu`` command line."""

from __future__ import annotations

from importlib.metadata import version

import typer

from sharegpu.k8s.cli import scheduler_extender, status, webhook
from sharegpu.kube.kubeconfig import quiet_http_logging
from sharegpu.node.cli import dra_driver, node_agent
from sharegpu.sim.cli import sim
from sharegpu.sim.trace_cli import trace_app
from sharegpu.strategybench.cli import bench

app = typer.Typer(
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


app.command("sim")(sim)
app.add_typer(trace_app, name="trace")
app.command("node-agent")(node_agent)
app.command("dra-driver")(dra_driver)
app.command("scheduler-extender")(scheduler_extender)
app.command("webhook")(webhook)
app.command("status")(status)
app.command("bench")(bench)


def main() -> None:
    app()
