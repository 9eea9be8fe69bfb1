"""Named policies: the FGD paper's baselines, FGD, and sharegpu's default."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sharegpu.placement.dra_allocator import dra_default_policy
from sharegpu.placement.dra_steer import dra_steered_policy
from sharegpu.placement.fragmentation import FragmentationModel, Workload
from sharegpu.placement.framework import Policy
from sharegpu.placement.plugins.baseline import (
    BestFitGpus,
    BestFitScore,
    DotProductScore,
    GpuClusteringScore,
    GpuPackingScore,
    RandomGpus,
    RandomScore,
)
from sharegpu.placement.plugins.fgd import FgdGpus, FgdScore
from sharegpu.placement.plugins.refined import RefinedFgdGpus, RefinedFgdScore


class UnknownPolicy(ValueError):
    pass


@dataclass(frozen=True)
class PolicyContext:
    """What a policy may know besides the ledger: the expected workload (for fragmentation-aware policies)."""

    workload: Workload | None = None

    def fragmentation(self, policy: str) -> FragmentationModel:
        if self.workload is None:
            raise UnknownPolicy(f"policy {policy!r} needs a workload distribution (typical task shapes)")
        return FragmentationModel(self.workload)


def _random(ctx: PolicyContext) -> Policy:
    return Policy("random", ((RandomScore(), 1),), RandomGpus(), description="a uniformly random feasible node")


def _dotprod(ctx: PolicyContext) -> Policy:
    return Policy("dotprod", ((DotProductScore(), 1),), BestFitGpus(), description="smallest dot product")


def _clustering(ctx: PolicyContext) -> Policy:
    return Policy("clustering", ((GpuClusteringScore(), 1),), BestFitGpus(), description="like pods together")


def _packing(ctx: PolicyContext) -> Policy:
    return Policy("packing", ((GpuPackingScore(), 1),), BestFitGpus(), description="fill used GPUs first")


def _bestfit(ctx: PolicyContext) -> Policy:
    return Policy("bestfit", ((BestFitScore(), 1),), BestFitGpus(), description="least CPU and GPU left")


def _fgd(ctx: PolicyContext) -> Policy:
    model = ctx.fragmentation("fgd")
    return Policy("fgd", ((FgdScore(model), 1),), FgdGpus(model), description="fragmentation gradient descent")


def _sharegpu(ctx: PolicyContext) -> Policy:
    scorer = RefinedFgdScore.of(ctx.fragmentation("sharegpu").workload)
    return Policy(
        "sharegpu",
        ((scorer, 1),),
        RefinedFgdGpus(scorer),
        description="FGD's choice less the cost of claiming GPU models that confined pods need, ties settled by exact "
        "fragmentation, CPU-stranded GPU and best fit",
    )


POLICIES: dict[str, Callable[[PolicyContext], Policy]] = {
    "random": _random,
    "dotprod": _dotprod,
    "clustering": _clustering,
    "packing": _packing,
    "bestfit": _bestfit,
    "fgd": _fgd,
    "sharegpu": _sharegpu,
    "dra-default": lambda ctx: dra_default_policy(),
    "dra-steered": lambda ctx: dra_steered_policy(ctx.fragmentation("dra-steered").workload),
}


def make_policy(name: str, ctx: PolicyContext) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise UnknownPolicy(f"unknown policy {name!r}; choose from: {', '.join(POLICIES)}") from None
    return factory(ctx)


def parse_policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise UnknownPolicy("no policy given; choose from: " + ", ".join(POLICIES))
    for n in names:
        if n not in POLICIES:
            raise UnknownPolicy(f"unknown policy {n!r}; choose from: {', '.join(POLICIES)}")
    return names
