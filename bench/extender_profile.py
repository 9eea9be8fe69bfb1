"""Where the extender's time goes (issue 34): one pod's path through the extender, phase by phase, in CPU time.

Two measurements, each a subcommand:

``rig``     One pod's whole path as the kube-scheduler drives it, on a real control plane (../shared/k8s-rig): a
            kube-scheduler running the Helm chart's profile calls an extender served over mutual TLS (HTTP/2 by
            ALPN), which runs as ``sharegpu scheduler-extender`` does (uvloop, preemption on, INFO log) in a child
            process of this script, with timers around each phase; its Bindings go to the real API server and its
            informer follows the real watches. ``--standing`` pods are created first and kept (the extender's first
            pods: every shape new to it), then ``--rounds`` times ``--pods`` pods (small MPS shares of four tenants,
            whole GPUs, MIG instances) are created at once onto ``--nodes`` fake nodes (H100, A100, A30; some GPUs
            in MIG mode), bound, then deleted; then one round with cProfile on the filter and the bind-and-watch
            paths and one with cProfile on the extender's whole thread. Every round is audited for over-allocation
            and its FailedScheduling events are counted, by message.
``cycles``  Filter (+ prioritize) per scheduling cycle at cluster scale, in-process (the extender's ASGI app called
            directly, as ``bench/extender_bench.py --in-process`` does): the openb node list replicated to
            ``--scale`` nodes and filled to 60 % of its GPU capacity, then ``--cycles`` trace pods, phase by phase:
            filter then prioritize of the node it left (as extender_bench.py), filter alone (as the kube-scheduler
            calls it when one node is left), filter and prioritize without narrowing, and, with ``--out``, the
            filter-alone cycles under cProfile, warm and cold apart (each pass a fresh extender: its cold cycles are
            cold again).

    SHAREGPU_TEST_KUBECONFIG=/tmp/k8s-real/kubeconfig uv run python bench/extender_profile.py rig --out DIR
    uv run python bench/extender_profile.py cycles --scale 10000 --cycles 1000 --warmup 100 --out DIR

How it measures. Each phase's CPU is this thread's CPU clock (``time.thread_time``) read around it: around a
synchronous call (decoding the arguments, filter's parts, the ledger), and around every step of a coroutine (the
bind, the Binding's API request, each watch event read, hypercorn's connection and send tasks), so that what other
tasks run while it waits is not counted. A request's phases are attributed to its pod; a watch event to the pod it
carries. What no phase covers is the event loop's own work between the steps (socket reads and writes, TLS records,
aiohttp's response callbacks); it is reported as the rest of the extender thread's CPU over the round. Figures are
CPU milliseconds per pod: the median over the pods of the measured rounds, its p90, and the mean (the rounds' total
over their pods, which counts the rare costly pod, e.g. the first of a new shape). The garbage collector's runs are
timed too (``gc.callbacks``); they happen inside the phases. cProfile runs on the thread's CPU clock in rounds of its
own (it slows what it measures, Python call-heavy code most): its figures rank functions, they are not costs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import cProfile
import gc
import json
import math
import multiprocessing
import os
import pstats
import random
import re
import signal
import statistics
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
BENCH = HERE.parent
ROOT = BENCH.parent
DATA = ROOT.parent / "shared" / "data" / "openb"
SCHEDULER = "sharegpu-scheduler"

# ----- the meter: CPU per (pod, phase) ---------------------------------------------------------------------------------
now = time.thread_time


def timers(on: bool) -> None:
    """The meter's clock on, or off while cProfile runs (``float()`` is 0.0 and, being a type, no profiled call)."""
    global now
    now = time.thread_time if on else float


class Meter:
    """CPU seconds of this thread per pod and phase, and per phase for work that belongs to no pod."""

    def __init__(self) -> None:
        self.by_pod: dict[str, Counter[str]] = defaultdict(Counter)
        self.loose: Counter[str] = Counter()  # per round, no pod: node events, preemption, hypercorn's reads
        self.events: Counter[str] = Counter()  # watch events seen, by kind and type
        self.reads = 0  # clock reads made by the meter (its own cost)

    def add(self, key: str | None, phase: str, dt: float) -> None:
        if key is None:
            self.loose[phase] += dt
        else:
            self.by_pod[key][phase] += dt

    def take(self) -> dict[str, Any]:
        out = {"by_pod": {k: dict(v) for k, v in self.by_pod.items()}, "loose": dict(self.loose),
               "events": dict(self.events), "reads": self.reads, "gc": GC.take()}  # fmt: skip
        self.by_pod, self.loose, self.events, self.reads = defaultdict(Counter), Counter(), Counter(), 0
        return out


METER = Meter()


@dataclass
class Request:
    """One HTTP request to the extender: its verb, the pod it names (known once decoded), its phases' CPU."""

    verb: str
    key: str | None = None
    spent: Counter[str] = field(default_factory=Counter)


REQUEST: contextvars.ContextVar[Request | None] = contextvars.ContextVar("request", default=None)


class Profiles:
    """cProfile of chosen paths: ``fp`` (filter and prioritize requests, whole), ``bw`` (bind requests, watch events,
    their view updates); or one profile of the whole thread (``thread``), enabled from outside."""

    def __init__(self) -> None:
        self.on = False
        self.groups: dict[str, cProfile.Profile] = {}
        self.active = False

    def start(self) -> None:
        self.groups = {"fp": cpu_profile(), "bw": cpu_profile()}
        self.on = True

    def stop(self) -> dict[str, cProfile.Profile]:
        self.on = False
        out, self.groups = self.groups, {}
        return out

    def enter(self, group: str) -> cProfile.Profile | None:
        if not self.on or self.active:
            return None
        prof = self.groups.get(group)
        if prof is not None:
            self.active = True
            prof.enable()
        return prof

    def leave(self, prof: cProfile.Profile | None) -> None:
        if prof is not None:
            prof.disable()
            self.active = False


PROFILES = Profiles()


def cpu_profile() -> cProfile.Profile:
    """cProfile on this thread's CPU clock: its default, the wall clock, charges whatever function was running when
    the machine (2 shared cores) ran another process, or the thread waited."""
    return cProfile.Profile(time.thread_time)


class GcMeter:
    """CPU of the cyclic garbage collector's runs, by generation (``gc.callbacks``). Its runs happen inside whatever
    phase allocated: this is not a phase of its own but a part of the others."""

    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()
        self.cpu: Counter[str] = Counter()
        self._t = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t = time.thread_time()
        else:
            gen = f"gen {info['generation']}"
            self.runs[gen] += 1
            self.cpu[gen] += time.thread_time() - self._t

    def take(self) -> dict[str, Any]:
        out = {"runs": dict(self.runs), "cpu_s": dict(self.cpu)}
        self.runs, self.cpu = Counter(), Counter()
        return out


GC = GcMeter()


class Timed:
    """Await ``awaitable``, adding up this thread's CPU over its own steps only (not what runs while it waits);
    ``done(cpu_seconds, result)`` is called at the end (result None when it raised), ``step(cpu_seconds)`` after
    each step (for a task that lives across rounds). With ``group``, each step runs under that group's profile."""

    __slots__ = ("awaitable", "done", "group", "step")

    def __init__(
        self,
        awaitable: Awaitable[Any],
        done: Callable[[float, Any], None] | None = None,
        group: str = "",
        step: Callable[[float], None] | None = None,
    ) -> None:
        self.awaitable, self.done, self.group, self.step = awaitable, done, group, step

    def __await__(self) -> Generator[Any, Any, Any]:
        it = self.awaitable.__await__()
        spent = 0.0
        value: Any = None
        error: BaseException | None = None
        result: Any = None
        try:
            while True:
                prof = PROFILES.enter(self.group) if self.group else None
                t = now()
                try:
                    step = it.send(value) if error is None else it.throw(error)
                except StopIteration as stop:
                    result = stop.value
                    return result
                finally:
                    dt = now() - t
                    spent += dt
                    PROFILES.leave(prof)
                    METER.reads += 2
                    if self.step is not None:
                        self.step(dt)
                try:
                    value, error = (yield step), None
                except GeneratorExit:
                    it.close()
                    raise
                except BaseException as e:  # thrown into the awaited object, as await would
                    value, error = None, e
        finally:
            if self.done is not None:
                self.done(spent, result)


