"""Steering the kube-scheduler's placement of DRA pods: the extender's ``/dra/filter`` leaves it sharegpu's node.

On the DRA path the kube-scheduler allocates the claims itself (its DynamicResources plugin: first fit on the
chosen node) and, left alone, picks the node by cpu and memory only (LeastAllocated spreads). With steering on,
the chart's scheduler profile calls a second extender entry, ``<extender>/dra``, with a filter verb only and no
``managedResources`` (so the kube-scheduler calls it for every pod of the profile: an extender with managed
resources is called only for pods whose containers ask one of them, and a DRA pod asks none). Its filter returns
the one candidate node that the ``dra-steered`` policy picks (:mod:`sharegpu.placement.dra_steer`): sharegpu's
score of the device the allocator's first fit takes there. Filter rather than prioritize: an extender's 0–10 score
would be quantised, and LeastAllocated would still spread among the ties.

Verified on the rig (Kubernetes v1.36.2): the binding extender (the first entry, with managedResources) is not
called at all for such a pod, so the default binder binds it; the kube-scheduler's DRA plugin allocates the claim
on the node the filter left (and has written the allocation before any bind). Nothing here binds or reserves.

What the filter knows is rebuilt from the API server's ResourceSlices (the GPUs of every DRA node), allocated
ResourceClaims (what their devices hold), Nodes (allocatable cpu and memory) and the pods bound to DRA nodes (their
cpu and memory). A pod steered but whose claim is not yet seen allocated is *held* on its node for a few seconds,
so that the next pods' filters count it (the scheduler allocates on its own, asynchronously).

The filter never makes a pod unschedulable: every node it is given already passed the kube-scheduler's own DRA
filter, and when steering cannot judge the pod (no sharegpu claim, MIG, several requests, claims not yet seen,
state not synced) it passes every node and the stock placement applies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from sharegpu.k8s.dra_view import DEVICE_PATH_DRA, DEVICE_PATH_LABEL, DRIVER, _mib, _num
from sharegpu.k8s.pod_request import _cpu_and_memory
from sharegpu.k8s.schema import Pod
from sharegpu.ledger import Ledger, LedgerError
from sharegpu.model.assignment import Assignment
from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog
from sharegpu.model.inventory import GpuDevice, NodeSpec
from sharegpu.model.request import GpuRequest, InvalidRequest
from sharegpu.placement.dra_steer import dra_steered_policy
from sharegpu.placement.fragmentation import Workload
from sharegpu.placement.framework import CycleState, Scheduler
from sharegpu.placement.mechanism import make_share

log = logging.getLogger(__name__)

SHARED_CLASS = "gpu.sharegpu.io"
WHOLE_CLASS = "whole-gpu.sharegpu.io"
STEERED_CLASSES = (SHARED_CLASS, WHOLE_CLASS)
HOLD_S = 10.0  # how long a steered pod's choice counts before its claim is seen allocated
_GPU_DEVICE = re.compile(r"^gpu-(\d+)$")
_MIG_DEVICE = re.compile(r"^gpu-(\d+)-mig-")


class NotSteered(Exception):
    """Steering cannot judge this pod; the message says why (the stock placement applies)."""


# ----- reading the objects ---------------------------------------------------------------------------------------
def _cpu_milli(q: Any) -> int:
    return round(_num(q) * 1000)


def claim_names(pod: Mapping[str, Any]) -> list[str]:
    """The ResourceClaims a pod uses, by name: its own claims and those made from its templates (which the resource
    claim controller names in ``status.resourceClaimStatuses``). Raises :class:`NotSteered` while one is unnamed."""
    spec = pod.get("spec") or {}
    made = {
        s.get("name"): s.get("resourceClaimName") for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []
    }
    out = []
    for rc in spec.get("resourceClaims") or []:
        name = rc.get("resourceClaimName") or made.get(rc.get("name"))
        if not name:
            if rc.get("resourceClaimTemplateName"):
                raise NotSteered(f"the claim of {rc.get('name')!r} is not made from its template yet")
            continue
        out.append(str(name))
    return out


def claim_request(key: str, claims: Iterable[Mapping[str, Any]], cpu_milli: int, host_memory_mib: int) -> GpuRequest:
    """The pod's GPU ask as a :class:`GpuRequest`, from its claims' device requests. Steered: exactly one request,
    of a shared-GPU class (``capacity.requests`` memory and compute, per device; one left out is the whole
    capacity, as the driver's request policy defaults say) or of the whole-GPU class, ExactCount."""
    requests = []
    for c in claims:
        for r in ((c.get("spec") or {}).get("devices") or {}).get("requests") or []:
            requests.append(r)
    if not requests:
        raise NotSteered("its claims request no device")
    if len(requests) > 1:
        raise NotSteered("its claims hold several device requests (steering handles one)")
    (r,) = requests
    exact = r.get("exactly")
    if not exact:
        raise NotSteered("its device request is not 'exactly' (firstAvailable is not steered)")
    cls = exact.get("deviceClassName", "")
    if cls not in STEERED_CLASSES:
        raise NotSteered(f"device class {cls!r} is not one of {', '.join(STEERED_CLASSES)}")
    if exact.get("allocationMode", "ExactCount") != "ExactCount":
        raise NotSteered("allocationMode All is not steered")
    count = int(exact.get("count") or 1)
    asked = (exact.get("capacity") or {}).get("requests") or {}
    try:
        if cls == WHOLE_CLASS or not asked:
            return GpuRequest(key, count, cpu_milli=cpu_milli, host_memory_mib=host_memory_mib)
        memory = _mib(asked["memory"]) if "memory" in asked else None
        compute = round(_num(asked["compute"]) * 10) if "compute" in asked else 1000
        return GpuRequest(
            key, count, compute_milli=compute, memory_mib=memory, cpu_milli=cpu_milli, host_memory_mib=host_memory_mib
        )
    except InvalidRequest as e:
        raise NotSteered(f"its request cannot be modelled: {e}") from None


@dataclass(frozen=True, slots=True)
class Steer:
    """The filter's answer: the node(s) to keep, and why (for the log)."""

    keep: list[str]
    why: str
    assignment: Assignment | None = None


class DraState:
    """The DRA nodes' state from raw API objects (dicts), and the ``dra-steered`` decision over it."""

    def __init__(self, catalog: Catalog = DEFAULT_CATALOG, seed: int = 0, hold_s: float = HOLD_S) -> None:
        self.catalog = catalog
        self.seed = seed
        self.hold_s = hold_s
        self.nodes: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}  # ns/name → pod (only pods on DRA nodes or with claims)
        self.slices: dict[str, dict[str, Any]] = {}
        self.claims: dict[str, dict[str, Any]] = {}  # ns/name → claim
        self.holds: dict[str, tuple[Assignment, tuple[str, ...], float]] = {}  # pod uid → (what, claim keys, until)
        self.synced = False
        self._dirty = True
        self._ledger: Ledger | None = None
        self._requests: list[GpuRequest] = []

    # ----- changes (from the watches) ------------------------------------------------------------------------------
    def reset(self, kind: str, objs: Iterable[Mapping[str, Any]]) -> None:
        store = self._store(kind)
        store.clear()
        for o in objs:
            self.apply(kind, "ADDED", o)
        self._dirty = True

    def apply(self, kind: str, event: str, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        key = f"{meta.get('namespace')}/{meta.get('name')}" if meta.get("namespace") else str(meta.get("name"))
        store = self._store(kind)
        if event == "DELETED":
            if store.pop(key, None) is not None:
                self._dirty = True
            return
        if kind == "slice" and (obj.get("spec") or {}).get("driver") != DRIVER:
            return
        if kind == "pod" and not (obj.get("spec") or {}).get("nodeName"):
            return  # unbound pods count through their holds
        store[key] = dict(obj)
        self._dirty = True

    def _store(self, kind: str) -> dict[str, dict[str, Any]]:
        return {"node": self.nodes, "pod": self.pods, "slice": self.slices, "claim": self.claims}[kind]

    # ----- the ledger of DRA nodes ---------------------------------------------------------------------------------
    def ledger(self, now: float | None = None) -> Ledger:
        now = time.monotonic() if now is None else now
        expired = [uid for uid, (_, _, until) in self.holds.items() if until <= now]
        for uid in expired:
            del self.holds[uid]
            self._dirty = True
        if self._ledger is None or self._dirty:
            self._ledger = self._build()
            self._dirty = False
        return self._ledger

    def _build(self) -> Ledger:
        gpus: dict[str, dict[int, GpuDevice]] = {}
        for s in self.slices.values():
            spec = s.get("spec") or {}
            node = str(spec.get("nodeName") or (spec.get("pool") or {}).get("name", ""))
            for d in spec.get("devices") or []:
                attrs = d.get("attributes") or {}
                if (attrs.get("type") or {}).get("string") != "gpu":
                    continue
                model = (attrs.get("model") or {}).get("string", "")
                if not self.catalog.known(model):
                    continue
                index = int((attrs.get("index") or {}).get("int", 0))
                memory = _mib(((d.get("capacity") or {}).get("memory") or {}).get("value", "0"))
                uuid = (attrs.get("uuid") or {}).get("string", f"{node}-gpu-{index}")
                gpus.setdefault(node, {})[index] = GpuDevice(index, uuid, model, memory_mib=memory)
        specs = []
        for name in sorted(gpus):
            obj = self.nodes.get(name)
            if obj is None or (obj.get("metadata") or {}).get("labels", {}).get(DEVICE_PATH_LABEL) != DEVICE_PATH_DRA:
                continue
            alloc = (obj.get("status") or {}).get("allocatable") or {}
            cpu, mem = _cpu_milli(alloc.get("cpu", "0")), _mib(alloc.get("memory", "0"))
            specs.append(NodeSpec(name, cpu, mem, tuple(gpus[name][i] for i in sorted(gpus[name]))))
        led = Ledger(specs, self.catalog)
        self._requests = []
        position = {
            n.name: {g.index: k for k, g in enumerate(n.gpus)} for n in led.nodes
        }  # GPU index → its place in the ledger
        for key, claim in self.claims.items():
            alloc = (claim.get("status") or {}).get("allocation") or {}
            results = [r for r in (alloc.get("devices") or {}).get("results") or [] if r.get("driver") == DRIVER]
            shares = []
            node = ""
            for r in results:
                node = str(r.get("pool", ""))
                if node not in led.index:
                    continue
                n = led.index[node]
                device = str(r.get("device", ""))
                m = _GPU_DEVICE.match(device) or _MIG_DEVICE.match(device)
                g = position[node].get(int(m.group(1))) if m else None
                if g is None:
                    continue
                consumed = r.get("consumedCapacity") or {}
                gpu = led.nodes[n].gpus[g]
                if _MIG_DEVICE.match(device) or not consumed:
                    req = GpuRequest(f"claim:{key}", 1)  # a partition or the whole GPU: nothing else can share it
                else:
                    mem = _mib(consumed["memory"]) if "memory" in consumed else gpu.memory_mib
                    compute = round(_num(consumed["compute"]) * 10) if "compute" in consumed else 1000
                    req = (
                        GpuRequest(f"claim:{key}", 1)
                        if mem >= gpu.memory_mib and compute >= 1000
                        else GpuRequest(f"claim:{key}", 1, compute_milli=compute, memory_mib=mem)
                    )
                self._requests.append(req)
                try:
                    shares.append(make_share(led, n, g, req))
                except (ValueError, InvalidRequest) as e:
                    log.debug("claim %s: not modelled on %s: %s", key, node, e)
            if shares and node in led.index:
                self._place(led, Assignment(f"claim:{key}", node, tuple(shares)))
        for key, pod in self.pods.items():
            on = str((pod.get("spec") or {}).get("nodeName") or "")
            if on not in led.index or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue
            cpu, mem = _pod_cpu_memory(pod)
            self._place(led, Assignment(f"pod:{key}", on, (), cpu, mem))
        for uid, (a, claim_keys, _) in list(self.holds.items()):
            if any(((self.claims.get(k) or {}).get("status") or {}).get("allocation") for k in claim_keys):
                del self.holds[uid]  # the allocation is seen: it accounts the GPU from now on
                continue
            if a.node in led.index:
                self._place(led, a)
        return led

    @staticmethod
    def _place(led: Ledger, a: Assignment) -> None:
        try:
            led.place(a, check_health=False)
        except LedgerError as e:
            # The API objects disagree with the model for a moment (e.g. a slice republished): the decision goes on
            # without this one rather than not at all.
            log.debug("%s: not accounted: %s", a.pod, e)

    # ----- the decision --------------------------------------------------------------------------------------------
    def steer(self, pod: Pod, candidates: list[str], workload: Workload | None = None) -> Steer:
        """The candidates to keep for ``pod``: the ``dra-steered`` pick, or all of them (and why) when steering
        cannot judge the pod."""
        raw = pod.model_dump(mode="json", by_alias=True)
        if not (raw.get("spec") or {}).get("resourceClaims"):
            return Steer(candidates, "no resource claims")
        if not self.synced:
            return Steer(candidates, "DRA state not synced")
        try:
            names = claim_names(raw)
            ns = pod.metadata.namespace
            claims = []
            for name in names:
                c = self.claims.get(f"{ns}/{name}")
                if c is None:
                    raise NotSteered(f"claim {ns}/{name} not seen yet")
                claims.append(c)
            cpu, mem = _cpu_and_memory(pod)
            req = claim_request(pod.key, claims, cpu, mem)
        except NotSteered as e:
            return Steer(candidates, str(e))
        uid = pod.metadata.uid or pod.key
        if self.holds.pop(uid, None) is not None:
            self._dirty = True  # scheduled again: its earlier choice must not count against it
        led = self.ledger()
        policy = dra_steered_policy(workload or Workload.from_requests([*self._requests, req]))
        sched = Scheduler(led, policy, self.seed)
        ok, usable = sched.feasible(req)
        idx = np.array([led.index.get(n, -1) for n in candidates], dtype=np.int64)
        known = idx[idx >= 0]
        cand = np.unique(known[ok[known]])
        if len(cand) == 0:
            return Steer(candidates, "no candidate fits in sharegpu's model of the DRA nodes")
        state = CycleState(req, usable, sched.rng, memo=sched.memo)
        best = sched.pick(cand, sched.scores(state, cand))
        a = sched.assignment_on(state, best)
        node = led.nodes[best].name
        self.holds[uid] = (a, tuple(f"{ns}/{n}" for n in names), time.monotonic() + self.hold_s)
        self._dirty = True
        return Steer([node], f"dra-steered pick among {len(cand)} node(s)", a)


def _pod_cpu_memory(p: Mapping[str, Any]) -> tuple[int, int]:
    try:
        return _cpu_and_memory(Pod.model_validate(p))
    except (InvalidRequest, ValueError):
        return 0, 0


# ----- following the API server ----------------------------------------------------------------------------------
async def follow_dra(state: DraState, client: Any, stop: asyncio.Event, max_backoff_s: float = 30.0) -> None:
    """List and watch Nodes, pods, the driver's ResourceSlices and ResourceClaims into ``state`` until ``stop``;
    relists after any error. A cluster that does not serve resource.k8s.io/v1 leaves steering off (logged once)."""
    from lightkube.resources.core_v1 import Node as KNode
    from lightkube.resources.core_v1 import Pod as KPod
    from lightkube.resources.resource_v1 import ResourceClaim, ResourceSlice

    kinds: list[tuple[str, Any, dict[str, Any]]] = [
        ("node", KNode, {}),
        ("pod", KPod, {"namespace": "*"}),
        ("slice", ResourceSlice, {"fields": {"spec.driver": DRIVER}}),
        ("claim", ResourceClaim, {"namespace": "*"}),
    ]
    backoff = 1.0
    while not stop.is_set():
        try:
            versions = {}
            for kind, res, kw in kinds:
                it = client.list(res, **kw)
                objs = [o.to_dict() async for o in it]
                state.reset(kind, objs)
                versions[kind] = str(getattr(it, "resourceVersion", "") or "")
            state.synced = True
            backoff = 1.0
            log.info(
                "DRA steering: following %d DRA node(s), %d slice(s), %d claim(s)",
                sum(
                    1
                    for n in state.nodes.values()
                    if (n.get("metadata") or {}).get("labels", {}).get(DEVICE_PATH_LABEL) == DEVICE_PATH_DRA
                ),
                len(state.slices),
                len(state.claims),
            )

            async def watch(kind: str, res: Any, kw: dict[str, Any], rv: str) -> None:
                async for event, obj in client.watch(res, resource_version=rv or None, **kw):
                    state.apply(kind, event, obj.to_dict())

            tasks = [asyncio.ensure_future(watch(k, r, kw, versions[k])) for k, r, kw in kinds]
            stopper = asyncio.ensure_future(stop.wait())
            done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
            for t in [*tasks, stopper]:
                t.cancel()
            await asyncio.gather(*tasks, stopper, return_exceptions=True)
            for t in done:
                if t is not stopper and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
        except asyncio.CancelledError:
            raise
        except Exception as e:
            state.synced = False
            log.warning("DRA steering: lost the API server (%s); relisting in %.0fs", e, backoff)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), backoff)
            backoff = min(backoff * 2, max_backoff_s)
