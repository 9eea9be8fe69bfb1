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
filter, and when steering cannot judge the pod (no sharegpu claim, several requests, claims not yet seen,
state not synced) it passes every node and the stock placement applies.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sharegpu.k8s.dra_objects import claimed_mib, claimed_percent
from sharegpu.k8s.pod_request import PERCENT_MILLI, cpu_and_memory
from sharegpu.kube.client import KubeClient
from sharegpu.kube.informer import Informer, Source, Timing, of_json
from sharegpu.kube.quantity import capacity_mib, capacity_milli, quantity_or_zero
from sharegpu.kube.schema import Pod
from sharegpu.ledger import Ledger, LedgerError
from sharegpu.model.assignment import Assignment, GpuShare, Mechanism, MigSlot
from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog
from sharegpu.model.contract import (
    ATTR_PROFILE,
    DEVICE_PATH_DRA,
    DEVICE_PATH_LABEL,
    DEVICE_TYPE_GPU,
    DRIVER,
    MIG_CLASS,
    SHARED_CLASS,
    WHOLE_CLASS,
    mig_profile_token,
    parse_device_name,
    read_slice_device,
)
from sharegpu.model.inventory import GpuDevice, NodeSpec
from sharegpu.model.request import FULL_MILLI, GpuRequest, InvalidRequest, Sharing
from sharegpu.placement.dra_steer import dra_steered_policy
from sharegpu.placement.fragmentation import Workload
from sharegpu.placement.framework import CycleState, Scheduler
from sharegpu.placement.mechanism import make_share

log = logging.getLogger(__name__)

STEERED_CLASSES = (SHARED_CLASS, WHOLE_CLASS, MIG_CLASS)
# The profile a MIG claim selects: a CEL selector on the device's ``profile`` attribute, as docs/dra.md shows.
_PROFILE_SELECTOR = re.compile(rf"""\.{ATTR_PROFILE}\s*==\s*["']([^"']+)["']""")
HOLD_S = 10.0  # how long a steered pod's choice counts before its claim is seen allocated


class NotSteered(Exception):
    """Steering cannot judge this pod; the message says why (the stock placement applies)."""


# ----- reading the objects ---------------------------------------------------------------------------------------
def claim_names(pod: Pod) -> list[str]:
    """The ResourceClaims a pod uses, by name (:meth:`Pod.claim_name`). Raises :class:`NotSteered` while one made
    from a template is not made yet."""
    out = []
    for rc in pod.spec.resource_claims:
        name = pod.claim_name(rc)
        if not name:
            if rc.resource_claim_template_name:
                raise NotSteered(f"the claim of {rc.name!r} is not made from its template yet")
            continue
        out.append(name)
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
        if cls == MIG_CLASS:
            profiles = {
                m.group(1)
                for sel in exact.get("selectors") or []
                for m in [_PROFILE_SELECTOR.search(str((sel.get("cel") or {}).get("expression", "")))]
                if m is not None
            }
            if len(profiles) != 1:
                raise NotSteered("a MIG claim is steered when one CEL selector names its profile")
            (profile,) = profiles
            return GpuRequest(
                key,
                count,
                mig_profile=profile,
                sharing=Sharing.MIG,
                cpu_milli=cpu_milli,
                host_memory_mib=host_memory_mib,
            )
        if cls == WHOLE_CLASS or not asked:
            return GpuRequest(key, count, cpu_milli=cpu_milli, host_memory_mib=host_memory_mib)
        # Asks, rounded up: the scheduler rounds a claim's ask up to the device's step (1Mi, 1 percent), and the
        # extender rounds a pod's the same way, so both paths model a "10G" share as 9537 MiB.
        memory = claimed_mib(asked)
        compute = claimed_percent(asked) * PERCENT_MILLI
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


@dataclass(frozen=True, slots=True)
class _Use:
    """What one allocated claim holds: per device, (GPU index, whole GPU?, memory MiB, compute milli, MIG
    partition as (profile, start) or None)."""

    node: str
    devices: tuple[tuple[int, bool, int, int, tuple[str, int] | None], ...]