def timed_sync(fn: Callable[..., Any], phase: str, group: str = "", key_of: Callable[..., str | None] | None = None):
    """``fn`` with its CPU added to the current request's ``phase`` (or, outside a request, to the pod ``key_of``
    names, else to no pod)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        prof = PROFILES.enter(group) if group else None
        t = now()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = now() - t
            PROFILES.leave(prof)
            METER.reads += 2
            req = REQUEST.get()
            if req is not None:
                req.spent[phase.format(verb=req.verb)] += dt
            else:
                METER.add(key_of(*args, **kwargs) if key_of else None, phase.format(verb="outside a request"), dt)

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def request_add(phase: str) -> Callable[[float, Any], None]:
    def done(dt: float, _: Any) -> None:
        req = REQUEST.get()
        if req is not None:
            req.spent[phase.format(verb=req.verb)] += dt

    return done


def wrap_app(app: Any) -> Any:
    """The extender's ASGI app, each HTTP request's phases metered (the receive and send callables hypercorn gives:
    reading the body from its queue, and writing the answer as HTTP/2 frames through TLS)."""

    async def metered(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await app(scope, receive, send)
            return
        verb = scope["path"].strip("/")
        req = Request(verb)
        token = REQUEST.set(req)

        async def timed_receive() -> Any:
            return await Timed(receive(), request_add(f"{verb}: receive body"))

        async def timed_send(message: Any) -> None:
            await Timed(send(message), request_add(f"{verb}: send answer"))

        def done(dt: float, _: Any) -> None:
            req.spent[f"{verb}: request"] += dt
            for phase, cpu in req.spent.items():
                METER.add(req.key, phase, cpu)

        group = "bw" if verb == "bind" else "fp"
        try:
            await Timed(app(scope, timed_receive, timed_send), done, group)
        finally:
            REQUEST.reset(token)

    metered.routes = getattr(app, "routes", [])  # type: ignore[attr-defined]
    return metered


def instrument(view: Any = None, api: Any = None) -> None:
    """Put the meter's timers around the extender's phases (class attributes here, in this process only; and on
    ``view`` and ``api``, the instances the informer and the binder call)."""
    from sharegpu.k8s.extender import binding, decisions, server
    from sharegpu.k8s.extender.decisions import Decisions
    from sharegpu.k8s.extender.metrics import ClusterMetrics
    from sharegpu.kube.schema import ExtenderArgs, ExtenderBindingArgs

    if GC not in gc.callbacks:
        gc.callbacks.append(GC)

    def decoder(model: Any, verb_of: Callable[[Any], str], key_of: Callable[[Any], str]) -> None:
        original = model.model_validate_json.__func__

        def validate_json(cls: Any, data: Any, *a: Any, **k: Any) -> Any:
            t = now()
            out = original(cls, data, *a, **k)
            dt = now() - t
            METER.reads += 2
            req = REQUEST.get()
            if req is not None:
                req.key = key_of(out)
                req.spent[f"{req.verb}: decode args"] += dt
                CAPTURE.keep(req.verb, data)
            return out

        model.model_validate_json = classmethod(validate_json)

    decoder(ExtenderArgs, lambda a: "filter", lambda a: a.Pod.key)
    decoder(ExtenderBindingArgs, lambda a: "bind", lambda a: f"{a.PodNamespace}/{a.PodName}")

    from sharegpu.k8s.extender.server import Extender

    Extender.filter_answer = timed_sync(Extender.filter_answer, "filter: handler")  # type: ignore[method-assign]
    Extender.prioritize_answer = timed_sync(Extender.prioritize_answer, "prioritize: handler")  # type: ignore[method-assign]
    Decisions._feasibility = timed_sync(Decisions._feasibility, "{verb}: feasibility (per-shape filter)")  # type: ignore[method-assign]
    Decisions._choose = timed_sync(Decisions._choose, "{verb}: scores and pick")  # type: ignore[method-assign]
    Decisions._hold = timed_sync(Decisions._hold, "{verb}: hold (GPU choice, ledger)")  # type: ignore[method-assign]
    if hasattr(decisions, "pod_request"):  # trees before issue 34's cut 2 parse the pod in filter and in bind
        decisions.pod_request = timed_sync(decisions.pod_request, "{verb}: pod_request")
        binding.pod_request = timed_sync(binding.pod_request, "{verb}: pod_request")
    ClusterMetrics.record = timed_sync(ClusterMetrics.record, "{verb}: metrics record")  # type: ignore[method-assign]

    original_bind = Extender.bind

    async def bind(self: Any, args: Any) -> Any:
        return await Timed(original_bind(self, args), request_add("bind: handler"))

    Extender.bind = bind  # type: ignore[method-assign]

    original_make_app = server.make_app

    def make_app(*a: Any, **k: Any) -> Any:
        return wrap_app(original_make_app(*a, **k))

    server.make_app = make_app

    if view is not None:
        if hasattr(view, "request_of"):  # since issue 34's cut 2: the view's kept request, read again only if changed
            view.request_of = timed_sync(view.request_of, "{verb}: pod_request")
        view.reserve = timed_sync(view.reserve, "{verb}: ledger reserve and settle")
        view.settle = timed_sync(view.settle, "{verb}: ledger reserve and settle")
        pod_apply = view.apply_pod
        node_apply = view.apply_node

        def apply_pod(event: str, pod: Any) -> None:
            prof = PROFILES.enter("bw")
            t = now()
            try:
                pod_apply(event, pod)
            finally:
                dt = now() - t
                PROFILES.leave(prof)
                METER.reads += 2
                METER.add(pod.key, f"watch: view and ledger apply ({PHASE[0]})", dt)

        def apply_node(event: str, node: Any) -> None:
            prof = PROFILES.enter("bw")
            t = now()
            try:
                node_apply(event, node)
            finally:
                PROFILES.leave(prof)
                METER.add(None, "node watch: view and ledger apply", now() - t)

        view.apply_pod, view.apply_node = apply_pod, apply_node
    if api is not None:
        api.bind_pod = _timed_coroutine(api.bind_pod, "bind: Binding API write (lightkube, aiohttp, TLS)")
        api.watch_pods = _timed_watch(api.watch_pods, "pod")
        api.watch_nodes = _timed_watch(api.watch_nodes, "node")


PHASE = ["create"]  # which half of a pod's life the watch events belong to: "create" (until bound) or "delete"


def _timed_coroutine(fn: Callable[..., Awaitable[Any]], phase: str) -> Callable[..., Awaitable[Any]]:
    async def wrapper(*a: Any, **k: Any) -> Any:
        return await Timed(fn(*a, **k), request_add(phase))

    return wrapper


def _timed_watch(fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
    """A watch whose every event's read (the HTTP stream's lines, json.loads, the pydantic model) is metered and
    attributed to the object it carries."""

    async def watch(*a: Any, **k: Any) -> Any:
        events = fn(*a, **k)
        try:
            while True:
                got: list[Any] = []

                def done(dt: float, item: Any, got: list[Any] = got) -> None:
                    got.append(dt)

                try:
                    item = await Timed(events.__anext__(), done, "bw")
                except StopAsyncIteration:
                    return
                event, obj = item
                METER.events[f"{kind} {event}"] += 1
                if kind == "pod":
                    METER.add(obj.key, f"watch: read and decode event ({PHASE[0]})", got[0])
                else:
                    METER.add(None, "node watch: read and decode event", got[0])
                yield item
        finally:
            await events.aclose()

    return watch


class Capture:
    """A few of the request bodies the kube-scheduler sent, for the decoding figures afterwards."""

    def __init__(self, keep: int = 300) -> None:
        self.bodies: dict[str, list[bytes]] = defaultdict(list)
        self.limit = keep

    def keep(self, verb: str, body: Any) -> None:
        kept = self.bodies[verb]
        if len(kept) < self.limit and isinstance(body, (bytes, bytearray)):
            kept.append(bytes(body))


CAPTURE = Capture()


# ----- the extender in a child process (rig) ------------------------------------------------------------------------
def extender_child(
    conn: Any, kubeconfig: str, port: int, pki: tuple[str, str, str], log_file: str, max_requests: int = 0
) -> None:
    """Serve the extender as ``sharegpu scheduler-extender`` does (uvloop, mutual TLS offering HTTP/2, preemption on,
    INFO logging into a file), instrumented; answer the bench's commands on ``conn``."""
    # bench/ is first on the path of a script run from it: none of its scripts may shadow a package the extender
    # imports (bench/priority.py once shadowed hypercorn's ``priority``; it is bench/priority_replay.py now).
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
    import logging

    import uvloop

    from sharegpu.k8s.cache.view import ClusterView
    from sharegpu.k8s.controllers.preemption import PreemptionConfig
    from sharegpu.k8s.extender import server
    from sharegpu.k8s.serving import server as serving
    from sharegpu.k8s.serving.tls import ServerTls
    from sharegpu.kube.api import LightkubeClusterApi
    from sharegpu.kube.kubeconfig import quiet_http_logging

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", filename=log_file, filemode="w"
    )
    quiet_http_logging()
    if max_requests:
        # hypercorn ends an HTTP/2 connection after keep_alive_max_requests (1,000) requests, with the scheduler's
        # requests still in flight on it; they fail (FailedScheduling: "server sent GOAWAY ... PROTOCOL_ERROR") and
        # the pods are retried. A bench of the path without those retries raises the limit (not the product).
        from hypercorn.config import Config

        Config.keep_alive_max_requests = max_requests
    view = ClusterView(scheduler_name=SCHEDULER)
    api = LightkubeClusterApi(Path(kubeconfig))
    instrument(view, api)

    original_preemption = server.run_preemption

    def run_preemption(*a: Any, **k: Any) -> Awaitable[Any]:
        return Timed(original_preemption(*a, **k), step=lambda dt: METER.add(None, "preemption controller", dt))

    server.run_preemption = run_preemption
    # The connection handler the serving module calls: its own subclass since issue 34's direct HTTP/2 answers.
    handler = "_TCPServer" if hasattr(serving, "_TCPServer") else "TCPServer"
    original_tcp = getattr(serving, handler)

    def tcp_server(*a: Any, **k: Any) -> Awaitable[Any]:
        def step(dt: float) -> None:
            METER.add(None, "HTTP/2 connection task (hypercorn: frames read, streams)", dt)

        return Timed(_Steps(original_tcp(*a, **k)), step=step)

    setattr(serving, handler, tcp_server)
    from hypercorn.protocol.h2 import H2Protocol

    original_send_task = H2Protocol.send_task

    async def send_task(self: Any) -> None:
        def step(dt: float) -> None:
            METER.add(None, "HTTP/2 send task (hypercorn: data frames, TLS writes)", dt)

        await Timed(original_send_task(self), step=step)

    H2Protocol.send_task = send_task  # type: ignore[method-assign]
    cert, key, ca = pki

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        profile: list[cProfile.Profile] = []

        # The steps of hypercorn's connection task are metered while it runs; split its long life into the rounds
        # by reading the meter's totals (they are only added when the connection ends): the bench reads the
        # thread's clock and subtracts what the phases took instead.
        async def handle(msg: tuple[Any, ...]) -> Any:
            what = msg[0]
            if what == "synced":
                deadline = time.monotonic() + msg[1]
                while not view.synced and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                return view.synced
            if what == "take":  # the meter since the last take, and the clocks
                PHASE[0] = msg[1]
                return {"meter": METER.take(), "thread_cpu": time.thread_time(), "process_cpu": time.process_time()}
            if what == "wait":  # until the view holds n pods of this round bound (n=0: none of them at all)
                prefix, n, timeout = msg[1] + "-", msg[2], msg[3]
                deadline = time.monotonic() + timeout
                while True:
                    t = now()
                    pods = [p for p in view.pods() if p.metadata.name.startswith(prefix)]
                    got = sum(1 for p in pods if p.spec.node_name) if n else len(pods)
                    METER.add(None, "bench: waiting on the view (not the extender's)", now() - t)
                    if (n and got >= n) or (not n and not pods) or time.monotonic() > deadline:
                        return got
                    await asyncio.sleep(0.05)
            if what == "profile":
                timers(False)
                if msg[1] == "groups":
                    PROFILES.start()
                elif msg[1] == "thread":
                    profile.append(cpu_profile())
                    profile[-1].enable()
                return True
            if what == "dump":  # stop profiling; write the profiles into the folder given
                folder = Path(msg[1])
                folder.mkdir(parents=True, exist_ok=True)
                written = []
                for name, prof in PROFILES.stop().items():
                    prof.dump_stats(str(folder / f"{name}.prof"))
                    written.append(name)
                while profile:
                    prof = profile.pop()
                    prof.disable()
                    prof.dump_stats(str(folder / "thread.prof"))
                    written.append("thread")
                timers(True)
                return written
            if what == "bodies":
                return dict(CAPTURE.bodies)
            if what == "stop":
                stop.set()
                return True
            raise ValueError(what)

        def commands() -> None:
            # A thread of its own that blocks on the pipe (the event loop would make the pipe non-blocking, and a
            # large answer would then fail to be written); the commands run on the loop.
            while True:
                msg = conn.recv()
                try:
                    conn.send(("ok", asyncio.run_coroutine_threadsafe(handle(msg), loop).result()))
                except Exception as e:  # the bench reports it
                    conn.send(("error", f"{type(e).__name__}: {e}"))
                if msg[0] == "stop":
                    return

        threading.Thread(target=commands, daemon=True).start()
        tls = ServerTls(Path(cert), Path(key), Path(ca))
        await server.run_extender(
            view, api, "127.0.0.1", port, stop=stop, scheduler_name=SCHEDULER, tls=tls,
            preemption=(PreemptionConfig(interval_s=2.0), api), **_as_the_cli(server.run_extender),
        )  # fmt: skip

    uvloop.run(main())


