"""The driver's opaque configuration (``gpu.sharegpu.io/v1alpha1``, kind ``GpuConfig``) and how configs merge.

A DeviceClass and a ResourceClaim may both carry a config for our driver; the allocation copies them into the
claim's status with their source. They apply in order — the class's first, then the claim's — and a field set
later wins, so the claim overrides its class field by field. A config is checked at Prepare, where an invalid one
fails that claim with a message that says what to change.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from sharegpu.model.contract import DRA_CONFIG_API_VERSION, DRA_CONFIG_KIND, DRIVER
from sharegpu.model.request import Isolation  # the one vocabulary of isolation levels
from sharegpu.node.errors import NodeError


class ConfigError(NodeError, ValueError):
    """An opaque config that cannot be used; the message names the field and the values it accepts."""


class Sharing(StrEnum):
    MPS = "MPS"
    TIME_SLICING = "TimeSlicing"


class TimeSlice(StrEnum):
    """``nvidia-smi compute-policy --set-timeslice`` values 0..3."""

    DEFAULT = "Default"
    SHORT = "Short"
    MEDIUM = "Medium"
    LONG = "Long"

    @property
    def level(self) -> int:
        return list(TimeSlice).index(self)


class GpuConfig(BaseModel):
    """One config object as written in a class or claim; unset fields leave the earlier config's value."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Literal types cannot name a constant: these are contract.DRA_CONFIG_API_VERSION and DRA_CONFIG_KIND.
    apiVersion: Literal["gpu.sharegpu.io/v1alpha1"]
    kind: Literal["GpuConfig"]
    sharing: Sharing | None = None
    timeSliceInterval: TimeSlice | None = None
    isolation: Isolation | None = None


class EffectiveConfig(BaseModel):
    """The merged config a device is prepared with."""

    model_config = ConfigDict(frozen=True)

    # None: no config asked for a mechanism. A share of a GPU is then shared through MPS; a MIG instance is the
    # claim's alone. The difference matters only on MIG devices, where MPS is allowed and TimeSlicing is not.
    sharing: Sharing | None = None
    timeSliceInterval: TimeSlice = TimeSlice.DEFAULT
    isolation: Isolation = Isolation.NONE  # no requirement beyond what the mechanism gives


def parse_config(parameters: Mapping[str, Any], where: str) -> GpuConfig:
    # An explicit null is not "unset": a user who writes `sharing: null` means something (probably "no sharing"),
    # and silently taking the class's MPS for it would hand out a mechanism they did not ask for.
    if not isinstance(parameters, Mapping):
        raise ConfigError(
            f"{where}: the opaque parameters must be an object such as {{apiVersion: {DRA_CONFIG_API_VERSION}, kind: {DRA_CONFIG_KIND}}}, "
            f"not {type(parameters).__name__}"
        )
    nulls = sorted(str(k) for k, v in parameters.items() if v is None and k in _FIELD_VALUES)
    if nulls:
        raise ConfigError(
            f"{where}: invalid {DRA_CONFIG_API_VERSION} config: "
            + "; ".join(
                f"{k}: null is not a value; leave the field out to keep the class's (or the default) or use "
                f"{_FIELD_VALUES[k]}"
                for k in nulls
            )
        )
    try:
        return GpuConfig.model_validate(parameters)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'config'}: {_hint(err)}" for err in e.errors(include_url=False)
        )
        raise ConfigError(f"{where}: invalid {DRA_CONFIG_API_VERSION} config: {problems}") from None


_FIELD_VALUES = {
    "sharing": " or ".join(s.value for s in Sharing),
    "timeSliceInterval": ", ".join(t.value for t in TimeSlice),
    "isolation": ", ".join(i.value for i in Isolation),
}


def _hint(err: Any) -> str:
    field = str(err["loc"][-1]) if err["loc"] else ""
    accepted = {"apiVersion": DRA_CONFIG_API_VERSION, "kind": DRA_CONFIG_KIND, **_FIELD_VALUES}
    if err["type"] == "extra_forbidden":
        return f"unknown field; the fields are {', '.join(accepted)}"
    if field in accepted:
        return f"{err.get('input')!r} is not accepted; use {accepted[field]}"
    return str(err["msg"])


def merge(configs: Iterable[GpuConfig]) -> EffectiveConfig:
    """Apply configs in order (class first, then claim); a field set later wins."""
    merged: dict[str, Any] = {}
    for c in configs:
        merged.update({k: v for k, v in c.model_dump(exclude={"apiVersion", "kind"}).items() if v is not None})
    return EffectiveConfig(**merged)


def configs_for_request(allocation_config: Iterable[Mapping[str, Any]], request: str, claim: str) -> EffectiveConfig:
    """The effective config of one request from ``status.allocation.devices.config`` (class entries first).

    Entries for other drivers are not ours to judge and are skipped; an entry whose ``requests`` is empty applies
    to every request.
    """
    from_class: list[GpuConfig] = []
    from_claim: list[GpuConfig] = []
    for n, entry in enumerate(allocation_config):
        opaque = entry.get("opaque") or {}
        if opaque.get("driver") != DRIVER:
            continue
        requests = entry.get("requests") or []
        if requests and request not in requests and not any(request.startswith(f"{r}/") for r in requests):
            continue
        source = entry.get("source", "FromClaim")
        config = parse_config(opaque.get("parameters") or {}, f"claim {claim}: config #{n} ({source})")
        (from_class if source == "FromClass" else from_claim).append(config)
    return merge([*from_class, *from_claim])
