"""The simulator's ``sim`` command: replay a workload through the policies (the ``trace`` group is in
sharegpu.sim.trace_cli); registered on the root app in sharegpu.cli."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from sharegpu.ledger import (
    DEFAULT_DAEMONS_PER_UNIT,
    MAX_DAEMON_MEMORY_MIB,
    MPS_DAEMON_MEMORY_MIB,
    MPS_MAX_CLIENTS,
    daemon_memory_problem,
)
from sharegpu.placement.policies import POLICIES, UnknownPolicy, parse_policies
from sharegpu.sim.engine import RunResult
from sharegpu.sim.mps_rules import DEFAULT_RULE, MpsRule, UnknownRule, parse_rules, run_label
from sharegpu.sim.openb import (
    TraceError,
    TraceTask,
    TraceWarning,
    Warn,
    load_nodes,
    read_pod_table,
    replay_gaps,
    unplaceable_models,
)
from sharegpu.sim.protocol import DEFAULT_UNDECLARED, MAX_SEEDS, MAX_USERS, parse_seeds
from sharegpu.sim.replay import PriorityOptions, arrivals_to_load
from sharegpu.sim.report import is_report, print_table, write_json, write_plot
from sharegpu.sim.runner import Experiment, never_fit, run_experiment, run_size
from sharegpu.sim.scenario import DEFAULT_POLICIES, DEFAULT_SEEDS, scenario_nodes, scenario_tasks
from sharegpu.sim.scenario import DEFAULT_TUNE as SCENARIO_TUNE
from sharegpu.sim.terminal import err_console, error, out_console, overwrite_refusal, same_file, warn

DEFAULT_OUT = Path("sharegpu-report")
TRACE_POLICIES = "fgd,sharegpu"
TRACE_SEEDS = "42"
TRACE_TUNE = 1.3  # the FGD paper's
MAX_TUNE = 100.0
# Above this many placement decisions (runs × pods per run) a run needs --large: at 0.1-0.5 ms a decision that is
# more than half an hour on 2 cores, and more likely a typo (--seeds 0-5000) than a plan.
MAX_DECISIONS = 10_000_000
MAX_MOVES = 16
MAX_LOAD = 10.0
MAX_ARRIVALS = 1_000_000
DEFAULT_ARRIVALS = 20_000


class UsageError(Exception):
    """Bad command-line input; printed without a traceback, exit code 2."""


def sim(
    nodes: str | None = typer.Option(
        None, "--nodes", metavar="FILE", help="Node list CSV (openb format). Default: the embedded scenario."
    ),
    pods: str | None = typer.Option(None, "--pods", metavar="FILE", help="Pod list CSV (openb format)."),
    policy: str | None = typer.Option(
        None,
        "--policy",
        help=f"Default: {TRACE_POLICIES} for a trace; {','.join(DEFAULT_POLICIES)} for the embedded scenario. "
        f"Comma-separated policies, each once, from: {', '.join(POLICIES)}.",
    ),
    seeds: str | None = typer.Option(
        None,
        "--seeds",
        help=f"Seeds: 42, 42-51 or 42,44 (at most {MAX_SEEDS:,}). Default: {TRACE_SEEDS} for a trace; "
        f"{DEFAULT_SEEDS[0]}-{DEFAULT_SEEDS[-1]} for the embedded scenario.",
    ),
    tune: float | None = typer.Option(
        None,
        "--tune",
        help=f"Grow the workload until its GPU demand is this multiple of the GPU capacity (above 0, at most "
        f"{MAX_TUNE:g}). Default: {TRACE_TUNE} for a trace (the FGD paper's); {SCENARIO_TUNE} for the embedded "
        "scenario (so that every seed passes 130 %).",
    ),
    json_out: str | None = typer.Option(
        None,
        "--json",
        metavar="FILE",
        help="Write the JSON report to this file, and the plot beside it (same name, .png).",
    ),
    out: str | None = typer.Option(
        None,
        "--out",
        metavar="DIR",
        help=f"Folder for the report: report.json and allocation.png. Default: {DEFAULT_OUT}. Not with --json.",
    ),
    replay: bool = typer.Option(
        False, "--replay", help="Honour creation/deletion times (pods leave, a pending queue retries) instead."
    ),
    high_share: float | None = typer.Option(
        None,
        "--high-priority-share",
        metavar="SHARE",
        help="Replay only: mark this share of the pods (0-1, seeded per run) high priority; the pending queue then "
        "retries higher priority first, and the report gives their waiting time.",
    ),
    preemption: bool = typer.Option(
        False,
        "--preemption",
        help="Replay only, with --high-priority-share: a high-priority pod that fits nowhere evicts lower-priority "
        "pods (they re-enter the queue and restart).",
    ),
    consolidation: bool = typer.Option(
        False,
        "--consolidation",
        help="Replay only: a pod that fits nowhere while enough GPU room is free in all gets up to --max-moves moves "
        "of other pods (lower-priority ones when priorities are marked).",
    ),
    max_moves: int | None = typer.Option(
        None, "--max-moves", help=f"With --consolidation: moves per plan, 1 to {MAX_MOVES}. Default: 2."
    ),
    load: float | None = typer.Option(
        None,
        "--load",
        help=f"Replay only: redraw the trace's pods with their lifetimes, arriving so that, once the cluster has "
        f"filled, the GPU busy on average is this multiple of the cluster's (above 0, at most {MAX_LOAD:g}); the "
        "trace as recorded never fills its cluster.",
    ),
    arrivals: int | None = typer.Option(
        None,
        "--arrivals",
        help=f"With --load: pods in the redraw, 1 to {MAX_ARRIVALS:,}. Default: enough for the cluster to fill and "
        f"stay at the load (arrivals spanning twice the longest rescaled lifetime; at least {DEFAULT_ARRIVALS:,}; "
        "about 105,000 on openb at --load 1.5); fewer are warned about.",
    ),
    mps_rule: str | None = typer.Option(
        None,
        "--mps-rule",
        metavar="RULES",
        help=f"Who may share an MPS unit (a GPU, or a MIG instance shared through MPS). Default: {DEFAULT_RULE} "
        "(what sharegpu does: a daemon per tenant on a unit; a tenant is the pods of one namespace and runAsUser, or "
        "a pod that declares no user alone). none: no rule, any pod joins a unit's one daemon; one-user: one tenant "
        "a unit (the cap before issue 32, not that rule exactly: an undeclared isolation-none share may now open an "
        "MPS GPU it holds alone, where it was time-sliced then); multi-user: every node in multi-user mode, one "
        "daemon a unit for all. "
        "Several, comma-separated, or all: each policy × seed runs under each rule, and a table compares them (every "
        f"rule counts each daemon's {MPS_DAEMON_MEMORY_MIB} MiB of GPU memory).",
    ),
    mps_daemons: int | None = typer.Option(
        None,
        "--mps-daemons-per-gpu",
        help=f"With --mps-rule per-tenant: the most MPS daemons (tenants) a unit runs, 1 to {MPS_MAX_CLIENTS}. "
        f"Default: {DEFAULT_DAEMONS_PER_UNIT}, the extender's.",
    ),
    daemon_memory: int | None = typer.Option(
        None,
        "--mps-daemon-memory",
        metavar="MIB",
        help=f"GPU memory each MPS daemon's server takes of its unit, under every rule, 0 to {MAX_DAEMON_MEMORY_MIB:,} "
        f"MiB. Default: {MPS_DAEMON_MEMORY_MIB}, what NVML listed for the server on an H200 (driver 580), the "
        "extender's; 0 leaves it out.",
    ),
    users: int | None = typer.Option(
        None,
        "--users",
        help=f"Under the rules that tell tenants apart (one-user, per-tenant): the Unix users that the pods declaring "
        f"one run as, drawn per pod with the seed (1 to {MAX_USERS:,}); the pods of one user are one tenant. "
        "Default: 1.",
    ),
    undeclared: float | None = typer.Option(
        None,
        "--undeclared",
        metavar="SHARE",
        help=f"Under the rules that tell tenants apart: the share of pods that declare no user (0-1, drawn per pod "
        f"with the seed); each is a tenant of its own. Default: {DEFAULT_UNDECLARED:g}, the common case: most pods "
        "set no runAsUser and leave their user to the image (every pod of the rig's load tests, the docs' first "
        "examples); a judgement, not a measured count.",
    ),
    force: bool = typer.Option(
        False,
        "--force",
        help="Overwrite the report's files even where one exists that is not a sharegpu report (without it, only an "
        "earlier report is replaced).",
    ),
    jobs: int = typer.Option(0, "--jobs", help="Parallel runs; 0 = one per CPU core."),
    large: bool = typer.Option(
        False,
        "--large",
        help=f"Run even above {MAX_DECISIONS / 1e6:g} million placement decisions (runs × pods per run), which "
        "takes more than about half an hour on 2 cores.",
    ),
) -> None:
    """Replay a workload through the placement policies and report GPU allocation (FGD paper protocol)."""
    console = out_console()
    warnings: list[TraceWarning | str] = []
    try:
        if jobs < 0:
            raise UsageError(f"--jobs {jobs} must be 0 (one per core) or more")
        nodes_path, pods_path = _path_option("--nodes", nodes), _path_option("--pods", pods)
        paths = report_paths(_path_option("--json", json_out), _path_option("--out", out))
        inputs = {"--nodes": nodes_path, "--pods": pods_path}
        check_not_inputs(paths, {flag: path for flag, path in inputs.items() if path is not None})
        check_overwrite(paths, json_out is not None, force)
        exp = _experiment(nodes_path, pods_path, policy, seeds, tune, replay, warnings.append)
        exp = _priority(exp, high_share, preemption, consolidation, max_moves, load, arrivals, warnings.append)
        exp = _mps(exp, mps_rule, mps_daemons, daemon_memory, users, undeclared, warnings.append)
        size = run_size(exp)
        if size.decisions > MAX_DECISIONS and not large:
            raise UsageError(
                f"{size}: more than {MAX_DECISIONS / 1e6:g} million, which takes more than about half an hour on 2 "
                "cores; give fewer --seeds or policies (or a smaller --tune), or add --large to run it anyway"
            )
    except (TraceError, UnknownPolicy, UnknownRule, UsageError, ValueError) as e:
        raise error(str(e)) from None
    for w in warnings:
        warn(w)
    # Said before the runs start, so that a long run is never a silent one.
    err_console().print(f"simulating {size}", highlight=False)
    started = time.perf_counter()
    try:
        runs = _run_with_progress(err_console(), exp, jobs)
    except KeyboardInterrupt:
        err_console().print(f"interrupted: no report written to {paths.json}", highlight=False)
        raise typer.Exit(code=130) from None
    title = f"{exp.name}: {exp.total_gpus} GPUs on {len(exp.nodes)} nodes, {len(exp.tasks)} tasks"
    title += ", replay" if exp.replay else f", tune {exp.tune}"
    if exp.load is not None:
        title += f" of {exp.arrivals:,} pods at load {exp.load:g}"
    if exp.priority is not None:
        title += f", {exp.priority.label()}"
    described = {rule.value: exp.mps(rule).label().removeprefix("MPS: ") for rule in exp.mps_rules}
    if len(exp.mps_rules) == 1:
        title += f", {exp.mps(exp.mps_rules[0]).label()}"
    print_table(console, runs, title, exp.total_gpus, described)
    meta: dict[str, object] = {
        "experiment": exp.name,
        "nodes": len(exp.nodes),
        "total_gpus": exp.total_gpus,
        "tasks": len(exp.tasks),
        "tune": exp.tune,
        "mps_rules": [rule.value for rule in exp.mps_rules],
        **({"mps_daemons_per_gpu": exp.daemons_per_gpu} if MpsRule.PER_TENANT in exp.mps_rules else {}),
        "mps_daemon_memory_mib": exp.daemon_memory_mib,
        **(
            {"users": exp.users, "undeclared": exp.undeclared}
            if any(rule.draws_tenants for rule in exp.mps_rules)
            else {}
        ),
        "mode": "replay" if exp.replay else "fgd-protocol",
        **({"load": exp.load, "arrivals": exp.arrivals} if exp.load is not None else {}),
        **({"priority": dataclasses.asdict(exp.priority)} if exp.priority is not None else {}),
        "policies": list(exp.policies),
        "seeds": list(exp.seeds),
        "total_wall_s": round(time.perf_counter() - started, 3),
    }
    try:
        write_json(paths.json, runs, meta)
        write_plot(paths.plot, runs, title)
    except OSError as e:
        raise error(f"cannot write the report: {e}") from None
    console.print(f"report: {paths.json} (JSON), {paths.plot} (plot)")


def _priority(
    exp: Experiment,
    high_share: float | None,
    preemption: bool,
    consolidation: bool,
    max_moves: int | None,
    load: float | None,
    arrivals: int | None,
    warn: Callable[[str], None] = lambda _: None,
) -> Experiment:
    """The replay options of issue 19, checked: each needs --replay, and each its companion."""
    given = [
        flag
        for flag, value in (
            ("--high-priority-share", high_share is not None),
            ("--preemption", preemption),
            ("--consolidation", consolidation),
            ("--max-moves", max_moves is not None),
            ("--load", load is not None),
            ("--arrivals", arrivals is not None),
        )
        if value
    ]
    if given and not exp.replay:
        raise UsageError(f"{', '.join(given)}: only with --replay (they change how pods wait, which a replay measures)")
    if high_share is not None and not 0 <= high_share <= 1:  # also NaN
        raise UsageError(
            f"--high-priority-share {high_share!r} is out of range: it is the share of pods marked high priority, "
            "from 0 to 1 (0.2 marks one pod in five)"
        )
    if preemption and not high_share:
        raise UsageError(
            "--preemption needs --high-priority-share above 0: only a pod of higher priority may evict others"
        )
    if max_moves is not None and not consolidation:
        raise UsageError("--max-moves bounds the moves of --consolidation; give --consolidation too, or leave it out")
    if max_moves is not None and not 1 <= max_moves <= MAX_MOVES:
        raise UsageError(f"--max-moves {max_moves} is out of range: 1 to {MAX_MOVES} moves per plan")
    if arrivals is not None and load is None:
        raise UsageError("--arrivals sets the size of the --load redraw; give --load too, or leave it out")
    if load is not None and not 0 < load <= MAX_LOAD:
        raise UsageError(
            f"--load {load!r} is out of range: the GPU busy on average as a multiple of the cluster's (1.5: demand "
            f"half again the capacity), above 0 and at most {MAX_LOAD:g}"
        )
    if arrivals is not None and not 1 <= arrivals <= MAX_ARRIVALS:
        raise UsageError(f"--arrivals {arrivals} is out of range: 1 to {MAX_ARRIVALS:,} pods")
    if load is not None and not any(t.deletion_time is not None for t in exp.tasks):
        raise UsageError("--load redraws pods with their lifetimes, and no pod of the trace has a deletion_time")
    if load is not None:
        needed = arrivals_to_load(exp.tasks, exp.capacity_milli, load)
        if arrivals is None:
            arrivals = min(max(DEFAULT_ARRIVALS, needed), MAX_ARRIVALS)
        if arrivals < needed:
            warn(
                f"--load {load:g} with {arrivals:,} arrivals: the redraw starts with an empty cluster, which fills over "
                f"about {needed // 2:,} arrivals (its longest rescaled lifetime), so the cluster is not held at the "
                f"load and few pods wait; give --arrivals {needed:,} or more (or leave it out)"
            )
    priority = None
    if high_share is not None or preemption or consolidation:
        priority = PriorityOptions(high_share or 0.0, preemption, consolidation, max_moves or 2)
    return dataclasses.replace(exp, priority=priority, load=load, arrivals=(arrivals or 0) if load is not None else 0)


def _mps(
    exp: Experiment,
    rules_text: str | None,
    daemons: int | None,
    daemon_memory: int | None,
    users: int | None,
    undeclared: float | None,
    warn: Callable[[str], None] = lambda _: None,
) -> Experiment:
    """The MPS tenancy options (issue 32), checked: each figure only with a rule it changes."""
    rules = parse_rules(rules_text) if rules_text is not None else (DEFAULT_RULE,)
    if daemons is not None and MpsRule.PER_TENANT not in rules:
        raise UsageError(
            f"--mps-daemons-per-gpu caps the daemons of --mps-rule per-tenant, and the rules given are "
            f"{', '.join(rules)}; add per-tenant to --mps-rule, or leave --mps-daemons-per-gpu out"
        )
    if daemons is not None and not 1 <= daemons <= MPS_MAX_CLIENTS:
        raise UsageError(
            f"--mps-daemons-per-gpu {daemons} is out of range: 1 to {MPS_MAX_CLIENTS} daemons a unit (each serves at "
            f"least one client, and an MPS unit takes at most {MPS_MAX_CLIENTS}); 1 is --mps-rule one-user"
        )
    if daemon_memory is not None and (problem := daemon_memory_problem(daemon_memory)):
        raise UsageError(f"--mps-daemon-memory {problem}")
    given = [flag for flag, value in (("--users", users), ("--undeclared", undeclared)) if value is not None]
    if given and not any(rule.draws_tenants for rule in rules):
        raise UsageError(
            f"{' and '.join(given)} draw whom the pods run as, which changes nothing under --mps-rule "
            f"{','.join(rules)} (every tenant shares a unit's one daemon there); add one-user or per-tenant to "
            f"--mps-rule, or leave {' and '.join(given)} out"
        )
    if users is not None and not 1 <= users <= MAX_USERS:
        raise UsageError(f"--users {users} is out of range: 1 to {MAX_USERS:,} Unix users")
    if undeclared is not None and not 0 <= undeclared <= 1:  # also NaN
        raise UsageError(
            f"--undeclared {undeclared!r} is out of range: it is the share of pods that declare no user, from 0 to 1 "
            "(0.8: four pods in five)"
        )
    if undeclared == 1 and users is not None and users > 1:
        warn(f"--users {users} with --undeclared 1: no pod declares a user, so the users drawn change nothing")
    return dataclasses.replace(
        exp,
        mps_rules=rules,
        daemons_per_gpu=daemons if daemons is not None else DEFAULT_DAEMONS_PER_UNIT,
        daemon_memory_mib=daemon_memory if daemon_memory is not None else MPS_DAEMON_MEMORY_MIB,
        users=users if users is not None else 1,
        undeclared=undeclared if undeclared is not None else DEFAULT_UNDECLARED,
    )


def _path_option(flag: str, text: str | None) -> Path | None:
    """A path option as given: Path('') is '.', which would quietly name the current folder."""
    if text is None:
        return None
    if not text.strip():
        raise UsageError(f"{flag} is empty; give a path, or leave the option out for its default")
    return Path(text)


@dataclass(frozen=True)
class ReportPaths:
    json: Path
    plot: Path


def report_paths(json_out: Path | None, out: Path | None) -> ReportPaths:
    """Where the report goes, checked before any run so that a long run never ends in a path error."""
    if json_out is not None and out is not None:
        # The two would split the report (JSON in one place, the plot in another); one place is clearer.
        raise UsageError(
            f"--json {json_out} and --out {out} both say where the report goes; give --out DIR (report.json and "
            "allocation.png in it) or --json FILE (the plot beside it, same name with .png), not both"
        )
    if json_out is not None:
        if json_out.suffix.lower() == ".png":
            raise UsageError(f"--json {json_out} would be overwritten by the plot; give it a .json name")
        paths = ReportPaths(json_out, json_out.with_suffix(".png"))
    else:
        folder = out or DEFAULT_OUT
        if folder.exists() and not folder.is_dir():
            raise UsageError(f"--out {folder} is a file; --out names a folder for report.json and allocation.png")
        paths = ReportPaths(folder / "report.json", folder / "allocation.png")
    for what, path in (("--json", paths.json), ("the plot", paths.plot)):
        _check_writable(what, path)
    return paths


def check_overwrite(paths: ReportPaths, json_given: bool, force: bool) -> None:
    """Refuse, without ``force``, a report path where a file exists that is not an earlier report (:func:`is_report`;
    the plot also when the JSON report beside it is one, as plots were not marked before): trace vary's rule."""
    earlier = is_report(paths.json)
    for what, path in (("--json" if json_given else "the JSON report", paths.json), ("the plot", paths.plot)):
        refused = overwrite_refusal(
            what, path, force, lambda p: earlier or is_report(p), "a sharegpu report (sim replaces only its own)"
        )
        if refused is not None:
            raise UsageError(refused)