def _as_the_cli(run_extender: Callable[..., Any]) -> dict[str, Any]:
    """The options ``sharegpu scheduler-extender`` gives ``run_extender`` beyond the bench's own, where the code being
    measured has them (the bench also measures older trees, exported with ``git archive``)."""
    import inspect

    return {"freeze_heap": True} if "freeze_heap" in inspect.signature(run_extender).parameters else {}


class _Steps:
    """An awaitable whose ``__await__`` is the object's (hypercorn's TCPServer is awaited, not a coroutine)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __await__(self) -> Generator[Any, Any, Any]:
        return self.obj.__await__()


class Child:
    def __init__(
        self, kubeconfig: str, port: int, pki: tuple[str, str, str], log_file: Path, max_requests: int = 0
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        args = (theirs, kubeconfig, port, pki, str(log_file), max_requests)
        self.proc = ctx.Process(target=extender_child, args=args)
        self.proc.start()

    def ask(self, *msg: Any, timeout: float = 600) -> Any:
        self.conn.send(msg)
        if not self.conn.poll(timeout):
            raise SystemExit(f"the extender did not answer {msg[0]} within {timeout:g}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise SystemExit(f"the extender failed {msg[0]}: {value}")
        return value

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(SystemExit, OSError):
                self.ask("stop", timeout=30)
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(10)


# ----- the rig's cluster and pods ----------------------------------------------------------------------------------
NODE_SHAPES = (  # (suffix, GPU model, GPUs, GPUs in MIG mode pinned by an administrator, share of the nodes)
    ("h100", "H100-80GB", 8, 1, 5),
    ("a100", "A100-80GB", 8, 0, 5),
    ("a30", "A30-24GB", 4, 0, 2),
)
TENANTS = 4


def node_specs(prefix: str, n: int) -> list[Any]:
    from sharegpu.model.inventory import GpuDevice, NodeSpec

    weights = [w for *_, w in NODE_SHAPES]
    specs = []
    for i in range(n):
        suffix, model, count, pinned, _ = NODE_SHAPES[_pick(i, weights)]
        name = f"{prefix}-{suffix}-{i:04d}"
        gpus = tuple(
            GpuDevice(g, f"GPU-{name}-{g}", model, mig_enabled=g >= count - pinned, mig_pinned=g >= count - pinned)
            for g in range(count)
        )
        specs.append(NodeSpec(name, 64000, 262144, gpus))
    return specs


def _pick(i: int, weights: list[int]) -> int:
    r = i % sum(weights)
    for k, w in enumerate(weights):
        if r < w:
            return k
        r -= w
    return 0


def pod_mix(round_name: str, n: int, seed: int) -> list[tuple[int, dict[str, Any]]]:
    """(tenant, pod) × n: 60 % small MPS shares (2Gi 5 % or 4Gi 10 %), 20 % whole GPUs, 20 % MIG instances (10Gi,
    isolation hardware); each tenant is a namespace and a Unix user (runAsUser), as MPS tenancy reads them."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        tenant = rng.randrange(TENANTS)
        r = rng.random()
        ann: dict[str, str] = {}
        if r < 0.6:
            kind = "mps"
            mem, pct = rng.choice([("2Gi", "5"), ("4Gi", "10")])
            limits = {"sharegpu.io/gpu": "1", "sharegpu.io/gpu-memory": mem, "sharegpu.io/gpu-compute": pct}
            ann["sharegpu.io/isolation"] = "memory"
        elif r < 0.8:
            kind = "whole"
            limits = {"sharegpu.io/gpu": "1"}
        else:
            kind = "mig"
            limits = {"sharegpu.io/gpu": "1", "sharegpu.io/gpu-memory": "10Gi"}
            ann["sharegpu.io/isolation"] = "hardware"
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{round_name}-{kind}-{i:04d}", "annotations": ann},
            "spec": {
                "schedulerName": SCHEDULER,
                "securityContext": {"runAsUser": 1000 + tenant},
                "restartPolicy": "Never",
                "containers": [
                    {
                        "name": "main",
                        "image": "registry.example/app:1",
                        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": limits},
                    }
                ],
            },
        }
        out.append((tenant, pod))
    return out


