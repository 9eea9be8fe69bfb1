"""Allocate and PreStartContainer: give each container exactly its own pod's share, or refuse it with a reason.

The kubelet's device plugin calls name device IDs, never the pod. sharegpu's device IDs are interchangeable tokens,
so the work is split in two, and nothing is ever guessed:

- **Allocate** (pod admission) answers with one CDI device, named after the device IDs
  (:func:`~sharegpu.model.contract.cdi_allocation_name`), and
  ``NVIDIA_VISIBLE_DEVICES=void``, so a container whose runtime never applied the CDI device sees no GPU at all.
- **PreStartContainer** (right before the kubelet creates the container; the plugin asks for it) finds the pod that
  holds these device IDs in the kubelet's own records (:mod:`sharegpu.node.attribution`), reads its
  ``sharegpu.io/assignment``, makes the share ready (MIG instance, MPS daemon and its limits) and writes the CDI
  spec that the runtime then applies: the visible unit, the limits and the MPS pipe.

An MPS share is served by its tenant's daemon on its unit (:mod:`sharegpu.model.tenant`: the pod's namespace and
declared UID, or the pod alone; on a multi-user node the unit's one daemon): the CDI spec mounts that daemon's pipe
directory only, so the container cannot reach another tenant's server. Its thread cap is its share against the other
shares of its tenant on the unit (the daemon's clients run together, the unit's daemons take turns:
:func:`~sharegpu.node.mps.thread_percentage`). A pod whose GPU containers declare different UIDs is refused.

Which share a container gets: the kubelet gives a pod exactly as many device IDs as the kube-scheduler counts GPUs
for it (:mod:`sharegpu.model.demand`), handing an init container's IDs on to later containers. So each device ID of a
pod is tied to one share of its assignment the first time it is seen, for the pod's life (recorded in the agent's
state): containers running at once hold distinct IDs and so distinct shares, and a container that takes over an init
container's IDs takes over its shares.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sharegpu.kube.errors import KubeError
from sharegpu.model.assignment import Assignment, GpuShare, InvalidAssignment, Mechanism
from sharegpu.model.contract import (
    ASSIGNMENT_ANNOTATION,
    GPU_RESOURCE,
    MECHANISM_ENV,
    NVIDIA_VISIBLE_DEVICES_ENV,
    SHARES_ENV,
    cdi_allocation_name,
    cdi_device_id,
)
from sharegpu.model.tenant import TenantConflict
from sharegpu.node.attribution import AttributionError, Attributor, Owner
from sharegpu.node.backends.base import BackendError, GpuBackend
from sharegpu.node.cdi import CdiDevice, CdiError, CdiMount, CdiWriter
from sharegpu.node.errors import NodeError
from sharegpu.node.kube import KubeApi, PodInfo
from sharegpu.node.mig import MigError, MigInvalid, MigManager, MigNeed
from sharegpu.node.mps import DaemonKey, MpsError, MpsLimits, MpsManager, mps_client_env
from sharegpu.node.state import AgentState

log = logging.getLogger(__name__)

MPS_PIPE_IN_CONTAINER = "/run/sharegpu/mps"
NO_GPU = "void"  # NVIDIA_VISIBLE_DEVICES value under which the NVIDIA runtime exposes no GPU


class AllocationError(NodeError):
    """Allocate or PreStartContainer cannot serve a container; the message goes to the kubelet and the pod's events."""


@dataclass(frozen=True, slots=True)
class AllocateAnswer:
    """What Allocate returns for one container: the CDI device that PreStartContainer fills in, and an environment
    that hides every GPU should the runtime not apply it."""

    cdi_device: str  # fully qualified: sharegpu.io/gpu=dp-…
    envs: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ContainerGrant:
    """What one container gets: the devices it may see and the limits that hold it to its share."""

    pod: str
    pod_uid: str
    container: str
    units: tuple[str, ...]  # GPU-… or MIG-… UUIDs, in the order of the container's shares
    envs: Mapping[str, str] = field(default_factory=dict)
    mounts: tuple[CdiMount, ...] = ()
    device_nodes: tuple[str, ...] = ()
    cdi_name: str = ""


