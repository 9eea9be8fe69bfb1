"""The openb trace loaders (sim/openb.py): fields, optional columns, and every way a file can be wrong."""

from __future__ import annotations

import string
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sharegpu.model.request import FULL_MILLI
from sharegpu.sim.openb import TraceError, TraceTask, load_nodes, load_pods

NODE_HEADER = "sn,cpu_milli,memory_mib,gpu,model"
POD_HEADER = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time"
)
MULTIGPU20_HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli"

Loader = Callable[[Path], object]


def write(tmp_path: Path, text: str, name: str = "trace.csv") -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def pods_file(tmp_path: Path, *rows: str, header: str = MULTIGPU20_HEADER) -> Path:
    return write(tmp_path, "\n".join((header, *rows)) + "\n", "pods.csv")


def nodes_file(tmp_path: Path, *rows: str, header: str = NODE_HEADER) -> Path:
    return write(tmp_path, "\n".join((header, *rows)) + "\n", "nodes.csv")


def assert_trace_error(exc: pytest.ExceptionInfo[TraceError], path: Path, line: int | None, *fragments: str) -> None:
    msg = str(exc.value)
    where = f"{path}:{line}" if line is not None else str(path)
    assert msg.startswith(where + ": "), msg
    assert exc.value.path == path
    assert exc.value.line == line
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"


# ----- nodes --------------------------------------------------------------------------------------------------
def test_load_nodes_fields_and_model_canonicalisation(tmp_path: Path) -> None:
    p = nodes_file(
        tmp_path,
        "openb-node-0000,64000,262144,2,P100",
        "openb-node-0001,96000,786432,8,V100M16",
        "openb-node-0002,32000,131072,4,V100M32",
        "openb-node-0003,128000,1048576,8,G2",
        "openb-node-0004,16000,65536,0,",
    )
    nodes = load_nodes(p)
    assert [n.name for n in nodes] == [f"openb-node-000{i}" for i in range(5)]
    assert [n.cpu_milli for n in nodes] == [64000, 96000, 32000, 128000, 16000]
    assert [n.memory_mib for n in nodes] == [262144, 786432, 131072, 1048576, 65536]
    assert [len(n.gpus) for n in nodes] == [2, 8, 4, 8, 0]
    assert {g.model for g in nodes[0].gpus} == {"P100"}
    assert {g.model for g in nodes[1].gpus} == {"V100-16GB"}
    assert {g.model for g in nodes[2].gpus} == {"V100-32GB"}
    assert {g.model for g in nodes[3].gpus} == {"G2"}  # an opaque trace name stays as it is
    for n in nodes:
        assert [g.index for g in n.gpus] == list(range(len(n.gpus)))
        assert len({g.uuid for g in n.gpus}) == len(n.gpus)
        assert all(g.healthy for g in n.gpus)


def test_load_nodes_accepts_whole_floats_and_spaces_and_skips_blank_lines(tmp_path: Path) -> None:
    p = nodes_file(tmp_path, " n0 , 1000.0 , 2048 ,1, T4 ", "", "  ,  ,  ,  ,  ", "n1,3000,4096,2.0,T4")
    nodes = load_nodes(p)
    assert [(n.name, n.cpu_milli, n.memory_mib, len(n.gpus)) for n in nodes] == [
        ("n0", 1000, 2048, 1),
        ("n1", 3000, 4096, 2),
    ]


def test_load_nodes_columns_in_any_order(tmp_path: Path) -> None:
    p = nodes_file(tmp_path, "T4,2,4096,n0,1000", header="model,gpu,memory_mib,sn,cpu_milli")
    (n,) = load_nodes(p)
    assert (n.name, n.cpu_milli, n.memory_mib, len(n.gpus), n.gpus[0].model) == ("n0", 1000, 4096, 2, "T4")