# ----- reporting ---------------------------------------------------------------------------------------------------------
def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))]


HANDLER_PARTS = {
    "filter": ("pod_request", "feasibility (per-shape filter)", "scores and pick"),
    "prioritize": ("pod_request", "feasibility (per-shape filter)", "scores and pick"),
    "bind": ("pod_request", "ledger reserve and settle", "Binding API write (lightkube, aiohttp, TLS)"),
}
HANDLER_REST = {"filter": "handler rest (names, answer body)", "prioritize": "handler rest (names, answer body)",
                "bind": "handler rest (checks, pod lookup, log line)"}  # fmt: skip
REQUEST_PARTS = ("receive body", "decode args", "handler", "send answer", "metrics record")
REQUEST_REST = "Starlette, middleware, rest"


def derive(phases: dict[str, float]) -> dict[str, float]:
    """A pod's phases, with the remainder of each level computed: a request's CPU less its parts, a handler's less
    its parts; "scores and pick" without the hold it makes."""
    out = dict(phases)
    for verb, parts in HANDLER_PARTS.items():
        whole = phases.get(f"{verb}: request")
        if whole is not None:
            out[f"{verb}: {REQUEST_REST}"] = whole - sum(phases.get(f"{verb}: {p}", 0.0) for p in REQUEST_PARTS)
        h = phases.get(f"{verb}: handler")
        if h is not None:
            out[f"{verb}: {HANDLER_REST[verb]}"] = h - sum(phases.get(f"{verb}: {p}", 0.0) for p in parts)
        if f"{verb}: scores and pick" in phases:
            out[f"{verb}: scores and pick"] -= phases.get(f"{verb}: hold (GPU choice, ledger)", 0.0)
    return out


ORDER: list[str] = []
SUB: set[str] = set()
for _verb, _parts in HANDLER_PARTS.items():
    _subs = [*_parts, *(("hold (GPU choice, ledger)",) if _verb != "bind" else ()), HANDLER_REST[_verb]]
    ORDER += [f"{_verb}: {x}" for x in ("request", "receive body", "decode args", "handler")]
    ORDER += [f"{_verb}: {x}" for x in _subs]
    SUB |= {f"{_verb}: {x}" for x in _subs}
    ORDER += [f"{_verb}: {x}" for x in ("send answer", "metrics record", REQUEST_REST)]
ORDER += [f"watch: {x} ({h})" for h in ("create", "delete") for x in ("read and decode event", "view and ledger apply")]
TOP_LEVEL = {"filter: request", "prioritize: request", "bind: request"}


def phase_table(pods: list[dict[str, float]], n_pods: int, title: str) -> list[dict[str, Any]]:
    rows = []
    seen = set().union(*(p.keys() for p in pods)) if pods else set()
    names = [p for p in ORDER if p in seen] + sorted(seen - set(ORDER))
    for name in names:
        values = [1000 * p.get(name, 0.0) for p in pods]
        mean = sum(values) / max(1, n_pods)
        rows.append({"phase": name, "median_ms": statistics.median(values), "p90_ms": pct(values, 90), "mean_ms": mean})
    print(f"\n{title}")
    print(f"{'phase':<58} {'median':>8} {'p90':>8} {'mean':>8}   (CPU ms per pod)")
    for r in rows:
        indent = "" if r["phase"] in TOP_LEVEL else ("      " if r["phase"] in SUB else "   ")
        print(f"{indent + r['phase']:<58} {r['median_ms']:8.3f} {r['p90_ms']:8.3f} {r['mean_ms']:8.3f}")
    return rows


# The call chain every request or event goes through (ASGI middleware and routing, the coroutines' resumption, the
# event loop): in a list by cumulative time they would fill the top rows and say nothing.
CHAIN = (
    "starlette/",
    "bench/extender_bench",
    "hypercorn/app_wrappers",
    "hypercorn/asyncio/task_group",
    "serving/body_limit",
    "asyncio/events",
    "asyncio/base_events",
    "asyncio/runners",
    "asyncio/tasks",
)
CHAIN_FUNCS = ("<method 'send' of 'coroutine_wrapper' objects>", "<method 'throw' of 'coroutine_wrapper' objects>",
               "<built-in method builtins.exec>", "<method 'run' of '_contextvars.Context' objects>")  # fmt: skip


def print_top(prof_file: Path, title: str, n: int, sort: str = "cumulative") -> list[dict[str, Any]]:
    """The top ``n`` functions of a profile by cumulative (or own) time; this script's wrappers are left out, and
    from the cumulative list the call chain (:data:`CHAIN`) and whatever encloses 85 % or more of the profile."""
    st = pstats.Stats(str(prof_file))
    total = st.total_tt  # type: ignore[attr-defined]
    rows = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        if file == str(HERE) or func in CHAIN_FUNCS:
            continue
        if sort == "cumulative" and (any(c in file for c in CHAIN) or ct >= 0.85 * total):
            continue
        rows.append({"function": _short(file, line, func), "calls": nc, "own_s": tt, "cumulative_s": ct})
    key = "cumulative_s" if sort == "cumulative" else "own_s"
    rows.sort(key=lambda r: -r[key])
    rows = rows[:n]
    print(f"\n{title} (profiled total {total:.3f} s; by {sort} time)")
    print(f"{'cumul %':>8} {'own %':>7} {'calls':>8}  function")
    for r in rows:
        print(
            f"{100 * r['cumulative_s'] / total:8.1f} {100 * r['own_s'] / total:7.1f} {r['calls']:>8}  {r['function']}"
        )
        r["cumulative_pct"] = round(100 * r["cumulative_s"] / total, 1)
        r["own_pct"] = round(100 * r["own_s"] / total, 1)
    return rows


def _short(file: str, line: int, func: str) -> str:
    for marker in ("site-packages/", "/src/", "lib/python3"):
        if marker in file:
            file = file.split(marker, 1)[1]
            break
    return f"{func} ({file}:{line})" if file != "~" else func


