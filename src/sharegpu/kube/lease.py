"""The ``coordination.k8s.io/v1`` Lease as leader election reads and writes it: a record and three requests.

The election itself (client-go's protocol) is :mod:`sharegpu.k8s.extender.leader`, on top of :class:`LeaseApi`;
:class:`sharegpu.kube.api.LightkubeClusterApi` implements it against an API server.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    holder: str
    lease_s: int
    acquired: datetime | None
    renewed: datetime | None
    transitions: int
    resource_version: str = ""


class LeaseApi(Protocol):
    async def get_lease(self, namespace: str, name: str) -> LeaseRecord:
        """The Lease, or :class:`~sharegpu.kube.errors.NotFound`."""
        ...

    async def create_lease(self, namespace: str, name: str, record: LeaseRecord) -> LeaseRecord: ...

    async def update_lease(self, namespace: str, name: str, record: LeaseRecord) -> LeaseRecord:
        """Replace the Lease under ``record.resource_version`` (:class:`~sharegpu.kube.errors.Conflict` if it
        changed since)."""
        ...


def _micro_time(t: datetime | None) -> str | None:
    return None if t is None else t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_time(v: Any) -> datetime | None:
    if v is None or isinstance(v, datetime):
        return v
    return datetime.fromisoformat(str(v).replace("Z", "+00:00"))


def lease_object(namespace: str, name: str, r: LeaseRecord) -> dict[str, Any]:
    """The Lease object (JSON) that holds ``r``."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if r.resource_version:
        meta["resourceVersion"] = r.resource_version
    spec = {
        "holderIdentity": r.holder,
        "leaseDurationSeconds": r.lease_s,
        "acquireTime": _micro_time(r.acquired),
        "renewTime": _micro_time(r.renewed),
        "leaseTransitions": r.transitions,
    }
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}


def lease_record(d: Mapping[str, Any]) -> LeaseRecord:
    """The record a Lease object (JSON) holds."""
    spec = d.get("spec") or {}
    return LeaseRecord(
        holder=spec.get("holderIdentity") or "",
        lease_s=int(spec.get("leaseDurationSeconds") or 0),
        acquired=_parse_time(spec.get("acquireTime")),
        renewed=_parse_time(spec.get("renewTime")),
        transitions=int(spec.get("leaseTransitions") or 0),
        resource_version=str((d.get("metadata") or {}).get("resourceVersion") or ""),
    )