@pytest.mark.parametrize(
    ("row", "line_fragments"),
    [
        ("n1,-1,1024,1,T4", ("cpu_milli is -1", "must not be negative")),
        ("n1,1000,-5,1,T4", ("memory_mib is -5", "must not be negative")),
        ("n1,lots,1024,1,T4", ("cpu_milli is 'lots'", "not a number")),
        ("n1,1000,1024,1.5,T4", ("gpu is '1.5'", "not a whole number")),
        ("n1,1000,1024,1", ("has 4 fields", "header has 5")),
        ("n1,1000,1024,1,T4,extra", ("has 6 fields", "header has 5")),
        ("n0,1000,1024,1,T4", ("node 'n0' is listed twice",)),
        (",1000,1024,1,T4", ("sn (node name) is empty",)),
        ("n1,1000,1024,2,", ("node 'n1' has 2 GPUs but no model",)),
    ],
)
def test_load_nodes_bad_row(tmp_path: Path, row: str, line_fragments: tuple[str, ...]) -> None:
    p = nodes_file(tmp_path, "n0,1000,1024,1,T4", row)
    with pytest.raises(TraceError) as e:
        load_nodes(p)
    assert_trace_error(e, p, 3, *line_fragments)


def test_load_nodes_unknown_column(tmp_path: Path) -> None:
    p = nodes_file(tmp_path, "n0,1000,1024,1,T4,x", header=NODE_HEADER + ",rack")
    with pytest.raises(TraceError) as e:
        load_nodes(p)
    assert_trace_error(e, p, 1, "unknown column", "rack")


def test_load_nodes_rejects_pod_only_columns(tmp_path: Path) -> None:
    # gpu_spec is a pod column, not a node column: the node list accepts no optional columns.
    p = nodes_file(tmp_path, "n0,1000,1024,1,T4,", header=NODE_HEADER + ",gpu_spec")
    with pytest.raises(TraceError) as e:
        load_nodes(p)
    assert_trace_error(e, p, 1, "unknown column", "gpu_spec")


def test_load_nodes_missing_column(tmp_path: Path) -> None:
    p = nodes_file(tmp_path, "n0,1000,1024,1", header="sn,cpu_milli,memory_mib,gpu")
    with pytest.raises(TraceError) as e:
        load_nodes(p)
    assert_trace_error(e, p, 1, "missing column", "model")


def test_load_nodes_given_a_pod_list_names_the_problem(tmp_path: Path) -> None:
    p = pods_file(tmp_path, "p0,1000,1024,1,1000")
    with pytest.raises(TraceError) as e:
        load_nodes(p)
    assert_trace_error(e, p, 1, "unknown column")


# ----- pods ---------------------------------------------------------------------------------------------------
def test_load_pods_full_format_fields(tmp_path: Path) -> None:
    p = pods_file(
        tmp_path,
        "openb-pod-0000,12000,16384,1,1000,,LS,Running,0,12537496,0",
        "openb-pod-0001,6000,12288,1,460,,LS,Running,427061,12902960,427061",
        "openb-pod-0002,8000,30517,0,0,,BE,Running,11811762,11827364,11811762",
        "openb-pod-0003,32000,65536,4,1000,V100M16|V100M32,LS,Running,5,,5",
        "openb-pod-0004,2000,4096,1,250,T4,BE,Pending,,,",
        header=POD_HEADER,
    )
    tasks = load_pods(p)
    assert all(isinstance(t, TraceTask) for t in tasks)
    assert [t.name for t in tasks] == [f"openb-pod-000{i}" for i in range(5)]
    r = [t.request for t in tasks]
    assert [x.cpu_milli for x in r] == [12000, 6000, 8000, 32000, 2000]
    assert [x.host_memory_mib for x in r] == [16384, 12288, 30517, 65536, 4096]
    assert [x.gpu_count for x in r] == [1, 1, 0, 4, 1]
    assert [x.compute_milli for x in r] == [1000, 460, None, 1000, 250]
    assert [x.total_milli for x in r] == [1000, 460, 0, 4000, 250]
    assert all(x.memory_mib is None for x in r)  # GPU memory plays no part in the trace
    assert r[0].allowed_models == frozenset()
    assert r[3].allowed_models == frozenset({"V100-16GB", "V100-32GB"})
    assert r[4].allowed_models == frozenset({"T4"})
    assert [(t.creation_time, t.deletion_time) for t in tasks] == [
        (0, 12537496),
        (427061, 12902960),
        (11811762, 11827364),
        (5, None),
        (None, None),
    ]