# ----- rig ---------------------------------------------------------------------------------------------------------------
def run_rig(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "tests" / "k8s"))
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(BENCH))
    from lightkube.resources.core_v1 import Node as KNode
    from lightkube.resources.core_v1 import Pod as KPod
    from rig import KUBECONFIG, Rig, audit

    from k8s_throughput import BoundWatch, cpu_s
    from proc_helpers import free_port

    if not KUBECONFIG:
        raise SystemExit("set SHAREGPU_TEST_KUBECONFIG to a running k8s-rig's kubeconfig (see ../shared/k8s-rig)")
    out_dir = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"rounds": []}
    with Rig.open() as rig:
        started = time.perf_counter()
        specs = node_specs(rig.prefix, args.nodes)
        for s in specs:
            rig.add_node(s.name.removeprefix(rig.prefix + "-"), [], agent=False, inventory=s)
        print(
            f"{len(specs)} nodes, {sum(len(s.gpus) for s in specs)} GPUs made in {time.perf_counter() - started:.1f} s"
        )
        namespaces = [rig.namespace(f"{rig.prefix}-t{t}") for t in range(TENANTS)]
        port = free_port()
        pki = rig.pki
        pair = (str(pki.server_crt), str(pki.server_key), str(pki.ca))
        child = Child(str(rig.kubeconfig), port, pair, out_dir / "extender.log", args.keep_alive_max_requests)
        try:
            if not child.ask("synced", 120):
                raise SystemExit("the extender's view did not sync")
            sched = rig.start_scheduler(f"https://127.0.0.1:{port}")
            pids = {"kube-scheduler (chart)": sched.p.pid,
                    "kube-apiserver": int((rig.k8s_real / "pids" / "kube-apiserver.pid").read_text())}  # fmt: skip
            time.sleep(2.0)  # the scheduler's caches hold every node
            # First the pods that stay (the cluster's standing load, and the extender's first pods: every shape new
            # to it), then the measured rounds on top of them, each deleted again, then the profiled rounds.
            plan = [("s", args.standing, "", True)] if args.standing else []
            plan += [(f"r{k + 1}", args.pods, "", False) for k in range(args.rounds)]
            if args.profile_pods:
                plan += [("pg", args.profile_pods, "groups", False), ("pt", args.profile_pods, "thread", False)]
            for round_name, n, profile, keep in plan:
                r = one_round(
                    rig, child, round_name, n, namespaces, profile, pids, out_dir, args, BoundWatch, cpu_s, KPod,
                    KNode, audit, keep,
                )  # fmt: skip
                report["rounds"].append(r)
            bodies = child.ask("bodies")
        finally:
            child.close()
    # A hundred filter bodies as the kube-scheduler sent them, kept beside the profiles.
    (out_dir / "filter-bodies.jsonl").write_bytes(b"\n".join((bodies.get("filter") or [])[:100]) + b"\n")
    report["decode"] = decode_costs(bodies)
    report["components"] = component_costs(bodies, Path(KUBECONFIG))
    summarize_rig(report, args)
    return report


def one_round(rig: Any, child: Child, name: str, n: int, namespaces: list[str], profile: str, pids: dict[str, int],
              out_dir: Path, args: argparse.Namespace, BoundWatch: Any, cpu_s: Any, KPod: Any, KNode: Any,
              audit: Any, keep: bool = False) -> dict[str, Any]:  # fmt: skip
    """Create ``n`` pods at once, wait until all are bound (and seen bound by the extender), then delete them one by
    one (16 at a time, as pods that finish) unless ``keep``; the extender's meter is taken after each half."""
    mix = pod_mix(name, n, args.seed + len(name) * 7919 + sum(map(ord, name)))
    per_ns = Counter(t for t, _ in mix)
    watches = {t: BoundWatch(rig, namespaces[t], per_ns[t]) for t in per_ns}
    if profile:
        child.ask("profile", profile)
    start = child.ask("take", "create")
    cpu0 = {k: cpu_s(p) for k, p in pids.items()}
    created: dict[str, float] = {}
    models = [(namespaces[t], KPod.from_dict(p)) for t, p in mix]

    def create(item: tuple[str, Any]) -> None:
        ns, pod = item
        created[f"{ns}/{pod.metadata.name}"] = time.perf_counter()
        rig.client.create(pod, namespace=ns)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(create, models))
    for t, w in watches.items():
        while not w.done.wait(1.0) and child.proc.is_alive() and time.perf_counter() - t0 < 300:
            pass
        if not child.proc.is_alive():
            raise SystemExit(f"round {name}: the extender exited (its log: {out_dir / 'extender.log'})")
        if not w.done.is_set():
            raise SystemExit(f"round {name}: only {len(w.bound)}/{per_ns[t]} pods of {namespaces[t]} bound in 300 s")
    wall = max(w.last for w in watches.values()) - t0
    child.ask("wait", name, n, 60)
    bound = child.ask("take", "delete")
    cpu1 = {k: cpu_s(p) for k, p in pids.items()}
    to_bind = [w.bound[k.split("/", 1)[1]] - created[k] for t, w in watches.items() for k in created
               if k.startswith(namespaces[t] + "/") and k.split("/", 1)[1] in w.bound]  # fmt: skip
    why: Counter[str] = Counter()
    for ns in namespaces:
        for e in rig.events(ns):
            if e.get("reason") == "FailedScheduling" and e["involvedObject"]["name"].startswith(name + "-"):
                # One event per pod and message, counted again on repeats; ports and stream IDs vary.
                text = re.sub(
                    r"127\.0\.0\.1:\d+", "EXTENDER", re.sub(r"LastStreamID=\d+", "LastStreamID=N", e["message"])
                )
                why[text[:160]] += int(e.get("count") or 1)
    refused = sum(why.values())
    nodes = [x.to_dict() for x in rig.client.list(KNode, labels={"sharegpu-test/rig": rig.prefix})]
    pods = [p for ns in namespaces for p in rig.pods(ns)]
    result = audit(nodes, pods)  # every pod bound so far, this round's and those kept from before
    ours = sum(1 for p in pods if p["metadata"]["name"].startswith(name + "-") and p["spec"].get("nodeName"))
    deleted = bound
    if not keep:

        def delete(item: tuple[str, Any]) -> None:
            rig.client.delete(KPod, item[1].metadata.name, namespace=item[0], grace_period=0)

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(delete, models))
        child.ask("wait", name, 0, 120)
        deleted = child.ask("take", "create")
    written = child.ask("dump", str(out_dir / f"profile-{name}")) if profile else []
    r = {
        "round": name, "pods": n, "profile": profile, "wall_s": round(wall, 2), "pods_per_s": round(n / wall, 1),
        "create_to_bind_p50_ms": round(1000 * statistics.median(to_bind), 1),
        "create_to_bind_p99_ms": round(1000 * pct(to_bind, 99), 1),
        "failed_scheduling_events": refused, "failed_scheduling_why": dict(why.most_common(5)), "bound": ours, "bound_in_cluster": result.bound,
        "over_allocations": len(result.findings), "kept": keep,
        "cpu_ms_per_pod_other": {k: round(1000 * (cpu1[k] - cpu0[k]) / n, 2) for k in pids},
        "bind_half": bound, "delete_half": None if keep else deleted, "profiles": written, "load_average": os.getloadavg(),
        "thread_cpu_bind_s": bound["thread_cpu"] - start["thread_cpu"],
        "thread_cpu_delete_s": deleted["thread_cpu"] - bound["thread_cpu"],
        "process_cpu_bind_s": bound["process_cpu"] - start["process_cpu"],
        "process_cpu_delete_s": deleted["process_cpu"] - bound["process_cpu"],
    }  # fmt: skip
    print(
        f"round {name}: {n} pods, {r['pods_per_s']} pods/s, create->bind p50 {r['create_to_bind_p50_ms']} ms "
        f"p99 {r['create_to_bind_p99_ms']} ms, bound {ours} (cluster {result.bound}), over-allocations "
        f"{len(result.findings)}, "
        f"FailedScheduling {refused}{', profiled: ' + profile if profile else ''}",
        flush=True,
    )
    for text, count in why.most_common(3):
        print(f"    FailedScheduling x{count}: {text}")
    return r


