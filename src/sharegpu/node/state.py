"""What the node agent must remember across its own restarts, in one small JSON file.

Everything else is found again from the hardware (MIG instances, MPS daemons) and from the pods' assignments.
Only two facts live nowhere else: which MIG instances sharegpu created (the others are a static layout it must
never destroy) and which GPUs it switched into MIG mode; plus the containers already allocated, so a restarted
agent never hands the same container out twice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class StateError(Exception):
    """The agent's state file cannot be read or written."""


class AgentState:
    """The persistent facts; every change is written through at once (atomically) when a path is given."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.managed_mig: set[str] = set()  # MIG UUIDs created by sharegpu
        self.mig_mode_set: set[str] = set()  # GPU UUIDs whose MIG mode sharegpu turned on
        self.allocations: dict[str, dict[str, tuple[str, ...]]] = {}  # pod UID → container → unit UUIDs
        if path is not None and path.exists():
            self._load(path)

    def add_managed_mig(self, mig_uuid: str) -> None:
        self.managed_mig.add(mig_uuid)
        self.save()

    def drop_managed_mig(self, mig_uuid: str) -> None:
        self.managed_mig.discard(mig_uuid)
        self.save()

    def set_mig_mode_by_us(self, gpu_uuid: str, on: bool) -> None:
        (self.mig_mode_set.add if on else self.mig_mode_set.discard)(gpu_uuid)
        self.save()

    def record_allocation(self, pod_uid: str, container: str, units: tuple[str, ...]) -> None:
        self.allocations.setdefault(pod_uid, {})[container] = units
        self.save()

    def allocated_containers(self, pod_uid: str) -> frozenset[str]:
        return frozenset(self.allocations.get(pod_uid, {}))

    def forget_pods_except(self, live_uids: set[str]) -> None:
        """Drop allocations of pods that no longer exist, so the file does not grow forever."""
        gone = set(self.allocations) - live_uids
        if gone:
            for uid in gone:
                del self.allocations[uid]
            self.save()

    def forget_pods(self, uids: set[str]) -> None:
        """Drop the allocations of these pods (the caller made sure that they are gone)."""
        gone = set(self.allocations) & uids
        if gone:
            for uid in gone:
                del self.allocations[uid]
            self.save()

    def save(self) -> None:
        if self.path is None:
            return
        data = {
            "managedMig": sorted(self.managed_mig),
            "migModeSet": sorted(self.mig_mode_set),
            "allocations": {uid: {c: list(u) for c, u in cs.items()} for uid, cs in self.allocations.items()},
        }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(self.path.suffix + ".tmp")
            tmp.write_text(json.dumps(data, sort_keys=True))
            os.replace(tmp, self.path)  # a crash leaves the old file or the new one, never half of one
        except OSError as e:
            raise StateError(f"cannot write the agent state {self.path}: {e.strerror or e}") from None

    def _load(self, path: Path) -> None:
        try:
            data: Any = json.loads(path.read_text())
            self.managed_mig = {str(u) for u in data.get("managedMig", [])}
            self.mig_mode_set = {str(u) for u in data.get("migModeSet", [])}
            self.allocations = {
                str(uid): {str(c): tuple(str(x) for x in units) for c, units in cs.items()}
                for uid, cs in data.get("allocations", {}).items()
            }
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise StateError(
                f"the agent state {path} is unreadable ({e}); move it away to start afresh "
                "(MIG instances sharegpu made will then be kept as if static)"
            ) from None