def check_not_inputs(paths: ReportPaths, inputs: dict[str, Path]) -> None:
    """Refuse a report path that is one of the input files: writing the report would destroy the input."""
    for what, path in (("the JSON report", paths.json), ("the plot", paths.plot)):
        for flag, given in inputs.items():
            if same_file(path, given):
                raise UsageError(
                    f"{what} would be written to {path}, which is the {flag} input {given}: that would overwrite it; "
                    "write the report elsewhere (--out DIR, or --json FILE.json)"
                )


def _check_writable(what: str, path: Path) -> None:
    if path.is_dir():
        raise UsageError(f"{what} {path} is a folder; give a file name")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise UsageError(f"{what} {path} exists and is not writable")
        return
    parent = path.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"cannot write {what} {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write {what} {path}: no permission to create files in {parent}")


def _policies(text: str) -> tuple[str, ...]:
    # parse_policies skips empty items, so '' or 'fgd,,bestfit' would quietly mean something else than was typed.
    if not text.strip():
        raise UsageError(f"--policy {text!r} names no policy; choose from: {', '.join(POLICIES)}")
    if any(not part.strip() for part in text.split(",")):
        raise UsageError(f"--policy {text!r}: an item between commas is empty; e.g. --policy fgd,sharegpu")
    names = parse_policies(text)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UsageError(f"--policy {text!r} names {', '.join(twice)} more than once; list each policy once")
    return tuple(names)


