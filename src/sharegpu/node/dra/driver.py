"""Prepare and unprepare claims: make each allocated device ready, write its CDI spec, remember it; undo it.

The node agent's GPU backend, MIG manager and MPS manager do the work, so a claim is enforced exactly as a
device-plugin assignment is: a MIG instance created at the allocated placement, an MPS daemon told the largest
share on its unit (the client's environment can only lower it), the time-slice setting of the GPU. Calls are
serialised by one lock; each claim succeeds or fails on its own. What was made for claims that are gone (a failed
Prepare half-way, an Unprepare) is released by deriving what the remaining claims need from the checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Protocol

from sharegpu.kube.schema import Pod, ResourceClaim
from sharegpu.model.assignment import Mechanism, MigSlot
from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog
from sharegpu.model.contract import (
    MECHANISM_ENV,
    MPS_MEMORY_LIMIT_ENV,
    MPS_PIPE_DIRECTORY_ENV,
    MPS_THREAD_PERCENTAGE_ENV,
    NVIDIA_VISIBLE_DEVICES_ENV,
    cdi_claim_device_name,
    cdi_device_id,
)
from sharegpu.node.allocation import MPS_PIPE_IN_CONTAINER
from sharegpu.node.backends.base import BackendError, GpuBackend
from sharegpu.node.cdi import CdiDevice, CdiError, CdiMount, CdiWriter
from sharegpu.node.dra.checkpoint import Checkpoint, CheckpointError
from sharegpu.node.dra.claims import ClaimError, ClaimPlan, DevicePlan, plan_claim
from sharegpu.node.dra.config import TimeSlice
from sharegpu.node.mig import MigError, MigManager, MigNeed
from sharegpu.node.mps import MpsError, MpsLimits, MpsManager

log = logging.getLogger(__name__)


class ClaimSource(Protocol):
    async def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        """The ResourceClaim; raises on any failure (one the schema cannot read too) with a readable message."""
        ...

    async def get_pod(self, namespace: str, name: str) -> Pod:
        """A Pod; raises on any failure (one the schema cannot read too) with a readable message."""
        ...


class TimeSlicer(Protocol):
    async def set(self, gpu_uuid: str, interval: TimeSlice) -> None: ...


class NvidiaSmiTimeSlicer:
    """``nvidia-smi compute-policy --set-timeslice``: the GPU's time-slice length, for all its time-shared clients."""

    def __init__(self, smi: str = "nvidia-smi") -> None:
        self._smi = smi

    async def set(self, gpu_uuid: str, interval: TimeSlice) -> None:
        try:
            proc = await asyncio.create_subprocess_exec(
                self._smi,
                "compute-policy",
                "-i",
                gpu_uuid,
                f"--set-timeslice={interval.level}",
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            out, _ = await asyncio.wait_for(proc.communicate(), 10.0)
        except (OSError, TimeoutError) as e:
            raise BackendError(f"cannot run {self._smi} compute-policy: {e}") from None
        if proc.returncode != 0:
            raise BackendError(f"{self._smi} compute-policy --set-timeslice failed: {out.decode(errors='replace')}")


class SimTimeSlicer:
    """The simulated node's time-slice settings (GPU UUID → interval)."""

    def __init__(self) -> None:
        self.intervals: dict[str, TimeSlice] = {}

    async def set(self, gpu_uuid: str, interval: TimeSlice) -> None:
        self.intervals[gpu_uuid] = interval


_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_NAMESPACE = re.compile(_DNS_LABEL)
_NAME = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_UID = re.compile(r"[A-Za-z0-9-]+")  # what a CDI file name can carry; API server UIDs are RFC 4122 UUIDs


def printable(text: str) -> str:
    """``text`` for a log line: control, format (bidirectional) and other non-printable characters escaped.

    Claim references come from the kubelet's request; a NUL or a right-to-left override in a log line would hide or
    reorder what an operator reads. Backslashes are escaped too, so an escaped form cannot be faked.
    """
    return "".join(
        ch if ch.isprintable() and ch != "\\" else ch.encode("unicode_escape").decode("ascii") for ch in text
    )


@dataclass(frozen=True, slots=True)
class ClaimRef:
    namespace: str
    uid: str
    name: str

    def problem(self) -> str:
        """Why the kubelet's reference cannot name a ResourceClaim ("" when it can).

        Checked before the name reaches an API path or the UID a file name: ``../../etc/passwd`` must never be
        read as a path, and an empty reference would read some other object.
        """
        out: list[str] = []
        if not _NAMESPACE.fullmatch(self.namespace) or len(self.namespace) > 63:
            out.append(f"namespace '{printable(self.namespace)}' is not a namespace name (a DNS label)")
        if not _NAME.fullmatch(self.name) or len(self.name) > 253:
            out.append(f"name '{printable(self.name)}' is not a ResourceClaim name (a DNS subdomain)")
        if not _UID.fullmatch(self.uid) or len(self.uid) > 128:
            out.append(f"UID '{printable(self.uid)}' is not a UID (letters, digits and '-')")
        if not out:
            return ""
        return "the claim reference is invalid: " + "; ".join(out) + "; the kubelet names claims the API server made"

    @property
    def shown(self) -> str:
        return f"{printable(self.namespace)}/{printable(self.name)} ({printable(self.uid)})"


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    request: str
    pool: str
    device: str
    cdi_ids: tuple[str, ...]
    share_id: str | None


@dataclass(frozen=True, slots=True)
class PrepareResult:
    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


class DraDriver:
    def __init__(
        self,
        node_name: str,
        backend: GpuBackend,
        claims: ClaimSource,
        mig: MigManager,
        mps: MpsManager,
        checkpoint: Checkpoint,
        cdi: CdiWriter,
        time_slicer: TimeSlicer,
        catalog: Catalog = DEFAULT_CATALOG,
    ) -> None:
        self.node_name = node_name
        self.backend = backend
        self._claims = claims
        self._mig = mig
        self._mps = mps
        self.checkpoint = checkpoint
        self._cdi = cdi
        self._time_slicer = time_slicer
        self._catalog = catalog
        self._sliced: set[str] = set()  # GPUs whose time slice this process changed
        self.lock = asyncio.Lock()

    # ----- the kubelet's calls ---------------------------------------------------------------------------------
    async def prepare(self, claims: Iterable[ClaimRef]) -> dict[str, PrepareResult]:
        out: dict[str, PrepareResult] = {}
        async with self.lock:
            for ref in claims:
                problem = ref.problem()
                if problem:
                    out[ref.uid] = PrepareResult(error=problem)
                    log.warning("claim %s not prepared: %s", ref.shown, printable(problem))
                    continue
                try:
                    out[ref.uid] = PrepareResult(await self._prepare_one(ref))
                except (ClaimError, MigError, MpsError, BackendError, CdiError, CheckpointError) as e:
                    out[ref.uid] = PrepareResult(error=str(e))
                except Exception as e:  # a bug must fail one claim, never the others
                    log.exception("preparing claim %s failed unexpectedly", ref.shown)
                    out[ref.uid] = PrepareResult(error=f"sharegpu DRA driver failed: {type(e).__name__}: {e}")
                if out[ref.uid].error:
                    log.warning("claim %s not prepared: %s", ref.shown, printable(out[ref.uid].error))
                    await self._release()  # what a half-done Prepare made and no prepared claim needs
        return out

    async def unprepare(self, claims: Iterable[ClaimRef]) -> dict[str, str]:
        """Claim UID → error ("" on success). A claim never prepared here (or already unprepared) succeeds."""
        out: dict[str, str] = {}
        async with self.lock:
            for ref in claims:
                try:
                    if ref.uid in self.checkpoint.claims:
                        self._cdi.remove(ref.uid)
                        self.checkpoint.drop(ref.uid)
                        log.info("unprepared claim %s", ref.shown)
                    out[ref.uid] = ""
                except (CdiError, CheckpointError) as e:
                    out[ref.uid] = str(e)
            await self._release()
        return out

    # ----- life cycle ------------------------------------------------------------------------------------------
    async def recover(self) -> None:
        """After a restart: adopt MPS daemons, drop CDI specs no checkpointed claim owns, release the rest."""
        await self._mps.recover()
        async with self.lock:
            for uid in self._cdi.claim_uids() - set(self.checkpoint.claims):
                self._cdi.remove(uid)
            await self._release()

    async def reconcile(self) -> None:
        async with self.lock:
            await self._release()

    # ----- internals -------------------------------------------------------------------------------------------
    async def _prepare_one(self, ref: ClaimRef) -> tuple[PreparedDevice, ...]:
        plan = self.checkpoint.claims.get(ref.uid)
        if plan is not None:  # prepared already (a retry, or the kubelet after our restart)
            return self._answer(plan, self.checkpoint.units[ref.uid])
        try:
            claim = await self._claims.get_claim(ref.namespace, ref.name)
        except Exception as e:
            raise ClaimError(f"cannot read claim {ref.namespace}/{ref.name}: {e}") from None
        plan = plan_claim(claim, ref.uid, self.node_name, self.backend.devices(), self._catalog)
        if any(d.mechanism is Mechanism.MPS for d in plan.devices):
            plan = replace(plan, user=await self._claim_user(plan, claim))
        units = await self._make_ready(plan)
        self._cdi.write(plan.uid, self._cdi_devices(plan, units))
        self.checkpoint.add(plan, units)
        log.info(
            "prepared claim %s (%s): %s",
            printable(plan.key),
            printable(plan.uid),
            ", ".join(f"{d.device}={d.mechanism.value}" for d in plan.devices),
        )
        return self._answer(plan, units)

    async def _claim_user(self, plan: ClaimPlan, claim: ResourceClaim) -> int | None:
        """The one Unix UID the pods the claim is reserved for declare for all their containers, or None."""
        users: set[int | None] = set()
        for r in claim.status.reserved_for:
            if r.resource != "pods":
                users.add(None)
                continue
            try:
                pod = await self._claims.get_pod(plan.namespace, r.name)
            except Exception as e:
                raise ClaimError(f"claim {plan.key}: cannot read its pod {r.name!r}: {e}") from None
            users |= {pod.run_as_user(c) for c in (*pod.spec.init_containers, *pod.spec.containers)}
        known = {u for u in users if u is not None}
        if len(known) > 1:
            raise ClaimError(
                f"claim {plan.key}: its pods run as Unix users {sorted(known)}; one MPS server serves one user at a "
                "time, so they would wait on each other: run them as one user (securityContext.runAsUser)"
            )
        return None if None in users or not known else known.pop()

    def _mps_conflict(self, plan: ClaimPlan, unit: str) -> str | None:
        """Why an MPS client of ``plan`` cannot join the MPS clients already prepared on ``unit``, if it cannot."""
        for uid, other in self.checkpoint.claims.items():
            if uid == plan.uid:
                continue
            shares_unit = any(
                d.mechanism is Mechanism.MPS and u == unit
                for d, u in zip(other.devices, self.checkpoint.units[uid], strict=True)
            )
            if not shares_unit:
                continue
            if other.user is None or plan.user is None or other.user != plan.user:
                theirs = f"user {other.user}" if other.user is not None else "a user it does not declare"
                mine = f"user {plan.user}" if plan.user is not None else "a user they do not declare"
                return (
                    f"the MPS unit {unit} serves claim {other.key} of {theirs}, and this claim's pods run as {mine}; "
                    "one MPS server serves one Unix user at a time, so they would wait until every client of the "
                    "other has exited. This claim waits until that unit is free; set securityContext.runAsUser to "
                    "the same UID in both pods to let them share it"
                )
        return None

    async def _make_ready(self, plan: ClaimPlan) -> tuple[str, ...]:
        if any(d.mechanism is Mechanism.MPS for d in plan.devices) and len(plan.devices) > 1:
            raise ClaimError(
                f"claim {plan.key}: an MPS client talks to one MPS daemon, which serves one GPU or MIG instance; "
                "put each MPS share in its own claim"
            )
        for d in plan.devices:
            if d.mechanism is Mechanism.MPS:
                target = self._mps_unit_of(d)
                if target is not None and (why := self._mps_conflict(plan, target)):
                    raise ClaimError(f"claim {plan.key}: {why}")
        gpus = {g.index: g for g in self.backend.devices()}
        # The scheduler never allocates a partition beside a whole or shared GPU (they share counters); an
        # allocation that does anyway (a stale pool generation) is refused rather than allowed to break the other.
        in_use = {(d.gpu_index, d.on_mig) for d, _ in self.checkpoint.devices()}
        for d in plan.devices:
            is_mig = d.on_mig
            if (d.gpu_index, not is_mig) in in_use:
                other = (
                    "used without MIG by another claim" if is_mig else "partitioned into MIG instances of other claims"
                )
                raise ClaimError(f"claim {plan.key}: {d.device} cannot be prepared: GPU {d.gpu_uuid} is {other}")
        units: list[str] = []
        for d in plan.devices:
            if d.on_mig:
                assert d.mig_profile is not None and d.mig_start is not None
                unit = self._mig.ensure(d.gpu_index, d.gpu_uuid, MigSlot(d.mig_profile, d.mig_start)).uuid
            else:
                if gpus[d.gpu_index].mig_enabled:
                    why = self._mig.release_for_whole_gpu(d.gpu_index, d.gpu_uuid, f"claim {plan.key}")
                    if why is not None:
                        raise ClaimError(
                            f"claim {plan.key}: GPU {d.gpu_uuid} is in MIG mode and {d.device} is not a MIG device; "
                            f"refusing to hand out the whole GPU: {why}"
                        )
                unit = d.gpu_uuid
            if d.mechanism is Mechanism.MPS:
                # The daemon holds the client to (at least) its share before the container can start.
                await self._mps.ensure(unit, MpsLimits.of_share(d.compute_percent * 10, d.memory_mib))
            if d.mechanism is Mechanism.TIME_SLICING:
                await self._time_slicer.set(d.gpu_uuid, d.time_slice)
                self._sliced.add(d.gpu_uuid)
            units.append(unit)
        return tuple(units)

    def _mps_unit_of(self, d: DevicePlan) -> str | None:
        """The unit an MPS device will run on, before it is made ready: the GPU, or its MIG instance if prepared."""
        if not d.on_mig:
            return d.gpu_uuid
        for other, unit in self.checkpoint.devices():
            if (other.gpu_index, other.mig_start, other.on_mig) == (d.gpu_index, d.mig_start, True):
                return unit
        return None  # a new instance: nobody else uses it

    def _cdi_devices(self, plan: ClaimPlan, units: tuple[str, ...]) -> tuple[CdiDevice, ...]:
        # Every device of the claim names all its units, so that merging their edits never hides one of them.
        visible = (NVIDIA_VISIBLE_DEVICES_ENV, ",".join(dict.fromkeys(units)))
        out: list[CdiDevice] = []
        for d, unit in zip(plan.devices, units, strict=True):
            env = [visible, (MECHANISM_ENV, d.mechanism.value)]
            mounts: list[CdiMount] = []
            if d.mechanism is Mechanism.MPS:
                spec = self._mps.spec(unit)
                env.append((MPS_PIPE_DIRECTORY_ENV, MPS_PIPE_IN_CONTAINER))
                env.append((MPS_THREAD_PERCENTAGE_ENV, str(d.compute_percent)))
                env.append((MPS_MEMORY_LIMIT_ENV, f"0={d.memory_mib}M"))
                mounts.append(CdiMount(MPS_PIPE_IN_CONTAINER, str(spec.pipe_dir)))
            nodes = self.backend.device_nodes(d.gpu_index)  # only nodes the host has: the runtime stats each one
            out.append(
                CdiDevice(cdi_claim_device_name(plan.uid, d.request, d.device), tuple(env), nodes, tuple(mounts))
            )
        return tuple(out)

    def _answer(self, plan: ClaimPlan, units: tuple[str, ...]) -> tuple[PreparedDevice, ...]:
        return tuple(
            PreparedDevice(
                d.request,
                d.pool,
                d.device,
                (cdi_device_id(cdi_claim_device_name(plan.uid, d.request, d.device)),),
                d.share_id,
            )
            for d in plan.devices
        )

    async def _release(self) -> None:
        """Bring MIG instances, MPS daemons and time slices to what the checkpointed claims need."""
        prepared = self.checkpoint.devices()
        needs = {
            MigNeed(d.gpu_index, d.mig_start, d.mig_profile)
            for d, _ in prepared
            if d.mig_profile is not None and d.mig_start is not None
        }
        non_mig: dict[int, set[str]] = {}
        for plan in self.checkpoint.claims.values():
            for d in plan.devices:
                if not d.on_mig:
                    non_mig.setdefault(d.gpu_index, set()).add(f"claim {plan.namespace}/{plan.name}")
        try:
            self._mig.reconcile(needs, non_mig)
        except BackendError as e:
            log.warning("MIG reconcile failed: %s", e)
        limits: dict[str, MpsLimits] = {}
        for d, unit in prepared:
            if d.mechanism is Mechanism.MPS:
                limits[unit] = MpsLimits.of_share(d.compute_percent * 10, d.memory_mib).union(limits.get(unit))
        await self._mps.reconcile(set(limits), limits)
        in_use = {d.gpu_uuid for d, _ in prepared if d.mechanism is Mechanism.TIME_SLICING}
        for gpu in sorted(self._sliced - in_use):
            try:
                await self._time_slicer.set(gpu, TimeSlice.DEFAULT)
                self._sliced.discard(gpu)
            except BackendError as e:
                log.warning("cannot reset the time slice of %s: %s", gpu, e)
