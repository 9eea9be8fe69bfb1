"""The kube-scheduler extender over HTTP: the scheduler's verbs routed to the decisions and the binder, and the
server that follows the API server beside them.

Protocol: k8s.io/kube-scheduler/extender/v1 (see :mod:`sharegpu.kube.schema`), JSON over HTTP POST to
``<urlPrefix>/<verb>``. Works with ``nodeCacheCapable: true`` (node names in, node names out) and ``false``
(whole Node objects in, the passing ones out, unchanged).

- filter, prioritize, preempt and dra/filter decide (:mod:`sharegpu.k8s.extender.decisions`): the policy's pick is held for
  the pod's bind, and a pod that fits nowhere gets a reason per node a user can act on;
- bind binds (:mod:`sharegpu.k8s.extender.binding`): the Binding writes the node and the assignment in one request, and what
  it reserved is released only when the pod is known not to be bound;
- /healthz and /readyz (only the leader in sync is ready), under a request-body limit; /metrics on its own port.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sharegpu.k8s.cache.view import NOT_SYNCED, ClusterView
from sharegpu.k8s.controllers.consolidation import ConsolidationConfig, enable_consolidation
from sharegpu.k8s.controllers.preemption import PreemptionConfig, run_preemption
from sharegpu.k8s.extender.answers import FilterAnswer
from sharegpu.k8s.extender.binding import NOT_LEADER, Binder
from sharegpu.k8s.extender.decisions import HOLD_S, Decisions
from sharegpu.k8s.extender.leader import LeaderElector
from sharegpu.k8s.extender.metrics import ClusterMetrics  # issue 10
from sharegpu.k8s.extender.node_names import ArgsDecoder
from sharegpu.k8s.serving.body_limit import EXTENDER_MAX_BODY, BodyLimit
from sharegpu.k8s.serving.tls import ServerTls
from sharegpu.kube.api import ClusterApi, DisruptionApi
from sharegpu.kube.schema import (
    ExtenderArgs,
    ExtenderBindingArgs,
    ExtenderBindingResult,
    ExtenderFilterResult,
    ExtenderPreemptionArgs,
    ExtenderPreemptionResult,
)
from sharegpu.model.contract import DEFAULT_SCHEDULER_NAME
from sharegpu.placement.fragmentation import Workload

log = logging.getLogger(__name__)


class Extender:
    """What the scheduler calls: the decisions and the binder over one cluster view, and the metrics the HTTP layer
    records. Only the leader holds and binds."""

    def __init__(
        self,
        view: ClusterView,
        api: ClusterApi | None,
        scheduler_name: str = DEFAULT_SCHEDULER_NAME,
        is_leader: Callable[[], bool] = lambda: True,
        hold_s: float = HOLD_S,
        metrics: ClusterMetrics | None = None,  # issue 10
        narrow: bool = True,
        policy: str = "sharegpu",
        seed: int = 0,
        workload: Workload | None = None,
    ) -> None:
        self.view = view
        self.api = api
        self.is_leader = is_leader
        self.metrics = metrics or ClusterMetrics(view)  # issue 10: recorded by the HTTP layer (make_app)
        # Told of every filter call (issue 19: preemption plans only on the nodes the kube-scheduler's own filters
        # passed for the pod: its affinity, taints and the resources it counts).
        self.on_filter: list[Callable[[ExtenderArgs], None]] = []
        self.decisions = Decisions(
            view,
            scheduler_name,
            may_hold=lambda: api is not None and is_leader(),
            on_chosen=lambda pod: self.binder.remember(pod),  # the pod as the scheduler sent it spares its bind a read
            hold_s=hold_s,
            narrow=narrow,
            policy=policy,
            seed=seed,
            workload=workload,
        )
        self.binder = Binder(view, api, self.decisions.schedulers, scheduler_name, is_leader)

    def filter(self, args: ExtenderArgs) -> ExtenderFilterResult:
        return self.filter_answer(args).result()

    def filter_answer(self, args: ExtenderArgs) -> FilterAnswer:
        for seen in self.on_filter:
            seen(args)
        return self.decisions.filter_answer(args)

    def prioritize(self, args: ExtenderArgs) -> list[tuple[str, int]]:
        return self.decisions.prioritize(args)

    def prioritize_answer(self, args: ExtenderArgs) -> bytes:
        return self.decisions.prioritize_answer(args)

    def preempt(self, args: ExtenderPreemptionArgs) -> ExtenderPreemptionResult:
        return self.decisions.preempt(args)

    def dra_filter(self, args: ExtenderArgs) -> ExtenderFilterResult:
        return self.decisions.dra_filter(args)

    async def bind(self, args: ExtenderBindingArgs) -> ExtenderBindingResult:
        return await self.binder.bind(args)


# ----- HTTP ------------------------------------------------------------------------------------------------------
def _json(answer: BaseModel | FilterAnswer | bytes) -> Response:
    if isinstance(answer, bytes):
        body = answer
    elif isinstance(answer, FilterAnswer):
        body = answer.body
    else:
        body = answer.model_dump_json().encode()
    return Response(body, media_type="application/json")


def _bad_request(e: ValidationError | ValueError, verb: str) -> Response:
    if isinstance(e, ValidationError):
        errors = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()[:5])
    else:
        errors = str(e)
    return JSONResponse({"error": f"malformed {verb} request: {errors}"}, status_code=400)


def make_app(extender: Extender, max_request_bytes: int = EXTENDER_MAX_BODY) -> Starlette:
    def verb(
        name: str, model: type[BaseModel], handle: Callable[[BaseModel], Awaitable[BaseModel | FilterAnswer | bytes]]
    ) -> Route:
        # issue 34: filter and prioritize get the same node list cycle after cycle, recognised by its bytes
        decode = ArgsDecoder().decode if model is ExtenderArgs else model.model_validate_json

        async def endpoint(request: Request) -> Response:
            body = await request.body()
            t0 = time.perf_counter()  # issue 10
            try:
                args = decode(body)
            except (ValidationError, ValueError) as e:
                extender.metrics.error(name, 400)  # issue 10
                return _bad_request(e, name)
            try:
                result = await handle(args)
                extender.metrics.record(name, args, result, time.perf_counter() - t0)  # issue 10
                return _json(result)
            except Exception as e:  # a bug must not take the scheduler's extender down: report, keep serving
                log.exception("%s failed", name)
                extender.metrics.error(name, 500)  # issue 10
                return JSONResponse({"error": f"{name} failed: {type(e).__name__}: {e}"}, status_code=500)

        return Route(f"/{name}", endpoint, methods=["POST"])

    async def do_filter(a: BaseModel) -> FilterAnswer:
        assert isinstance(a, ExtenderArgs)
        return extender.filter_answer(a)

    async def do_prioritize(a: BaseModel) -> bytes:
        assert isinstance(a, ExtenderArgs)
        return extender.prioritize_answer(a)

    async def do_bind(a: BaseModel) -> BaseModel:
        assert isinstance(a, ExtenderBindingArgs)
        return await extender.bind(a)

    async def do_dra_filter(a: BaseModel) -> BaseModel:
        assert isinstance(a, ExtenderArgs)
        return extender.dra_filter(a)

    async def do_preempt(a: BaseModel) -> BaseModel:
        assert isinstance(a, ExtenderPreemptionArgs)
        return extender.preempt(a)

    async def healthz(request: Request) -> Response:
        return Response("ok\n", media_type="text/plain")

    async def readyz(request: Request) -> Response:
        # Behind the Service, only the leader is ready: the scheduler's calls reach the one replica that binds.
        if not extender.is_leader():
            return Response(NOT_LEADER + "\n", status_code=503, media_type="text/plain")
        if extender.view.synced:
            return Response("in sync\n", media_type="text/plain")
        return Response(NOT_SYNCED + "\n", status_code=503, media_type="text/plain")

    return Starlette(
        routes=[
            verb("filter", ExtenderArgs, do_filter),
            verb("prioritize", ExtenderArgs, do_prioritize),
            verb("bind", ExtenderBindingArgs, do_bind),
            verb("preempt", ExtenderPreemptionArgs, do_preempt),
            verb("dra/filter", ExtenderArgs, do_dra_filter),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
        ],
        middleware=[Middleware(BodyLimit, max_bytes=max_request_bytes, what="extender request")],
    )


async def run_extender(
    view: ClusterView,
    api: ClusterApi,
    host: str,
    port: int,
    stop: asyncio.Event | None = None,
    scheduler_name: str = DEFAULT_SCHEDULER_NAME,
    elector: LeaderElector | None = None,
    tls: ServerTls | None = None,
    health: tuple[str, int] | None = None,
    max_request_bytes: int = EXTENDER_MAX_BODY,
    metrics_listen: tuple[str, int] | None = None,  # issue 10
    preemption: tuple[PreemptionConfig, DisruptionApi] | None = None,  # issue 19
    consolidation: ConsolidationConfig | None = None,  # issue 19 item 2: off unless given (needs preemption)
    policy: str = "sharegpu",
    seed: int = 0,
    freeze_heap: bool = False,
) -> None:
    """Serve the extender (over mutual TLS with ``tls``; ``health``: a plain-HTTP port with only the probes) and
    follow the API server until ``stop`` (or SIGTERM/SIGINT); raises OSError when a port cannot be bound. With an
    ``elector``, only while it holds the Lease does this replica hold, bind and report ready. ``freeze_heap``: the
    process serves nothing else (:func:`keep_warm`'s ``freeze``)."""
    from sharegpu.k8s.extender.warm import keep_warm
    from sharegpu.k8s.serving.server import Listener, Site, probes_only, serve

    stop = stop or asyncio.Event()
    leads = elector.is_leader if elector else lambda: True
    extender = Extender(view, api, scheduler_name, is_leader=leads, policy=policy, seed=seed)
    app = make_app(extender, max_request_bytes)
    sites = [Site(app, Listener(host, port, tls), "scheduler extender")]
    if health is not None:
        sites.append(Site(probes_only(app), Listener(*health), "health probes"))
    if metrics_listen:  # issue 10: /metrics on its own port (a busy port fails the start with an OSError)
        sites.append(Site(extender.metrics.app(), Listener(*metrics_listen), "metrics"))
    tasks = [asyncio.ensure_future(view.follow(api, stop))]
    # issue 34: every pod shape the view holds scored on every node before the first pod and after each relist
    tasks.append(asyncio.ensure_future(keep_warm(extender.decisions.schedulers, stop, freeze=freeze_heap)))
    if preemption is not None:  # issue 19: the leader preempts for GPU room (sharegpu.k8s.controllers.preemption)
        config, disruption = preemption
        registry = extender.metrics.registry
        leads = extender.is_leader
        tasks.append(
            asyncio.ensure_future(
                run_preemption(
                    view,
                    extender.decisions.schedulers,
                    disruption,
                    registry,
                    scheduler_name,
                    leads,
                    config,
                    stop,
                    extender.on_filter,
                    enable_consolidation(consolidation) if consolidation is not None else None,
                )
            )
        )
    if elector is not None:

        def changed(leader: bool) -> None:
            extender.metrics.set_leader(leader)
            if leader:
                view.resync()  # bind only on a ledger listed after the previous leader stopped
            else:
                view.drop_holds()

        elector.on_change = changed
        tasks.append(asyncio.ensure_future(elector.run(stop)))
    try:
        await serve(sites, stop)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await api.close()