def test_load_pods_gpu_spec_aliases_and_spaces_canonicalise(tmp_path: Path) -> None:
    p = pods_file(
        tmp_path,
        "p0,1000,1024,1,500, V100M16 |  V100-SXM2-32GB ,LS,Running,,,",
        "p1,1000,1024,1,500,G1|G3,LS,Running,,,",
        header=POD_HEADER,
    )
    t0, t1 = load_pods(p)
    assert t0.request.allowed_models == frozenset({"V100-16GB", "V100-32GB"})
    assert t1.request.allowed_models == frozenset({"G1", "G3"})
    assert t0.request.allows_model("V100-16GB")
    assert not t0.request.allows_model("T4")


def test_load_pods_multigpu20_format_without_optional_columns(tmp_path: Path) -> None:
    p = pods_file(tmp_path, "p0,12000,16384,1,1000", "p1,6000,12288,1,460", "p2,64000,262144,8,1000", "p3,4000,0,0,0")
    tasks = load_pods(p)
    assert [(t.request.gpu_count, t.request.milli, t.request.total_milli) for t in tasks] == [
        (1, 1000, 1000),
        (1, 460, 460),
        (8, 1000, 8000),
        (0, 1000, 0),
    ]
    assert all(t.creation_time is None and t.deletion_time is None for t in tasks)
    assert all(t.request.allowed_models == frozenset() for t in tasks)


def test_load_pods_clamps_a_share_above_one_gpu(tmp_path: Path) -> None:
    p = pods_file(tmp_path, "p0,1000,1024,1,1500", "p1,1000,1024,2,2000")
    t0, t1 = load_pods(p)
    assert t0.request.compute_milli == FULL_MILLI
    assert t1.request.compute_milli == FULL_MILLI
    assert t1.request.total_milli == 2 * FULL_MILLI


def test_load_pods_deletion_equal_to_creation_is_fine(tmp_path: Path) -> None:
    p = pods_file(tmp_path, "p0,1000,1024,1,1000,,LS,Running,7,7,7", header=POD_HEADER)
    (t,) = load_pods(p)
    assert (t.creation_time, t.deletion_time) == (7, 7)


BAD_POD_ROWS = [
    ("p1,-1000,1024,1,500", ("cpu_milli is -1000", "must not be negative")),
    ("p1,1000,-1,1,500", ("memory_mib is -1", "must not be negative")),
    ("p1,1000,1024,-1,500", ("num_gpu is -1", "must not be negative")),
    ("p1,1000,1024,1,-500", ("gpu_milli is -500", "must not be negative")),
    ("p1,1000,1024,one,500", ("num_gpu is 'one'", "not a number")),
    ("p1,1000,1024,1,", ("gpu_milli is ''", "not a number")),
    ("p1,1000,1024,1,12.5", ("gpu_milli is '12.5'", "not a whole number")),
    ("p1,1000,1024,1", ("has 4 fields", "header has 5")),
    ("p1,1000,1024,1,500,x", ("has 6 fields", "header has 5")),
    ("p0,1000,1024,1,500", ("pod 'p0' is listed twice",)),
    (",1000,1024,1,500", ("name (pod name) is empty",)),
    ("p1,1000,1024,0,500", ("gpu_milli is 500 but num_gpu is 0",)),
    ("p1,1000,1024,1,0", ("num_gpu is 1 but gpu_milli is 0",)),
    ("p1,1000,1024,2,500", ("2-GPU pod must use whole GPUs", "not 500")),
    ("p1,1000,1024,65,1000", ("GPU count 65",)),  # the request's own validation, reported with its line
]


@pytest.mark.parametrize(("row", "fragments"), BAD_POD_ROWS)
def test_load_pods_bad_row(tmp_path: Path, row: str, fragments: tuple[str, ...]) -> None:
    # A blank line before the bad row: the reported line is the file's line, not the row count.
    p = write(tmp_path, f"{MULTIGPU20_HEADER}\np0,1000,1024,1,500\n\n{row}\n", "pods.csv")
    with pytest.raises(TraceError) as e:
        load_pods(p)
    assert_trace_error(e, p, 4, *fragments)


