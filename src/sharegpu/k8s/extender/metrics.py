"""The extender's Prometheus metrics: what it decided, how fast, and how full and fragmented the cluster is.

Two kinds of series, all ``sharegpu_*`` and documented in docs/metrics.md:

- event counters and histograms the extender updates as it serves (filter decisions, binds by outcome, latency per
  verb, malformed or failed requests, leader status);
- cluster gauges computed at scrape time from the extender's own ledger by :class:`ClusterCollector`, through the
  same functions as ``sharegpu status`` (:mod:`sharegpu.k8s.status.report`): GPUs by model and mechanism, memory and
  compute promised, allocation and the simulator's fragmentation measure, pending pods by reason class, and the
  view's sync state and relists.

Everything lives in the :class:`ClusterMetrics` object's own registry (never the process-global one). ``/metrics``
is served on its own port by :meth:`ClusterMetrics.serve`, on the extender's event loop, so a scrape reads the
ledger between two events, never in the middle of one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from enum import StrEnum
from importlib.metadata import PackageNotFoundError, version

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.extender.answers import FilterAnswer
from sharegpu.k8s.pending import REASON_CLASSES, pending_pods
from sharegpu.k8s.pod_request import asks_for_sharegpu
from sharegpu.k8s.status.report import MODE_NAMES, cluster_summary
from sharegpu.kube.quantity import MIB
from sharegpu.kube.schema import ExtenderArgs, ExtenderBindingResult, ExtenderPreemptionResult
from sharegpu.ledger import GpuMode
from sharegpu.model.contract import GPU_RESOURCE, ISOLATION_ANNOTATION, MIG_PROFILE_ANNOTATION, SHARING_ANNOTATION

VERBS = ("filter", "prioritize", "bind", "preempt")
# Extender calls take sub-millisecond (a filter over 1,000 nodes) to seconds (a bind waits on the API server).
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class FilterOutcome(StrEnum):
    FEASIBLE = "feasible"  # at least one node passed
    UNSCHEDULABLE = "unschedulable"  # no node passed (an invalid request counts here too)
    NOT_SYNCED = "not_synced"  # refused: the view had lost the API server
    IGNORED = "ignored"  # the pod asks for no sharegpu resource: every node passed unchanged


class BindOutcome(StrEnum):
    BOUND = "bound"
    CONFLICT = "conflict"  # lost a race: the pod changed, was bound or replaced, or its share was taken meanwhile
    UNSCHEDULABLE = "unschedulable"  # the chosen node has no room (any more) for the pod
    REFUSED = "refused"  # not ours to bind (other scheduler, no sharegpu resource, invalid) or the view out of sync
    FAILURE = "failure"  # the API server refused or could not be reached, and the bind was taken back
    UNKNOWN = "unknown"  # the Binding's result is not known (settled later by reading the pod back)


class PreemptOutcome(StrEnum):
    VICTIMS = "victims"  # at least one node where evicting the proposed victims makes room
    NONE = "none"


# Until the extender's bind reports typed outcomes (then it calls ClusterMetrics.bind itself), a bind's result is
# classed by the words of its error, checked in this order (the first match wins; the default is UNSCHEDULABLE: the
# node's reason from the placement framework, or its missing inventory). Pod and node names cannot contain these
# words (DNS names have no spaces, quotes or capitals). tests/k8s/test_cluster_metrics.py drives every bind path of
# the extender and checks the class of each, so a reworded error fails there.
_BIND_CLASSES: tuple[tuple[BindOutcome, tuple[str, ...]], ...] = (
    # A bind whose outcome is unknown keeps its reservation until it is settled (extender._bind's messages).
    (BindOutcome.UNKNOWN, ("stay reserved", "answers to its Binding were lost", "is unknown and not settled")),
    (
        BindOutcome.CONFLICT,
        (
            "it was replaced",
            "already bound to",
            "changed since it was read",
            "already in progress",
            "cannot place ",
            "is already placed",
            "already assigned to node",
            "does not match",
        ),
    ),
    (
        BindOutcome.REFUSED,
        (
            "lost the API server",
            "not the leader",
            "its schedulerName is",
            "asks for no sharegpu.io resource",
            "request '",
            GPU_RESOURCE,
            ISOLATION_ANNOTATION,
            SHARING_ANNOTATION,
            MIG_PROFILE_ANNOTATION,
        ),
    ),
    (
        BindOutcome.FAILURE,
        ("cannot get pod", "cannot read pod", "cannot annotate pod", "cannot bind pod ", "not found", "no API server"),
    ),
)


def bind_outcome(result: ExtenderBindingResult) -> BindOutcome:
    """The class of a bind's result (an empty error is a bind)."""
    error = result.Error
    if not error:
        return BindOutcome.BOUND
    for outcome, words in _BIND_CLASSES:
        if any(w in error for w in words):
            return outcome
    return BindOutcome.UNSCHEDULABLE


