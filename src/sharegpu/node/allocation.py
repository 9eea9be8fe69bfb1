"""Allocate: find the container that the kubelet is starting and turn its assignment into what enforces it.

The kubelet's Allocate call names only device IDs, never the pod. sharegpu's device IDs are interchangeable
tokens, so the pod is found the way other GPU-sharing plugins do it: the oldest pending pod bound to this node
whose next not-yet-allocated container asks for as many ``sharegpu.io/gpu`` as the kubelet passed. Its
``sharegpu.io/assignment`` then decides everything: which GPU or MIG instance, and which limits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

from sharegpu.model.assignment import Assignment, GpuShare, InvalidAssignment, Mechanism
from sharegpu.node.backends.base import BackendError, GpuBackend
from sharegpu.node.kube import ASSIGNMENT_ANNOTATION, GPU_RESOURCE, ContainerInfo, KubeApi, KubeError, PodInfo
from sharegpu.node.mig import MigError, MigInvalid, MigManager, MigNeed
from sharegpu.node.mps import MpsError, MpsLimits, MpsManager
from sharegpu.node.state import AgentState

log = logging.getLogger(__name__)

MPS_PIPE_IN_CONTAINER = "/run/sharegpu/mps"
REFUSED_TTL_S = 600.0  # the kubelet marks a refused pod Failed long before this; the API may lag behind it
REFUSED_MAX = 1024


class AllocationError(Exception):
    """Allocate cannot serve a container; the message goes to the kubelet and the pod's events."""


@dataclass(frozen=True, slots=True)
class MountSpec:
    container_path: str
    host_path: str
    read_only: bool = False


@dataclass(frozen=True, slots=True)
class ContainerGrant:
    """What one container gets: the devices it may see and the limits that hold it to its share."""

    pod: str
    pod_uid: str
    container: str
    units: tuple[str, ...]  # GPU-… or MIG-… UUIDs, in the assignment's order
    envs: Mapping[str, str] = field(default_factory=dict)
    mounts: tuple[MountSpec, ...] = ()


@dataclass(frozen=True, slots=True)
class RecentGrant:
    """What one Allocate just handed out, for a reconcile whose pod list may predate it.

    The reconcile loop lists pods, then acts; an Allocate that runs in between is not in that list. Until the
    grant is older than the allocator's grace period, reconcile treats its MIG instances, MPS daemon (with its
    limits) and GPUs as needed and its pod's allocations as live.
    """

    pod_uid: str
    at: float  # time.monotonic() when it was made
    mig: frozenset[MigNeed] = frozenset()
    non_mig_gpus: frozenset[int] = frozenset()
    mps: tuple[tuple[str, MpsLimits], ...] = ()  # unit UUID and the limits its daemon was given