POD_TOP = ("filter: request", "prioritize: request", "bind: request", *ORDER[-4:])


def pooled(selected: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds' pods (each pod's phases over both halves), their per-round work and the thread's CPU."""
    pods: list[dict[str, float]] = []
    n = 0
    loose: dict[str, Counter[str]] = {"bind half": Counter(), "delete half": Counter()}
    events: Counter[str] = Counter()
    thread = process = 0.0
    reads = 0
    gc_cpu: Counter[str] = Counter()
    gc_runs: Counter[str] = Counter()
    for r in selected:
        merged: dict[str, Counter[str]] = defaultdict(Counter)
        for half, label in (("bind_half", "bind half"), ("delete_half", "delete half")):
            if r[half] is None:
                continue
            m = r[half]["meter"]
            for gen, cpu in m["gc"]["cpu_s"].items():
                gc_cpu[gen] += cpu
                gc_runs[gen] += m["gc"]["runs"][gen]
            loose[label].update(m["loose"])
            events.update({f"{k} ({label})": v for k, v in m["events"].items()})
            reads += m["reads"]
            for key, ph in m["by_pod"].items():
                merged[key].update(ph)
        pods += [derive(dict(v)) for v in merged.values()]
        n += r["pods"]
        thread += r["thread_cpu_bind_s"] + (0.0 if r["kept"] else r["thread_cpu_delete_s"])
        process += r["process_cpu_bind_s"] + (0.0 if r["kept"] else r["process_cpu_delete_s"])
    return {"pods": pods, "n": n, "loose": loose, "events": events, "thread": thread, "process": process,
            "reads": reads, "gc_cpu": gc_cpu, "gc_runs": gc_runs}  # fmt: skip


def summarize_rig(report: dict[str, Any], args: argparse.Namespace) -> None:
    """Per phase, CPU ms per pod: the first round (every shape new to the extender) apart from the later ones."""
    rounds = report["rounds"]
    summaries = []
    clock_ns = _clock_cost_ns()
    first = [r for r in rounds if r["kept"]]
    later = [r for r in rounds if not r["kept"] and not r["profile"]]
    for label, selected in (("the extender's first pods (kept; every shape new to it; no delete half)", first),
                            ("later rounds on top of them (created, bound, deleted)", later)):  # fmt: skip
        if not selected:
            continue
        p = pooled(selected)
        n = p["n"]
        rows = phase_table(p["pods"], n, f"Extender CPU per pod, {label}: {len(selected)} round(s), {n} pods")
        print(f"\n{'per round, no pod (CPU ms per pod)':<62} {'bind half':>9} {'delete':>8} {'both':>8}")
        names = sorted(set(p["loose"]["bind half"]) | set(p["loose"]["delete half"]),
                       key=lambda k: -(p["loose"]["bind half"][k] + p["loose"]["delete half"][k]))  # fmt: skip
        loose_rows = {}
        for k in names:
            b, d = (1000 * p["loose"][h][k] / n for h in ("bind half", "delete half"))
            loose_rows[k] = b + d
            print(f"{k:<62} {b:9.3f} {d:8.3f} {b + d:8.3f}")
        harness = sum(v for k, v in loose_rows.items() if k.startswith("bench:"))
        per_pod = sum(1000 * sum(x.get(ph, 0.0) for ph in POD_TOP) for x in p["pods"]) / n
        attributed = per_pod + sum(v for k, v in loose_rows.items() if not k.startswith("bench:"))
        total = 1000 * p["thread"] / n - harness
        rest = total - attributed
        print(f"{'event loop rest (socket I/O, TLS records, callbacks, GC)':<62} {'':>9} {'':>8} {rest:8.3f}")
        print(f"{'TOTAL: the extender thread, create to bound to deleted':<62} {'':>9} {'':>8} {total:8.3f}")
        print(f"{'  (its process, all threads)':<62} {'':>9} {'':>8} {1000 * p['process'] / n - harness:8.3f}")
        meter = p["reads"] / n * clock_ns / 1e6
        gc_text = ", ".join(
            f"{g}: {1000 * p['gc_cpu'][g] / n:.3f} ms ({p['gc_runs'][g]} runs)" for g in sorted(p["gc_cpu"])
        )
        print(f"of which the garbage collector (inside the phases above, not besides them): {gc_text or 'none'}")
        print(
            f"the meter itself: {p['reads'] / n:.0f} clock reads per pod, {clock_ns:.0f} ns each: {meter:.3f} ms per pod"
        )
        print("watch events per pod: " + ", ".join(f"{k} {v / n:.2f}" for k, v in sorted(p["events"].items())))
        per_round = []
        for r in selected:
            q = pooled([r])
            h = sum(v for k, v in q["loose"]["bind half"].items() if k.startswith("bench:"))
            h += sum(v for k, v in q["loose"]["delete half"].items() if k.startswith("bench:"))
            per_round.append({
                "round": r["round"], "total_ms_per_pod": 1000 * (q["thread"] - h) / q["n"],
                **{f"median {ph}": 1000 * statistics.median(x.get(ph, 0.0) for x in q["pods"]) for ph in POD_TOP},
            })  # fmt: skip
        if len(per_round) > 1:
            print("per round (spread): " + "; ".join(
                f"{x['round']}: total {x['total_ms_per_pod']:.2f}, filter {x['median filter: request']:.2f}, "
                f"bind {x['median bind: request']:.2f}" for x in per_round))  # fmt: skip
        summaries.append({"label": label, "pods": n, "rows": rows, "loose_ms_per_pod": loose_rows,
                          "event_loop_rest_ms_per_pod": rest, "total_ms_per_pod": total,
                          "process_ms_per_pod": 1000 * p["process"] / n - harness, "meter_ms_per_pod": meter,
                          "events_per_pod": {k: v / n for k, v in p["events"].items()}, "per_round": per_round,
                          "gc_ms_per_pod": {g: 1000 * v / n for g, v in p["gc_cpu"].items()},
                          "gc_runs": dict(p["gc_runs"])})  # fmt: skip
    report["summary"] = summaries
    for r in rounds:
        d = args.out / f"profile-{r['round']}"
        if r["profile"] == "groups":
            report["top_filter_path"] = print_top(d / "fp.prof", "filter requests, whole", args.top)
            report["top_filter_path_own"] = print_top(d / "fp.prof", "filter requests, whole", args.top, "own")
            report["top_bind_watch"] = print_top(d / "bw.prof", "bind requests + the pods' watch events", args.top)
            report["top_bind_watch_own"] = print_top(d / "bw.prof", "bind requests + watch events", args.top, "own")
        if r["profile"] == "thread":
            report["top_thread"] = print_top(d / "thread.prof", "the extender's whole thread", args.top)
            report["top_thread_own"] = print_top(d / "thread.prof", "the extender's whole thread", args.top, "own")


def _clock_cost_ns() -> float:
    """What one read of the meter's clock costs here (median of five runs of 100,000)."""
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(100_000):
            time.thread_time()
        runs.append((time.perf_counter() - t) / 100_000 * 1e9)
    return statistics.median(runs)


