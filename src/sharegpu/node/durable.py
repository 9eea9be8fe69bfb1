"""The node's one way to put a file on disk, and its versioned, checksummed record format.

A node process that dies (an OOM kill, a node crash) must leave every file it keeps either as it was or as it became,
never half written, and a power loss must not undo a write the process went on from: the data is written to a
temporary file beside the target, flushed to the disk (``fsync``), renamed over the target, and the directory is
flushed so that the rename itself is durable.

State the node reads back (the agent's state, the DRA driver's checkpoint) is a *record*: ``{"kind", "version",
"checksum", "data"}``, the checksum a SHA-256 of the data's canonical JSON. A reader knows each version it can read
and migrates older ones forward (as NVIDIA's DRA driver does with its checkpoint versions); a newer version, another
kind or a checksum that does not match is refused with a message that says what to do, never guessed at.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sharegpu.node.errors import NodeError


class RecordError(NodeError):
    """A record file that cannot be trusted: unreadable, of another kind or a newer version, or corrupt."""


Migration = Callable[[dict[str, Any]], dict[str, Any]]


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``, durably: the old content or the new, whatever happens. Raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):  # some file systems cannot fsync a directory; the rename is done anyway
            os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def checksum(data: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def save_record(path: Path, kind: str, version: int, data: Mapping[str, Any]) -> None:
    """Write ``data`` as a record of ``kind`` at ``version``. Raises OSError."""
    record = {"kind": kind, "version": version, "checksum": f"sha256:{checksum(data)}", "data": data}
    write_atomic(path, json.dumps(record, sort_keys=True))


def load_record(
    path: Path,
    kind: str,
    version: int,
    migrations: Mapping[int, Migration] | None = None,
    legacy: Callable[[dict[str, Any]], tuple[int, dict[str, Any]] | None] | None = None,
) -> dict[str, Any]:
    """The data of the record at ``path``, migrated to ``version``.

    ``migrations[v]`` turns version ``v``'s data into version ``v + 1``'s. ``legacy`` recognises a file written before
    records existed and returns its version and data (None: not such a file).
    """
    try:
        raw: Any = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise RecordError(f"{path} cannot be read: {e}") from None
    if not isinstance(raw, dict):
        raise RecordError(f"{path} is not a {kind} record (not a JSON object)")
    old = legacy(raw) if "checksum" not in raw and legacy is not None else None
    if old is not None:
        found, data = old
    else:
        if raw.get("kind") != kind:
            raise RecordError(f"{path} holds a {raw.get('kind')!r} record, not {kind!r}")
        v, d = raw.get("version"), raw.get("data")
        if isinstance(v, bool) or not isinstance(v, int) or not isinstance(d, dict):
            raise RecordError(f"{path}: version {v!r} or its data is malformed")
        found, data = v, d
        if raw.get("checksum") != f"sha256:{checksum(data)}":
            raise RecordError(f"{path}: its checksum does not match its content (the file was changed or damaged)")
    if found > version:
        raise RecordError(
            f"{path} is {kind} version {found}, newer than this sharegpu reads ({version}): run the newer sharegpu, "
            "or move the file away"
        )
    while found < version:
        step = (migrations or {}).get(found)
        if step is None:
            raise RecordError(f"{path} is {kind} version {found}, which this sharegpu cannot read")
        data, found = step(data), found + 1
    return data
