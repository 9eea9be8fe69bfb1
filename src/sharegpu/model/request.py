"""What a workload asks for: GPUs, memory, compute, isolation — validated once, on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypeVar

from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog, GpuModel

FULL_MILLI = 1000  # compute of one whole GPU (or one whole MIG instance) in milli-GPU
MAX_GPUS_PER_REQUEST = 64


class Isolation(StrEnum):
    NONE = "none"  # time-slicing allowed: nothing enforced
    MEMORY = "memory"  # the memory limit is enforced (MPS or MIG); a fault in an MPS neighbour still ends it
    # A fault in a neighbour must not end it, memory need not be enforced: its own CUDA context, time-sliced (on the
    # H200 an illegal-address fault killed the faulting client's MPS neighbour; a time-sliced neighbour ran on).
    FAULT = "fault"
    HARDWARE = "hardware"  # faults elsewhere must not reach it (MIG or a whole GPU)


class Sharing(StrEnum):
    AUTO = "auto"
    EXCLUSIVE = "exclusive"
    TIME_SLICING = "time-slicing"
    MPS = "mps"
    MIG = "mig"


class InvalidRequest(ValueError):
    """A request that can never be valid; the message says what to change."""


E = TypeVar("E", bound=StrEnum)


def _parse_enum(kind: type[E], value: str | E, what: str) -> E:
    try:
        return kind(value)
    except ValueError:
        allowed = " | ".join(v.value for v in kind)
        raise InvalidRequest(f"{what} {value!r} is not one of: {allowed}") from None


@dataclass(frozen=True, slots=True)
class GpuRequest:
    """One pod's (or trace task's) demand. Compute is in milli-GPU per GPU (1000 = a whole GPU).

    ``compute_milli`` and ``memory_mib`` are per GPU; ``None`` means the workload did not say. With neither given
    each GPU is a whole GPU; with only memory given, compute follows the share's memory (see :meth:`compute_on`).
    ``allowed_models`` holds canonical catalog names; empty means any model.
    """

    name: str
    gpu_count: int = 1
    compute_milli: int | None = None
    memory_mib: int | None = None
    isolation: Isolation = Isolation.NONE
    sharing: Sharing = Sharing.AUTO
    allowed_models: frozenset[str] = frozenset()
    mig_profile: str | None = None
    cpu_milli: int = 0
    host_memory_mib: int = 0
    # Who may share an MPS server with it (sharegpu.model.tenant): an MPS share joins a daemon of its own tenant or
    # opens one. None: any (the simulator's "no rule"; a pod always has one).
    tenant: str | None = None
    catalog: Catalog = field(default=DEFAULT_CATALOG, repr=False, compare=False)

    def __post_init__(self) -> None:
        who = f"request {self.name!r}: " if self.name else ""
        object.__setattr__(self, "isolation", _parse_enum(Isolation, self.isolation, f"{who}isolation"))
        object.__setattr__(self, "sharing", _parse_enum(Sharing, self.sharing, f"{who}sharing"))
        for what, value in (
            ("GPU count", self.gpu_count),
            ("GPU compute", self.compute_milli),
            ("GPU memory", self.memory_mib),
            ("CPU", self.cpu_milli),
            ("host memory", self.host_memory_mib),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise InvalidRequest(f"{who}{what} must be an integer, not {value!r}")
        object.__setattr__(self, "allowed_models", self.catalog.canonical(self.allowed_models))
        self._validate()

    def _validate(self) -> None:
        who = f"request {self.name!r}: " if self.name else ""
        if not isinstance(self.gpu_count, int) or not 0 <= self.gpu_count <= MAX_GPUS_PER_REQUEST:
            raise InvalidRequest(f"{who}GPU count {self.gpu_count} must be an integer from 0 to {MAX_GPUS_PER_REQUEST}")
        if self.cpu_milli < 0:
            raise InvalidRequest(f"{who}CPU {self.cpu_milli}m is negative; ask for 0 or more")
        if self.host_memory_mib < 0:
            raise InvalidRequest(f"{who}host memory {self.host_memory_mib}Mi is negative; ask for 0 or more")
        if self.compute_milli is not None and not 1 <= self.compute_milli <= FULL_MILLI:
            raise InvalidRequest(
                f"{who}GPU compute {self.compute_milli / 10:g}% is outside 1–100%; ask for a share of one GPU "
                "(use more GPUs for more than one GPU's compute)"
            )
        if self.memory_mib is not None and self.memory_mib <= 0:
            raise InvalidRequest(f"{who}GPU memory {self.memory_mib}Mi must be positive (or leave it unset)")
        if self.gpu_count == 0:
            if self.memory_mib is not None or self.compute_milli is not None or self.mig_profile:
                raise InvalidRequest(
                    f"{who}GPU memory, compute or a MIG profile was given with 0 GPUs; ask for ≥ 1 GPU"
                )
            return
        candidates = self.candidate_models()
        if self.allowed_models and not candidates:
            raise InvalidRequest(f"{who}no known GPU model among {sorted(self.allowed_models)}")
        if self.memory_mib is not None:
            sized = [m for m in candidates if not m.generic]
            largest = max((m.memory_mib for m in sized), default=0)
            if sized and self.memory_mib > largest:
                raise InvalidRequest(
                    f"{who}GPU memory {self.memory_mib}Mi is above the largest allowed GPU ({largest}Mi); ask for "
                    "less memory per GPU, or more GPUs"
                )
        self._validate_mechanism(who, candidates)

    def _validate_mechanism(self, who: str, candidates: list[GpuModel]) -> None:
        mig_models = [m for m in candidates if m.mig_capable]
        if self.isolation is Isolation.HARDWARE and self.sharing in (Sharing.TIME_SLICING, Sharing.MPS):
            raise InvalidRequest(
                f"{who}isolation 'hardware' cannot be met by sharing '{self.sharing}'; use sharing mig, exclusive or auto"
            )
        if self.isolation is Isolation.MEMORY and self.sharing is Sharing.TIME_SLICING:
            raise InvalidRequest(
                f"{who}isolation 'memory' cannot be met by time-slicing (it enforces no memory limit); use mps, mig or auto"
            )
        if self.isolation is Isolation.FAULT and self.sharing is Sharing.MPS:
            raise InvalidRequest(
                f"{who}isolation 'fault' cannot be met by MPS (a fault in one MPS client ends every client of its "
                "server); use sharing time-slicing, mig, exclusive or auto"
            )
        if self.sharing is Sharing.MPS and self.gpu_count > 1 and not self.is_whole:
            raise InvalidRequest(
                f"{who}an MPS share on {self.gpu_count} GPUs cannot run: a process is the client of one MPS daemon, "
                "and each GPU has its own; ask for 1 GPU per MPS share, or use sharing time-slicing or exclusive"
            )
        if self.sharing is Sharing.EXCLUSIVE and self.mig_profile:
            raise InvalidRequest(
                f"{who}sharing 'exclusive' takes a whole GPU but MIG profile {self.mig_profile!r} asks for an "
                "instance; drop one of them"
            )
        if self.sharing is Sharing.MIG or self.mig_profile:
            if not mig_models:
                allowed = ", ".join(sorted(self.allowed_models)) or "any"
                raise InvalidRequest(f"{who}MIG was asked but no allowed GPU model ({allowed}) supports MIG")
            if self.mig_profile and not any(self.mig_profile in {p.name for p in m.mig_profiles} for m in mig_models):
                raise InvalidRequest(
                    f"{who}MIG profile {self.mig_profile!r} exists on no allowed model; profiles are e.g. "
                    f"{', '.join(p.name for p in mig_models[0].mig_profiles)}"
                )
            if self.mig_profile:
                self._validate_profile_memory(who, mig_models, self.mig_profile)
        if self.sharing is Sharing.MPS and not any(m.mps_capable for m in candidates):
            raise InvalidRequest(f"{who}MPS was asked but no allowed GPU model supports it (Volta or later)")
        if (
            self.isolation is Isolation.MEMORY
            and self.sharing is Sharing.AUTO
            and self.gpu_count > 1
            and not self.is_whole
            and not mig_models
        ):
            raise InvalidRequest(
                f"{who}isolation 'memory' on {self.gpu_count} GPUs needs MIG (an MPS client talks to one GPU's "
                "daemon) and no allowed GPU model supports MIG; ask for 1 GPU, for whole GPUs (drop the memory and "
                "compute), or allow a MIG-capable model"
            )

    def _validate_profile_memory(self, who: str, mig_models: list[GpuModel], name: str) -> None:
        """The memory asked must fit the named MIG profile's instance on some allowed model that has it: the
        instance is all the memory the pod will get (a bigger ask would be placed and bound short)."""
        if self.memory_mib is None:
            return
        having = [m for m in mig_models if any(p.name == name for p in m.mig_profiles)]
        holds = max(m.profile(name).memory_mib for m in having)
        if self.memory_mib <= holds:
            return
        # Profiles of the same models that would hold it, smallest first (fewest slices, then memory).
        bigger = sorted(
            {
                (p.compute_slices, p.memory_mib, p.name)
                for m in having
                for p in m.mig_profiles
                if p.memory_mib >= self.memory_mib
            }
        )
        models = ", ".join(m.name for m in having)
        if bigger:
            change = (
                f"ask for a profile that holds at least {self.memory_mib}Mi (e.g. {bigger[0][2]}) or for at most "
                f"{holds}Mi of GPU memory"
            )
        else:
            change = f"no MIG profile of {models} holds that much; ask for at most {holds}Mi of GPU memory"
        raise InvalidRequest(
            f"{who}GPU memory {self.memory_mib}Mi is more than MIG profile {name!r} holds ({holds}Mi on {models}); "
            f"{change}"
        )

    def candidate_models(self) -> list[GpuModel]:
        """Catalog models this request may run on (unknown allowed names resolve to generic entries)."""
        if self.allowed_models:
            return [self.catalog.get(n) for n in sorted(self.allowed_models)]
        return list(self.catalog)

    def allows_model(self, model_name: str) -> bool:
        return not self.allowed_models or model_name in self.allowed_models

    @property
    def wants_gpu(self) -> bool:
        return self.gpu_count > 0

    @property
    def is_whole(self) -> bool:
        """Whole GPUs, exclusively: no memory or compute share asked and no sharing mechanism forced."""
        return (
            self.gpu_count > 0
            and self.compute_milli in (None, FULL_MILLI)
            and self.memory_mib is None
            and self.mig_profile is None
            and self.sharing in (Sharing.AUTO, Sharing.EXCLUSIVE)
        ) or (self.gpu_count > 0 and self.sharing is Sharing.EXCLUSIVE)

    @property
    def may_use_mps(self) -> bool:
        """Whether some route of this request ends as an MPS client (so its tenant matters to placement)."""
        return (
            self.gpu_count > 0
            and not self.is_whole
            and self.sharing in (Sharing.AUTO, Sharing.MPS, Sharing.MIG)
            and self.isolation in (Isolation.NONE, Isolation.MEMORY)
            and (self.sharing is not Sharing.MIG or self.isolation is Isolation.MEMORY)
        )

    @property
    def total_milli(self) -> int:
        """GPU demand in milli-GPU over all its GPUs (the trace's num_gpu × gpu_milli)."""
        return self.gpu_count * self.milli

    @property
    def milli(self) -> int:
        """Compute per GPU in milli-GPU as the trace counts it: a whole GPU unless a share was given."""
        if self.compute_milli is not None:
            return self.compute_milli
        return FULL_MILLI if self.memory_mib is None else 1

    def compute_on(self, model: GpuModel) -> int:
        """Compute to reserve per GPU of ``model``: what was asked, else the memory share's fraction of the GPU.

        Reserving compute in proportion to memory keeps a GPU from being promised to more memory-only
        workloads than its compute can serve.
        """
        if self.compute_milli is not None:
            return self.compute_milli
        if self.memory_mib is None:
            return FULL_MILLI
        if model.memory_mib <= 0:
            return 1
        return max(1, min(FULL_MILLI, -(-self.memory_mib * FULL_MILLI // model.memory_mib)))

    def shape_key(self) -> tuple[object, ...]:
        """What placement scores depend on: equal keys score equally on equal nodes. The tenant is left out: the
        filter is kept per shape for a share that opens a daemon, and the scheduler adds the units that already run
        the request's tenant on top (one cached filter for every pod of a shape, whoever it runs as)."""
        return (
            self.gpu_count,
            self.compute_milli,
            self.memory_mib,
            self.isolation,
            self.sharing,
            self.allowed_models,
            self.mig_profile,
            self.cpu_milli,
            self.host_memory_mib,
        )