def filter_outcome(args: ExtenderArgs, answer: FilterAnswer) -> FilterOutcome:
    if not asks_for_sharegpu(args.Pod):
        return FilterOutcome.IGNORED
    if answer.passed:
        return FilterOutcome.FEASIBLE
    if answer.not_synced:
        return FilterOutcome.NOT_SYNCED
    return FilterOutcome.UNSCHEDULABLE


def _package_version() -> str:
    try:
        return version("sharegpu")
    except PackageNotFoundError:
        return "unknown"


class ClusterCollector:
    """Cluster gauges computed from the view's ledger at scrape time (the report of ``sharegpu status``)."""

    def __init__(self, view: ClusterView) -> None:
        self.view = view

    def collect(self) -> Iterable[Metric]:
        view = self.view
        led = view.ledger
        pending = pending_pods(view)
        summary = cluster_summary(view, pending)
        out: list[Metric] = []

        def gauge(name: str, doc: str, value: float | None = None, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, value=value, labels=list(labels) if labels else None)
            out.append(g)
            return g

        gauge(
            "sharegpu_cluster_nodes", "Nodes with a valid sharegpu inventory in the extender's ledger.", len(led.nodes)
        )
        # Per GPU, vectorised over the ledger's (node × GPU slot) arrays: 6,212 GPUs are one numpy pass.
        present = led.present
        model_id = led.model_id[present].astype(np.int64)
        mode = led.mode[present].astype(np.int64)
        n_models = len(led.model_names)
        width = max(int(m) for m in GpuMode) + 1
        by_model_mode = np.bincount(model_id * width + mode, minlength=n_models * width).reshape(n_models, width)
        unhealthy = np.bincount(model_id[~led.healthy[present]], minlength=n_models)
        mem_total = np.bincount(model_id, weights=led.gpu_mem_total[present], minlength=n_models)
        fam = gauge(
            "sharegpu_cluster_gpus",
            "GPUs by model and by how each is used now (mechanism free: nothing placed on it).",
            labels=("model", "mechanism"),
        )
        for m, model in enumerate(led.model_names):
            for mode_value, count in enumerate(by_model_mode[m].tolist()):
                if count:
                    fam.add_metric([model, MODE_NAMES[GpuMode(mode_value)]], count)
        fam = gauge("sharegpu_cluster_gpus_unhealthy", "GPUs their node agent reports unhealthy.", labels=("model",))
        for m, model in enumerate(led.model_names):
            fam.add_metric([model], int(unhealthy[m]))
        fam = gauge("sharegpu_cluster_gpu_memory_bytes", "GPU memory of all GPUs, by model.", labels=("model",))
        for m, model in enumerate(led.model_names):
            fam.add_metric([model], int(mem_total[m]) * MIB)

        mem: dict[tuple[str, str], int] = {}
        compute: dict[tuple[str, str], int] = {}
        for a in led.assignments.values():
            n = led.index[a.node]
            keys = [
                (led.gpu_model(n, s.gpu_index).name, MODE_NAMES[GpuMode(int(led.mode[n, s.gpu_index]))])
                for s in a.shares
            ]
            for key, s in zip(keys, a.shares, strict=True):
                mem[key] = mem.get(key, 0) + s.memory_mib
            # The ledger's own measure of a share (a MIG share counts its instance's part of the GPU).
            if len(set(keys)) == 1:
                compute[keys[0]] = compute.get(keys[0], 0) + led.gpu_milli_of(a)
            else:
                for key, s in zip(keys, a.shares, strict=True):
                    compute[key] = compute.get(key, 0) + led.gpu_milli_of(dataclasses.replace(a, shares=(s,)))
        fam = gauge(
            "sharegpu_cluster_gpu_memory_promised_bytes",
            "GPU memory promised to pods, by GPU model and the GPU's mechanism.",
            labels=("model", "mechanism"),
        )
        for key, mib in sorted(mem.items()):
            fam.add_metric(list(key), mib * MIB)
        fam = gauge(
            "sharegpu_cluster_gpu_compute_promised_gpus",
            "GPU compute promised to pods in GPUs (0.3 = 30 % of one GPU), by GPU model and mechanism.",
            labels=("model", "mechanism"),
        )
        for key, milli in sorted(compute.items()):
            fam.add_metric(list(key), milli / 1000)
        gauge(
            "sharegpu_cluster_allocation_ratio",
            "GPU compute promised / GPU capacity (sharegpu sim's allocation), 0-1.",
            summary["allocation_pct"] / 100,
        )
        if summary["fragmentation_pct"] is not None:
            gauge(
                "sharegpu_cluster_fragmentation_ratio",
                "Free GPU compute the workload's typical pod shapes cannot use / GPU capacity (sharegpu sim's "
                "fragmentation, FGD's measure), 0-1. Absent until a sharegpu pod has been seen.",
                summary["fragmentation_pct"] / 100,
            )
        gauge("sharegpu_cluster_pods_placed", "Pods holding an assignment in the ledger.", len(led))
        fam = gauge(
            "sharegpu_cluster_pending_pods",
            "Pods that ask for sharegpu and are not placed, by why they wait now (docs/metrics.md lists the reasons).",
            labels=("reason",),
        )
        by_reason = {r["reason"]: r["pods"] for r in summary["pending_reasons"]}
        for reason in REASON_CLASSES:
            fam.add_metric([reason], by_reason.get(reason, 0))
        gauge("sharegpu_cluster_view_synced", "1 while the extender's view follows the API server.", int(view.synced))
        out.append(
            CounterMetricFamily(
                "sharegpu_cluster_view_relists",
                "Full lists of Nodes and Pods taken from the API server (start, ended or broken watches).",
                value=view.relists,
            )
        )
        fam = gauge(
            "sharegpu_cluster_view_problems",
            "Objects left out of the accounting (invalid inventories or assignments); sharegpu status names them.",
            labels=("kind",),
        )
        problems = view.problems
        for kind in ("node", "pod"):
            fam.add_metric([kind], sum(1 for p in problems if p.kind == kind))
        return out


