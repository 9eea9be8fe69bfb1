"""The driver's checkpoint: every claim prepared on this node and what was made for it, in one JSON file.

Prepare writes a claim here once its devices are ready and its CDI spec is written, and answers a claim found
here from the file (Prepare is idempotent, and a restarted driver answers the kubelet's retries the same way);
Unprepare drops it after undoing it. MIG instances, MPS daemons and their limits that the remaining claims need are
derived from this file, so a restart keeps them and an Unprepare releases exactly what nobody needs any more.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from sharegpu.model.assignment import Mechanism
from sharegpu.model.tenant import NO_TENANT, own_tenant, user_tenant
from sharegpu.node.dra.claims import ClaimPlan, DevicePlan
from sharegpu.node.dra.config import TimeSlice
from sharegpu.node.durable import RecordError, load_record, save_record
from sharegpu.node.errors import NodeError

KIND = "sharegpu-dra-checkpoint"
# 1: a plain JSON file {"version": 1, "claims"} before records, claims without their pods' user; 2: a claim's "user"
# (the one UID its pods declared, or none); 3: its "tenant" (sharegpu.model.tenant), whose MPS daemon serves it.
VERSION = 3


class CheckpointError(NodeError):
    """The checkpoint cannot be read or written; the message says which file and what to do."""


class Checkpoint:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.claims: dict[str, ClaimPlan] = {}
        self.units: dict[str, tuple[str, ...]] = {}  # claim UID → the unit UUID of each device, in order
        if path.exists():
            self._load()

    def add(self, plan: ClaimPlan, units: tuple[str, ...]) -> None:
        self.claims[plan.uid] = plan
        self.units[plan.uid] = units
        self._save()

    def drop(self, uid: str) -> None:
        if self.claims.pop(uid, None) is not None:
            self.units.pop(uid, None)
            self._save()

    def devices(self) -> list[tuple[DevicePlan, str]]:
        """Every prepared device with its unit UUID."""
        return [(d, u) for uid, plan in self.claims.items() for d, u in zip(plan.devices, self.units[uid], strict=True)]

    def _save(self) -> None:
        data = {
            "claims": {
                uid: {
                    "namespace": p.namespace,
                    "name": p.name,
                    "devices": [asdict(d) for d in p.devices],
                    "units": list(self.units[uid]),
                    **({"tenant": p.tenant} if p.tenant != NO_TENANT else {}),
                }
                for uid, p in self.claims.items()
            },
        }
        try:
            save_record(self.path, KIND, VERSION, data)
        except OSError as e:
            raise CheckpointError(f"cannot write the DRA checkpoint {self.path}: {e.strerror or e}") from None

    def _load(self) -> None:
        try:
            data: Any = load_record(self.path, KIND, VERSION, {1: dict, 2: _user_to_tenant}, _version_1)
            for uid, c in data["claims"].items():
                devices = tuple(
                    DevicePlan(
                        **{**d, "mechanism": Mechanism(d["mechanism"]), "time_slice": TimeSlice(d["time_slice"])}
                    )
                    for d in c["devices"]
                )
                tenant = c.get("tenant", NO_TENANT)  # absent: a claim without MPS
                if not isinstance(tenant, str):
                    raise ValueError(f"claim {uid}: tenant {tenant!r} is not a tenant key")
                self.claims[uid] = ClaimPlan(uid, c["namespace"], c["name"], devices, tenant)
                self.units[uid] = tuple(str(u) for u in c["units"])
        except (RecordError, ValueError, TypeError, KeyError, AttributeError) as e:
            raise CheckpointError(
                f"the DRA checkpoint {self.path} is unreadable ({e}); prepared claims cannot be recovered from it. "
                "Drain the node's DRA pods, then move the file away"
            ) from None


def _version_1(raw: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
    """The checkpoint as written before it was a record: ``{"version": 1, "claims": …}``."""
    if raw.get("version") == 1 and isinstance(raw.get("claims"), dict):
        return 1, {"claims": raw["claims"]}
    return None


def _user_to_tenant(data: dict[str, Any]) -> dict[str, Any]:
    """Version 2 → 3: a claim's user becomes its tenant.

    An MPS claim whose pods declared one UID served that UID's pods of its namespace: their tenant. One without a
    user (its pods left it to the image) becomes a tenant of its own, named after the claim (its UID is no pod's),
    so that it never shares a daemon with a claim prepared later. A claim without MPS has no tenant.
    """
    claims: dict[str, Any] = {}
    for uid, c in data["claims"].items():
        c = dict(c)
        user = c.pop("user", None)
        if user is not None and (isinstance(user, bool) or not isinstance(user, int)):
            raise ValueError(f"claim {uid}: user {user!r} is not a UID")
        if any(d.get("mechanism") == Mechanism.MPS.value for d in c["devices"]):
            c["tenant"] = user_tenant(c["namespace"], user) if user is not None else own_tenant(uid)
        claims[uid] = c
    return {**data, "claims": claims}
