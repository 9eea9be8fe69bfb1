"""Faults under MPS: noticing that a fatal fault in one client ended every client of its MPS server.

Under MPS all clients of a server run in one GPU context, so a fatal fault in one (an illegal address on the H200)
ends its neighbours on that server; the time-sliced neighbour of a faulting process runs on, and so do the clients of
the unit's other daemons (a unit runs a daemon per tenant, each with its own server). Three signals tell the agent,
each tied to the one daemon it came from:

- **the logs**: each control daemon writes ``control.log`` and its servers ``server.log`` in the daemon's own log
  directory (``CUDA_MPS_LOG_DIRECTORY``, which the :class:`~sharegpu.node.mps.MpsManager` sets to
  ``<root>/<unit>/<tenant dir>/log``). Lines are read once each (:class:`LogTail`) and matched against
  :data:`FAULT_PATTERNS`. Driver 580 on an H200 wrote ``Client {PID: …, Context: 1} encountered a fatal GPU error.``
  and ``Server is handling a fatal GPU error.`` (BENCHMARKS.md "On a real GPU"); the other patterns are kept loose
  for drivers not seen yet, in one place, to extend;
- **NVML critical Xid events** (:meth:`~sharegpu.node.backends.base.GpuBackend.xid_events`), which name a unit, not
  a daemon: see :meth:`sharegpu.node.enforcement.EnforcementWatch.faults` for how they are tied to one (driver 580
  reported none for a client's fault on the H200);
- **a vanished server**: an MPS server pid that NVML listed in the last reconcile is gone while the agent still runs
  its daemon and pods of the daemon's tenant still share the unit (an idle server stays up until its daemon quits).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from sharegpu.node.mps import DaemonKey

log = logging.getLogger(__name__)

LOG_FILES = ("control.log", "server.log")

# A line is a fault when one of these matches and none of IGNORED does. Case-insensitive, anywhere in the line.
FAULT_PATTERNS: tuple[re.Pattern[str], ...] = tuple(
    re.compile(p, re.IGNORECASE)
    for p in (
        r"\bfatal\b",
        r"\bexception\b",
        r"\bxid\b",
        r"illegal\s+(memory\s+)?(address|access|instruction)",
        r"\bfault(ed|s)?\b",
        r"exited\s+with\s+(status|code)\s+[1-9]",
        r"\bterminated\s+by\s+signal\b",
        r"\bmemory\s+(page\s+)?fault\b",
    )
)
# Lines that mention the words without being a fault: commands echoed into control.log (e.g. get_server_status).
IGNORED: tuple[re.Pattern[str], ...] = (re.compile(r"\bcmd\s*:", re.IGNORECASE),)
# "[2013-08-05 13:00:09.269 Server 13929] New client 14781 connected": the stamp, the writer and its pid.
_HEADER = re.compile(r"^\[(?P<stamp>[^\]]*?)\s+(?P<who>[A-Za-z]+)\s+(?P<pid>\d+)\]\s*(?P<text>.*)$")
_MAX_READ = 1 << 20  # bytes per file per reconcile: a flood of lines is read over several reconciles


@dataclass(frozen=True, slots=True)
class LogLine:
    file: str  # control.log or server.log
    text: str  # the message, header removed
    stamp: str = ""
    writer: str = ""  # Server, Control, …
    pid: int | None = None


def parse_line(file: str, line: str) -> LogLine:
    m = _HEADER.match(line.strip())
    if m is None:
        return LogLine(file, line.strip())
    return LogLine(file, m["text"], m["stamp"], m["who"], int(m["pid"]))


def is_fault(line: LogLine) -> bool:
    return not any(p.search(line.text) for p in IGNORED) and any(p.search(line.text) for p in FAULT_PATTERNS)


def fault_lines(log_dir: Path) -> list[LogLine]:
    """Every fault line of a unit's logs, read whole (for a check script; the agent reads each line once)."""
    out = []
    for name in LOG_FILES:
        try:
            text = (log_dir / name).read_text(errors="replace")
        except OSError:
            continue
        out += [line for line in (parse_line(name, raw) for raw in text.splitlines()) if is_fault(line)]
    return out