@dataclass(frozen=True, slots=True)
class RecentGrant:
    """What one PreStartContainer just handed out, for a reconcile whose pod list may predate it.

    The reconcile loop lists pods, then acts; a grant made in between is not in that list. Until the grant is older
    than the allocator's grace period, reconcile treats its MIG instances, MPS daemon (with its limits) and GPUs as
    needed and its pod's allocations as live.
    """

    pod_uid: str
    pod_key: str  # namespace/name, for messages
    at: float  # time.monotonic() when it was made
    mig: frozenset[MigNeed] = frozenset()
    non_mig_gpus: frozenset[int] = frozenset()
    mps: tuple[tuple[DaemonKey, MpsLimits], ...] = ()  # the daemon that serves it and the limits it was given


def same_place(a: GpuShare, b: GpuShare) -> bool:
    """Whether two shares sit on one unit: the same GPU, and the same MIG instance or none."""
    return a.gpu_uuid == b.gpu_uuid and a.mig == b.mig


def tenant_compute(share: GpuShare, tenant: str, pods: Sequence[tuple[Assignment, str]]) -> int:
    """The compute of every MPS share of ``tenant`` on ``share``'s unit (``pods``: each pod's assignment and the tenant
    of the daemon that serves it): what a client's thread cap is held against (at least ``share``'s own)."""
    total = sum(
        s.compute_milli
        for a, t in pods
        if t == tenant
        for s in a.shares
        if s.sharing is Mechanism.MPS and same_place(s, share)
    )
    return max(total, share.compute_milli)


def share_text(s: GpuShare) -> str:
    """One share as the container sees it in SHAREGPU_SHARES, e.g. ``gpu=GPU-…,mig=3g.40gb@4,sharing=mps,memory=4096Mi,compute=250m``."""
    mig = f",mig={s.mig.profile}@{s.mig.start}" if s.mig is not None else ""
    return f"gpu={s.gpu_uuid}{mig},sharing={s.sharing.value},memory={s.memory_mib}Mi,compute={s.compute_milli}m"


