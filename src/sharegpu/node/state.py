"""What the node agent must remember across its own restarts, in one small JSON file.

Everything else is found again from the hardware (MIG instances, MPS daemons) and from the pods' assignments.
Only these facts live nowhere else: which MIG instances sharegpu created (the others are a static layout it must
never destroy) and which GPUs it switched into MIG mode; which share of its pod's assignment each device ID the
kubelet handed out is tied to (so a restarted agent, or a restarted container, gets the very same share and never
one that another running container holds); the containers granted, and the CDI specs written for them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sharegpu.node.durable import RecordError, load_record, save_record
from sharegpu.node.errors import NodeError

KIND = "sharegpu-agent-state"
VERSION = 1  # 0: the unversioned file written before records (same fields)


class StateError(NodeError):
    """The agent's state file cannot be read or written."""


class AgentState:
    """The persistent facts; every change is written through at once (atomically) when a path is given."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.managed_mig: set[str] = set()  # MIG UUIDs created by sharegpu
        self.mig_mode_set: set[str] = set()  # GPU UUIDs whose MIG mode sharegpu turned on
        self.allocations: dict[str, dict[str, tuple[str, ...]]] = {}  # pod UID → container → unit UUIDs
        self.device_share: dict[str, dict[str, int]] = {}  # pod UID → device ID → index of its share
        self.cdi_specs: dict[str, set[str]] = {}  # pod UID → CDI allocation names written for it
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

    def record_allocation(self, pod_uid: str, container: str, units: tuple[str, ...], cdi_name: str = "") -> None:
        self.allocations.setdefault(pod_uid, {})[container] = units
        if cdi_name:
            self.cdi_specs.setdefault(pod_uid, set()).add(cdi_name)
        self.save()

    def allocated_containers(self, pod_uid: str) -> frozenset[str]:
        return frozenset(self.allocations.get(pod_uid, {}))

    def device_shares(self, pod_uid: str) -> dict[str, int]:
        return dict(self.device_share.get(pod_uid, {}))

    def tie_device_shares(self, pod_uid: str, ties: dict[str, int]) -> dict[str, int]:
        """Tie more device IDs of a pod to shares (never re-tie one); returns all of the pod's ties."""
        current = self.device_share.setdefault(pod_uid, {})
        for device, index in ties.items():
            if device in current:
                raise ValueError(f"device ID {device} of pod {pod_uid} is tied to share {current[device]} already")
            current[device] = index
        self.save()
        return dict(current)

    def known_pods(self) -> set[str]:
        return set(self.allocations) | set(self.device_share) | set(self.cdi_specs)

    def all_cdi_specs(self) -> set[str]:
        return {n for names in self.cdi_specs.values() for n in names}

    def forget_pods(self, uids: set[str]) -> set[str]:
        """Drop what is recorded of these pods (the caller made sure that they are gone); returns the names of their
        CDI specs that no other pod's record names, which the caller removes.

        A spec's name depends only on the device IDs the kubelet picked (Allocate names it before the pod is known),
        so a live pod that got a finished pod's device IDs has the same spec name: removing it would take the live
        pod's spec away.
        """
        gone = self.known_pods() & uids
        specs: set[str] = set()
        if gone:
            for uid in gone:
                self.allocations.pop(uid, None)
                self.device_share.pop(uid, None)
                specs |= self.cdi_specs.pop(uid, set())
            self.save()
        return specs - self.all_cdi_specs()

    def save(self) -> None:
        if self.path is None:
            return
        data = {
            "managedMig": sorted(self.managed_mig),
            "migModeSet": sorted(self.mig_mode_set),
            "allocations": {uid: {c: list(u) for c, u in cs.items()} for uid, cs in self.allocations.items()},
            "deviceShares": self.device_share,
            "cdiSpecs": {uid: sorted(names) for uid, names in self.cdi_specs.items()},
        }
        try:
            save_record(self.path, KIND, VERSION, data)
        except OSError as e:
            raise StateError(f"cannot write the agent state {self.path}: {e.strerror or e}") from None

    def _load(self, path: Path) -> None:
        try:
            data: Any = load_record(path, KIND, VERSION, {0: dict}, _unversioned)
            self.managed_mig = {str(u) for u in data.get("managedMig", [])}
            self.mig_mode_set = {str(u) for u in data.get("migModeSet", [])}
            self.allocations = {
                str(uid): {str(c): tuple(str(x) for x in units) for c, units in cs.items()}
                for uid, cs in data.get("allocations", {}).items()
            }
            self.device_share = {
                str(uid): {str(d): int(i) for d, i in ties.items()}
                for uid, ties in data.get("deviceShares", {}).items()
            }
            self.cdi_specs = {str(uid): {str(n) for n in names} for uid, names in data.get("cdiSpecs", {}).items()}
        except (RecordError, ValueError, TypeError, AttributeError) as e:
            raise StateError(
                f"the agent state {path} is unreadable ({e}); move it away to start afresh "
                "(MIG instances sharegpu made will then be kept as if static)"
            ) from None


def _unversioned(raw: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
    """The state file as written before it was a record: the fields alone."""
    known = {"managedMig", "migModeSet", "allocations", "deviceShares", "cdiSpecs"}
    return (0, raw) if raw.keys() <= known else None