def decode_costs(bodies: dict[str, list[bytes]]) -> dict[str, Any]:
    """What decoding the kube-scheduler's bodies costs, against plain JSON parsing of the same bytes (the floor any
    typed decoder stands on). Medians over the captured bodies, each decoded ``REPEAT`` times."""
    from pydantic import TypeAdapter

    from sharegpu.kube.schema import ExtenderArgs, ExtenderBindingArgs, Pod

    try:
        import msgspec
    except ImportError:  # pragma: no cover - msgspec comes with the lock today, not as a dependency of sharegpu
        msgspec = None
    repeat = 20
    out: dict[str, Any] = {}
    names = TypeAdapter(list[str])

    def per_call(fn: Callable[[Any], Any], arg: Any) -> float:
        t = time.thread_time()
        for _ in range(repeat):
            fn(arg)
        return 1e6 * (time.thread_time() - t) / repeat  # µs

    for verb, model in (("filter", ExtenderArgs), ("bind", ExtenderBindingArgs)):
        kept = bodies.get(verb) or []
        if not kept:
            continue
        figures: dict[str, list[float]] = defaultdict(list)
        for body in kept[:100]:
            figures["pydantic model_validate_json (as served)"].append(per_call(model.model_validate_json, body))
            figures["json.loads (floor: untyped)"].append(per_call(json.loads, body))
            if msgspec is not None:
                figures["msgspec.json.decode (untyped)"].append(per_call(msgspec.json.decode, body))
            if verb == "filter":
                obj = json.loads(body)
                pod_bytes = json.dumps(obj["Pod"]).encode()
                names_bytes = json.dumps(obj.get("NodeNames") or []).encode()
                figures["  its Pod alone: Pod.model_validate_json"].append(per_call(Pod.model_validate_json, pod_bytes))
                figures["  its NodeNames alone: list[str] validate_json"].append(
                    per_call(names.validate_json, names_bytes)
                )
        out[verb] = {
            "bodies": len(kept[:100]),
            "bytes_median": statistics.median(len(b) for b in kept[:100]),
            "us_per_decode_median": {k: round(statistics.median(v), 1) for k, v in figures.items()},
        }
        print(f"\ndecoding {verb} bodies ({out[verb]['bodies']} as sent, median {out[verb]['bytes_median']:.0f} bytes); "
              "µs per decode, median")  # fmt: skip
        for k, v in out[verb]["us_per_decode_median"].items():
            print(f"  {k:<52} {v:8.1f}")
    return out


def component_costs(bodies: dict[str, list[bytes]], kubeconfig: Path) -> dict[str, float]:
    """What three pieces of a pod's path cost alone, on the pods the kube-scheduler sent (µs per call, median over
    the pods of the best of three runs of 20 calls): reading a Pod's GPU request (filter, bind and every watch event
    do it, from the same spec), validating a Pod as a watch event carries it (from its JSON, as the informer does:
    json.loads then the model), and building a Binding's request through lightkube and httpx (no I/O)."""
    import asyncio as aio

    from sharegpu.k8s.pod_request import pod_request
    from sharegpu.kube.api import LightkubeClusterApi
    from sharegpu.kube.schema import ExtenderArgs, Pod
    from sharegpu.model.catalog import DEFAULT_CATALOG

    def per_call(fn: Callable[[], Any]) -> float:
        best = math.inf
        for _ in range(3):
            t = time.thread_time()
            for _ in range(20):
                fn()
            best = min(best, (time.thread_time() - t) / 20)
        return 1e6 * best

    pods = [ExtenderArgs.model_validate_json(b).Pod for b in (bodies.get("filter") or [])[:100]]
    if not pods:
        return {}
    texts = [json.dumps(p.model_dump(mode="json", by_alias=True, exclude_unset=True)).encode() for p in pods]
    figures: dict[str, list[float]] = defaultdict(list)
    for pod, text in zip(pods, texts, strict=True):
        figures["pod_request(Pod) (the GPU request read from the spec)"].append(
            per_call(lambda pod=pod: pod_request(pod, DEFAULT_CATALOG))
        )
        figures["json.loads of a Pod (a watch event's object)"].append(per_call(lambda text=text: json.loads(text)))
        obj = json.loads(text)
        figures["Pod.model_validate of it (after json.loads)"].append(per_call(lambda obj=obj: Pod.model_validate(obj)))

    async def binding_requests() -> list[float]:
        from lightkube.models.core_v1 import ObjectReference
        from lightkube.models.meta_v1 import ObjectMeta
        from lightkube.resources.core_v1 import Pod as KPod

        api = LightkubeClusterApi(kubeconfig)
        generic = api.client.lightkube._client
        out = []
        try:
            for pod in pods[:50]:
                meta = pod.metadata

                def build(meta: Any = meta) -> Any:
                    binding = KPod.Binding(
                        metadata=ObjectMeta(name=meta.name, namespace=meta.namespace, uid=meta.uid or None,
                                            resourceVersion=meta.resource_version or None,
                                            annotations={"sharegpu.io/assignment": "{}"}),
                        target=ObjectReference(apiVersion="v1", kind="Node", name="node-1"),
                    )  # fmt: skip
                    request = generic.prepare_request("post", obj=binding, name=meta.name, namespace=meta.namespace)
                    request.response_type = None
                    return generic.build_adapter_request(request)

                out.append(per_call(build))
        finally:
            await api.close()
        return out

    figures["a Binding's request built by lightkube and httpx (no I/O)"] = aio.run(binding_requests())
    out = {k: round(statistics.median(v), 1) for k, v in figures.items()}
    print(f"\npieces of the path alone, on {len(pods)} pods the kube-scheduler sent; µs per call, median")
    for k, v in out.items():
        print(f"  {k:<60} {v:8.1f}")
    return out


