"""The ``trace`` command group: inspect openb pod lists and derive variants of them (registered on the root app in
sharegpu.cli)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import typer
from rich import box
from rich.table import Table

from sharegpu.sim.openb import TraceError, read_pod_table
from sharegpu.sim.report import fit_tables
from sharegpu.sim.terminal import error, out_console, overwrite_refusal, same_file, warn
from sharegpu.sim.variants import Shares, VariantError, VariantSpec, measure, vary, write_variant

trace_app = typer.Typer(
    help="Inspect openb pod lists and derive variants of them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _shares_table(title: str, rows: dict[str, Shares]) -> Table:
    t = Table(
        title=title,
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        caption="CPU-only: % of pods; sharing, multi-GPU: % of GPU demand; gpu_spec: % of GPU pods with a model "
        "constraint",
    )
    t.add_column("pod list", overflow="fold")  # a long path folds onto more lines rather than being cut
    columns: tuple[tuple[str, Callable[[Shares], str]], ...] = (
        ("pods", lambda x: f"{x.pods:,}"),
        ("GPU pods", lambda x: f"{x.gpu_pods:,}"),
        ("GPU demand", lambda x: f"{x.gpu_demand_milli / 1000:,.1f}"),
        ("CPU-only %", lambda x: f"{x.cpu_only_pct:.1f}"),
        ("sharing %", lambda x: f"{x.sharing_pct:.1f}"),
        ("multi-GPU %", lambda x: f"{x.multi_gpu_pct:.1f}"),
        ("gpu_spec %", lambda x: f"{x.gpu_spec_pct:.1f}"),
    )
    for label, _ in columns:
        t.add_column(label, justify="right", no_wrap=True)
    for name, shares in rows.items():
        t.add_row(name, *(fmt(shares) for _, fmt in columns))
    return t


@trace_app.command("vary")
def trace_vary(
    base: Path = typer.Argument(..., help="The base pod list (openb format), e.g. openb_pod_list_default.csv."),
    out_text: str = typer.Option(
        ..., "--out", "-o", metavar="FILE", help="Where to write the variant (a pod list CSV)."
    ),
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
    out = Path(out_text)
    try:
        if not out_text.strip():
            raise VariantError("--out is empty; give the file to write the variant to, e.g. -o variant.csv")
        for flag, given in (("the base trace", base), ("the --spec-source", spec_source)):
            if given is not None and same_file(out, given):
                raise VariantError(f"--out {out} is {flag} itself; write the variant to another file")
        spec = VariantSpec(cpu_only, sharing, multi_gpu, gpu_spec, seed)
        if out.is_dir():
            raise VariantError(f"--out {out} is a folder; give a file name, e.g. {out / 'variant.csv'}")
        if (refused := overwrite_refusal("--out", out, force)) is not None:
            raise VariantError(refused)
        if cpu_only is None and sharing is None and multi_gpu is None and gpu_spec is None:
            # The variant would be the base's rows again: a copy, not a variant.
            raise VariantError(
                "give at least one share to change: --cpu-only, --sharing, --multi-gpu or --gpu-spec (without one "
                "the variant is a copy of the base); `sharegpu trace describe BASE` shows the base's shares"
            )
        table = read_pod_table(base, warn=warn)
        source = read_pod_table(spec_source, warn=warn) if spec_source is not None else None
        variant = vary(table, spec, source)
        write_variant(out, variant)
    except (TraceError, VariantError) as e:
        raise error(str(e)) from None
    except OSError as e:
        raise error(f"cannot write {out}: {e.strerror or e}") from None
    console = out_console()
    shares = {str(base): measure(table.tasks), str(out): measure(variant.tasks)}
    for part in fit_tables(console, _shares_table(f"wrote {out}", shares)):
        console.print(part)


@trace_app.command("describe")
def trace_describe(
    pods: list[Path] = typer.Argument(..., help="Pod lists (openb format)."),
) -> None:
    """Print the shares of CPU-only, sharing, multi-GPU and model-constrained pods of each pod list."""
    try:
        columns = {p.stem.removeprefix("openb_pod_list_"): measure(read_pod_table(p, warn=warn).tasks) for p in pods}
    except TraceError as e:
        raise error(str(e)) from None
    console = out_console()
    for part in fit_tables(console, _shares_table("pod lists", columns)):
        console.print(part)
