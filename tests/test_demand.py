"""A pod's demand from its containers: the kube-scheduler's rule, native sidecars included."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sharegpu.model.demand import ContainerDemand, pod_demand, running_at_once


def app(name: str, n: int) -> ContainerDemand:
    return ContainerDemand(name, n)


def init(name: str, n: int) -> ContainerDemand:
    return ContainerDemand(name, n, init=True)


def side(name: str, n: int) -> ContainerDemand:
    return ContainerDemand(name, n, init=True, sidecar=True)


@pytest.mark.parametrize(
    ("containers", "expected"),
    [
        ([app("a", 1)], 1),
        ([app("a", 1), app("b", 2)], 3),
        ([init("i", 2), app("a", 1)], 2),  # the init container's GPUs are handed on
        ([init("i", 1), app("a", 2)], 2),
        ([side("s", 1), app("a", 1)], 2),  # the sidecar runs beside the app container (was counted as 1)
        ([side("s", 1), init("i", 2), app("a", 1)], 3),  # the init container runs beside the sidecar
        ([init("i", 2), side("s", 1), app("a", 1)], 2),
        ([init("i", 1), side("s", 1), init("j", 1), app("a", 1)], 2),
        ([side("s", 1), side("t", 1)], 2),
        ([init("i", 3)], 3),
        ([], 0),
    ],
)
def test_pod_demand(containers: list[ContainerDemand], expected: int) -> None:
    assert pod_demand(containers) == expected


def test_a_sidecar_must_be_an_init_container() -> None:
    with pytest.raises(ValueError, match="only an init container"):
        ContainerDemand("x", 1, sidecar=True)


kinds = st.sampled_from(["app", "init", "side"])


@given(st.lists(st.tuples(kinds, st.integers(0, 4)), max_size=8))
def test_demand_is_the_largest_phase(spec: list[tuple[str, int]]) -> None:
    """The demand equals the most that any set of containers running at once holds, and bounds every such set."""
    containers = [
        ContainerDemand(f"c{i}", n, init=kind != "app", sidecar=kind == "side") for i, (kind, n) in enumerate(spec)
    ]
    amount = {c.name: c.amount for c in containers}
    phases = running_at_once(containers)
    assert pod_demand(containers) == max(sum(amount[n] for n in p) for p in phases)
