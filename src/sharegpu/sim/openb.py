"""Loaders for the openb trace format (Alibaba cluster-trace-gpu-v2023): node list and pod lists.

Every problem is reported as :class:`TraceError` naming the file and line, so that a bad file never turns into
a traceback. Only the columns of the format are accepted: an unknown column is an error, not silently ignored.
"""

from __future__ import annotations

import codecs
import csv
import io
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog
from sharegpu.model.inventory import NodeSpec, sim_gpus
from sharegpu.model.request import FULL_MILLI, GpuRequest, InvalidRequest

NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
NODE_REQUIRED = NODE_COLUMNS
POD_REQUIRED = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
# Bounds that no real machine or pod reaches; beyond them a value is a typo, not a cluster.
MAX_VALUE = 10**12
MAX_GPUS_PER_NODE = 64
POD_OPTIONAL = ("gpu_spec", "qos", "pod_phase", "creation_time", "deletion_time", "scheduled_time")
# What a trace file may make the program hold. The openb pod lists have about 8,000 rows in 0.6 MB; these caps are
# 60 times that and keep a run's memory to about a gigabyte; beyond them a file is a mistake (a device such as
# /dev/zero, a log, a generated file gone wrong), and reading it whole would only grow memory.
MAX_FILE_BYTES = 64 * 2**20
MAX_ROWS = 500_000
MAX_LINE_BYTES = 64 * 2**10  # an openb row is under 200 bytes
READ_CHUNK = 2**20
# The trace's anonymised GPU models: not in the catalog, yet no typo.
OPAQUE_MODELS = frozenset({"G1", "G2", "G3"})


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line and what to fix."""

    def __init__(self, path: Path, line: int | None, message: str) -> None:
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {message}")
        self.path = path
        self.line = line


@dataclass(frozen=True, slots=True)
class TraceTask:
    """One pod of a trace: its request and, for replay, when it was created and deleted (seconds)."""

    request: GpuRequest
    creation_time: int | None = None
    deletion_time: int | None = None

    @property
    def name(self) -> str:
        return self.request.name


def _decode(path: Path) -> str:
    """The file as text, read up to ``MAX_FILE_BYTES``. Decoding it whole (rather than as the CSV reader pulls
    chunks) lets a bad byte be reported on its own line, not on the line the reader had reached; reading it by
    chunks stops at the first NUL byte (binary data, /dev/zero) or the cap instead of filling memory."""
    chunks: list[bytes] = []
    decoder = codecs.getincrementaldecoder("utf-8")()
    text: list[str] = []
    size = 0
    line_start = 0  # file offset of the line being read
    lines = 1
    try:
        with path.open("rb") as f:
            while chunk := f.read(READ_CHUNK):
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_FILE_BYTES:
                    raise TraceError(
                        path,
                        None,
                        f"is larger than {MAX_FILE_BYTES // 2**20} MiB, more than any trace (the openb pod lists are "
                        f"under 1 MB, at most {MAX_ROWS:,} rows are read); check that it is the trace you meant, or "
                        "split it",
                    )
                text.append(decoder.decode(chunk))  # first: a byte that is not UTF-8 is named as such
                nul = chunk.find(b"\0")
                if nul >= 0:
                    data = b"".join(chunks)
                    at = size - len(chunk) + nul
                    raise TraceError(
                        path,
                        data.count(b"\n", 0, at) + 1,
                        "not a CSV text file: it holds a NUL byte (binary data); give a CSV file",
                    )
                start = size - len(chunk)
                for nl in _newlines(chunk):
                    if start + nl - line_start > MAX_LINE_BYTES:
                        break
                    line_start = start + nl + 1
                    lines += 1
                if size - line_start > MAX_LINE_BYTES:
                    raise TraceError(
                        path,
                        lines,
                        f"a line is longer than {MAX_LINE_BYTES // 2**10} KiB (a trace row is under 200 bytes): not a "
                        "trace's CSV; check the file",
                    )
            text.append(decoder.decode(b"", final=True))
    except UnicodeDecodeError:
        data = b"".join(chunks)
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:  # where in the whole file: the incremental decoder counts per chunk
            line = data.count(b"\n", 0, e.start) + 1
            column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
            raise TraceError(
                path,
                line,
                f"not a readable CSV file: byte 0x{data[e.start]:02x} at column {column} is not UTF-8 text",
            ) from None
        raise TraceError(path, None, "not a readable CSV file: it ends inside a UTF-8 character") from None
    except OSError as e:
        raise TraceError(path, None, f"cannot open: {e.strerror or e}") from None
    # A byte-order mark (spreadsheet programs write one) is not part of the first column's name.
    return "".join(text).removeprefix("\ufeff")


def _newlines(chunk: bytes) -> list[int]:
    out, at = [], chunk.find(b"\n")
    while at >= 0:
        out.append(at)
        at = chunk.find(b"\n", at + 1)
    return out


def _rows(
    path: Path, required: tuple[str, ...], optional: tuple[str, ...]
) -> tuple[tuple[str, ...], list[tuple[int, dict[str, str]]]]:
    """The header and the non-blank rows, each with its line in the file."""
    reader = csv.reader(io.StringIO(_decode(path), newline=""))
    try:
        header = next(reader)
    except StopIteration:
        raise TraceError(path, 1, "file is empty; expected a CSV header") from None
    except csv.Error as e:
        raise TraceError(path, 1, f"not a readable CSV file: {e}") from None
    header = [h.strip() for h in header]
    unknown = [h for h in header if h not in required and h not in optional]
    if unknown:
        raise TraceError(path, 1, f"unknown column(s) {unknown}; expected {list(required + optional)}")
    missing = [h for h in required if h not in header]
    if missing:
        raise TraceError(path, 1, f"missing column(s) {missing}")
    if len(set(header)) != len(header):
        raise TraceError(path, 1, "a column is named twice")
    rows: list[tuple[int, dict[str, str]]] = []
    shared: dict[str, str] = {}
    line = 1
    try:
        for row in reader:
            line = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != len(header):
                raise TraceError(path, line, f"has {len(row)} fields; the header has {len(header)}")
            if len(rows) == MAX_ROWS:
                raise TraceError(
                    path,
                    line,
                    f"has more than {MAX_ROWS:,} rows, the most a trace may have (the openb pod lists have about "
                    "8,000); give a smaller trace, e.g. a sample of its rows",
                )
            # One string object per distinct value: most columns repeat a few values ("LS", "Running", "0", ""),
            # and a trace of 500,000 rows otherwise holds millions of equal strings (about 200 MiB).
            rows.append((line, dict(zip(header, (shared.setdefault(v, v) for v in map(str.strip, row)), strict=True))))
    except csv.Error as e:
        # The reader counts the line it failed on only once it has read it; a row it stopped in is the next one.
        raise TraceError(path, max(reader.line_num, line + 1), f"not a readable CSV row: {e}") from None
    if not rows:
        raise TraceError(path, None, "has a header but no rows")
    return tuple(header), rows


# Whole numbers as the trace writes them: plain ASCII digits, optionally with a zero fraction ("1000.0"). Python's
# int() and float() also take "1e1", "1_000", "inf" and non-ASCII digits, which no trace writes and which would turn
# a typo into a number.
_WHOLE = re.compile(r"-?[0-9]+(?:\.0*)?")
_NUMBER = re.compile(r"-?(?:[0-9]+\.?[0-9]*|\.[0-9]+)")


def _int(path: Path, line: int, row: Mapping[str, str], col: str, optional: bool = False) -> int | None:
    text = row.get(col, "")
    if text == "" and optional:
        return None
    if not _WHOLE.fullmatch(text):
        if _NUMBER.fullmatch(text):
            raise TraceError(path, line, f"{col} is {text!r}, not a whole number")
        raise TraceError(
            path, line, f"{col} is {text!r}, not a number: write a whole number in plain digits, e.g. 1000"
        )
    value = int(text.partition(".")[0])
    if value < 0:
        raise TraceError(path, line, f"{col} is {value}; it must not be negative")
    if value > MAX_VALUE:
        raise TraceError(path, line, f"{col} is {value}, beyond any real machine; check the value")
    return value


def _req_int(path: Path, line: int, row: Mapping[str, str], col: str) -> int:
    v = _int(path, line, row, col)
    assert v is not None
    return v


def _unique_name(path: Path, line: int, row: Mapping[str, str], col: str, kind: str, seen: set[str]) -> str:
    name = row[col]
    if not name:
        raise TraceError(path, line, f"{col} ({kind} name) is empty")
    if name in seen:
        raise TraceError(path, line, f"{kind} {name!r} is listed twice")
    seen.add(name)
    return name


@dataclass(frozen=True, slots=True)
class TraceWarning:
    """Something a trace file says that is accepted but probably not meant; printed with its file and line."""

    path: Path
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


Warn = Callable[[TraceWarning], None]


class _Findings:
    """Collects one kind of finding row by row, so that a file with thousands of them gives one warning."""

    def __init__(self) -> None:
        self.lines: dict[str, list[int]] = {}

    def add(self, key: str, line: int) -> None:
        self.lines.setdefault(key, []).append(line)

    def emit(self, warn: Warn | None, path: Path, message: Callable[[str, int], str]) -> None:
        if warn is None:
            return
        for key, lines in self.lines.items():
            where = ", ".join(map(str, lines[:5])) + (", …" if len(lines) > 5 else "")
            warn(TraceWarning(path, lines[0], f"{message(key, len(lines))} (line {where})"))


def _unknown_models(catalog: Catalog, names: Iterable[str]) -> list[str]:
    return sorted(n for n in names if not catalog.known(n) and n.upper() not in OPAQUE_MODELS)


def load_nodes(path: Path, catalog: Catalog = DEFAULT_CATALOG, warn: Warn | None = None) -> list[NodeSpec]:
    """The node list. A GPU model that is neither in the catalog nor one of the trace's anonymised names is
    accepted as an opaque model (whole GPUs and compute shares only) and reported through ``warn``."""
    nodes = []
    seen: set[str] = set()
    unknown, starved = _Findings(), _Findings()
    for line, row in _rows(path, NODE_REQUIRED, ())[1]:
        name = _unique_name(path, line, row, "sn", "node", seen)
        gpus = _req_int(path, line, row, "gpu")
        if gpus > MAX_GPUS_PER_NODE:
            raise TraceError(path, line, f"node {name!r} has {gpus} GPUs; at most {MAX_GPUS_PER_NODE} are supported")
        model = row["model"]
        if gpus and not model:
            raise TraceError(path, line, f"node {name!r} has {gpus} GPUs but no model")
        for m in _unknown_models(catalog, [model] if gpus else []):
            unknown.add(m, line)
        model_name = catalog.get(model).name if model else ""
        cpu, memory = _req_int(path, line, row, "cpu_milli"), _req_int(path, line, row, "memory_mib")
        if gpus and not cpu and not memory:
            # Every pod asks for some CPU or memory: such GPUs could never be used, and would count as idle
            # capacity against every policy. A lost value, not a machine.
            raise TraceError(
                path,
                line,
                f"node {name!r} has {gpus} GPUs but 0 CPU and 0 memory, so no pod could ever use them; give its "
                "cpu_milli and memory_mib (or gpu 0)",
            )
        if gpus and not (cpu and memory):
            starved.add("CPU" if not cpu else "memory", line)
        nodes.append(NodeSpec(name, cpu, memory, sim_gpus(name, model_name, gpus)))
    unknown.emit(
        warn,
        path,
        lambda m, n: (
            f"GPU model {m!r} ({n} node(s)) is not in the GPU catalog; it is taken as an opaque model "
            "(whole GPUs and compute shares, no MIG, no memory sizing): check the spelling"
        ),
    )
    starved.emit(
        warn,
        path,
        lambda what, n: (
            f"{n} node(s) with GPUs have 0 {what}: only pods that ask for no {what} can use their GPUs; check "
            f"the {'cpu_milli' if what == 'CPU' else 'memory_mib'} value"
        ),
    )
    return nodes


@dataclass(frozen=True)
class PodTable:
    """A pod list as read: the header, each row's text and file line, and the validated task of each row."""

    path: Path
    header: tuple[str, ...]
    rows: tuple[Mapping[str, str], ...]
    lines: tuple[int, ...]
    tasks: tuple[TraceTask, ...]