class Allocator:
    def __init__(
        self,
        node_name: str,
        backend: GpuBackend,
        kube: KubeApi,
        mig: MigManager,
        mps: MpsManager,
        state: AgentState,
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
        self._wait_s = wait_s
        self._poll_s = poll_s
        self._grace_s = grant_grace_s
        self._recent: list[RecentGrant] = []
        # Pods Allocate refused (or failed on): the kubelet rejects such a pod for good, but its Failed status can
        # reach the API after the next Allocate, which must not pick it again. Bounded, and each entry expires.
        self._refused: OrderedDict[str, float] = OrderedDict()  # pod UID → monotonic expiry
        # One container at a time (two calls must never pick the same container); the reconcile loop takes it too
        # around everything that destroys, stops or forgets, so it never acts between an Allocate's steps.
        self.lock = asyncio.Lock()

    async def allocate(self, device_count: int) -> ContainerGrant:
        if device_count < 1:
            raise AllocationError(f"the kubelet asked for {device_count} {GPU_RESOURCE}; at least 1 is needed")
        async with self.lock:
            deadline = time.monotonic() + self._wait_s
            pod, container, index = await self._find_container(device_count, deadline)
            try:
                assignment = self._assignment_of(pod)
                shares = self._shares_for(pod, assignment, container, index)
                grant = await self._grant(pod, container, shares, deadline)
            except BaseException:
                self._refuse(pod.uid)  # whatever the reason, the kubelet now rejects this pod
                raise
            self._remember(pod.uid, shares, grant)
            self._state.record_allocation(pod.uid, container.name, grant.units)
            log.info("allocated %s to %s container %s", ",".join(grant.units), pod.key, container.name)
            return grant

    def recent_grants(self) -> tuple[RecentGrant, ...]:
        """The grants made within the grace period (older ones are dropped here)."""
        cutoff = time.monotonic() - self._grace_s
        self._recent = [g for g in self._recent if g.at >= cutoff]
        return tuple(self._recent)

    def _remember(self, pod_uid: str, shares: tuple[GpuShare, ...], grant: ContainerGrant) -> None:
        mps = tuple(
            (unit, MpsLimits.of_share(s.compute_milli, s.memory_mib))
            for s, unit in zip(shares, grant.units, strict=True)
            if s.sharing is Mechanism.MPS
        )
        self.recent_grants()  # prune
        self._recent.append(
            RecentGrant(
                pod_uid,
                time.monotonic(),
                frozenset(MigNeed(s.gpu_index, s.mig.start, s.mig.profile) for s in shares if s.mig is not None),
                frozenset(s.gpu_index for s in shares if s.mig is None),
                mps,
            )
        )

    # ----- which container -------------------------------------------------------------------------------------
    async def _find_container(self, count: int, deadline: float) -> tuple[PodInfo, ContainerInfo, int]:
        # The scheduler binds a pod before the kubelet starts it, but this agent's list may lag: retry, bounded.
        last_error = ""
        while True:
            try:
                pods = await self._kube.pods_on_node(self.node_name)
            except KubeError as e:
                pods, last_error = [], str(e)
            found = self._pick(pods, count)
            if found is not None:
                return found
            if time.monotonic() >= deadline:
                why = f" (last API error: {last_error})" if last_error else ""
                raise AllocationError(
                    f"no pending pod bound to node {self.node_name} has a container waiting for "
                    f"{count} {GPU_RESOURCE}{why}"
                )
            await asyncio.sleep(self._poll_s)

    def _refuse(self, pod_uid: str) -> None:
        self._refused.pop(pod_uid, None)
        self._refused[pod_uid] = time.monotonic() + REFUSED_TTL_S
        while len(self._refused) > REFUSED_MAX:
            self._refused.popitem(last=False)

    def refused(self, pod_uid: str) -> bool:
        expiry = self._refused.get(pod_uid)
        if expiry is None:
            return False
        if expiry < time.monotonic():
            del self._refused[pod_uid]
            return False
        return True

    def _pick(self, pods: list[PodInfo], count: int) -> tuple[PodInfo, ContainerInfo, int] | None:
        waiting = [
            p
            for p in pods
            if p.node_name == self.node_name
            and p.phase == "Pending"
            and not p.reason  # the kubelet rejected it (UnexpectedAdmissionError, OutOf…): no Allocate will come
            and not p.deleting
            and p.gpu_containers
            and not self.refused(p.uid)
        ]
        for pod in sorted(waiting, key=lambda p: (p.created, p.key)):
            done = self._state.allocated_containers(pod.uid)
            for c, index in pod.share_offsets():
                if c.name not in done:
                    if c.gpus == count:
                        return pod, c, index
                    break  # the kubelet allocates a pod's containers in order: this pod is not the one
        return None

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

    def _shares_for(self, pod: PodInfo, a: Assignment, container: ContainerInfo, index: int) -> tuple[GpuShare, ...]:
        asked = pod.gpu_demand
        if asked != len(a.shares):
            raise AllocationError(
                f"pod {pod.key}: its containers ask for {asked} {GPU_RESOURCE} in all, "
                f"but its assignment holds {len(a.shares)} GPU share(s)"
            )
        return a.shares[index : index + container.gpus]

    # ----- what enforces it ------------------------------------------------------------------------------------
    async def _grant(
        self, pod: PodInfo, container: ContainerInfo, shares: tuple[GpuShare, ...], deadline: float
    ) -> ContainerGrant:
        devices = {d.index: d for d in self._backend.devices()}
        units: list[str] = []
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
        envs = {"NVIDIA_VISIBLE_DEVICES": ",".join(units)}
        mounts: list[MountSpec] = []
        mps = [(i, s) for i, s in enumerate(shares) if s.sharing is Mechanism.MPS]
        if mps:
            if len(shares) > 1:
                raise AllocationError(
                    f"pod {pod.key} container {container.name}: an MPS client talks to one MPS daemon, which serves "
                    "one GPU or MIG instance; give each MPS share its own container"
                )
            i, s = mps[0]
            try:
                # The daemon holds the client to its share (at least: to the largest share on the unit) before the
                # container may start; the environment below can only lower that further.
                spec = await self._mps.ensure(units[i], MpsLimits.of_share(s.compute_milli, s.memory_mib))
            except MpsError as e:
                raise AllocationError(f"pod {pod.key}: {e}") from None
            mounts.append(MountSpec(MPS_PIPE_IN_CONTAINER, str(spec.pipe_dir)))
            envs["CUDA_MPS_PIPE_DIRECTORY"] = MPS_PIPE_IN_CONTAINER
            # Rounded down: a client may use less than promised, never more.
            envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, s.compute_milli // 10))
            if s.memory_mib > 0:
                envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={s.memory_mib}M"
        return ContainerGrant(pod.key, pod.uid, container.name, tuple(units), envs, tuple(mounts))

    async def _whole_gpu(self, pod: PodInfo, s: GpuShare, deadline: float) -> None:
        # A GPU in MIG mode has no whole-GPU device: its UUID would hand the container every MIG instance on it.
        while True:
            why = self._mig.release_for_whole_gpu(s.gpu_index, s.gpu_uuid)
            if why is None:
                return
            if time.monotonic() >= deadline:
                raise AllocationError(
                    f"pod {pod.key}: GPU {s.gpu_index} ({s.gpu_uuid}) is in MIG mode and its share is not a MIG "
                    f"instance; refusing to hand out the whole GPU: {why}"
                )
            await asyncio.sleep(self._poll_s)

    async def _unit_of(self, pod: PodInfo, s: GpuShare, deadline: float) -> str:
        assert s.mig is not None
        # An instance in the way may belong to a pod that is still shutting down: wait for it, bounded.
        while True:
            try:
                return self._mig.ensure(s.gpu_index, s.gpu_uuid, s.mig).uuid
            except (MigError, BackendError) as e:
                if isinstance(e, MigInvalid) or time.monotonic() >= deadline:
                    raise AllocationError(f"pod {pod.key}: MIG instance not available: {e}") from None
            await asyncio.sleep(self._poll_s)