class ClusterMetrics:
    """The extender's metrics: counters and histograms it updates, cluster gauges computed at scrape time."""

    def __init__(self, view: ClusterView) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "sharegpu_extender_decisions",
            "Filter and preempt decisions by outcome.",
            ["verb", "outcome"],
            registry=r,
        )
        self.binds = Counter("sharegpu_extender_binds", "Binds by outcome.", ["outcome"], registry=r)
        self.latency = Histogram(
            "sharegpu_extender_request_duration_seconds",
            "Time to answer one extender call, by verb.",
            ["verb"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "sharegpu_extender_request_errors",
            "Extender calls answered with an HTTP error (400 malformed, 500 internal), by verb.",
            ["verb", "code"],
            registry=r,
        )
        self.leader = Gauge(
            "sharegpu_extender_leader",
            "1 while this replica is the one that reserves and binds (always 1 without leader election).",
            registry=r,
        )
        info = Gauge("sharegpu_build_info", "The running sharegpu version (always 1).", ["version"], registry=r)
        info.labels(_package_version()).set(1)
        self.leader.set(1)
        # Every series exists from the start at 0, so that rate() and absent() behave before the first event.
        for o in FilterOutcome:
            self.decisions.labels("filter", o.value)
        for p in PreemptOutcome:
            self.decisions.labels("preempt", p.value)
        for b in BindOutcome:
            self.binds.labels(b.value)
        for v in VERBS:
            self.latency.labels(v)
            for code in ("400", "500"):
                self.errors.labels(v, code)
        r.register(ClusterCollector(view))

    # ----- what the extender calls ---------------------------------------------------------------------------
    def bind(self, outcome: BindOutcome) -> None:
        self.binds.labels(outcome.value).inc()

    def decision(self, verb: str, outcome: StrEnum) -> None:
        self.decisions.labels(verb, outcome.value).inc()

    def set_leader(self, leader: bool) -> None:
        self.leader.set(1 if leader else 0)

    def record(self, verb: str, args: BaseModel, result: object, seconds: float) -> None:
        """One answered extender call: its latency and, by verb, its outcome (the extender's HTTP layer calls this
        once per call, so that the verbs themselves stay free of metrics)."""
        self.latency.labels(verb).observe(seconds)
        if verb == "filter" and isinstance(args, ExtenderArgs) and isinstance(result, FilterAnswer):
            self.decision("filter", filter_outcome(args, result))
        elif verb == "bind" and isinstance(result, ExtenderBindingResult):
            self.bind(bind_outcome(result))
        elif verb == "preempt" and isinstance(result, ExtenderPreemptionResult):
            self.decision("preempt", PreemptOutcome.VICTIMS if result.NodeNameToMetaVictims else PreemptOutcome.NONE)

    def error(self, verb: str, code: int) -> None:
        self.errors.labels(verb, str(code)).inc()

    # ----- serving -------------------------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)

    def app(self) -> Starlette:
        async def metrics(request: Request) -> Response:
            return Response(self.render(), media_type=CONTENT_TYPE_LATEST)

        return Starlette(routes=[Route("/metrics", metrics, methods=["GET"])])