def read_pod_table(path: Path, catalog: Catalog = DEFAULT_CATALOG, warn: Warn | None = None) -> PodTable:
    """The pod list with its raw rows (for tools that rewrite a trace). ``gpu_milli`` above one GPU is clamped to
    one GPU, as the FGD reference does, and reported through ``warn``, as is a ``gpu_spec`` model that is neither
    in the catalog nor one of the trace's anonymised names."""
    header, rows = _rows(path, POD_REQUIRED, POD_OPTIONAL)
    seen: set[str] = set()
    clamped, unknown = _Findings(), _Findings()
    tasks = []
    for line, row in rows:
        task = _task(path, line, row, catalog, seen)
        if _req_int(path, line, row, "gpu_milli") > FULL_MILLI:
            clamped.add("", line)
        for m in _unknown_models(catalog, _spec_models(row)):
            unknown.add(m, line)
        tasks.append(task)
    clamped.emit(
        warn,
        path,
        lambda _, n: (
            f"gpu_milli above {FULL_MILLI} (one whole GPU) in {n} row(s); clamped to {FULL_MILLI} as the "
            "FGD reference does"
        ),
    )
    unknown.emit(
        warn,
        path,
        lambda m, n: (
            f"gpu_spec names GPU model {m!r} ({n} pod(s)), which is not in the GPU catalog: check the "
            "spelling; such a pod runs only on nodes of that exact model"
        ),
    )
    return PodTable(path, header, tuple(r for _, r in rows), tuple(line for line, _ in rows), tuple(tasks))