def _tune(tune: float | None, default: float) -> float:
    if tune is None:
        return default
    if not 0 < tune <= MAX_TUNE:  # also NaN
        raise UsageError(
            f"--tune {tune!r} is out of range: it is a multiple of the cluster's GPU capacity (1.3 grows the "
            f"workload to 130 % of it), and must be above 0 and at most {MAX_TUNE:g} ({MAX_TUNE:g} × capacity)"
        )
    return tune


def _experiment(
    nodes: Path | None,
    pods: Path | None,
    policy: str | None,
    seeds: str | None,
    tune: float | None,
    replay: bool,
    warn: Warn,
) -> Experiment:
    if (nodes is None) != (pods is None):
        raise UsageError("give both --nodes and --pods (a trace), or neither (the embedded scenario)")
    if nodes is None or pods is None:
        if replay:
            raise UsageError(
                "--replay honours a trace's creation and deletion times, and the embedded scenario has none; give "
                "--nodes and --pods of a trace that has them, or leave out --replay"
            )
        return Experiment(
            name="embedded scenario",
            nodes=tuple(scenario_nodes()),
            tasks=tuple(TraceTask(r) for r in scenario_tasks()),
            policies=_policies(policy if policy is not None else ",".join(DEFAULT_POLICIES)),
            seeds=tuple(parse_seeds(seeds) if seeds is not None else DEFAULT_SEEDS),
            tune=_tune(tune, SCENARIO_TUNE),
        )
    policies = _policies(policy if policy is not None else TRACE_POLICIES)
    seed_list = tuple(parse_seeds(seeds if seeds is not None else TRACE_SEEDS))
    tune_value = _tune(tune, TRACE_TUNE)
    node_list = load_nodes(nodes, warn=warn)
    table = read_pod_table(pods, warn=warn)
    if not any(n.gpus for n in node_list):
        raise UsageError(f"{nodes}: no node has a GPU")
    gpu_pods = sum(1 for t in table.tasks if t.request.gpu_count)
    if not gpu_pods:
        raise UsageError(
            f"{pods}: none of its {len(table.tasks):,} pods asks for a GPU (all are CPU-only), and the report "
            "measures GPU allocation against GPU demand; give a pod list with GPU pods (num_gpu above 0)"
        )
    if replay:
        for w in replay_gaps(table):
            warn(w)
    for w in unplaceable_models(node_list, table):
        warn(w)
    never = never_fit(node_list, table.tasks)
    if never:
        reasons = "; ".join(f"{n:,} pod(s): {reason} (e.g. {example})" for reason, (n, example) in never.items())
        lost = sum(n for n, _ in never.values())
        if lost >= gpu_pods:
            raise UsageError(
                f"{pods}: none of its GPU pods fits on any node of {nodes}, even with the cluster empty, so every "
                f"policy would allocate nothing ({reasons}); check that the two files belong together"
            )
        warn(
            TraceWarning(
                pods,
                1,
                f"{lost:,} of {len(table.tasks):,} pods fit on no node even with the cluster empty, and every policy "
                f"skips them: {reasons}",
            )
        )
    return Experiment(
        name=pods.stem,
        nodes=tuple(node_list),
        tasks=table.tasks,
        policies=policies,
        seeds=seed_list,
        tune=tune_value,
        replay=replay,
    )


def _run_with_progress(console: Console, exp: Experiment, jobs: int) -> list[RunResult]:
    """One bar for the runs, and one per run in flight counting its pods (long runs take minutes)."""
    total = len(exp.mps_rules) * len(exp.policies) * len(exp.seeds)
    several = len(exp.mps_rules) > 1
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
        in_flight: dict[tuple[str, int], TaskID] = {}

        def moving(policy: str, seed: int, pods: int, of: int) -> None:
            key = (policy, seed)
            if key not in in_flight:
                in_flight[key] = progress.add_task(f"  {policy} seed {seed}: pods", total=of)
            progress.update(in_flight[key], completed=pods)

        def done(r: RunResult) -> None:
            label = run_label(r.policy, r.mps_rule if several else None)
            task = in_flight.pop((label, r.seed), None)
            if task is not None:
                progress.remove_task(task)
            progress.update(bar, advance=1, description=f"{label} seed {r.seed}: {r.wall_s:.1f}s")

        return run_experiment(exp, jobs, done, moving)
