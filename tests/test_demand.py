"""A pod's demand, checked against expectations computed here, not by the module under test.

The hand-computed cases follow the kube-scheduler's rule: max(sum of app containers and native sidecars, each init
container beside the sidecars started before it) — max(sum of containers, max of init containers) when there are no
sidecars — then a pod-level request replaces that, and ``spec.overhead`` is added on top. The property test compares
with a transcription of the kube-scheduler's own loop (component-helpers ``AggregateContainerRequests``: running
totals, not the phases that :func:`running_at_once` lists), so a mistake in either formulation shows.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sharegpu.k8s.pod_request import cpu_and_memory, pod_request
from sharegpu.kube.schema import Pod
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
        ([init("i", 2), app("a", 1)], 2),  # max(1, 2): the init container's GPUs are handed on
        ([init("i", 1), app("a", 2)], 2),  # max(2, 1)
        ([init("i", 3), init("j", 1), app("a", 1), app("b", 1)], 3),  # max(1 + 1, max(3, 1))
        ([init("i", 1), init("j", 1), app("a", 1)], 1),  # init containers run one at a time: max(1, max(1, 1))
        ([side("s", 1), app("a", 1)], 2),  # the sidecar runs beside the app container
        ([side("s", 1), init("i", 2), app("a", 1)], 3),  # max(1 + 1, 1 + 2): the init container beside the sidecar
        ([init("i", 2), side("s", 1), app("a", 1)], 2),  # max(1 + 1, 2, 1): the sidecar starts after it
        ([init("i", 1), side("s", 1), init("j", 1), app("a", 1)], 2),
        ([side("s", 1), side("t", 1)], 2),
        ([init("i", 3)], 3),
        ([], 0),
    ],
)
def test_pod_demand(containers: list[ContainerDemand], expected: int) -> None:
    assert pod_demand(containers) == expected


@pytest.mark.parametrize(
    ("containers", "overhead", "pod_level", "expected"),
    [
        ([app("a", 100), app("b", 200)], 250, None, 550),  # 100 + 200 + 250
        ([init("i", 500), app("a", 100), app("b", 200)], 250, None, 750),  # max(300, 500) + 250
        ([side("s", 100), init("i", 500), app("a", 100)], 50, None, 650),  # max(200, 100 + 500) + 50
        ([init("i", 500), app("a", 100)], 0, 1000, 1000),  # the pod-level request replaces the containers' 500
        ([init("i", 500), app("a", 100)], 250, 200, 450),  # pod-level 200, then the overhead
        ([], 250, None, 250),  # a pod whose containers name nothing still costs its overhead
    ],
)
def test_overhead_and_pod_level_requests(
    containers: list[ContainerDemand], overhead: int, pod_level: int | None, expected: int
) -> None:
    assert pod_demand(containers, overhead=overhead, pod_level=pod_level) == expected


def test_negative_overhead_is_refused() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        pod_demand([app("a", 1)], overhead=-1)


def test_a_sidecar_must_be_an_init_container() -> None:
    with pytest.raises(ValueError, match="only an init container"):
        ContainerDemand("x", 1, sidecar=True)


def scheduler_loop(spec: list[tuple[str, int]]) -> int:
    """The kube-scheduler's aggregation written as its loop does it (running totals over the init containers)."""
    reqs = sum(n for kind, n in spec if kind == "app")
    restartable = 0
    init_reqs = 0
    for kind, n in spec:
        if kind == "app":
            continue
        if kind == "side":
            reqs += n  # a sidecar runs for the pod's whole life, beside the app containers
            restartable += n
            current = restartable
        else:
            current = n + restartable
        init_reqs = max(init_reqs, current)
    return max(reqs, init_reqs)


kinds = st.sampled_from(["app", "init", "side"])


@given(st.lists(st.tuples(kinds, st.integers(0, 4)), max_size=8), st.integers(0, 3))
def test_demand_matches_the_schedulers_loop(spec: list[tuple[str, int]], overhead: int) -> None:
    # Init containers come first in a pod's spec; the strategy's order is kept within each list.
    spec = [s for s in spec if s[0] != "app"] + [s for s in spec if s[0] == "app"]
    containers = [
        ContainerDemand(f"c{i}", n, init=kind != "app", sidecar=kind == "side") for i, (kind, n) in enumerate(spec)
    ]
    assert pod_demand(containers, overhead=overhead) == scheduler_loop(spec) + overhead


@given(st.lists(st.tuples(kinds, st.integers(0, 4)), max_size=8))
def test_no_phase_holds_more_than_the_demand(spec: list[tuple[str, int]]) -> None:
    """Every set of containers that can run at once fits in the demand (the node agent relies on it)."""
    spec = [s for s in spec if s[0] != "app"] + [s for s in spec if s[0] == "app"]
    containers = [
        ContainerDemand(f"c{i}", n, init=kind != "app", sidecar=kind == "side") for i, (kind, n) in enumerate(spec)
    ]
    amount = {c.name: c.amount for c in containers}
    assert all(sum(amount[n] for n in p) <= scheduler_loop(spec) for p in running_at_once(containers))


def pod(spec: dict[str, Any]) -> Pod:
    return Pod.model_validate({"metadata": {"name": "p", "namespace": "ns"}, "spec": spec})


def container(name: str, cpu: str, memory: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": "x", "resources": {"requests": {"cpu": cpu, "memory": memory}}, **extra}


def test_a_pods_cpu_and_memory_count_init_containers_and_overhead() -> None:
    p = pod(
        {
            "initContainers": [container("i", "2", "1Gi")],
            "containers": [container("a", "500m", "256Mi"), container("b", "250m", "512Mi")],
            "overhead": {"cpu": "250m", "memory": "120Mi"},
        }
    )
    # cpu: max(500 + 250, 2000) + 250; memory: max(256 + 512, 1024) + 120
    assert cpu_and_memory(p) == (2250, 1144)


def test_a_pod_level_request_replaces_the_containers_for_its_resources_only() -> None:
    p = pod(
        {
            "containers": [container("a", "500m", "256Mi"), container("b", "250m", "512Mi")],
            "resources": {"requests": {"cpu": "3"}},  # memory left to the containers
            "overhead": {"memory": "100Mi"},
        }
    )
    assert cpu_and_memory(p) == (3000, 256 + 512 + 100)
    # Limits alone stand for requests, as the API server defaults them.
    p = pod({"containers": [container("a", "500m", "256Mi")], "resources": {"limits": {"memory": "2Gi"}}})
    assert cpu_and_memory(p) == (500, 2048)


def test_the_gpu_request_carries_the_overhead_but_not_into_the_gpu_count() -> None:
    gpu = {"limits": {"sharegpu.io/gpu": "1", "sharegpu.io/gpu-memory": "10Gi", "cpu": "1", "memory": "1Gi"}}
    p = pod({"containers": [{"name": "a", "image": "x", "resources": gpu}], "overhead": {"cpu": "100m"}})
    req = pod_request(p)
    assert req is not None
    assert (req.gpu_count, req.cpu_milli, req.host_memory_mib) == (1, 1100, 1024)


def test_an_unreadable_overhead_says_where() -> None:
    p = pod({"containers": [container("a", "1", "1Gi")], "overhead": {"cpu": "lots"}})
    with pytest.raises(ValueError, match=r"spec.overhead: cpu 'lots' is not a Kubernetes quantity"):
        cpu_and_memory(p)