def load_pods(path: Path, catalog: Catalog = DEFAULT_CATALOG, warn: Warn | None = None) -> list[TraceTask]:
    return list(read_pod_table(path, catalog, warn).tasks)


def unplaceable_models(nodes: Sequence[NodeSpec], table: PodTable) -> list[TraceWarning]:
    """Pods whose ``gpu_spec`` allows no GPU model that any node of the cluster has: they can never be placed."""
    present = {g.model for n in nodes for g in n.gpus}
    found = _Findings()
    for line, task in zip(table.lines, table.tasks, strict=True):
        allowed = task.request.allowed_models
        if task.request.gpu_count and allowed and not allowed & present:
            found.add("|".join(sorted(allowed)), line)
    out: list[TraceWarning] = []
    found.emit(
        out.append,
        table.path,
        lambda spec, n: (
            f"{n} pod(s) allow only GPU model(s) {spec}, which no node of the cluster has; they can never be placed"
        ),
    )
    return out


def _spec_models(row: Mapping[str, str]) -> list[str]:
    return [m.strip() for m in row.get("gpu_spec", "").split("|") if m.strip()]


def _check_spec(path: Path, line: int, row: Mapping[str, str]) -> None:
    """A ``gpu_spec`` with an empty name between its ``|`` (``T4||``) is a list cut short or a typo, not "any
    model": refused rather than read as the names that are there."""
    text = row.get("gpu_spec", "").strip()
    if text and any(not m.strip() for m in text.split("|")):
        raise TraceError(
            path,
            line,
            f"gpu_spec {text!r} has an empty model name; separate the models by one '|', e.g. 'V100M16|V100M32'",
        )


