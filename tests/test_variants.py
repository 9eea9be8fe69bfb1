"""Trace variants (sim/variants.py and `sharegpu trace vary`): shares hit, determinism, what is kept, bad options."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sharegpu.cli import app
from sharegpu.model.request import FULL_MILLI
from sharegpu.sim.openb import PodTable, load_pods, read_pod_table
from sharegpu.sim.variants import PodClass, VariantError, VariantSpec, measure, pod_class, vary

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "openb"
needs_trace = pytest.mark.skipif(not (DATA / "openb_pod_list_default.csv").exists(), reason="no openb trace data")
runner = CliRunner()

HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time"


def base_rows() -> list[str]:
    """A small trace with every class, varied CPU and memory, and a few model constraints."""
    rows = []
    for i in range(40):
        rows.append(f"c{i:02d},{1000 + 100 * i},{2048 + i},0,0,,BE,Running,{i},{i + 100},{i}")
    for i in range(60):
        spec = "T4" if i % 10 == 0 else ""
        rows.append(f"s{i:02d},{2000 + i},{4096 + i},1,{100 + 13 * i},{spec},LS,Running,{i},,{i}")
    for i in range(50):
        spec = "V100M16|V100M32" if i % 7 == 0 else ""
        rows.append(f"w{i:02d},{4000 + i},{8192 + i},1,1000,{spec},LS,Running,{i},{i + 5},{i}")
    for i, n in enumerate([2, 2, 4, 4, 8, 8, 8, 2]):
        spec = "G2" if n == 8 and i == 4 else ""
        rows.append(f"m{i:02d},{8000 * n},{16384 * n},{n},1000,{spec},LS,Running,{i},,{i}")
    return rows


@pytest.fixture
def base(tmp_path: Path) -> PodTable:
    p = tmp_path / "base.csv"
    p.write_text("\n".join([HEADER, *base_rows()]) + "\n")
    return read_pod_table(p)


def largest(table: PodTable, c: PodClass) -> int:
    return max(t.request.total_milli for t in table.tasks if pod_class(t.request) is c)


def test_measure_counts_shares_as_the_family_names_them(base: PodTable) -> None:
    s = measure(base.tasks)
    reqs = [t.request for t in base.tasks]
    demand = sum(r.total_milli for r in reqs)
    assert s.pods == 158 and s.gpu_pods == 118 and s.gpu_demand_milli == demand
    assert s.cpu_only_pct == pytest.approx(100 * 40 / 158)
    assert s.sharing_pct == pytest.approx(100 * sum(100 + 13 * i for i in range(60)) / demand)
    assert s.multi_gpu_pct == pytest.approx(100 * 1000 * 38 / demand)
    assert s.gpu_spec_pct == pytest.approx(100 * (6 + 8 + 1) / 118)


@pytest.mark.parametrize(
    "spec",
    [
        VariantSpec(multi_gpu=50, seed=3),
        VariantSpec(sharing=80, seed=4),
        VariantSpec(sharing=100, seed=5),
        VariantSpec(sharing=20, multi_gpu=60, seed=6),
        VariantSpec(cpu_only=5, seed=7),
        VariantSpec(cpu_only=60, gpu_spec=50, seed=8),
        VariantSpec(gpu_spec=0, multi_gpu=0, seed=9),
    ],
)
def test_shares_of_the_written_file_match_the_targets(base: PodTable, spec: VariantSpec, tmp_path: Path) -> None:
    v = vary(base, spec)
    out = tmp_path / "variant.csv"
    out.write_text(v.csv_text())
    tasks = load_pods(out)  # the existing loader reads it
    got, before = measure(tasks), measure(base.tasks)
    assert got == measure(v.tasks)
    # Total GPU demand is the base's, within half of the largest pod of a resampled class.
    slack = max(largest(base, c) for c in (PodClass.SHARING, PodClass.WHOLE, PodClass.MULTI)) / 2
    assert abs(got.gpu_demand_milli - before.gpu_demand_milli) <= 2 * slack
    tol = 100 * slack / got.gpu_demand_milli
    if spec.sharing is not None:
        assert got.sharing_pct == pytest.approx(spec.sharing, abs=tol)
    if spec.multi_gpu is not None:
        assert got.multi_gpu_pct == pytest.approx(spec.multi_gpu, abs=tol)
    if spec.sharing is None and spec.multi_gpu is not None and spec.multi_gpu < 100:
        # The rest keeps the base's ratio of sharing to whole single-GPU demand.
        whole = 100 - got.sharing_pct - got.multi_gpu_pct
        base_whole = 100 - before.sharing_pct - before.multi_gpu_pct
        assert got.sharing_pct / whole == pytest.approx(before.sharing_pct / base_whole, rel=0.1)
    cpu = spec.cpu_only if spec.cpu_only is not None else before.cpu_only_pct
    assert got.cpu_only_pct == pytest.approx(cpu, abs=100 / got.pods)
    if spec.gpu_spec is not None:
        assert got.gpu_spec_pct == pytest.approx(spec.gpu_spec, abs=100 / got.gpu_pods)


def test_same_seed_same_bytes_other_seed_other_rows(base: PodTable) -> None:
    a = vary(base, VariantSpec(multi_gpu=40, gpu_spec=30, seed=11)).csv_text()
    b = vary(base, VariantSpec(multi_gpu=40, gpu_spec=30, seed=11)).csv_text()
    c = vary(base, VariantSpec(multi_gpu=40, gpu_spec=30, seed=12)).csv_text()
    assert a == b
    assert a != c


def test_rows_are_base_rows_and_only_gpu_spec_is_rewritten(base: PodTable) -> None:
    v = vary(base, VariantSpec(sharing=60, cpu_only=30, gpu_spec=25, seed=2))
    by_name = {r["name"]: r for r in base.rows}
    assert v.header == base.header
    names = [r["name"] for r in v.rows]
    assert len(set(names)) == len(names)
    for row in v.rows:
        original = by_name[row["name"].split("-dup")[0]]
        assert {k: x for k, x in row.items() if k not in ("name", "gpu_spec")} == {
            k: x for k, x in original.items() if k not in ("name", "gpu_spec")
        }
    # A class that grew repeats its rows as evenly as possible (passes of permutations): counts differ by ≤ 1.
    copies = collections.Counter(r["name"].split("-dup")[0] for r in v.rows)
    sharing = [copies[f"s{i:02d}"] for i in range(60)]
    assert max(sharing) - min(sharing) <= 1 and max(sharing) >= 2


def test_unchanged_shares_keep_the_base_rows_exactly(base: PodTable) -> None:
    v = vary(base, VariantSpec(seed=1))
    assert [dict(r) for r in v.rows] == [dict(r) for r in base.rows]


def test_added_gpu_spec_is_drawn_from_pods_of_the_same_shape(base: PodTable, tmp_path: Path) -> None:
    v = vary(base, VariantSpec(gpu_spec=80, seed=5))
    for row, t in zip(v.rows, v.tasks, strict=True):
        r = t.request
        if not row["gpu_spec"]:
            continue
        if r.gpu_count == 8:
            assert row["gpu_spec"] == "G2"  # the only 8-GPU pod with a constraint
        elif r.gpu_count in (2, 4):
            assert row["gpu_spec"] == "G2"  # no 2- or 4-GPU constraint: drawn from pods asking for more GPUs
        elif r.milli < FULL_MILLI:
            assert row["gpu_spec"] == "T4"
        else:
            assert row["gpu_spec"] == "V100M16|V100M32"


def test_gpu_spec_needs_a_source_with_constraints(tmp_path: Path) -> None:
    p = tmp_path / "plain.csv"
    p.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1,1,1,500\np1,1,1,1,1000\n")
    plain = read_pod_table(p)
    with pytest.raises(VariantError, match="no pod with a gpu_spec"):
        vary(plain, VariantSpec(gpu_spec=50))
    src = tmp_path / "src.csv"
    src.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\nq0,1,1,1,300,T4\n")
    v = vary(plain, VariantSpec(gpu_spec=100), read_pod_table(src))
    assert v.header == ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec")
    assert [r["gpu_spec"] for r in v.rows] == ["T4", "T4"]  # the whole pod falls back to the only spec


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"sharing": 101}, "--sharing 101 must be a percentage from 0 to 100"),
        ({"multi_gpu": -1}, "--multi-gpu -1"),
        ({"gpu_spec": 150}, "--gpu-spec 150"),
        ({"cpu_only": 100}, "--cpu-only 100"),
        ({"sharing": 60, "multi_gpu": 50}, "add up to more than 100 %"),
        ({"seed": -3}, "--seed -3"),
    ],
)
def test_bad_options(kwargs: dict[str, float], fragment: str) -> None:
    with pytest.raises(VariantError, match=fragment.replace("+", r"\+")):
        VariantSpec(**kwargs)  # type: ignore[arg-type]


def test_a_class_the_base_lacks_cannot_get_a_share(tmp_path: Path) -> None:
    p = tmp_path / "nomulti.csv"
    p.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1,1,1,500\np1,1,1,1,1000\n")
    t = read_pod_table(p)
    with pytest.raises(VariantError, match="no multi-GPU pods"):
        vary(t, VariantSpec(multi_gpu=20))
    with pytest.raises(VariantError, match="no CPU-only pods"):
        vary(t, VariantSpec(cpu_only=50))
    q = tmp_path / "allshare.csv"
    q.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1,1,1,500\n")
    with pytest.raises(VariantError, match="no whole single-GPU or multi-GPU pods"):
        vary(read_pod_table(q), VariantSpec(sharing=50))


# ----- the command ----------------------------------------------------------------------------------------------
def test_cli_vary_writes_a_loadable_file_and_prints_the_shares(base: PodTable, tmp_path: Path) -> None:
    out = tmp_path / "v" / "multi50.csv"
    r = runner.invoke(app, ["trace", "vary", str(base.path), "--out", str(out), "--multi-gpu", "50", "--seed", "1"])
    assert r.exit_code == 0, r.output
    written = measure(load_pods(out)).multi_gpu_pct
    assert written == pytest.approx(50, abs=4)  # 8-GPU pods in a trace of 120 GPUs: coarse steps
    assert "multi-GPU %" in r.stdout and f"{written:.1f}" in r.stdout
    # An existing file is kept unless --force; the same command then writes the same bytes.
    before = out.read_bytes()
    r = runner.invoke(app, ["trace", "vary", str(base.path), "--out", str(out), "--multi-gpu", "50", "--seed", "1"])
    assert r.exit_code == 2 and "--force" in r.stderr
    r = runner.invoke(
        app, ["trace", "vary", str(base.path), "-o", str(out), "--multi-gpu", "50", "--seed", "1", "--force"]
    )
    assert r.exit_code == 0 and out.read_bytes() == before


def test_cli_vary_errors_exit_2_on_stderr(base: PodTable, tmp_path: Path) -> None:
    cases = [
        (["--out", str(tmp_path / "x.csv"), "--sharing", "120"], "--sharing 120"),
        (["--out", str(base.path), "--force"], "is the base trace itself"),
        (["--out", str(tmp_path)], "is a folder"),
        (["--out", str(tmp_path / "x.csv"), "--gpu-spec", "10", "--spec-source", str(tmp_path / "no.csv")], "no.csv"),
    ]
    for args, fragment in cases:
        r = runner.invoke(app, ["trace", "vary", str(base.path), *args])
        assert r.exit_code == 2, (args, r.output)
        assert fragment in r.stderr and "Traceback" not in r.output
    assert not (tmp_path / "x.csv").exists()


def test_cli_describe(base: PodTable) -> None:
    r = runner.invoke(app, ["trace", "describe", str(base.path)])
    assert r.exit_code == 0, r.output
    assert "base" in r.stdout and "25.3" in r.stdout  # 40 of 158 pods are CPU-only


@needs_trace
@pytest.mark.trace
def test_visible_family_measures_as_named() -> None:
    """The definitions reproduce the family's names on the visible files."""
    got = {t: measure(load_pods(DATA / f"openb_pod_list_{t}.csv")) for t in ("cpu050", "gpushare40", "multigpu20")}
    assert got["cpu050"].cpu_only_pct == pytest.approx(5.0, abs=0.1)
    assert got["gpushare40"].sharing_pct == pytest.approx(40.0, abs=0.2)
    assert got["multigpu20"].multi_gpu_pct == pytest.approx(20.0, abs=0.5)
    assert measure(load_pods(DATA / "openb_pod_list_gpuspec10.csv")).gpu_spec_pct == pytest.approx(10.0, abs=0.5)


@needs_trace
@pytest.mark.trace
def test_variant_of_the_default_trace_hits_its_targets() -> None:
    base = read_pod_table(DATA / "openb_pod_list_default.csv")
    spec_source = read_pod_table(DATA / "openb_pod_list_gpuspec10.csv")
    v = measure(vary(base, VariantSpec(multi_gpu=40, gpu_spec=20, cpu_only=10, seed=42), spec_source).tasks)
    assert v.multi_gpu_pct == pytest.approx(40, abs=0.1)
    assert v.gpu_spec_pct == pytest.approx(20, abs=0.05)
    assert v.cpu_only_pct == pytest.approx(10, abs=0.05)
    assert v.gpu_demand_milli == pytest.approx(measure(base.tasks).gpu_demand_milli, rel=0.001)
