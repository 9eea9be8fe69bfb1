"""Where a request landed and how it is enforced: the content of the ``sharegpu.io/assignment`` annotation.

An :class:`Assignment` is the single source of truth from which all cluster state can be rebuilt, so it
round-trips through JSON exactly and its parser rejects anything it cannot vouch for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sharegpu.model.request import FULL_MILLI
from sharegpu.model.tenant import own_tenant, user_tenant

ASSIGNMENT_VERSION = 1


class Mechanism(StrEnum):
    EXCLUSIVE = "exclusive"
    TIME_SLICING = "time-slicing"
    MPS = "mps"
    MIG = "mig"


class InvalidAssignment(ValueError):
    """An assignment (e.g. a pod annotation) that is malformed or inconsistent."""


@dataclass(frozen=True, slots=True)
class MigSlot:
    """A MIG GPU instance: its profile and its start on the memory-slot axis."""

    profile: str
    start: int


@dataclass(frozen=True, slots=True)
class GpuShare:
    """One GPU (or MIG instance) of an assignment.

    ``mechanism`` is how the GPU is shared; for ``mig`` the share lives inside instance ``mig`` and
    ``inner`` says how that instance is shared (exclusive, mps or time-slicing). ``compute_milli`` and
    ``memory_mib`` are what was reserved — of the GPU, or of the instance for MIG.
    """

    gpu_index: int
    gpu_uuid: str
    mechanism: Mechanism
    compute_milli: int
    memory_mib: int = 0
    mig: MigSlot | None = None
    inner: Mechanism | None = None

    def __post_init__(self) -> None:
        if self.gpu_index < 0:
            raise InvalidAssignment(f"GPU index {self.gpu_index} is negative")
        if not 0 < self.compute_milli <= FULL_MILLI:
            raise InvalidAssignment(f"compute {self.compute_milli} milli is outside 1–{FULL_MILLI}")
        if self.memory_mib < 0:
            raise InvalidAssignment(f"memory {self.memory_mib}Mi is negative")
        if (self.mechanism is Mechanism.MIG) != (self.mig is not None):
            raise InvalidAssignment("a MIG share needs its instance (profile and start), and only a MIG share has one")
        if self.mechanism is Mechanism.MIG and self.inner not in (
            Mechanism.EXCLUSIVE,
            Mechanism.MPS,
            Mechanism.TIME_SLICING,
        ):
            raise InvalidAssignment("a MIG share must say how its instance is shared: exclusive, mps or time-slicing")
        if self.mechanism is not Mechanism.MIG and self.inner is not None:
            raise InvalidAssignment("only a MIG share has an inner mechanism")

    @property
    def sharing(self) -> Mechanism:
        """How the unit this share sits on (GPU or MIG instance) is shared."""
        return self.inner if self.inner is not None else self.mechanism

    @property
    def memory_enforced(self) -> bool:
        # An MPS client is held to memory only when a limit was asked (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT);
        # a MIG instance or a whole GPU bounds memory by itself.
        if self.mechanism is Mechanism.MIG or self.sharing is Mechanism.EXCLUSIVE:
            return True
        return self.sharing is Mechanism.MPS and self.memory_mib > 0

    @property
    def compute_enforced(self) -> bool:
        # A whole GPU or MIG instance is a hardware boundary. An MPS client's SM cap is its share against its own
        # daemon's other clients, and the unit's daemons take turns (sharegpu.node.mps): its compute is shared, not
        # held to the share. Time-slicing enforces nothing.
        return self.sharing is Mechanism.EXCLUSIVE


@dataclass(frozen=True, slots=True)
class Assignment:
    pod: str  # "namespace/name" on Kubernetes, the task name in a simulation
    node: str
    shares: tuple[GpuShare, ...]
    cpu_milli: int = 0
    host_memory_mib: int = 0
    # Who may share the MPS daemon of its MPS shares (sharegpu.model.tenant): the ledger counts the daemons of each
    # unit by tenant. None: any (a simulated task; an assignment with no MPS share).
    tenant: str | None = None

    def __post_init__(self) -> None:
        if not self.pod or not self.node:
            raise InvalidAssignment("an assignment needs a pod and a node")
        units = [(s.gpu_index, s.mig.start if s.mig else None) for s in self.shares]
        if len(set(units)) != len(units):
            raise InvalidAssignment(f"assignment of {self.pod} names the same GPU or MIG instance twice")
        if self.cpu_milli < 0 or self.host_memory_mib < 0:
            raise InvalidAssignment(f"assignment of {self.pod} has negative CPU or memory")

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": ASSIGNMENT_VERSION,
            "pod": self.pod,
            "node": self.node,
            "cpuMilli": self.cpu_milli,
            "hostMemoryMiB": self.host_memory_mib,
            # Written with every MPS share ("": any tenant), so that one from before tenants (no key) is told apart.
            **({"tenant": self.tenant or ""} if any(s.sharing is Mechanism.MPS for s in self.shares) else {}),
            "gpus": [
                {
                    "index": s.gpu_index,
                    "uuid": s.gpu_uuid,
                    "mechanism": s.mechanism.value,
                    "computeMilli": s.compute_milli,
                    "memoryMiB": s.memory_mib,
                    "memoryEnforced": s.memory_enforced,
                    "computeEnforced": s.compute_enforced,
                    **({"mig": {"profile": s.mig.profile, "start": s.mig.start}} if s.mig else {}),
                    **({"inner": s.inner.value} if s.inner else {}),
                }
                for s in self.shares
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_dict(cls, d: Any) -> Assignment:
        """Parse strictly: wrong types are rejected, never coerced, since this text comes from the cluster."""
        try:
            obj = _obj(d, "assignment")
            version = obj.get("version")
            if isinstance(version, bool) or not isinstance(version, int) or version != ASSIGNMENT_VERSION:
                raise InvalidAssignment(f"assignment version {version!r} is not {ASSIGNMENT_VERSION}")
            gpus = obj["gpus"]
            if not isinstance(gpus, list):
                raise InvalidAssignment("assignment 'gpus' is not a list")
            shares = []
            for raw in gpus:
                g = _obj(raw, "an entry of 'gpus'")
                mig = g.get("mig")
                inner = g.get("inner")
                slot = None
                if mig is not None:
                    m = _obj(mig, "'mig'")
                    slot = MigSlot(_str(m["profile"]), _int(m["start"]))
                shares.append(
                    GpuShare(
                        gpu_index=_int(g["index"]),
                        gpu_uuid=_str(g["uuid"]),
                        mechanism=Mechanism(_str(g["mechanism"])),
                        compute_milli=_int(g["computeMilli"]),
                        memory_mib=_int(g.get("memoryMiB", 0)),
                        mig=slot,
                        inner=Mechanism(_str(inner)) if inner is not None else None,
                    )
                )
            return cls(
                pod=_str(obj["pod"]),
                node=_str(obj["node"]),
                shares=tuple(shares),
                cpu_milli=_int(obj.get("cpuMilli", 0)),
                host_memory_mib=_int(obj.get("hostMemoryMiB", 0)),
                tenant=_tenant(obj, shares),
            )
        except InvalidAssignment:
            raise
        except KeyError as e:
            raise InvalidAssignment(f"assignment is missing the key {e}") from None
        except (TypeError, ValueError) as e:
            raise InvalidAssignment(f"assignment is malformed: {e}") from None

    @classmethod
    def from_json(cls, text: str) -> Assignment:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise InvalidAssignment(f"assignment is not valid JSON: {e}") from None
        except RecursionError:
            raise InvalidAssignment("assignment JSON is nested too deeply") from None


def _obj(v: Any, what: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise InvalidAssignment(f"{what} is not a JSON object")
    return v


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise InvalidAssignment(f"expected a string, got {v!r}")
    return v


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidAssignment(f"expected an integer, got {v!r}")
    return v


def _tenant(obj: dict[str, Any], shares: list[GpuShare]) -> str | None:
    """The assignment's tenant; one written before tenants existed says a ``user`` (or none) instead, and is read as
    its pod's tenant: the same namespace and UID where it named one, its pod alone where it did not."""
    if obj.get("tenant") is not None:
        return _str(obj["tenant"]) or None
    if not any(s.sharing is Mechanism.MPS for s in shares):
        return None
    pod = _str(obj["pod"])
    namespace = pod.partition("/")[0]
    return user_tenant(namespace, _int(obj["user"])) if obj.get("user") is not None else own_tenant(pod)
