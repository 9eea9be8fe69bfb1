"""The kube-scheduler extender: filter, prioritize, bind and preempt over HTTP, on the simulator's ledger and policies.

Protocol: k8s.io/kube-scheduler/extender/v1 (see :mod:`sharegpu.k8s.schema`), JSON over HTTP POST to
``<urlPrefix>/<verb>``. Works with ``nodeCacheCapable: true`` (node names in, node names out) and ``false``
(whole Node objects in, the passing ones out, unchanged).

- filter: every rejected node gets a reason a user can act on ("largest free share 12Gi < 20Gi asked"); the
  kube-scheduler puts them in the pod's FailedScheduling event.
- prioritize: the policy's scores of the candidates, scaled to 0–10. The node the policy itself would pick (best
  score, its tie-break) gets 10 and every other node at most 9, so that with a dominant extender weight the
  kube-scheduler binds where ``sharegpu sim`` would.
- bind: decide the GPUs on the chosen node, reserve them in the ledger (synchronously, so a concurrent bind sees
  the reservation), write ``sharegpu.io/assignment`` under the pod's resourceVersion, then create the Binding. Any
  failure releases the reservation: of two binds racing for the last share, the second finds it taken.
- preempt: keep only the nodes where evicting the proposed victims really frees room for the pod.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sharegpu.k8s.api import ApiError, ClusterApi, Conflict
from sharegpu.k8s.cluster_metrics import ClusterMetrics  # issue 10
from sharegpu.k8s.pod_request import ASSIGNMENT_ANNOTATION, DEFAULT_SCHEDULER_NAME, pod_request
from sharegpu.k8s.schema import (
    MAX_EXTENDER_PRIORITY,
    ExtenderArgs,
    ExtenderBindingArgs,
    ExtenderBindingResult,
    ExtenderFilterResult,
    ExtenderPreemptionArgs,
    ExtenderPreemptionResult,
    MetaVictims,
    Pod,
)
from sharegpu.k8s.view import ClusterView
from sharegpu.ledger import Ledger, LedgerError
from sharegpu.model.assignment import Assignment
from sharegpu.model.request import GpuRequest, InvalidRequest
from sharegpu.placement.framework import BoolArray, CycleState, Decision, IntArray

log = logging.getLogger(__name__)

NOT_SYNCED = "sharegpu has lost the API server and is reconnecting; no new placements until its view is back in sync"
CACHE_SIZE = 256


@dataclass(frozen=True, slots=True)
class _Feasible:
    request: GpuRequest
    ok: BoolArray
    usable: BoolArray


class Extender:
    def __init__(
        self,
        view: ClusterView,
        api: ClusterApi | None,
        scheduler_name: str = DEFAULT_SCHEDULER_NAME,
        metrics: ClusterMetrics | None = None,  # issue 10
    ) -> None:
        self.view = view
        self.metrics = metrics or ClusterMetrics(view)  # issue 10: recorded by the HTTP layer (make_app)
        self.api = api
        self.scheduler_name = scheduler_name  # /bind binds only pods of this scheduler that ask for sharegpu
        # Filter's feasibility, reused by the prioritize call of the same cycle while the ledger is unchanged.
        self._feasible: OrderedDict[tuple[str, str, int], _Feasible] = OrderedDict()
        self._names: tuple[Ledger, list[str], IntArray] | None = None

    # ----- filter ----------------------------------------------------------------------------------------------
    def filter(self, args: ExtenderArgs) -> ExtenderFilterResult:
        names = _node_names(args)
        try:
            req = pod_request(args.Pod, self.view.catalog)
        except InvalidRequest as e:
            # No node and no preemption can help a request that can never be valid.
            return self._filtered(args, [], {}, dict.fromkeys(names, str(e)))
        if req is None:
            return self._filtered(args, names, {}, {})
        if not self.view.synced:
            return self._filtered(args, [], dict.fromkeys(names, NOT_SYNCED), {})
        f = self._feasibility(args.Pod, req)
        idx = self._indices(names)
        known = idx >= 0
        fits = np.zeros(len(names), dtype=bool)
        fits[known] = f.ok[idx[known]]
        passed = [names[i] for i in np.flatnonzero(fits).tolist()]
        failed: dict[str, str] = {}
        unresolvable = {names[i]: self.view.node_problem(names[i]) for i in np.flatnonzero(~known).tolist()}
        rejected = np.flatnonzero(known & ~fits)
        if len(rejected):
            reasons = self.view.scheduler().explain_nodes(req, f.usable, idx[rejected])
            for i, reason in zip(rejected.tolist(), reasons, strict=True):
                if _never_fits(reason):
                    unresolvable[names[i]] = reason  # no eviction can help
                else:
                    failed[names[i]] = reason
        return self._filtered(args, passed, failed, unresolvable)

    @staticmethod
    def _filtered(
        args: ExtenderArgs, passed: list[str], failed: dict[str, str], unresolvable: dict[str, str]
    ) -> ExtenderFilterResult:
        if args.NodeNames is None and args.Nodes is not None:
            keep = set(passed)
            # exclude_unset: exactly the fields that came in (unknown ones included) go back out.
            nodes = args.Nodes.model_dump(mode="json", by_alias=True, exclude_unset=True)
            nodes["items"] = [n for n, name in zip(args.Nodes.items, args.Nodes.names(), strict=True) if name in keep]
            return ExtenderFilterResult(Nodes=nodes, FailedNodes=failed, FailedAndUnresolvableNodes=unresolvable)
        return ExtenderFilterResult(NodeNames=passed, FailedNodes=failed, FailedAndUnresolvableNodes=unresolvable)

    def _feasibility(self, pod: Pod, req: GpuRequest) -> _Feasible:
        view = self.view
        led = view.ledger
        key = (pod.metadata.uid or pod.key, pod.metadata.resource_version, view.generation)
        hit = self._feasible.get(key)
        if hit is not None:
            return hit
        ok, usable = view.scheduler().feasible(req)
        f = _Feasible(req, ok, usable)
        assert led is view.ledger
        self._feasible[key] = f
        if len(self._feasible) > CACHE_SIZE:
            self._feasible.popitem(last=False)
        return f

    # ----- prioritize ------------------------------------------------------------------------------------------
    def prioritize(self, args: ExtenderArgs) -> list[tuple[str, int]]:
        """(Host, Score) per node, in the order given: the HostPriorityList, as plain tuples (a model per node would
        cost more than the scoring)."""
        names = _node_names(args)
        try:
            req = pod_request(args.Pod, self.view.catalog)
        except InvalidRequest:
            req = None
        if req is None or not self.view.synced:
            return [(n, 0) for n in names]
        f = self._feasibility(args.Pod, req)
        sched = self.view.scheduler()
        idx = self._indices(names)
        known = idx >= 0
        fits = np.zeros(len(names), dtype=bool)
        fits[known] = f.ok[idx[known]]
        out = np.zeros(len(names), dtype=np.int64)
        cand = np.unique(idx[fits])  # node order, each node once (a name may repeat)
        if len(cand):
            scores = sched.scores(CycleState(req, f.usable, sched.rng), cand)
            best = sched.pick(cand, scores)
            lo, hi = int(scores.min()), int(scores.max())
            top = MAX_EXTENDER_PRIORITY - 1
            # Others share 0..9 by score; only the policy's own pick gets 10.
            scaled = np.full(len(cand), top, dtype=np.int64) if hi == lo else (scores - lo) * top // (hi - lo)
            scaled[cand == best] = MAX_EXTENDER_PRIORITY
            by_node = np.zeros(len(sched.ledger.nodes), dtype=np.int64)
            by_node[cand] = scaled
            out[fits] = by_node[idx[fits]]
        return list(zip(names, out.tolist(), strict=True))

    def _indices(self, names: list[str]) -> IntArray:
        """Ledger indices of ``names`` (-1: not a sharegpu node); the scheduler sends the same list every cycle."""
        led = self.view.ledger
        cached = self._names
        if cached is not None and cached[0] is led and cached[1] == names:
            return cached[2]
        idx = np.array([led.index.get(n, -1) for n in names], dtype=np.int64)
        self._names = (led, names, idx)
        return idx

    # ----- bind ------------------------------------------------------------------------------------------------
    async def bind(self, args: ExtenderBindingArgs) -> ExtenderBindingResult:
        key = f"{args.PodNamespace}/{args.PodName}"
        if self.api is None:
            return ExtenderBindingResult(Error="this extender has no API server connection to bind with")
        if not self.view.synced:
            return ExtenderBindingResult(Error=f"cannot bind {key}: {NOT_SYNCED}")
        try:
            pod = await self.api.get_pod(args.PodNamespace, args.PodName)
        except ApiError as e:
            return ExtenderBindingResult(Error=f"cannot bind {key}: {e}")
        if args.PodUID and pod.metadata.uid and pod.metadata.uid != args.PodUID:
            return ExtenderBindingResult(Error=f"cannot bind {key}: it was replaced (UID {pod.metadata.uid})")
        if pod.spec.node_name:
            return ExtenderBindingResult(Error=f"cannot bind {key}: it is already bound to {pod.spec.node_name}")
        if pod.spec.scheduler_name != self.scheduler_name:
            # The extender binds only what its own scheduler placed: its pods/binding permission is cluster-wide.
            return ExtenderBindingResult(
                Error=f"cannot bind {key}: its schedulerName is {pod.spec.scheduler_name or 'unset'}, not "
                f"{self.scheduler_name}; the sharegpu extender binds only the pods of its scheduler"
            )
        try:
            req = pod_request(pod, self.view.catalog)
        except InvalidRequest as e:
            return ExtenderBindingResult(Error=f"cannot bind {key}: {e}")
        if req is None:
            return ExtenderBindingResult(
                Error=f"cannot bind {key}: it asks for no sharegpu.io resource; the sharegpu extender binds only pods "
                "that do"
            )
        # From here to reserve() nothing awaits: the decision and the reservation see one ledger state.
        led = self.view.ledger
        n = led.index.get(args.Node)
        if n is None:
            return ExtenderBindingResult(Error=f"cannot bind {key}: {self.view.node_problem(args.Node)}")
        self.view.forget_unbound(key)  # the pod is unbound: an earlier attempt's assignment holds nothing real
        d = self.view.scheduler().decide_on(req, n)
        if not isinstance(d, Decision):
            return ExtenderBindingResult(Error=f"cannot bind {key}: {d.reason}")
        try:
            self.view.reserve(d.assignment, pod.metadata.uid)
        except LedgerError as e:
            return ExtenderBindingResult(Error=f"cannot bind {key}: {e}")
        return await self._write(key, pod, d)

    async def _write(self, key: str, pod: Pod, d: Decision) -> ExtenderBindingResult:
        assert self.api is not None
        a = d.assignment
        ns, name = pod.metadata.namespace, pod.metadata.name
        try:
            annotated = await self.api.patch_pod_annotations(
                ns, name, {ASSIGNMENT_ANNOTATION: a.to_json()}, pod.metadata.resource_version
            )
        except ApiError as e:
            self.view.settle(key, None)
            why = "it changed since it was read; the scheduler retries" if isinstance(e, Conflict) else str(e)
            return ExtenderBindingResult(Error=f"cannot bind {key}: {why}")
        try:
            await self.api.bind_pod(ns, name, pod.metadata.uid, a.node)
        except ApiError as e:
            # Not bound: take the assignment back so that it holds nothing (best effort; a leftover annotation on an
            # unbound pod is replaced by its next bind).
            cleaned: Pod | None = None
            try:
                cleaned = await self.api.patch_pod_annotations(
                    ns, name, {ASSIGNMENT_ANNOTATION: None}, annotated.metadata.resource_version
                )
            except ApiError as e2:
                log.warning("pod %s: cannot remove the assignment of a failed bind: %s", key, e2)
            self.view.settle(key, cleaned)
            return ExtenderBindingResult(Error=f"cannot bind {key}: {e}")
        self.view.settle(key, annotated, bound=True)
        units = ", ".join(f"{s.gpu_uuid}{'/' + s.mig.profile if s.mig else ''} ({s.sharing})" for s in a.shares)
        log.info("bound %s to %s: %s", key, a.node, units or "no GPU")
        return ExtenderBindingResult()

    # ----- preempt ---------------------------------------------------------------------------------------------
    def preempt(self, args: ExtenderPreemptionArgs) -> ExtenderPreemptionResult:
        """Keep the nodes where evicting the victims frees room for the pod (checked on the real ledger, undone)."""
        try:
            req = pod_request(args.Pod, self.view.catalog)
        except InvalidRequest:
            return ExtenderPreemptionResult()
        victims: dict[str, MetaVictims] = {}
        if args.NodeNameToMetaVictims is not None:
            victims = dict(args.NodeNameToMetaVictims)
        elif args.NodeNameToVictims is not None:
            victims = {
                node: MetaVictims.model_validate(
                    {"Pods": [{"UID": p.metadata.uid} for p in v.Pods], "NumPDBViolations": v.NumPDBViolations}
                )
                for node, v in args.NodeNameToVictims.items()
            }
        if req is None:
            return ExtenderPreemptionResult(NodeNameToMetaVictims=victims)
        if not self.view.synced:
            return ExtenderPreemptionResult()
        led = self.view.ledger
        by_uid = self.view.pod_keys_by_uid()
        kept: dict[str, MetaVictims] = {}
        sched = self.view.scheduler()
        for node, mv in victims.items():
            n = led.index.get(node)
            if n is None:
                continue
            # Each victim once (a body may name one twice), and only those the ledger holds now.
            keys = list(dict.fromkeys(by_uid[p.UID] for p in mv.Pods if p.UID in by_uid))
            released: list[Assignment] = []
            try:
                for k in keys:
                    if k in led.assignments:
                        released.append(led.release(k))
                ok, _ = sched.feasible(req)
                fits = bool(ok[n])
            finally:
                # Exactly what was released goes back, as it was (health is not checked again: it holds already).
                for a in reversed(released):
                    led.place(a, check_health=False)
            if fits:
                unique = list({v.UID: v for v in mv.Pods}.values())
                kept[node] = mv if len(unique) == len(mv.Pods) else mv.model_copy(update={"Pods": unique})
        self.view.generation += 1  # the ledger is as it was, but its node versions moved
        return ExtenderPreemptionResult(NodeNameToMetaVictims=kept)


def _never_fits(reason: str) -> bool:
    """Whether a filter reason says the node cannot host the pod whatever is evicted (no GPU of an allowed model,
    or fewer healthy ones than it asks for)."""
    return (
        reason.startswith("no GPU of an allowed model")
        or reason == "no sharegpu GPUs"
        or " healthy GPU(s) of an allowed model < " in reason
    )


def _node_names(args: ExtenderArgs) -> list[str]:
    if args.NodeNames is not None:
        return list(args.NodeNames)
    if args.Nodes is not None:
        return args.Nodes.names()
    return []


# ----- HTTP ------------------------------------------------------------------------------------------------------
def _json(model: BaseModel | list[tuple[str, int]]) -> Response:
    if isinstance(model, list):
        body = json.dumps([{"Host": h, "Score": s} for h, s in model], separators=(",", ":")).encode()
    else:
        body = model.model_dump_json().encode()
    return Response(body, media_type="application/json")


def _bad_request(e: ValidationError | ValueError, verb: str) -> Response:
    if isinstance(e, ValidationError):
        errors = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()[:5])
    else:
        errors = str(e)
    return JSONResponse({"error": f"malformed {verb} request: {errors}"}, status_code=400)


def make_app(extender: Extender) -> Starlette:
    def verb(
        name: str, model: type[BaseModel], handle: Callable[[BaseModel], Awaitable[BaseModel | list[tuple[str, int]]]]
    ) -> Route:
        async def endpoint(request: Request) -> Response:
            body = await request.body()
            t0 = time.perf_counter()  # issue 10
            try:
                args = model.model_validate_json(body)
            except (ValidationError, ValueError) as e:
                extender.metrics.error(name, 400)  # issue 10
                return _bad_request(e, name)
            try:
                result = await handle(args)
                extender.metrics.record(name, args, result, time.perf_counter() - t0, NOT_SYNCED)  # issue 10
                return _json(result)
            except Exception as e:  # a bug must not take the scheduler's extender down: report, keep serving
                log.exception("%s failed", name)
                extender.metrics.error(name, 500)  # issue 10
                return JSONResponse({"error": f"{name} failed: {type(e).__name__}: {e}"}, status_code=500)

        return Route(f"/{name}", endpoint, methods=["POST"])

    async def do_filter(a: BaseModel) -> BaseModel:
        assert isinstance(a, ExtenderArgs)
        return extender.filter(a)

    async def do_prioritize(a: BaseModel) -> list[tuple[str, int]]:
        assert isinstance(a, ExtenderArgs)
        return extender.prioritize(a)

    async def do_bind(a: BaseModel) -> BaseModel:
        assert isinstance(a, ExtenderBindingArgs)
        return await extender.bind(a)

    async def do_preempt(a: BaseModel) -> BaseModel:
        assert isinstance(a, ExtenderPreemptionArgs)
        return extender.preempt(a)

    async def healthz(request: Request) -> Response:
        return Response("ok\n", media_type="text/plain")

    async def readyz(request: Request) -> Response:
        if extender.view.synced:
            return Response("in sync\n", media_type="text/plain")
        return Response(NOT_SYNCED + "\n", status_code=503, media_type="text/plain")

    return Starlette(
        routes=[
            verb("filter", ExtenderArgs, do_filter),
            verb("prioritize", ExtenderArgs, do_prioritize),
            verb("bind", ExtenderBindingArgs, do_bind),
            verb("preempt", ExtenderPreemptionArgs, do_preempt),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
        ]
    )


async def run_extender(
    view: ClusterView,
    api: ClusterApi,
    host: str,
    port: int,
    stop: asyncio.Event | None = None,
    scheduler_name: str = DEFAULT_SCHEDULER_NAME,
    metrics_listen: tuple[str, int] | None = None,  # issue 10
) -> None:
    """Serve the extender and follow the API server until ``stop`` (or SIGTERM/SIGINT, handled by uvicorn)."""
    import uvicorn

    stop = stop or asyncio.Event()
    extender = Extender(view, api, scheduler_name)
    app = make_app(extender)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    # issue 10: /metrics on its own port, bound first (a busy port fails the start with an OSError)
    metrics = metrics_listen and asyncio.ensure_future(
        extender.metrics.serve(extender.metrics.listen(*metrics_listen), stop)
    )
    follow = asyncio.ensure_future(view.follow(api, stop))
    # issue 10: ``stop`` ends the server too, as the docstring says (tests stop run_extender this way)
    asyncio.ensure_future(stop.wait()).add_done_callback(lambda _: setattr(server, "should_exit", True))
    try:
        await server.serve()
    finally:
        stop.set()
        await follow
        if metrics:
            await metrics
        await api.close()