class Allocator:
    def __init__(
        self,
        node_name: str,
        backend: GpuBackend,
        kube: KubeApi,
        mig: MigManager,
        mps: MpsManager,
        state: AgentState,
        attributor: Attributor,
        cdi: CdiWriter,
        wait_s: float = 15.0,
        poll_s: float = 0.5,
        grant_grace_s: float = 120.0,
    ) -> None:
        self.node_name = node_name
        self._backend = backend
        self._kube = kube
        self._mig = mig
        self._mps = mps
        self._state = state
        self._attributor = attributor
        self.cdi = cdi
        self._wait_s = wait_s
        self._poll_s = poll_s
        self._grace_s = grant_grace_s
        self._recent: list[RecentGrant] = []
        # One container at a time (two calls must never tie one device ID to two shares); the reconcile loop takes it
        # too around everything that destroys, stops or forgets, so it never acts between a grant's steps.
        self.lock = asyncio.Lock()
        # Set when a grant waits on MIG room that finished pods may still hold: the agent reconciles at once (the
        # scheduler frees a finished pod's share at once, the agent's timer would only in up to its interval).
        self.reconcile_wanted = asyncio.Event()

    # ----- the kubelet's calls ---------------------------------------------------------------------------------
    def allocate(self, device_ids: Sequence[str]) -> AllocateAnswer:
        if not device_ids:
            raise AllocationError(f"the kubelet asked for 0 {GPU_RESOURCE}; at least 1 is needed")
        name = cdi_allocation_name(device_ids)
        return AllocateAnswer(cdi_device_id(name), {NVIDIA_VISIBLE_DEVICES_ENV: NO_GPU})

    async def prestart(self, device_ids: Sequence[str]) -> ContainerGrant:
        """The container that holds ``device_ids`` is about to be created: make its share ready and write its CDI
        spec. Raises :class:`AllocationError` (the kubelet retries the container later) rather than guess."""
        ids = tuple(sorted(set(device_ids)))
        async with self.lock:
            deadline = time.monotonic() + self._wait_s
            try:
                owner = await self._attributor.owner(ids)
            except AttributionError as e:
                raise AllocationError(str(e)) from None
            pod, pods = await self._pod_of(owner, deadline)
            assignment = self._assignment_of(pod)
            shares = self._shares_for(pod, assignment, ids)
            grant = await self._grant(pod, owner.container, shares, deadline, cdi_allocation_name(ids), pods)
            try:
                self.cdi.write_allocation(
                    CdiDevice(
                        grant.cdi_name,
                        tuple(grant.envs.items()),
                        grant.device_nodes,
                        grant.mounts,
                    )
                )
            except CdiError as e:
                raise AllocationError(f"pod {pod.key}: {e}") from None
            self._remember(pod, shares, grant, pods)
            self._state.record_allocation(pod.uid, owner.container, grant.units, grant.cdi_name)
            log.info(
                "prestart: %s container %s gets %s (device IDs %s)",
                pod.key,
                owner.container,
                ",".join(grant.units),
                ",".join(ids),
            )
            return grant

    async def _pause(self, reconcile: bool = False) -> None:
        """Wait a poll period without the lock: the other containers of a burst are served meanwhile (the kubelet gives
        each PreStartContainer 30 s, so one container waiting for a MIG instance must not hold up the rest)."""
        if reconcile:
            self.reconcile_wanted.set()
        self.lock.release()
        try:
            await asyncio.sleep(self._poll_s)
        finally:
            await self.lock.acquire()

    def recent_grants(self) -> tuple[RecentGrant, ...]:
        """The grants made within the grace period (older ones are dropped here)."""
        cutoff = time.monotonic() - self._grace_s
        self._recent = [g for g in self._recent if g.at >= cutoff]
        return tuple(self._recent)

    def _remember(
        self, pod: PodInfo, shares: tuple[GpuShare, ...], grant: ContainerGrant, pods: Sequence[PodInfo]
    ) -> None:
        mps: tuple[tuple[DaemonKey, MpsLimits], ...] = ()
        if any(s.sharing is Mechanism.MPS for s in shares):
            tenant = self._tenant(pod)
            peers = self.mps_peers(pods)
            mps = tuple(
                (
                    self._mps.key(unit, tenant),
                    MpsLimits.of_share(s.compute_milli, s.memory_mib, tenant_compute(s, tenant, peers)),
                )
                for s, unit in zip(shares, grant.units, strict=True)
                if s.sharing is Mechanism.MPS
            )
        self.recent_grants()  # prune
        self._recent.append(
            RecentGrant(
                pod.uid,
                pod.key,
                time.monotonic(),
                frozenset(MigNeed(s.gpu_index, s.mig.start, s.mig.profile) for s in shares if s.mig is not None),
                frozenset(s.gpu_index for s in shares if s.mig is None),
                mps,
            )
        )

    # ----- whose tenant -----------------------------------------------------------------------------------------
    def _tenant(self, pod: PodInfo) -> str:
        """The tenant of the daemon that serves ``pod``'s MPS clients on this node."""
        try:
            return self._mps.tenant_key(pod.tenant)
        except TenantConflict as e:
            raise AllocationError(f"pod {pod.key}: {e}") from None

    def mps_peers(self, pods: Sequence[PodInfo]) -> list[tuple[Assignment, str]]:
        """The live pods of this node (``pods``: as the API lists them, the starting one included) with an MPS share,
        as (assignment, tenant of the daemon that serves them); a pod whose assignment or tenant cannot be read is
        left out (it is refused when its containers start)."""
        out = []
        for p in pods:
            text = p.annotations.get(ASSIGNMENT_ANNOTATION)
            if p.finished or p.node_name != self.node_name or text is None:
                continue
            try:
                a = Assignment.from_json(text)
                if a.node == self.node_name and a.pod == p.key and any(s.sharing is Mechanism.MPS for s in a.shares):
                    out.append((a, self._mps.tenant_key(p.tenant)))
            except (InvalidAssignment, TenantConflict):
                continue
        return out

    # ----- whose container -------------------------------------------------------------------------------------
    async def _pod_of(self, owner: Owner, deadline: float) -> tuple[PodInfo, list[PodInfo]]:
        """The pod the kubelet named, as the API has it (this agent's list may lag a moment: retry, bounded), and the
        node's pods as that list showed them."""
        last_error = ""
        while True:
            try:
                pods = await self._kube.pods_on_node(self.node_name)
            except KubeError as e:
                pods, last_error = [], str(e)
            found = [
                p
                for p in pods
                if (not owner.name or (p.namespace, p.name) == (owner.namespace, owner.name))
                and (not owner.uid or p.uid == owner.uid)
            ]
            if len(found) == 1 and found[0].node_name == self.node_name:
                return found[0], pods
            if time.monotonic() >= deadline:
                why = f" (last API error: {last_error})" if last_error else ""
                raise AllocationError(
                    f"the kubelet says pod {owner.pod} holds these {GPU_RESOURCE}, but no such pod"
                    f"{f' with UID {owner.uid}' if owner.uid and owner.name else ''} is bound to node "
                    f"{self.node_name} in the API{why}; refusing to guess"
                )
            await self._pause()

    # ----- its assignment --------------------------------------------------------------------------------------
    def _assignment_of(self, pod: PodInfo) -> Assignment:
        text = pod.annotations.get(ASSIGNMENT_ANNOTATION)
        if text is None:
            raise AllocationError(
                f"pod {pod.key} asks for {GPU_RESOURCE} but has no {ASSIGNMENT_ANNOTATION} annotation; "
                "it must be scheduled by the sharegpu scheduler"
            )
        try:
            a = Assignment.from_json(text)
        except InvalidAssignment as e:
            raise AllocationError(f"pod {pod.key}: {ASSIGNMENT_ANNOTATION} is invalid: {e}") from None
        if a.node != self.node_name:
            raise AllocationError(
                f"pod {pod.key}: its assignment is for node {a.node}, not this node {self.node_name}; refusing it"
            )
        if a.pod != pod.key:
            raise AllocationError(
                f"pod {pod.key}: its assignment belongs to pod {a.pod}; refusing a foreign assignment"
            )
        return a

    def _shares_for(self, pod: PodInfo, a: Assignment, ids: tuple[str, ...]) -> tuple[GpuShare, ...]:
        demand = pod.gpu_demand
        if demand != len(a.shares):
            raise AllocationError(
                f"pod {pod.key}: its containers hold {demand} {GPU_RESOURCE} at their peak, "
                f"but its assignment holds {len(a.shares)} GPU share(s)"
            )
        tied = self._state.device_shares(pod.uid)
        taken = set(tied.values())
        free = [i for i in range(len(a.shares)) if i not in taken]
        new = [d for d in ids if d not in tied]
        if len(new) > len(free):
            raise AllocationError(
                f"pod {pod.key}: the kubelet gave it more {GPU_RESOURCE} device IDs ({len(tied) + len(new)}) than its "
                f"assignment has shares ({len(a.shares)}); refusing"
            )
        if new:
            tied = self._state.tie_device_shares(pod.uid, dict(zip(new, free, strict=False)))
        return tuple(a.shares[tied[d]] for d in ids)

    # ----- what enforces it ------------------------------------------------------------------------------------
    async def _grant(
        self,
        pod: PodInfo,
        container: str,
        shares: tuple[GpuShare, ...],
        deadline: float,
        cdi_name: str,
        pods: Sequence[PodInfo],
    ) -> ContainerGrant:
        devices = {d.index: d for d in self._backend.devices()}
        units: list[str] = []
        nodes: list[str] = []
        for s in shares:
            dev = devices.get(s.gpu_index)
            if dev is None or dev.uuid != s.gpu_uuid:
                have = ", ".join(f"{d.index}={d.uuid}" for d in devices.values()) or "none"
                raise AllocationError(
                    f"pod {pod.key}: its assignment names GPU {s.gpu_index} ({s.gpu_uuid}), "
                    f"which node {self.node_name} does not have; its GPUs: {have}"
                )
            if not dev.healthy:
                raise AllocationError(f"pod {pod.key}: GPU {dev.uuid} is unhealthy")
            if s.mig is None and dev.mig_enabled:
                await self._whole_gpu(pod, s, deadline)
            units.append(await self._unit_of(pod, s, deadline) if s.mig is not None else dev.uuid)
            try:
                nodes += self._backend.device_nodes(s.gpu_index)
            except BackendError as e:
                raise AllocationError(f"pod {pod.key}: GPU {dev.uuid}: {e}") from None
        envs = {
            NVIDIA_VISIBLE_DEVICES_ENV: ",".join(units),
            MECHANISM_ENV: ",".join(s.sharing.value for s in shares),
            # What the container was given, in words it can log: the assignment's shares, one per unit.
            SHARES_ENV: ";".join(share_text(s) for s in shares),
        }
        mounts: list[CdiMount] = []
        mps = [(i, s) for i, s in enumerate(shares) if s.sharing is Mechanism.MPS]
        if mps:
            if len(shares) > 1:
                raise AllocationError(
                    f"pod {pod.key} container {container}: an MPS client talks to one MPS daemon, which serves "
                    "one GPU or MIG instance; give each MPS share its own container"
                )
            i, s = mps[0]
            tenant = self._tenant(pod)
            # Its cap is held against its own tenant's shares on the unit: the clients it runs beside.
            together = tenant_compute(s, tenant, self.mps_peers(pods))
            try:
                # Its tenant's daemon holds the client to its share (at least: to the largest of the tenant's shares on
                # the unit) before the container may start; the environment below can only lower that further.
                spec = await self._mps.ensure(
                    units[i], tenant, MpsLimits.of_share(s.compute_milli, s.memory_mib, together)
                )
            except MpsError as e:
                raise AllocationError(f"pod {pod.key}: {e}") from None
            # Only its own daemon's pipe directory: a container cannot reach another tenant's server.
            mounts.append(CdiMount(MPS_PIPE_IN_CONTAINER, str(spec.pipe_dir)))
            envs |= mps_client_env(MPS_PIPE_IN_CONTAINER, s.compute_milli, s.memory_mib, together)
        return ContainerGrant(
            pod.key, pod.uid, container, tuple(units), envs, tuple(mounts), tuple(dict.fromkeys(nodes)), cdi_name
        )

    async def _whole_gpu(self, pod: PodInfo, s: GpuShare, deadline: float) -> None:
        # A GPU in MIG mode has no whole-GPU device: its UUID would hand the container every MIG instance on it.
        while True:
            why = self._mig.release_for_whole_gpu(s.gpu_index, s.gpu_uuid, f"pod {pod.key}")
            if why is None:
                return
            if time.monotonic() >= deadline:
                raise AllocationError(
                    f"pod {pod.key}: GPU {s.gpu_index} ({s.gpu_uuid}) is in MIG mode and its share is not a MIG "
                    f"instance; refusing to hand out the whole GPU: {why}"
                )
            await self._pause(reconcile=True)

    async def _unit_of(self, pod: PodInfo, s: GpuShare, deadline: float) -> str:
        assert s.mig is not None
        # An instance in the way may belong to a pod that is still shutting down: wait for it, bounded.
        while True:
            try:
                return self._mig.ensure(s.gpu_index, s.gpu_uuid, s.mig).uuid
            except (MigError, BackendError) as e:
                if isinstance(e, MigInvalid) or time.monotonic() >= deadline:
                    raise AllocationError(f"pod {pod.key}: MIG instance not available: {e}") from None
            await self._pause(reconcile=True)