class LogTail:
    """New complete lines of a log file, each read once.

    A file already there when it is first looked at is taken from its end (an agent that restarts does not report
    old faults again); one that appears later is read from its start. A file that shrank or was replaced (a new
    daemon, a rotated log) is read again from its start; a line still being written waits for its newline.
    """

    def __init__(self, path: Path, from_end: bool) -> None:
        self.path = path
        self._ino: int | None = None
        self._offset = 0
        self._from_end = from_end

    def read(self) -> list[str]:
        try:
            st = self.path.stat()
        except OSError:
            self._ino, self._offset, self._from_end = None, 0, False  # once gone, a new file is read whole
            return []
        if st.st_ino != self._ino or st.st_size < self._offset:
            self._offset = st.st_size if self._from_end else 0
            self._ino = st.st_ino
        self._from_end = False
        if st.st_size == self._offset:
            return []
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read(_MAX_READ)
        except OSError as e:
            log.warning("cannot read MPS log %s: %s", self.path, e)
            return []
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self._offset += end + 1
        return data[: end + 1].decode(errors="replace").splitlines()


@dataclass(frozen=True, slots=True)
class FaultSignal:
    """One sign that the clients of an MPS daemon's server died of a fault."""

    unit_uuid: str
    source: str  # "log", "xid" or "server-gone"
    detail: str
    tenant: str | None = None  # the tenant of the daemon it came from (None: it names the unit only: an Xid)

    @property
    def daemon(self) -> DaemonKey | None:
        return DaemonKey(self.unit_uuid, self.tenant) if self.tenant is not None else None


class MpsLogWatch:
    """The fault lines of every MPS daemon's logs since the last look."""

    def __init__(self) -> None:
        self._tails: dict[Path, LogTail] = {}
        self._started = False

    def scan(self, log_dirs: Mapping[DaemonKey, Path]) -> list[FaultSignal]:
        """``log_dirs``: each watched daemon's log directory."""
        out: list[FaultSignal] = []
        for key, log_dir in sorted(log_dirs.items()):
            for name in LOG_FILES:
                path = log_dir / name
                tail = self._tails.get(path)
                if tail is None:
                    tail = self._tails[path] = LogTail(path, from_end=not self._started)
                for raw in tail.read():
                    line = parse_line(name, raw)
                    if is_fault(line):
                        out.append(FaultSignal(key.unit_uuid, "log", f"{name}: {raw.strip()}", key.tenant))
        self._started = True
        wanted = {d / n for d in log_dirs.values() for n in LOG_FILES}
        for gone in set(self._tails) - wanted:
            del self._tails[gone]  # a daemon no longer watched; its directory may come back as a new daemon's
        return out


class ServerWatch:
    """MPS server pids per daemon between reconciles: one gone while its tenant still had pods there is a fault sign."""

    def __init__(self) -> None:
        self._before: dict[DaemonKey, frozenset[int]] = {}

    def update(
        self,
        servers: Mapping[DaemonKey, Iterable[int]],
        daemons: Iterable[DaemonKey],
        with_pods: Iterable[DaemonKey],
    ) -> list[FaultSignal]:
        """``servers``: server pids per daemon now; ``daemons``: the daemons the agent runs (a server that ends
        because the agent stopped its daemon is no fault); ``with_pods``: the daemons whose tenant's pods still
        share their unit."""
        now = {k: frozenset(p) for k, p in servers.items()}
        keep = set(daemons) & set(with_pods)
        out = []
        for key, before in sorted(self._before.items()):
            gone = before - now.get(key, frozenset())
            if gone and key in keep:
                pids = ", ".join(str(p) for p in sorted(gone))
                out.append(
                    FaultSignal(
                        key.unit_uuid,
                        "server-gone",
                        f"MPS server {pids} ended while pods still share the daemon",
                        key.tenant,
                    )
                )
        self._before = now
        return out