WORKLOAD_DRIFT = 0.1  # the workload's shapes are taken again when the claims seen changed by this share


class DraState:
    """The DRA nodes' state from raw API objects (dicts), and the ``dra-steered`` decision over it.

    Every object is parsed once, when its event arrives, and the ledger follows the claims, pods and holds
    incrementally (a release and a place per change); only a change of a DRA node's GPUs (its slices) or of its
    allocatable cpu and memory rebuilds it. The scheduler over it (and its per-node memo) is kept until the ledger
    is rebuilt or the workload drifts.
    """

    def __init__(self, catalog: Catalog = DEFAULT_CATALOG, seed: int = 0, hold_s: float = HOLD_S) -> None:
        self.catalog = catalog
        self.seed = seed
        self.hold_s = hold_s
        self.claims: dict[str, dict[str, Any]] = {}  # ns/name → claim (its spec is read when its pod is steered)
        self.holds: dict[str, tuple[Assignment, tuple[str, ...], float]] = {}  # pod uid → (what, claim keys, until)
        self.synced = False
        self._nodes: dict[str, tuple[int, int]] = {}  # DRA node → allocatable (cpu milli, memory MiB)
        self._slices: dict[str, tuple[str, tuple[GpuDevice, ...]]] = {}  # slice → (node, its GPUs)
        self._uses: dict[str, _Use] = {}  # claim key → what its allocation holds
        self._pods: dict[str, tuple[str, int, int]] = {}  # pod key → (node, cpu, memory) of pods bound to a node
        self._ledger: Ledger | None = None
        self._scheduler: tuple[Scheduler, int] | None = None  # and the claim count its workload was taken at

    def counts(self) -> tuple[int, int, int]:
        """(DRA nodes, driver slices, claims) seen."""
        return len(self._nodes), len(self._slices), len(self.claims)

    # ----- changes (from the watches) ------------------------------------------------------------------------------
    def reset(self, kind: str, objs: Iterable[Mapping[str, Any]]) -> None:
        if kind == "node":
            self._nodes.clear()
        elif kind == "slice":
            self._slices.clear()
        elif kind == "claim":
            self.claims.clear()
            self._uses.clear()
        else:
            self._pods.clear()
        self._ledger = None
        for o in objs:
            self.apply(kind, "ADDED", o)

    def apply(self, kind: str, event: str, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        key = f"{meta.get('namespace')}/{meta.get('name')}" if meta.get("namespace") else str(meta.get("name"))
        gone = event == "DELETED"
        if kind == "node":
            labels = meta.get("labels") or {}
            cap = None
            if not gone and labels.get(DEVICE_PATH_LABEL) == DEVICE_PATH_DRA:
                alloc = (obj.get("status") or {}).get("allocatable") or {}
                # What the node has: rounded down.
                cap = (
                    capacity_milli(quantity_or_zero(alloc.get("cpu", "0"))),
                    capacity_mib(quantity_or_zero(alloc.get("memory", "0"))),
                )
            if self._nodes.get(key) != cap:
                self._set(self._nodes, key, cap)
                self._ledger = None
        elif kind == "slice":
            parsed = None if gone else self._parse_slice(obj)
            if self._slices.get(key) != parsed:
                self._set(self._slices, key, parsed)
                self._ledger = None
        elif kind == "claim":
            self._set(self.claims, key, None if gone else dict(obj))
            use = None if gone else _parse_use(obj, self.catalog)
            if use is not None:
                # The allocation is seen: it accounts the GPU from now on. The hold goes first, or the two would
                # count the pod twice and the allocation would not fit beside its own hold.
                for uid, (_, claim_keys, _) in list(self.holds.items()):
                    if key in claim_keys:
                        self._drop_hold(uid)
            if self._uses.get(key) != use:
                self._set(self._uses, key, use)
                self._account(f"claim:{key}", self._claim_assignment(key, use) if use is not None else None)
        else:
            spec = obj.get("spec") or {}
            node = str(spec.get("nodeName") or "")
            finished = (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed")
            use_pod = None
            if not gone and node and not finished:
                cpu, mem = _pod_cpu_memory(obj)
                use_pod = (node, cpu, mem)
            if self._pods.get(key) != use_pod:
                self._set(self._pods, key, use_pod)
                a = Assignment(f"pod:{key}", node, (), use_pod[1], use_pod[2]) if use_pod is not None else None
                self._account(f"pod:{key}", a)

    @staticmethod
    def _set(store: dict[str, Any], key: str, value: Any) -> None:
        if value is None:
            store.pop(key, None)
        else:
            store[key] = value

    def _parse_slice(self, obj: Mapping[str, Any]) -> tuple[str, tuple[GpuDevice, ...]] | None:
        spec = obj.get("spec") or {}
        if spec.get("driver") != DRIVER:
            return None
        node = str(spec.get("nodeName") or (spec.get("pool") or {}).get("name", ""))
        gpus = []
        for raw in spec.get("devices") or []:
            d = read_slice_device(raw)
            if d.type != DEVICE_TYPE_GPU or not self.catalog.known(d.model):
                continue
            uuid = f"{node}-gpu-{d.index}" if d.uuid is None else d.uuid
            gpus.append(GpuDevice(d.index, uuid, d.model, memory_mib=capacity_mib(quantity_or_zero(d.memory))))
        return node, tuple(gpus)

    # ----- the ledger of DRA nodes ---------------------------------------------------------------------------------
    def ledger(self, now: float | None = None) -> Ledger:
        now = time.monotonic() if now is None else now
        for uid in [uid for uid, (_, _, until) in self.holds.items() if until <= now]:
            self._drop_hold(uid)
        if self._ledger is None:
            self._ledger = self._build()
            self._scheduler = None
        return self._ledger

    def _build(self) -> Ledger:
        gpus: dict[str, dict[int, GpuDevice]] = {}
        for node, devices in self._slices.values():
            for g in devices:
                gpus.setdefault(node, {})[g.index] = g
        specs = [
            NodeSpec(name, *self._nodes[name], tuple(gpus[name][i] for i in sorted(gpus[name])))
            for name in sorted(gpus)
            if name in self._nodes
        ]
        led = Ledger(specs, self.catalog)
        self._ledger = led
        for key, use in self._uses.items():
            self._account(f"claim:{key}", self._claim_assignment(key, use))
        for key, (node, cpu, mem) in self._pods.items():
            self._account(f"pod:{key}", Assignment(f"pod:{key}", node, (), cpu, mem))
        for uid, (a, _, _) in self.holds.items():
            self._account(f"hold:{uid}", a)
        return led

    def _claim_assignment(self, key: str, use: _Use) -> Assignment | None:
        led = self._ledger
        if led is None or use.node not in led.index:
            return None
        n = led.index[use.node]
        position = {g.index: k for k, g in enumerate(led.nodes[n].gpus)}
        shares = []
        for index, whole, mem, compute, mig in use.devices:
            g = position.get(index)
            if g is None:
                continue
            gpu = led.nodes[n].gpus[g]
            if mig is not None:
                try:
                    profile = led.gpu_model(n, g).profile(mig[0])
                except ValueError:
                    pass  # a profile this model lacks: the GPU counts as taken
                else:
                    shares.append(
                        GpuShare(g, gpu.uuid, Mechanism.MIG, FULL_MILLI, profile.memory_mib,
                                 MigSlot(profile.name, mig[1]), Mechanism.EXCLUSIVE)
                    )  # fmt: skip
                    continue
            total = gpu.memory_mib
            if whole or (mem >= total and compute >= FULL_MILLI):
                req = GpuRequest(f"claim:{key}", 1)  # a partition or the whole GPU: nothing else can share it
            else:
                req = GpuRequest(f"claim:{key}", 1, compute_milli=compute, memory_mib=mem)
            try:
                shares.append(make_share(led, n, g, req))
            except (ValueError, InvalidRequest) as e:
                log.debug("claim %s: not modelled on %s: %s", key, use.node, e)
        return Assignment(f"claim:{key}", use.node, tuple(shares)) if shares else None

    def _account(self, name: str, a: Assignment | None) -> None:
        """Make the ledger hold ``a`` under ``name`` (nothing: ``a`` is None), replacing what it held there."""
        led = self._ledger
        if led is None:
            return  # built from the parsed objects when next needed
        if name in led.assignments:
            led.release(name)
        if a is None or a.node not in led.index:
            return
        if a.pod != name:
            a = Assignment(name, a.node, a.shares, a.cpu_milli, a.host_memory_mib)
        try:
            led.place(a, check_health=False)
        except LedgerError as e:
            # The API objects disagree with the model for a moment (e.g. a slice republished): the decision goes on
            # without this one rather than not at all.
            log.warning("DRA steering: %s not accounted: %s", name, e)

    def _drop_hold(self, uid: str) -> None:
        if self.holds.pop(uid, None) is not None:
            self._account(f"hold:{uid}", None)

    def _hold(self, uid: str, a: Assignment, claim_keys: tuple[str, ...]) -> None:
        self.holds[uid] = (a, claim_keys, time.monotonic() + self.hold_s)
        self._account(f"hold:{uid}", a)

    def _requests(self) -> list[GpuRequest]:
        """The allocated claims as requests (the workload's shapes when the operator fixed none)."""
        out = []
        for key, use in self._uses.items():
            if use.devices:
                _, whole, mem, compute, mig = use.devices[0]
                n = len(use.devices)
                if mig is not None:
                    try:
                        out.append(GpuRequest(key, n, mig_profile=mig[0], sharing=Sharing.MIG))
                        continue
                    except InvalidRequest:
                        pass
                out.append(GpuRequest(key, n) if whole else GpuRequest(key, n, compute_milli=compute, memory_mib=mem))
        return out

    def scheduler(self, req: GpuRequest, workload: Workload | None) -> Scheduler:
        led = self.ledger()
        n = len(self._uses)
        kept = self._scheduler
        if (
            kept is not None
            and kept[0].ledger is led
            and (workload is not None or abs(n - kept[1]) <= WORKLOAD_DRIFT * kept[1])
        ):
            return kept[0]
        shapes = workload or Workload.from_requests([*self._requests(), req])
        sched = Scheduler(led, dra_steered_policy(shapes), self.seed)
        self._scheduler = (sched, n)
        return sched

    # ----- the decision --------------------------------------------------------------------------------------------
    def steer(self, pod: Pod, candidates: list[str], workload: Workload | None = None) -> Steer:
        """The candidates to keep for ``pod``: the ``dra-steered`` pick, or all of them (and why) when steering
        cannot judge the pod."""
        if not pod.spec.resource_claims:
            return Steer(candidates, "no resource claims")
        if not self.synced:
            return Steer(candidates, "DRA state not synced")
        try:
            names = claim_names(pod)
            ns = pod.metadata.namespace
            claims = []
            for name in names:
                c = self.claims.get(f"{ns}/{name}")
                if c is None:
                    raise NotSteered(f"claim {ns}/{name} not seen yet")
                claims.append(c)
            cpu, mem = cpu_and_memory(pod)
            req = claim_request(pod.key, claims, cpu, mem)
        except NotSteered as e:
            return Steer(candidates, str(e))
        uid = pod.metadata.uid or pod.key
        self._drop_hold(uid)  # scheduled again: its earlier choice must not count against it
        sched = self.scheduler(req, workload)
        led = sched.ledger
        ok, usable = sched.feasible(req)
        idx = np.array([led.index.get(n, -1) for n in candidates], dtype=np.int64)
        known = idx[idx >= 0]
        cand = np.unique(known[ok[known]])
        if len(cand) == 0:
            return Steer(candidates, "no candidate fits in sharegpu's model of the DRA nodes")
        state = CycleState(req, usable, sched.rng, memo=sched.memo)
        best = sched.pick(cand, sched.scores(state, cand))
        a = sched.assignment_on(state, best)
        self._hold(uid, a, tuple(f"{ns}/{n}" for n in names))
        return Steer([led.nodes[best].name], f"dra-steered pick among {len(cand)} node(s)", a)


def _profile_names(catalog: Catalog) -> dict[str, str]:
    """MIG profile names by their token in device names ("3g.40gb" → "3g40gb"), over the catalog's models."""
    return {mig_profile_token(p.name): p.name for m in catalog for p in m.mig_profiles}


def _parse_use(claim: Mapping[str, Any], catalog: Catalog = DEFAULT_CATALOG) -> _Use | None:
    """What an allocated claim holds of this driver's GPUs (None: not allocated, or nothing of ours)."""
    alloc = (claim.get("status") or {}).get("allocation") or {}
    devices = []
    node = ""
    for r in (alloc.get("devices") or {}).get("results") or []:
        if r.get("driver") != DRIVER:
            continue
        device = str(r.get("device", ""))
        name = parse_device_name(device)
        if name is None:
            continue
        node = str(r.get("pool", ""))
        consumed = r.get("consumedCapacity") or {}
        part = None
        if name.mig_token is not None and name.mig_start is not None and name.mig_token in _profile_names(catalog):
            part = (_profile_names(catalog)[name.mig_token], name.mig_start)
        whole = name.is_mig or not consumed
        mem = claimed_mib(consumed)
        mem = 1 << 40 if mem is None else mem  # left out: the whole memory
        compute = claimed_percent(consumed) * PERCENT_MILLI
        devices.append((name.gpu_index, whole, mem, compute, part))
    return _Use(node, tuple(devices)) if devices else None


def _pod_cpu_memory(p: Mapping[str, Any]) -> tuple[int, int]:
    try:
        return cpu_and_memory(Pod.model_validate(p))
    except (InvalidRequest, ValueError):
        return 0, 0


# ----- following the API server ----------------------------------------------------------------------------------
async def follow_dra(state: DraState, client: KubeClient, stop: asyncio.Event, max_backoff_s: float = 30.0) -> None:
    """List and watch Nodes, pods, the driver's ResourceSlices and ResourceClaims into ``state`` until ``stop``
    (an :class:`~sharegpu.kube.informer.Informer`: watch deadlines, ordering, bounded cancellation); relists after
    any error. A cluster that does not serve resource.k8s.io/v1 leaves steering unsynced (logged on each retry)."""
    from lightkube.resources.core_v1 import Node as KNode
    from lightkube.resources.core_v1 import Pod as KPod
    from lightkube.resources.resource_v1 import ResourceClaim, ResourceSlice

    def source(kind: str, res: Any, namespace: str | None = None, fields: dict[str, Any] | None = None) -> Source[Any]:
        return Source(
            kind,
            lambda: client.list(res, f"list {kind}s", namespace, fields),
            lambda rv, timeout_s: client.watch(res, rv, f"watch {kind}s", timeout_s, namespace, fields),
            lambda event, obj: state.apply(kind, event, obj),
            of_json,
        )

    def listed(lists: Mapping[str, Sequence[Any]]) -> None:
        for kind, objs in lists.items():
            state.reset(kind, objs)
        state.synced = True
        log.info("DRA steering: following %d DRA node(s), %d slice(s), %d claim(s)", *state.counts())

    def lost(e: Exception, retry_s: float) -> None:
        state.synced = False
        log.warning("DRA steering: lost the API server (%s); relisting in %.0fs", e, retry_s)

    sources = [
        source("node", KNode),
        source("pod", KPod, "*"),
        source("slice", ResourceSlice, fields={"spec.driver": DRIVER}),
        source("claim", ResourceClaim, "*"),
    ]
    informer = Informer("DRA steering", sources, listed, lost, Timing(backoff_s=1.0, max_backoff_s=max_backoff_s))
    try:
        await informer.run(stop)
    finally:
        state.synced = False
