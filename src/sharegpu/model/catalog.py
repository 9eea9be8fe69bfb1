"""GPU catalog: the models sharegpu knows, their memory, SMs and MIG geometry.

MIG geometry follows NVIDIA's MIG user guide: instances sit on a memory-slot axis (8 slots on A100/H100/H200,
4 on A30) at fixed valid start slots, and an ``Ng`` profile also takes N of the GPU's compute slices
(7 on A100/H100/H200, 4 on A30). Opaque or unknown model names (the openb trace's ``G1``/``G2``/``G3``) get a
generic, non-MIG entry so that a trace never fails on a model name it cannot know.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

GIB = 1024  # MiB per GiB


@dataclass(frozen=True, slots=True)
class MigProfile:
    """One GPU-instance profile, e.g. ``3g.40gb`` on an H100-80GB."""

    name: str
    compute_slices: int  # the N of "Ng"
    memory_slots: int  # width on the memory-slot axis
    memory_mib: int
    starts: tuple[int, ...]  # valid start slots
    sms: int = 0  # SMs of an instance where NVIDIA's table differs from slices × SMs per slice (H100 3g, 7g)

    @property
    def max_instances(self) -> int:
        return len(self.starts)

    def placements(self) -> Iterator[tuple[int, int]]:
        """Every valid (start, size) on the memory-slot axis."""
        for s in self.starts:
            yield s, self.memory_slots


@dataclass(frozen=True, slots=True)
class GpuModel:
    name: str
    memory_mib: int
    sms: int
    mig_profiles: tuple[MigProfile, ...] = ()
    memory_slots: int = 0  # slots on the MIG memory axis; 0 when the model has no MIG
    compute_slices: int = 0
    sms_per_slice: int = 0
    aliases: tuple[str, ...] = ()
    mps_capable: bool = True  # Volta and later: MPS with per-client memory and SM limits
    generic: bool = False  # an opaque/unknown name: capacity unknown, treat as one schedulable unit
    architecture: str = "unknown"  # NVIDIA's name for the generation, as DRA attributes publish it
    compute_capability: str = "0.0.0"  # CUDA compute capability as a semantic version

    @property
    def mig_capable(self) -> bool:
        return bool(self.mig_profiles)

    def profile(self, name: str) -> MigProfile:
        for p in self.mig_profiles:
            if p.name == name:
                return p
        known = ", ".join(p.name for p in self.mig_profiles) or "none (this model has no MIG)"
        raise UnknownMigProfile(f"MIG profile {name!r} does not exist on {self.name}; its profiles are: {known}")

    def profile_sms(self, profile: MigProfile) -> int:
        return profile.sms or profile.compute_slices * self.sms_per_slice


class CatalogError(ValueError):
    """A GPU model or MIG profile that the catalog cannot resolve."""


class UnknownGpuModel(CatalogError):
    pass


class UnknownMigProfile(CatalogError):
    pass


def _mig_8slot(sizes_gb: tuple[int, int, int, int, int, int], slot_mib: int) -> tuple[MigProfile, ...]:
    """The A100/H100/H200 geometry: 8 memory slots, 7 compute slices (DESIGN §4)."""
    g1s, g1l, g2, g3, g4, g7 = sizes_gb
    return (
        MigProfile(f"1g.{g1s}gb", 1, 1, slot_mib, tuple(range(7))),
        MigProfile(f"1g.{g1l}gb", 1, 2, 2 * slot_mib, (0, 2, 4, 6)),
        MigProfile(f"2g.{g2}gb", 2, 2, 2 * slot_mib, (0, 2, 4)),
        MigProfile(f"3g.{g3}gb", 3, 4, 4 * slot_mib, (0, 4)),
        MigProfile(f"4g.{g4}gb", 4, 4, 4 * slot_mib, (0,)),
        MigProfile(f"7g.{g7}gb", 7, 8, 8 * slot_mib, (0,)),
    )


def _mig_a30() -> tuple[MigProfile, ...]:
    slot = 6 * GIB
    return (
        MigProfile("1g.6gb", 1, 1, slot, (0, 1, 2, 3)),
        MigProfile("2g.12gb", 2, 2, 2 * slot, (0, 2)),
        MigProfile("4g.24gb", 4, 4, 4 * slot, (0,)),
    )


def _hopper(profiles: tuple[MigProfile, ...]) -> tuple[MigProfile, ...]:
    """Hopper's SM counts per profile (NVIDIA's MIG guide): 3g has 60 and 7g all 132, not slices × 16."""
    extra = {3: 60, 4: 64, 7: 132}
    return tuple(
        MigProfile(p.name, p.compute_slices, p.memory_slots, p.memory_mib, p.starts, extra.get(p.compute_slices, 0))
        for p in profiles
    )


def _builtin_models() -> tuple[GpuModel, ...]:
    # Profile memory is the nominal size in the profile's name, so "10Gi" fits "1g.10gb" as a user expects.
    a100_40 = _mig_8slot((5, 10, 10, 20, 20, 40), 5 * GIB)
    a100_80 = _mig_8slot((10, 20, 20, 40, 40, 80), 10 * GIB)
    h200 = tuple(
        MigProfile(p.name, p.compute_slices, p.memory_slots, mib, p.starts)
        for p, mib in zip(
            _mig_8slot((18, 35, 35, 71, 71, 141), 0),
            (18 * GIB, 35 * GIB, 35 * GIB, 71 * GIB, 71 * GIB, 141 * GIB),
            strict=True,
        )
    )
    return (
        GpuModel(
            "A100-40GB",
            40 * GIB,
            108,
            a100_40,
            8,
            7,
            14,
            ("A100-SXM4-40GB", "A100-PCIE-40GB"),
            architecture="Ampere",
            compute_capability="8.0.0",
        ),
        GpuModel(
            "A100-80GB",
            80 * GIB,
            108,
            a100_80,
            8,
            7,
            14,
            ("A100-SXM4-80GB", "A100-PCIE-80GB"),
            architecture="Ampere",
            compute_capability="8.0.0",
        ),
        GpuModel(
            "H100-80GB",
            80 * GIB,
            132,
            _hopper(a100_80),
            8,
            7,
            16,
            ("H100-SXM5-80GB", "H100-80GB-HBM3", "H100"),
            architecture="Hopper",
            compute_capability="9.0.0",
        ),
        GpuModel(
            "H200-141GB",
            141 * GIB,
            132,
            _hopper(h200),
            8,
            7,
            16,
            ("H200", "H200-SXM-141GB"),
            architecture="Hopper",
            compute_capability="9.0.0",
        ),
        GpuModel(
            "A30-24GB", 24 * GIB, 56, _mig_a30(), 4, 4, 14, ("A30",), architecture="Ampere", compute_capability="8.0.0"
        ),
        GpuModel("T4", 16 * GIB, 40, aliases=("Tesla-T4",), architecture="Turing", compute_capability="7.5.0"),
        GpuModel(
            "V100-16GB",
            16 * GIB,
            80,
            aliases=("V100M16", "V100-SXM2-16GB"),
            architecture="Volta",
            compute_capability="7.0.0",
        ),
        GpuModel(
            "V100-32GB",
            32 * GIB,
            80,
            aliases=("V100M32", "V100-SXM2-32GB"),
            architecture="Volta",
            compute_capability="7.0.0",
        ),
        GpuModel("A10", 24 * GIB, 72, aliases=("A10-24GB",), architecture="Ampere", compute_capability="8.6.0"),
        GpuModel("L4", 24 * GIB, 58, aliases=("L4-24GB",), architecture="Ada Lovelace", compute_capability="8.9.0"),
        GpuModel(
            "L40S", 48 * GIB, 142, aliases=("L40S-48GB",), architecture="Ada Lovelace", compute_capability="8.9.0"
        ),
        GpuModel(
            "RTX-4090",
            24 * GIB,
            128,
            aliases=("RTX4090", "GeForce-RTX-4090"),
            architecture="Ada Lovelace",
            compute_capability="8.9.0",
        ),
        # Pascal's MPS has no per-client memory limit and 16 clients: sharegpu time-slices it instead.
        GpuModel(
            "P100",
            16 * GIB,
            56,
            aliases=("P100-16GB", "Tesla-P100"),
            mps_capable=False,
            architecture="Pascal",
            compute_capability="6.0.0",
        ),
    )


# Generic entries stand for names the catalog cannot know (the openb trace's G1/G2/G3, a new card): their
# memory is unknown, so a memory request can never be proven to fit and only compute shares are placed there.
GENERIC_MEMORY_MIB = 0
GENERIC_SMS = 0


def _norm(name: str) -> str:
    return name.strip().upper().replace("_", "-").replace(" ", "-")


@dataclass(frozen=True)
class Catalog:
    """An immutable name → model map that resolves aliases and gives unknown names a generic entry."""

    models: tuple[GpuModel, ...] = field(default_factory=_builtin_models)
    _index: Mapping[str, GpuModel] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index: dict[str, GpuModel] = {}
        for m in self.models:
            for n in (m.name, *m.aliases):
                key = _norm(n)
                if key in index and index[key] is not m:
                    raise CatalogError(f"GPU model name {n!r} is defined twice in the catalog")
                index[key] = m
        object.__setattr__(self, "_index", index)

    def __iter__(self) -> Iterator[GpuModel]:
        return iter(self.models)

    def known(self, name: str) -> bool:
        return _norm(name) in self._index

    def get(self, name: str) -> GpuModel:
        """The model for ``name``; an unknown name gets a generic non-MIG entry under that name."""
        if not name.strip():
            raise UnknownGpuModel("GPU model name is empty; give a model such as H100-80GB")
        found = self._index.get(_norm(name))
        if found is not None:
            return found
        return GpuModel(name.strip(), GENERIC_MEMORY_MIB, GENERIC_SMS, mps_capable=False, generic=True)

    def strict(self, name: str) -> GpuModel:
        """The model for ``name``; unknown names are an error (used where a user names a model)."""
        found = self._index.get(_norm(name))
        if found is None:
            raise UnknownGpuModel(f"unknown GPU model {name!r}; known models: {', '.join(m.name for m in self.models)}")
        return found

    def canonical(self, names: Iterable[str]) -> frozenset[str]:
        return frozenset(self.get(n).name for n in names)

    @property
    def largest_memory_mib(self) -> int:
        return max(m.memory_mib for m in self.models)


DEFAULT_CATALOG = Catalog()
