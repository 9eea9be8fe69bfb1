"""The simulator's commands: ``sim`` (replay a workload through the policies) and the ``trace`` group
(inspect and derive openb pod lists); registered on the root app in sharegpu.cli."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sharegpu.placement.policies import UnknownPolicy, parse_policies
from sharegpu.sim.engine import RunResult
from sharegpu.sim.openb import TraceError, TraceTask, load_nodes, load_pods, read_pod_table
from sharegpu.sim.protocol import parse_seeds
from sharegpu.sim.report import print_table, write_json, write_plot
from sharegpu.sim.runner import Experiment, run_experiment
from sharegpu.sim.scenario import DEFAULT_POLICIES, DEFAULT_SEEDS, scenario_nodes, scenario_tasks
from sharegpu.sim.variants import Shares, VariantError, VariantSpec, measure, vary, write_variant


class UsageError(Exception):
    """Bad command-line input; printed without a traceback, exit code 2."""


def _fail(console: Console, message: str) -> typer.Exit:
    console.print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(code=2)


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


trace_app = typer.Typer(
    help="Inspect openb pod lists and derive variants of them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _err() -> Console:
    return Console(stderr=True, width=None if sys.stderr.isatty() else 120)


def _out() -> Console:
    return Console(width=None if sys.stdout.isatty() else 120)


def _error(message: str) -> typer.Exit:
    _err().print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(code=2)


def _warn(message: object) -> None:
    _err().print(f"[yellow]warning:[/] {message}", highlight=False)


def _shares_table(title: str, rows: dict[str, Shares]) -> Table:
    t = Table(
        title=title,
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        caption="CPU-only: % of pods; sharing, multi-GPU: % of GPU demand; gpu_spec: % of GPU pods with a model "
        "constraint",
    )
    t.add_column("pod list")
    columns = (
        ("pods", "pods", "{:,.0f}"),
        ("GPU pods", "gpu_pods", "{:,.0f}"),
        ("GPU demand", "gpu_demand_gpus", "{:,.1f}"),
        ("CPU-only %", "cpu_only_pct", "{:.1f}"),
        ("sharing %", "sharing_pct", "{:.1f}"),
        ("multi-GPU %", "multi_gpu_pct", "{:.1f}"),
        ("gpu_spec %", "gpu_spec_pct", "{:.1f}"),
    )
    for label, _, _ in columns:
        t.add_column(label, justify="right", no_wrap=True)
    for name, shares in rows.items():
        d = shares.as_dict()
        t.add_row(name, *(fmt.format(d[key]) for _, key, fmt in columns))
    return t


@trace_app.command("vary")
def trace_vary(
    base: Path = typer.Argument(..., help="The base pod list (openb format), e.g. openb_pod_list_default.csv."),
    out: Path = typer.Option(..., "--out", "-o", help="Where to write the variant (a pod list CSV)."),
    cpu_only: float | None = typer.Option(None, "--cpu-only", help="CPU-only pods, % of all pods."),
    sharing: float | None = typer.Option(
        None, "--sharing", help="Sharing pods (one GPU, gpu_milli < 1000), % of the GPU demand."
    ),
    multi_gpu: float | None = typer.Option(None, "--multi-gpu", help="Multi-GPU pods, % of the GPU demand."),
    gpu_spec: float | None = typer.Option(
        None, "--gpu-spec", help="Model-constrained pods (gpu_spec set), % of GPU pods."
    ),
    spec_source: Path | None = typer.Option(
        None, "--spec-source", help="Pod list whose gpu_spec values are drawn for new constraints. Default: the base."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of every random choice: same inputs and seed, same file."),
    force: bool = typer.Option(False, "--force", help="Overwrite --out if it exists."),
) -> None:
    """Write a variant of a pod list with chosen shares of CPU-only, sharing, multi-GPU and model-constrained pods.

    Rows are resampled by class from the base (passes of seeded permutations; a share not given keeps the base's
    proportions; the total GPU demand stays the base's); only gpu_spec is ever rewritten. Details: the module
    docstring of sharegpu.sim.variants and the README.
    """
    try:
        spec = VariantSpec(cpu_only, sharing, multi_gpu, gpu_spec, seed)
        if out.exists() and out.resolve() == base.resolve():
            raise VariantError(f"--out {out} is the base trace itself; write the variant to another file")
        if out.is_dir():
            raise VariantError(f"--out {out} is a folder; give a file name, e.g. {out / 'variant.csv'}")
        if out.exists() and not force:
            raise VariantError(f"--out {out} exists; give --force to overwrite it")
        table = read_pod_table(base, warn=_warn)
        source = read_pod_table(spec_source, warn=_warn) if spec_source is not None else None
        variant = vary(table, spec, source)
        write_variant(out, variant)
    except (TraceError, VariantError) as e:
        raise _error(str(e)) from None
    except OSError as e:
        raise _error(f"cannot write {out}: {e.strerror or e}") from None
    _out().print(_shares_table(f"wrote {out}", {str(base): measure(table.tasks), str(out): measure(variant.tasks)}))


@trace_app.command("describe")
def trace_describe(
    pods: list[Path] = typer.Argument(..., help="Pod lists (openb format)."),
) -> None:
    """Print the shares of CPU-only, sharing, multi-GPU and model-constrained pods of each pod list."""
    try:
        columns = {p.stem.removeprefix("openb_pod_list_"): measure(read_pod_table(p, warn=_warn).tasks) for p in pods}
    except TraceError as e:
        raise _error(str(e)) from None
    _out().print(_shares_table("pod lists", columns))