def _task(path: Path, line: int, row: Mapping[str, str], catalog: Catalog, seen: set[str]) -> TraceTask:
    name = _unique_name(path, line, row, "name", "pod", seen)
    _check_spec(path, line, row)
    num_gpu = _req_int(path, line, row, "num_gpu")
    milli = _req_int(path, line, row, "gpu_milli")
    if num_gpu == 0 and milli:
        raise TraceError(path, line, f"gpu_milli is {milli} but num_gpu is 0")
    if num_gpu and milli == 0:
        raise TraceError(path, line, f"num_gpu is {num_gpu} but gpu_milli is 0")
    # The reference clamps a share above one GPU to one GPU.
    milli = min(milli, FULL_MILLI)
    if num_gpu > 1 and milli < FULL_MILLI:
        raise TraceError(path, line, f"a {num_gpu}-GPU pod must use whole GPUs (gpu_milli 1000), not {milli}")
    try:
        req = GpuRequest(
            name,
            gpu_count=num_gpu,
            compute_milli=milli if num_gpu else None,
            allowed_models=frozenset(_spec_models(row)),
            cpu_milli=_req_int(path, line, row, "cpu_milli"),
            host_memory_mib=_req_int(path, line, row, "memory_mib"),
            catalog=catalog,
        )
    except InvalidRequest as e:
        raise TraceError(path, line, str(e)) from None
    created = _int(path, line, row, "creation_time", optional=True)
    deleted = _int(path, line, row, "deletion_time", optional=True)
    if created is not None and deleted is not None and deleted < created:
        raise TraceError(path, line, f"deletion_time {deleted} is before creation_time {created}")
    return TraceTask(req, created, deleted)


def replay_gaps(table: PodTable) -> list[TraceWarning]:
    """What ``--replay`` would have to make up for a pod list: an error when no pod has a creation time or none a
    deletion time (a replay would then show nothing of what it is for: every pod would arrive at once, or none
    would ever leave and the pending queue would only grow), and a warning per kind of pod that lacks one."""
    no_start, no_end = _Findings(), _Findings()
    for line, task in zip(table.lines, table.tasks, strict=True):
        if task.creation_time is None:
            no_start.add("", line)
        if task.deletion_time is None:
            no_end.add("", line)
    pods = len(table.tasks)
    for column, findings in (("creation_time", no_start), ("deletion_time", no_end)):
        if sum(map(len, findings.lines.values())) == pods:
            raise TraceError(
                table.path,
                None,
                f"no pod has a {column}, so --replay has no {column.split('_')[0]} times to honour; run without "
                "--replay (the FGD protocol: pods arrive one at a time and never leave), or give the pods "
                "creation_time and deletion_time",
            )
    out: list[TraceWarning] = []
    no_start.emit(
        out.append, table.path, lambda _, n: f"{n} pod(s) have no creation_time; --replay submits them at time 0"
    )
    no_end.emit(
        out.append,
        table.path,
        lambda _, n: f"{n} pod(s) have no deletion_time; --replay keeps them to the end (they never leave)",
    )
    return out