def test_load_pods_deletion_before_creation(tmp_path: Path) -> None:
    p = pods_file(tmp_path, "p0,1000,1024,1,500,,LS,Running,100,99,100", header=POD_HEADER)
    with pytest.raises(TraceError) as e:
        load_pods(p)
    assert_trace_error(e, p, 2, "deletion_time 99 is before creation_time 100")


def test_load_pods_bad_optional_time(tmp_path: Path) -> None:
    p = pods_file(tmp_path, "p0,1000,1024,1,500,,LS,Running,soon,,", header=POD_HEADER)
    with pytest.raises(TraceError) as e:
        load_pods(p)
    assert_trace_error(e, p, 2, "creation_time is 'soon'", "not a number")


def test_load_pods_unknown_column(tmp_path: Path) -> None:
    p = pods_file(tmp_path, "p0,1000,1024,1,500,x", header=MULTIGPU20_HEADER + ",priority")
    with pytest.raises(TraceError) as e:
        load_pods(p)
    assert_trace_error(e, p, 1, "unknown column", "priority")


@pytest.mark.parametrize("col", ["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli"])
def test_load_pods_missing_column(tmp_path: Path, col: str) -> None:
    cols = [c for c in MULTIGPU20_HEADER.split(",") if c != col]
    p = pods_file(tmp_path, ",".join("1" for _ in cols), header=",".join(cols))
    with pytest.raises(TraceError) as e:
        load_pods(p)
    assert_trace_error(e, p, 1, "missing column", col)


def test_load_pods_column_named_twice(tmp_path: Path) -> None:
    p = pods_file(tmp_path, "p0,1000,1024,1,500,LS,LS", header=MULTIGPU20_HEADER + ",qos,qos")
    with pytest.raises(TraceError) as e:
        load_pods(p)
    assert_trace_error(e, p, 1, "named twice")


@pytest.mark.parametrize("loader", [load_pods, load_nodes])
def test_empty_file(tmp_path: Path, loader: Loader) -> None:
    p = write(tmp_path, "")
    with pytest.raises(TraceError) as e:
        loader(p)
    assert_trace_error(e, p, 1, "file is empty")


@pytest.mark.parametrize(("loader", "header"), [(load_pods, MULTIGPU20_HEADER), (load_nodes, NODE_HEADER)])
def test_header_only(tmp_path: Path, loader: Loader, header: str) -> None:
    p = write(tmp_path, header + "\n\n\n")
    with pytest.raises(TraceError) as e:
        loader(p)
    # There is no line to point at: the message names the file and says what is missing.
    assert_trace_error(e, p, None, "has a header but no rows")


@pytest.mark.parametrize("loader", [load_pods, load_nodes])
def test_missing_file(tmp_path: Path, loader: Loader) -> None:
    p = tmp_path / "nope" / "pods.csv"
    with pytest.raises(TraceError) as e:
        loader(p)
    assert_trace_error(e, p, None, "cannot open")


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError) as e:
        load_pods(tmp_path)
    assert_trace_error(e, tmp_path, None, "cannot open")


def test_not_utf8(tmp_path: Path) -> None:
    p = tmp_path / "pods.csv"
    p.write_bytes(MULTIGPU20_HEADER.encode() + b"\np0,1000,1024,1,500\np\xff\xfe1,1,1,1,1\n")
    with pytest.raises(TraceError) as e:
        load_pods(p)
    assert str(e.value).startswith(f"{p}:")
    assert "not a readable CSV" in str(e.value)


def test_binary_header(tmp_path: Path) -> None:
    p = tmp_path / "pods.csv"
    p.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff")
    with pytest.raises(TraceError) as e:
        load_pods(p)
    assert_trace_error(e, p, 1)


# ----- garbage never escapes as another exception ---------------------------------------------------------------
GARBAGE = settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def _load_both(p: Path) -> None:
    for loader in (load_pods, load_nodes):
        try:
            loader(p)
        except TraceError as e:
            assert str(e).startswith(str(p))