# ----- cycles at scale ---------------------------------------------------------------------------------------------------
def run_cycles(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(BENCH))
    from dataclasses import replace

    from extender_bench import InProcess, fill, node_json, placed_pod_json, pod_json
    from sharegpu.k8s.cache.view import ClusterView
    from sharegpu.k8s.extender.server import Extender, make_app
    from sharegpu.kube.schema import Node, Pod
    from sharegpu.placement.fragmentation import Workload
    from sharegpu.sim.openb import load_nodes, load_pods

    instrument()
    CAPTURE.limit = 0  # 10,000 names a body: the decoding figures take one of their own
    from sharegpu.k8s.extender import server as server_mod

    make_app = server_mod.make_app  # noqa: F811 - the metered one
    specs = load_nodes(args.nodes_csv)
    base = specs
    if args.scale > len(specs):
        specs = [
            replace(s, name=f"{s.name}-r{i // len(base)}") for i, s in enumerate(base * (args.scale // len(base) + 1))
        ]
        specs = specs[: args.scale]
    tasks = [t.request for t in load_pods(args.pods_csv)]
    if args.scale > len(base):
        tasks = [replace(t, name=f"{t.name}-r{k}") for k in range(args.scale // len(base) + 1) for t in tasks]
    rnd = random.Random(args.seed)
    rnd.shuffle(tasks)
    workload = Workload.from_requests(tasks)
    t = time.perf_counter()
    placed, rest, _ = fill(specs, tasks, 0.6, "first-fit", "sharegpu", workload, args.seed)
    view = ClusterView()
    view.reset([Node.model_validate(node_json(s)) for s in specs],
               [Pod.model_validate(placed_pod_json(r, a, f"uid-placed-{i}")) for i, (r, a) in enumerate(placed)])  # fmt: skip
    view.synced = True
    print(
        f"{len(specs)} nodes, {len(placed)} pods placed before, set up in {time.perf_counter() - t:.1f} s", flush=True
    )
    names = [s.name for s in specs]
    names_bytes = json.dumps(names).encode()
    total = args.cycles + args.warmup
    reqs = (rest * (1 + total // max(1, len(rest))))[:total]
    pods = [json.dumps(pod_json(r, f"uid-cycle-{i}")).encode() for i, r in enumerate(reqs)]
    seen: set[Any] = set()
    cold = []
    for r in reqs:
        cold.append(r.shape_key() not in seen)
        seen.add(r.shape_key())
    report: dict[str, Any] = {"nodes": len(specs), "pods_placed": len(placed), "cycles": args.cycles,
                              "warmup": args.warmup, "cold_cycles": sum(cold[args.warmup:])}  # fmt: skip

    profiles = {"warm": cpu_profile(), "cold": cpu_profile()}

    def one_pass(narrow: bool, profile: bool, cycles: int, prioritize: bool = True) -> list[dict[str, float]]:
        ext = Extender(view, None, policy="sharegpu", seed=args.seed, workload=workload, narrow=narrow)
        app = make_app(ext)
        out = []
        timers(not profile)
        with InProcess(app) as client:
            for i in range(min(total, args.warmup + cycles)):
                prof = profiles["cold" if cold[i] else "warm"] if profile and i >= args.warmup else None
                fbody = b'{"Pod":' + pods[i] + b',"Nodes":null,"NodeNames":' + names_bytes + b"}"
                if prof is not None:  # the extender's calls only, not this client's JSON work
                    prof.enable()
                t0 = time.thread_time()
                status, body = client.post("/filter", fbody)
                t1 = time.thread_time()
                if prof is not None:
                    prof.disable()
                passed = json.loads(body)["NodeNames"] if status == 200 else None
                if passed is None:
                    raise SystemExit(f"filter: HTTP {status}: {body[:300]!r}")
                pbody = b'{"Pod":' + pods[i] + b',"Nodes":null,"NodeNames":' + json.dumps(passed).encode() + b"}"
                t3 = t4 = time.thread_time()
                if prioritize:
                    if prof is not None:
                        prof.enable()
                    t3 = time.thread_time()
                    status, body = client.post("/prioritize", pbody)
                    t4 = time.thread_time()
                    if prof is not None:
                        prof.disable()
                    if status != 200:
                        raise SystemExit(f"prioritize: HTTP {status}: {body[:300]!r}")
                m = METER.take()
                phases: dict[str, float] = Counter()
                for ph in m["by_pod"].values():
                    phases.update(ph)
                phases["cycle (filter + prioritize calls)"] = (t1 - t0) + (t4 - t3)
                phases = derive(dict(phases))
                phases[GC_ROW] = sum(m["gc"]["cpu_s"].values())
                phases["_cold"] = float(cold[i])
                phases["_passed"] = float(len(passed))
                if i >= args.warmup:
                    out.append(phases)
        return out

    # Each pass has an extender of its own (its caches start cold, the view's ledger is shared and unchanged: with
    # no API server nothing is held or bound).
    print("pass 1: narrowed filter, then prioritize of the one node left (as bench/extender_bench.py)", flush=True)
    timed = one_pass(True, False, args.cycles)
    report["narrow"] = cycles_summary(timed, "narrowed filter + prioritize of its one node (as extender_bench.py)")
    print("pass 2: narrowed filter alone (the kube-scheduler skips prioritize when one node is left)", flush=True)
    alone = one_pass(True, False, args.cycles, prioritize=False)
    report["filter_only"] = cycles_summary(alone, "narrowed filter alone (as the kube-scheduler calls it)")
    if args.full_prioritize_cycles:
        print("pass 3: narrow=False (prioritize over every node that passed)", flush=True)
        full = one_pass(False, False, args.full_prioritize_cycles)
        report["full"] = cycles_summary(full, "filter without narrowing + prioritize over every passing node")
    if args.out:
        print("pass 4: cProfile of pass 2's cycles (a fresh extender: the same cycles cold again)", flush=True)
        one_pass(True, True, args.cycles, prioritize=False)
        timers(True)
        args.out.mkdir(parents=True, exist_ok=True)
        for kind, prof in profiles.items():
            path = args.out / f"cycles-{len(specs)}-{kind}.prof"
            prof.dump_stats(str(path))
            what = f"narrowed filter alone at {len(specs)} nodes, {kind} cycles"
            report[f"top_{kind}"] = print_top(path, what, args.top)
            report[f"top_{kind}_own"] = print_top(path, what, args.top, "own")
    body = b'{"Pod":' + pods[args.warmup] + b',"Nodes":null,"NodeNames":' + names_bytes + b"}"
    report["decode"] = decode_costs({"filter": [body]})
    return report


GC_ROW = "of which: garbage collector"


def cycles_summary(cycles: list[dict[str, float]], title: str) -> dict[str, Any]:
    warm = [c for c in cycles if not c["_cold"]]
    cold = [c for c in cycles if c["_cold"]]
    seen = set().union(*(c.keys() for c in cycles))
    names = [p for p in ["cycle (filter + prioritize calls)", *ORDER, GC_ROW] if p in seen]
    names += sorted(k for k in seen - set(names) if not k.startswith("_"))
    rows = []
    print(f"\n{title}: {len(cycles)} cycles ({len(cold)} cold), nodes passing the filter median "
          f"{statistics.median(c['_passed'] for c in cycles):.0f}")  # fmt: skip
    print(
        f"{'phase (CPU ms per cycle)':<52} {'warm p50':>9} {'warm p99':>9} {'all p99':>9} {'cold mean':>10} {'all mean':>9}"
    )
    for name in names:
        w = [1000 * c.get(name, 0.0) for c in warm] or [0.0]
        a = [1000 * c.get(name, 0.0) for c in cycles]
        k = [1000 * c.get(name, 0.0) for c in cold]
        row = {"phase": name, "warm_p50_ms": statistics.median(w), "warm_p99_ms": pct(w, 99), "p99_ms": pct(a, 99),
               "cold_mean_ms": sum(k) / len(k) if k else None, "mean_ms": sum(a) / len(a)}  # fmt: skip
        rows.append(row)
        indent = "" if name.startswith("cycle") or name in TOP_LEVEL else ("      " if name in SUB else "   ")
        cold_txt = f"{row['cold_mean_ms']:10.3f}" if k else f"{'-':>10}"
        print(f"{indent + name:<52} {row['warm_p50_ms']:9.3f} {row['warm_p99_ms']:9.3f} {row['p99_ms']:9.3f} "
              f"{cold_txt} {row['mean_ms']:9.3f}")  # fmt: skip
    return {"cycles": len(cycles), "cold": len(cold), "rows": rows}


# ----- main ----------------------------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    rig = sub.add_parser("rig", help="one pod's path through the real kube-scheduler and API server (needs the rig)")
    rig.add_argument("--nodes", type=int, default=120, help="fake nodes (H100 x8, A100 x8, A30 x4 in 5:5:2)")
    rig.add_argument("--pods", type=int, default=500, help="pods per round, created at once")
    rig.add_argument(
        "--standing",
        type=int,
        default=500,
        help="pods created first and kept (the extender's first pods, reported apart as cold)",
    )
    rig.add_argument("--rounds", type=int, default=3, help="measured rounds on top of them, each deleted again")
    rig.add_argument("--profile-pods", type=int, default=300, help="pods of each of the two cProfile rounds (0: none)")
    rig.add_argument("--out", type=Path, default=Path("extender-profile"), help="folder for profiles, log and JSON")
    rig.add_argument(
        "--keep-alive-max-requests",
        type=int,
        default=0,
        help="raise hypercorn's limit of requests per HTTP/2 connection (1,000) in the bench's extender: past it the "
        "connection is closed under the scheduler's requests in flight and their pods are retried (0: as shipped)",
    )
    cyc = sub.add_parser("cycles", help="filter + prioritize per cycle at cluster scale, in-process")
    cyc.add_argument("--scale", type=int, default=10000, help="nodes (the openb node list replicated)")
    cyc.add_argument("--cycles", type=int, default=1000)
    cyc.add_argument("--warmup", type=int, default=100)
    cyc.add_argument("--full-prioritize-cycles", type=int, default=200,
                     help="cycles of a pass without narrowing (prioritize over every passing node); 0: none")  # fmt: skip
    cyc.add_argument("--nodes-csv", type=Path, default=DATA / "openb_node_list_gpu_node.csv")
    cyc.add_argument("--pods-csv", type=Path, default=DATA / "openb_pod_list_default.csv")
    cyc.add_argument("--out", type=Path, default=None, help="folder for the cProfile pass (none: no profile pass)")
    for p in (rig, cyc):
        p.add_argument("--seed", type=int, default=42)
        p.add_argument("--top", type=int, default=25, help="functions listed per profile")
        p.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    # A bench stopped with SIGTERM still removes its nodes and namespaces from the rig (Rig.open's cleanup).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(f"load average {os.getloadavg()}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}", flush=True)
    if args.what == "rig":
        report = run_rig(args)
    else:
        if not args.nodes_csv.is_file() or not args.pods_csv.is_file():
            print(f"openb trace not found at {args.nodes_csv} / {args.pods_csv}", file=sys.stderr)
            return 2
        report = run_cycles(args)
    report["load_average_end"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
