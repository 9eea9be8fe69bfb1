"""The ``sharegpu`` command line."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sharegpu.k8s.cli import scheduler_extender, status, webhook
from sharegpu.node.cli import dra_driver, node_agent
from sharegpu.placement.policies import UnknownPolicy, parse_policies
from sharegpu.sim.engine import RunResult
from sharegpu.sim.openb import TraceError, TraceTask, load_nodes, load_pods
from sharegpu.sim.protocol import parse_seeds
from sharegpu.sim.report import print_table, write_json, write_plot
from sharegpu.sim.runner import Experiment, run_experiment
from sharegpu.sim.scenario import DEFAULT_POLICIES, DEFAULT_SEEDS, scenario_nodes, scenario_tasks

app = typer.Typer(
    help="sharegpu: GPU sharing for Kubernetes — ask for memory, compute and isolation; sharegpu picks "
    "time-slicing, MPS or MIG and places the share without fragmenting the cluster.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def root() -> None:
    """GPU sharing for Kubernetes."""


class UsageError(Exception):
    """Bad command-line input; printed without a traceback, exit code 2."""


def _fail(console: Console, message: str) -> typer.Exit:
    console.print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(code=2)


@app.command()
def sim(
    nodes: Path | None = typer.Option(
        None, "--nodes", help="Node list CSV (openb format). Default: the embedded scenario."
    ),
    pods: Path | None = typer.Option(None, "--pods", help="Pod list CSV (openb format)."),
    policy: str | None = typer.Option(None, "--policy", help="Comma-separated policies, e.g. fgd,sharegpu."),
    seeds: str | None = typer.Option(None, "--seeds", help="Seeds: 42, 42-51 or 42,44."),
    tune: float = typer.Option(1.3, "--tune", help="Grow the workload until its GPU demand is this × capacity."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the JSON report here."),
    out: Path = typer.Option(Path("sharegpu-report"), "--out", help="Folder for the report (JSON and PNG)."),
    replay: bool = typer.Option(False, "--replay", help="Honour creation/deletion times (pods leave) instead."),
    jobs: int = typer.Option(0, "--jobs", help="Parallel runs; 0 = one per CPU core."),
) -> None:
    """Replay a workload through the placement policies and report GPU allocation (FGD paper protocol)."""
    console = Console(width=None if sys.stdout.isatty() else 120)
    try:
        exp = _experiment(nodes, pods, policy, seeds, tune, replay)
    except (TraceError, UnknownPolicy, UsageError, ValueError) as e:
        raise _fail(console, str(e)) from None
    if jobs < 0:
        raise _fail(console, f"--jobs {jobs} must be 0 (one per core) or more")
    started = time.perf_counter()
    runs = _run_with_progress(console, exp, jobs)
    title = f"{exp.name}: {exp.total_gpus} GPUs on {len(exp.nodes)} nodes, {len(exp.tasks)} tasks, tune {exp.tune}"
    print_table(console, runs, title, exp.total_gpus)
    json_path = json_out or out / "report.json"
    png_path = out / "allocation.png"
    meta: dict[str, object] = {
        "experiment": exp.name,
        "nodes": len(exp.nodes),
        "total_gpus": exp.total_gpus,
        "tasks": len(exp.tasks),
        "tune": exp.tune,
        "mode": "replay" if exp.replay else "fgd-protocol",
        "policies": list(exp.policies),
        "seeds": list(exp.seeds),
        "total_wall_s": round(time.perf_counter() - started, 3),
    }
    try:
        write_json(json_path, runs, meta)
        write_plot(png_path, runs, title)
    except OSError as e:
        raise _fail(console, f"cannot write the report: {e}") from None
    console.print(f"report: {json_path} (JSON), {png_path} (plot)")


def _experiment(
    nodes: Path | None, pods: Path | None, policy: str | None, seeds: str | None, tune: float, replay: bool
) -> Experiment:
    if (nodes is None) != (pods is None):
        raise UsageError("give both --nodes and --pods (a trace), or neither (the embedded scenario)")
    if not 0 < tune <= 100:
        raise UsageError(f"--tune {tune} must be above 0 (1.3 grows the workload to 130 % of GPU capacity)")
    if nodes is not None and pods is not None:
        node_list = load_nodes(nodes)
        tasks = load_pods(pods)
        if not any(n.gpus for n in node_list):
            raise UsageError(f"{nodes}: no node has a GPU")
        return Experiment(
            name=pods.stem,
            nodes=tuple(node_list),
            tasks=tuple(tasks),
            policies=tuple(parse_policies(policy or "fgd,sharegpu")),
            seeds=tuple(parse_seeds(seeds or "42")),
            tune=tune,
            replay=replay,
        )
    return Experiment(
        name="embedded scenario",
        nodes=tuple(scenario_nodes()),
        tasks=tuple(TraceTask(r) for r in scenario_tasks()),
        policies=tuple(parse_policies(policy or ",".join(DEFAULT_POLICIES))),
        seeds=tuple(parse_seeds(seeds) if seeds else DEFAULT_SEEDS),
        tune=tune,
        replay=replay,
    )


def _run_with_progress(console: Console, exp: Experiment, jobs: int) -> list[RunResult]:
    total = len(exp.policies) * len(exp.seeds)
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    ) as progress:
        bar = progress.add_task(f"simulating {total} run(s)", total=total)

        def done(r: RunResult) -> None:
            progress.update(bar, advance=1, description=f"{r.policy} seed {r.seed}: {r.wall_s:.1f}s")

        return run_experiment(exp, jobs, done)


app.command("node-agent")(node_agent)
app.command("dra-driver")(dra_driver)
app.command("scheduler-extender")(scheduler_extender)
app.command("webhook")(webhook)
app.command("status")(status)


def main() -> None:
    app()
