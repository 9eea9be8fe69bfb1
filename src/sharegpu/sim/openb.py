"""Loaders for the openb trace format (Alibaba cluster-trace-gpu-v2023): node list and pod lists.

Every problem is reported as :class:`TraceError` naming the file and line, so that a bad file never turns into
a traceback. Only the columns of the format are accepted: an unknown column is an error, not silently ignored.
"""

from __future__ import annotations

import csv
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


def _rows(path: Path, required: tuple[str, ...], optional: tuple[str, ...]) -> list[tuple[int, dict[str, str]]]:
    try:
        f = path.open(newline="", encoding="utf-8")
    except OSError as e:
        raise TraceError(path, None, f"cannot open: {e.strerror or e}") from None
    with f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            raise TraceError(path, 1, "file is empty; expected a CSV header") from None
        except (csv.Error, UnicodeDecodeError) as e:
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
        rows = []
        try:
            for row in reader:
                line = reader.line_num
                if not row or all(not c.strip() for c in row):
                    continue
                if len(row) != len(header):
                    raise TraceError(path, line, f"has {len(row)} fields; the header has {len(header)}")
                rows.append((line, dict(zip(header, (c.strip() for c in row), strict=True))))
        except (csv.Error, UnicodeDecodeError) as e:
            raise TraceError(path, reader.line_num, f"not a readable CSV row: {e}") from None
    if not rows:
        raise TraceError(path, None, "has a header but no rows")
    return rows


def _int(path: Path, line: int, row: dict[str, str], col: str, optional: bool = False) -> int | None:
    text = row.get(col, "")
    if text == "" and optional:
        return None
    try:
        value = int(text)
    except ValueError:
        try:
            f = float(text)
        except ValueError:
            raise TraceError(path, line, f"{col} is {text!r}, not a number") from None
        if not f.is_integer():
            raise TraceError(path, line, f"{col} is {text!r}, not a whole number") from None
        value = int(f)
    if value < 0:
        raise TraceError(path, line, f"{col} is {value}; it must not be negative")
    if value > MAX_VALUE:
        raise TraceError(path, line, f"{col} is {value}, beyond any real machine; check the value")
    return value


def _req_int(path: Path, line: int, row: dict[str, str], col: str) -> int:
    v = _int(path, line, row, col)
    assert v is not None
    return v


def _unique_name(path: Path, line: int, row: dict[str, str], col: str, kind: str, seen: set[str]) -> str:
    name = row[col]
    if not name:
        raise TraceError(path, line, f"{col} ({kind} name) is empty")
    if name in seen:
        raise TraceError(path, line, f"{kind} {name!r} is listed twice")
    seen.add(name)
    return name


def load_nodes(path: Path, catalog: Catalog = DEFAULT_CATALOG) -> list[NodeSpec]:
    nodes = []
    seen: set[str] = set()
    for line, row in _rows(path, NODE_REQUIRED, ()):
        name = _unique_name(path, line, row, "sn", "node", seen)
        gpus = _req_int(path, line, row, "gpu")
        if gpus > MAX_GPUS_PER_NODE:
            raise TraceError(path, line, f"node {name!r} has {gpus} GPUs; at most {MAX_GPUS_PER_NODE} are supported")
        model = row["model"]
        if gpus and not model:
            raise TraceError(path, line, f"node {name!r} has {gpus} GPUs but no model")
        model_name = catalog.get(model).name if model else ""
        nodes.append(
            NodeSpec(
                name,
                _req_int(path, line, row, "cpu_milli"),
                _req_int(path, line, row, "memory_mib"),
                sim_gpus(name, model_name, gpus),
            )
        )
    return nodes


def load_pods(path: Path, catalog: Catalog = DEFAULT_CATALOG) -> list[TraceTask]:
    tasks = []
    seen: set[str] = set()
    for line, row in _rows(path, POD_REQUIRED, POD_OPTIONAL):
        tasks.append(_task(path, line, row, catalog, seen))
    return tasks


def _task(path: Path, line: int, row: dict[str, str], catalog: Catalog, seen: set[str]) -> TraceTask:
    name = _unique_name(path, line, row, "name", "pod", seen)
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
    spec = row.get("gpu_spec", "")
    models = frozenset(m.strip() for m in spec.split("|") if m.strip())
    try:
        req = GpuRequest(
            name,
            gpu_count=num_gpu,
            compute_milli=milli if num_gpu else None,
            allowed_models=models,
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