@GARBAGE
@given(data=st.binary(max_size=400))
def test_random_bytes_raise_only_trace_error(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    p = tmp_path_factory.mktemp("garbage") / "trace.csv"
    p.write_bytes(data)
    _load_both(p)


@GARBAGE
@given(text=st.text(max_size=400))
def test_random_text_raises_only_trace_error(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    p = tmp_path_factory.mktemp("garbage") / "trace.csv"
    p.write_bytes(text.encode("utf-8", "surrogatepass"))
    _load_both(p)


# Rows that look like the real thing often enough to get past the header and into row parsing, with now and then
# a garbage field or a wrong field count. Values are short and never spell a number in exponent notation, so
# that no node can ask for so many GPUs that building its devices takes forever.
_GARBAGE_FIELD = st.one_of(
    st.sampled_from(["", "-1", "1.5", "2.0", "nan", "inf", "-0", " 7 ", "1_0", '"', '"a,b"', "\t", "x,y", "\r"]),
    st.text(alphabet=string.digits + string.ascii_letters.replace("e", "").replace("E", "") + '."|- ', max_size=4),
)
_POD_COLUMNS: dict[str, st.SearchStrategy[str]] = {
    "name": st.sampled_from(["p0", "p1", "p2", "p3", "p4", "p5"]),
    "cpu_milli": st.integers(0, 64000).map(str),
    "memory_mib": st.integers(0, 262144).map(str),
    "num_gpu": st.sampled_from(["0", "1", "1", "2", "8", "65"]),
    "gpu_milli": st.sampled_from(["0", "1", "250", "460", "1000", "1500", "2000"]),
    "gpu_spec": st.sampled_from(["", "", "T4", "V100M16|V100M32", "G1|G2", "|", "A|B"]),
    "qos": st.sampled_from(["LS", "BE", ""]),
    "pod_phase": st.sampled_from(["Running", "Pending", ""]),
    "creation_time": st.sampled_from(["", "0", "10", "100"]),
    "deletion_time": st.sampled_from(["", "0", "10", "100", "12902960"]),
    "scheduled_time": st.sampled_from(["", "0", "10"]),
}
_NODE_COLUMNS: dict[str, st.SearchStrategy[str]] = {
    "sn": st.sampled_from(["n0", "n1", "n2", "n3", "n4", ""]),
    "cpu_milli": st.integers(0, 128000).map(str),
    "memory_mib": st.integers(0, 1048576).map(str),
    "gpu": st.sampled_from(["0", "1", "2", "4", "8", "8.0"]),
    "model": st.sampled_from(["", "T4", "P100", "V100M16", "V100M32", "G1", "G2", "G3", "A10"]),
}


@st.composite
def csv_files(draw: st.DrawFn, columns: dict[str, st.SearchStrategy[str]]) -> str:
    header = draw(st.permutations(list(columns)))
    rows = []
    for _ in range(draw(st.integers(0, 6))):
        fields = [
            draw(st.one_of(columns[c], _GARBAGE_FIELD) if draw(st.integers(0, 15)) == 0 else columns[c]) for c in header
        ]
        if draw(st.integers(0, 15)) == 0:
            fields = fields[:-1] if draw(st.booleans()) else [*fields, "x"]
        rows.append(",".join(fields))
    return "\n".join([",".join(header), *rows]) + draw(st.sampled_from(["", "\n", "\r\n"]))


@GARBAGE
@given(text=csv_files(_POD_COLUMNS))
def test_random_pod_rows_raise_only_trace_error(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    p = tmp_path_factory.mktemp("garbage") / "pods.csv"
    p.write_text(text, encoding="utf-8")
    try:
        tasks = load_pods(p)
    except TraceError as e:
        assert str(e).startswith(f"{p}")
        return
    for t in tasks:  # what loads is a valid trace task
        assert t.request.gpu_count >= 0 and t.request.cpu_milli >= 0 and t.request.host_memory_mib >= 0
        assert t.request.gpu_count <= 1 or t.request.milli == FULL_MILLI


@GARBAGE
@given(text=csv_files(_NODE_COLUMNS))
def test_random_node_rows_raise_only_trace_error(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    p = tmp_path_factory.mktemp("garbage") / "nodes.csv"
    p.write_text(text, encoding="utf-8")
    try:
        nodes = load_nodes(p)
    except TraceError as e:
        assert str(e).startswith(f"{p}")
        return
    assert len({n.name for n in nodes}) == len(nodes)
