"""A pod's demand for one resource from its containers, counted the way the kube-scheduler and the kubelet count it.

Init containers run one at a time, before the app containers, and hand what they held on to the next container.
A native sidecar (an init container with ``restartPolicy: Always``) starts in init order and then runs for the rest
of the pod's life, beside the later init containers and beside the app containers. So the pod needs, at its peak:

- while init container *i* runs: the sidecars started before it, plus *i* itself (for a sidecar: every sidecar up to
  and including it);
- once the app containers run: every sidecar plus every app container;

and its demand is the largest of these (k8s.io/component-helpers ``resource.PodRequests``; the kubelet's device
manager reuses devices the same way, so a pod holds exactly this many device IDs). Two pod-level fields change the
number the kube-scheduler counts, in this order: a pod-level request (``spec.resources.requests``, PodLevelResources,
on by default since 1.34; CPU and memory only) replaces the containers' peak for that resource, and the pod's
``spec.overhead`` (set from its RuntimeClass) is added on top. Every place that turns a pod's containers into one
number (the webhook, the extender, the cluster view, the DRA steerer, the node agent) asks :func:`pod_demand`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ContainerDemand:
    """One container's amount of a resource, and how it runs."""

    name: str
    amount: int
    init: bool = False  # listed under initContainers
    sidecar: bool = False  # an init container with restartPolicy: Always (runs beside the app containers)

    def __post_init__(self) -> None:
        if self.sidecar and not self.init:
            raise ValueError(f"container {self.name!r}: only an init container can be a sidecar")


def pod_demand(containers: Iterable[ContainerDemand], overhead: int = 0, pod_level: int | None = None) -> int:
    """The pod's demand as the kube-scheduler counts it (see the module's docstring); containers in spec order, init
    containers first. ``pod_level``: the pod's own request for the resource (None: it sets none), which replaces the
    containers' peak; ``overhead``: its ``spec.overhead`` for the resource, added on top of either."""
    if overhead < 0 or (pod_level is not None and pod_level < 0):
        raise ValueError(f"overhead {overhead} and pod-level request {pod_level} must not be negative")
    if pod_level is not None:
        return pod_level + overhead
    return _containers_peak(containers) + overhead


def _containers_peak(containers: Iterable[ContainerDemand]) -> int:
    app = 0
    sidecars = 0  # sidecars started so far
    init_peak = 0
    for c in containers:
        if not c.init:
            app += c.amount
        elif c.sidecar:
            sidecars += c.amount
            init_peak = max(init_peak, sidecars)
        else:
            init_peak = max(init_peak, sidecars + c.amount)
    return max(app + sidecars, init_peak)


def running_at_once(containers: Iterable[ContainerDemand]) -> tuple[frozenset[str], ...]:
    """The sets of containers that can run at the same time (each a phase of the pod's life), in order.

    Containers of one set must never share what they were given; containers of different sets may (the kubelet
    hands an init container's devices on to later containers).
    """
    phases: list[frozenset[str]] = []
    sidecars: list[str] = []
    app: list[str] = []
    for c in containers:
        if not c.init:
            app.append(c.name)
        elif c.sidecar:
            sidecars.append(c.name)
            phases.append(frozenset(sidecars))
        else:
            phases.append(frozenset([*sidecars, c.name]))
    phases.append(frozenset([*sidecars, *app]))
    return tuple(phases)
