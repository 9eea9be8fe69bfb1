"""``sharegpu bench``: the command (registered in :mod:`sharegpu.cli`; ``python -m sharegpu.strategybench`` runs it
without the rest of the command line, i.e. without importing the Kubernetes client)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape

from sharegpu.strategybench.results import STRATEGIES, Measurement, aggregate
from sharegpu.strategybench.workloads import KINDS, WorkloadParams

if TYPE_CHECKING:
    from sharegpu.strategybench.recommend import Recommendation
    from sharegpu.strategybench.runner import BenchBackend, Unit

DEFAULT_MPS_ROOT = Path("/tmp/sharegpu-bench-mps")  # apart from the node agent's daemons (<state dir>/mps)


def _fail(message: str, code: int = 2) -> typer.Exit:
    Console(stderr=True).print(f"[red]error:[/] {escape(message)}", highlight=False)
    return typer.Exit(code)


def _list(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise _fail(f"--{what}: {', '.join(bad) or 'nothing given'} is not one of {', '.join(allowed)}")
    return items


def _counts(text: str) -> list[int]:
    try:
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise _fail(f"--clients {text!r}: give client counts separated by commas, e.g. 1,2,4") from None
    if not counts or counts[0] < 1 or counts[-1] > 48:
        raise _fail(f"--clients {text!r}: each count must be 1..48 (an MPS server takes at most 48 clients)")
    return counts


def cupy_missing_message(cuda_major: int | None) -> str:
    wheel = f"cupy-cuda{cuda_major}x" if cuda_major else "cupy-cuda12x (or cupy-cuda13x for a CUDA 13 driver)"
    return (
        "sharegpu bench runs its GPU clients with CuPy, which is not installed. Install the bench extra: "
        f"pip install 'sharegpu[bench]' — or the CuPy wheel for this driver's CUDA version: pip install {wheel}"
    )


def _cuda_major() -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlSystemGetCudaDriverVersion()) // 1000
    except Exception:  # no driver: the message names both wheels
        return None


def bench(
    gpu: str = typer.Option("0", "--gpu", help="The GPU to run on: its index or UUID."),
    unit: str | None = typer.Option(
        None, "--unit", help="A MIG instance UUID of that GPU to share (default: the GPU, or its first MIG instance)."
    ),
    clients: str = typer.Option("1,2,4", "--clients", help="Client counts; 1 is the dedicated baseline."),
    strategies: str = typer.Option(",".join(STRATEGIES), "--strategies", help="Strategies to compare."),
    workloads: str = typer.Option(",".join(KINDS), "--workloads", help="Workloads to run."),
    seconds: float | None = typer.Option(
        None, "--seconds", help="Measured window of light and heavy [2.5; quick 1.5]."
    ),
    repeat: int | None = typer.Option(None, "--repeat", help="Repetitions of each window [3; quick 2]."),
    quick: bool = typer.Option(False, "--quick", help="Shorter windows and fewer repetitions (about 2 minutes)."),
    rate: float = typer.Option(200.0, "--rate", help="Light inference: requests per second per client."),
    batch_seconds: float | None = typer.Option(
        None, "--batch-seconds", help="Size of a batch job: its run time alone [1.0; quick 0.5]."
    ),
    out: Path = typer.Option(Path("sharegpu-bench"), "--out", help="Directory for bench.json and bench.png."),
    mps_root: Path = typer.Option(DEFAULT_MPS_ROOT, "--mps-root", help="Pipe and log directories of the MPS daemons."),
    publish: bool = typer.Option(False, "--publish", help="Annotate this node's Node with the recommendations."),
    node: str | None = typer.Option(None, "--node", envvar="NODE_NAME", help="The Node to annotate [$NODE_NAME]."),
    kubeconfig: Path | None = typer.Option(None, "--kubeconfig", help="Kubeconfig for --publish [in-cluster]."),
    backend: str = typer.Option("cupy", "--backend", hidden=True, help="cupy, or fake (tests: modelled clients)."),
    fake_ts_overhead: float = typer.Option(0.1, "--fake-ts-overhead", hidden=True),
    fake_sim_config: Path | None = typer.Option(None, "--fake-sim-config", hidden=True),
) -> None:
    """Compare dedicated, time-slicing, MPS (without and with limits) and MIG on this node's GPU for light
    inference, heavy compute, parallel batch jobs and a memory-hungry job; recommend one per workload.

    Needs the GPU to itself (other work disturbs the figures), CuPy (pip install 'sharegpu\\[bench]') and, for
    MPS, root and nvidia-cuda-mps-control on PATH. Never changes a GPU's MIG mode. See docs/bench.md.
    """
    from sharegpu.strategybench.runner import BenchError

    t_start = time.time()
    seconds = seconds if seconds is not None else (1.5 if quick else 2.5)
    repeat = repeat if repeat is not None else (2 if quick else 3)
    batch_seconds = batch_seconds if batch_seconds is not None else (0.5 if quick else 1.0)
    if not (0.2 <= seconds <= 60) or not (1 <= repeat <= 20) or not (0.05 <= batch_seconds <= 30) or rate <= 0:
        raise _fail("--seconds must be 0.2..60, --repeat 1..20, --batch-seconds 0.05..30 and --rate above 0")
    if backend not in ("cupy", "fake"):
        raise _fail(f"--backend {backend!r}: cupy or fake")
    kinds = _list(workloads, KINDS, "workloads")
    wanted = _list(strategies, STRATEGIES, "strategies")
    counts = _counts(clients)
    if publish and not node:
        raise _fail("--publish needs the Node's name: --node NAME or $NODE_NAME (the chart's Job sets it)")
    # The table has nine columns of figures with their spread: wider than 80 columns where the output is a file.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    try:
        if publish and node:
            from sharegpu.strategybench.publish import check_publish

            check_publish(node, kubeconfig)  # before minutes on the GPU: the Node exists and may be annotated
        bb = _backend(backend, fake_ts_overhead, fake_sim_config)
        unit_used, recs = run_bench(
            console, bb, gpu, unit, counts, wanted, kinds, seconds, repeat, rate, batch_seconds, out, mps_root
        )
        if publish and node:
            from sharegpu.strategybench.publish import note_of, publish_note

            note = note_of(unit_used, recs)
            publish_note(node, note, kubeconfig)
            console.print(f"published on node {node} ({note_annotation()}): {note.text()}")
    except BenchError as e:
        raise _fail(str(e)) from None
    except KeyboardInterrupt:
        raise _fail("interrupted; the clients and MPS daemons were stopped", 130) from None
    console.print(f"done in {time.time() - t_start:.0f} s")


def note_annotation() -> str:
    from sharegpu.model.contract import BENCH_ANNOTATION

    return BENCH_ANNOTATION


def _backend(name: str, ts_overhead: float, sim_config: Path | None) -> BenchBackend:
    from sharegpu.strategybench.runner import BenchBackend, BenchError, NvmlBusySampler, ReportedBusySampler

    if name == "fake":
        from sharegpu.node.backends.sim import SimBackend
        from sharegpu.node.backends.sim_config import SimConfigError, load_sim_config, parse_sim_config
        from sharegpu.node.mps import SimMpsDaemon
        from sharegpu.strategybench.fake import OVERHEAD_ENV

        try:
            cfg = load_sim_config(sim_config) if sim_config else parse_sim_config("gpus: [{model: H100-80GB}]")
        except SimConfigError as e:
            raise BenchError(str(e)) from None
        return BenchBackend(
            "fake",
            SimBackend(cfg, seed="bench"),
            SimMpsDaemon(),
            lambda _i: ReportedBusySampler(),
            {OVERHEAD_ENV: str(ts_overhead)},
        )
    if importlib.util.find_spec("cupy") is None:
        raise BenchError(cupy_missing_message(_cuda_major()))
    from sharegpu.node.backends.base import BackendError
    from sharegpu.node.backends.nvml import NvmlBackend
    from sharegpu.node.backends.nvml_api import PynvmlApi
    from sharegpu.node.mps import NvidiaMpsDaemon

    try:
        gpu = NvmlBackend(PynvmlApi())
        gpu.devices()
    except (BackendError, ImportError, OSError) as e:
        raise BenchError(f"cannot read the GPUs through NVML ({e}); is the NVIDIA driver installed?") from None
    return BenchBackend("cupy", gpu, NvidiaMpsDaemon(), lambda i: NvmlBusySampler(gpu, i))


def _mps_unavailable(backend: BenchBackend) -> str | None:
    if backend.name == "fake":
        return None
    from sharegpu.node.mps import MPS_CONTROL

    if shutil.which(MPS_CONTROL) is None:
        return f"{MPS_CONTROL} is not on PATH (it ships with the NVIDIA driver, e.g. /usr/local/nvidia/bin)"
    if os.geteuid() != 0:
        return "the MPS control daemon needs root (run sharegpu bench as root, as the node agent runs)"
    return None


def run_bench(
    console: Console,
    backend: BenchBackend,
    gpu: str,
    unit: str | None,
    counts: list[int],
    strategies: list[str],
    kinds: list[str],
    seconds: float,
    repeat: int,
    rate: float,
    batch_seconds: float,
    out: Path,
    mps_root: Path,
) -> tuple[Unit, list[Recommendation]]:
    """Plan, run every group, report; returns the unit shared and the recommendations."""
    from sharegpu.strategybench.recommend import recommend
    from sharegpu.strategybench.report import print_report, to_json, write_json, write_plot
    from sharegpu.strategybench.runner import BenchError, Orchestrator, Skipped, plan, terminate_as_interrupt

    t0 = time.time()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BenchError(f"cannot create --out {out}: {e.strerror or e}") from None
    no_mps = _mps_unavailable(backend) if {"mps", "mps-limits"} & set(strategies) else None
    p = plan(backend.gpu, gpu, unit, strategies, counts)
    skipped = list(p.skipped)
    groups = list(p.groups)
    if no_mps:
        skipped += [Skipped(g.strategy, g.clients, no_mps) for g in groups if g.strategy in ("mps", "mps-limits")]
        groups = [g for g in groups if g.strategy not in ("mps", "mps-limits")]
    u = p.unit
    console.print(f"[bold]sharegpu bench[/] on {u.name} ({u.uuid}, {u.memory_mib} MiB) · backend {backend.name}")
    for n in p.notes:
        console.print(n, markup=False)
    for s in skipped:
        console.print(f"skipped {s.strategy} ×{s.clients}: {s.why}", markup=False)
    busy = [pr.pid for pr in backend.gpu.processes(u.gpu_index)] if backend.name != "fake" else []
    if busy:
        console.print(
            f"[yellow]warning:[/] processes {escape(str(busy))} use GPU {u.gpu_index}: they disturb the figures"
        )
    if not groups:
        raise BenchError("nothing to run: every strategy asked for was skipped (see above)")
    params = WorkloadParams(seconds=seconds, rate=rate, hold_s=min(seconds / 2, 1.0))
    orch = Orchestrator(
        backend, mps_root, params, kinds, repeat, lambda m: console.print(m, markup=False), batch_seconds
    )
    measurements: list[Measurement] = []
    with terminate_as_interrupt():
        try:
            for g in groups:
                tg = time.time()
                for m in orch.run_group(g):
                    measurements.append(m)
                    if m.errors:
                        console.print(f"[red]{g.strategy} ×{g.clients} {m.kind}: {escape(m.errors[0])}[/]")
                console.print(f"{g.strategy} ×{g.clients}: {time.time() - tg:.1f} s")
        finally:
            orch.close()
    rows = aggregate(measurements)
    recs = recommend(rows, u.memory_mib)
    title = f"{u.name} · {', '.join(str(c) for c in counts)} clients · {seconds:g} s windows × {repeat}"
    notes = [f"skipped {s.strategy} ×{s.clients}: {s.why}" for s in skipped]
    print_report(console, rows, recs, title, notes)
    meta = {
        "unit": {"uuid": u.uuid, "gpu_index": u.gpu_index, "name": u.name, "memory_mib": u.memory_mib, "mig": u.mig},
        "backend": backend.name,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
        "elapsed_s": round(time.time() - t0, 1),
        "params": params.to_json() | {"repeat": repeat, "batch_seconds": batch_seconds, "clients": counts},
        "batch_matmuls": orch.batch_matmuls,
        "skipped": [{"strategy": s.strategy, "clients": s.clients, "why": s.why} for s in skipped],
    }
    write_json(out / "bench.json", to_json(rows, recs, meta, [m.to_json() for m in measurements]))
    if write_plot(out / "bench.png", rows, title):
        console.print(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")
    else:
        console.print(f"wrote {out / 'bench.json'} (no plot: no workload gave a figure)")
    return u, recs
