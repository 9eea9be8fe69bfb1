"""Choosing MIG placements that keep the most layouts reachable.

The driver, left to itself, puts an instance wherever it fits first, and small instances created early can
leave no aligned room for a later 3g ("Insufficient Resources"). The planner instead enumerates every valid
layout of the model once (sets of non-overlapping placements within the compute slices) and puts a new
instance where it keeps a layout that uses every compute slice reachable, and among such starts where the most
layouts containing the instances already there stay reachable — the choice that closes the fewest doors.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache

from sharegpu.model.catalog import GpuModel, MigProfile

Placement = tuple[str, int]  # (profile name, start slot)


def _mask(p: MigProfile, start: int) -> int:
    return ((1 << p.memory_slots) - 1) << start


@cache
def layouts(model: GpuModel) -> tuple[frozenset[Placement], ...]:
    """Every valid set of instances on ``model`` (the empty one included). Pure, so memoised per model."""
    placements = [(p, s) for p in model.mig_profiles for s in p.starts]
    out: list[frozenset[Placement]] = []

    def extend(i: int, used: int, slices: int, chosen: tuple[Placement, ...]) -> None:
        out.append(frozenset(chosen))
        for j in range(i, len(placements)):
            p, s = placements[j]
            m = _mask(p, s)
            if used & m or slices + p.compute_slices > model.compute_slices:
                continue
            extend(j + 1, used | m, slices + p.compute_slices, (*chosen, (p.name, s)))

    extend(0, 0, 0, ())
    return tuple(out)


def reachable(model: GpuModel, existing: Iterable[Placement]) -> tuple[int, int]:
    """(most compute slices any layout containing ``existing`` uses, how many layouts contain it)."""
    have = frozenset(existing)
    slices = {p.name: p.compute_slices for p in model.mig_profiles}
    best = count = 0
    for layout in layouts(model):
        if have <= layout:
            count += 1
            best = max(best, sum(slices[n] for n, _ in layout))
    return best, count


def best_start(model: GpuModel, existing: Iterable[Placement], profile: MigProfile, free_starts: Iterable[int]) -> int:
    """The free start for a new ``profile`` instance that keeps a fully used GPU reachable if any start does, and
    among those the most layouts reachable (the higher start on ties)."""
    have = frozenset(existing)
    starts = list(free_starts)
    if not starts:
        raise ValueError(f"no free start for {profile.name} on {model.name}")
    return max(starts, key=lambda s: (reachable(model, have | {(profile.name, s)}), s))
