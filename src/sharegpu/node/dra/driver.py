"""Prepare and unprepare claims: make each allocated device ready, write its CDI spec, remember it; undo it.

The node agent's GPU backend, MIG manager and MPS manager do the work, so a claim is enforced exactly as a
device-plugin assignment is: a MIG instance created at the allocated placement, the MPS daemon of the claim's tenant
on its unit (:mod:`sharegpu.model.tenant`: the pods of one namespace and one declared UID, or a pod alone), told the
largest share of that tenant there (the client's environment can only lower it), the time-slice setting of the GPU.
A claim's tenant is that of the pods whose containers use it; the kubelet prepares a claim once for all its pods and
hands every one of them the same CDI devices, so a claim whose pods are of different tenants is refused (with what to
change) rather than given one daemon for users it cannot serve at once. Calls are serialised by one lock; each claim
succeeds or fails on its own. What was made for claims that are gone (a failed Prepare half-way, an Unprepare) is
released by deriving what the remaining claims need from the checkpoint.
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
    NVIDIA_VISIBLE_DEVICES_ENV,
    cdi_claim_device_name,
    cdi_device_id,
)
from sharegpu.model.tenant import MULTI_USER_TENANT, TenantConflict, describe, own_tenant, tenant_of
from sharegpu.node.allocation import MPS_PIPE_IN_CONTAINER
from sharegpu.node.backends.base import BackendError, GpuBackend
from sharegpu.node.cdi import CdiDevice, CdiError, CdiMount, CdiWriter
from sharegpu.node.dra.checkpoint import Checkpoint, CheckpointError
from sharegpu.node.dra.claims import ClaimError, ClaimPlan, DevicePlan, plan_claim
from sharegpu.node.dra.config import TimeSlice
from sharegpu.node.errors import NodeError
from sharegpu.node.mig import MigError, MigManager, MigNeed
from sharegpu.node.mps import DaemonKey, MpsError, MpsLimits, MpsManager, mps_client_env

log = logging.getLogger(__name__)


class DriverSetupError(NodeError):
    """The driver cannot serve with these settings (its MPS mode against the node or the checkpoint); the message says
    what to change."""


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

    @property
    def mps(self) -> MpsManager:
        """The node's MPS daemons (the audit and fault watch read them; change them under :attr:`lock` only)."""
        return self._mps

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
        """After a restart: adopt MPS daemons, drop CDI specs no checkpointed claim owns, release the rest.

        Raises :class:`DriverSetupError` where the MPS mode is not the one the checkpointed MPS claims were prepared
        in (their containers use those daemons).
        """
        self.check_mps_mode()
        await self._mps.recover()
        async with self.lock:
            for uid in self._cdi.claim_uids() - set(self.checkpoint.claims):
                self._cdi.remove(uid)
            await self._release()

    async def reconcile(self) -> None:
        async with self.lock:
            await self._release()

    def check_mps_mode(self) -> None:
        """Raise :class:`DriverSetupError` where the MPS mode is not the checkpointed claims': see :meth:`recover`."""
        other = sorted(
            plan.key
            for plan in self.checkpoint.claims.values()
            if any(d.mechanism is Mechanism.MPS for d in plan.devices)
            and (plan.tenant == MULTI_USER_TENANT) != self._mps.multi_user
        )
        if other:
            was = "in multi-user mode" if not self._mps.multi_user else "with a daemon per tenant"
            raise DriverSetupError(
                f"MPS claims prepared {was} remain on this node ({', '.join(other[:5])}"
                f"{', …' if len(other) > 5 else ''}); their containers use those daemons. Start the driver as "
                f"before ({'with' if not self._mps.multi_user else 'without'} --mps-multi-user), delete the pods of "
                "those claims and let it unprepare them, then change the setting"
            )

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
            plan = replace(plan, tenant=await self._claim_tenant(plan, claim))
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

    async def _claim_tenant(self, plan: ClaimPlan, claim: ResourceClaim) -> str:
        """Whose MPS daemon serves the claim: the one tenant of the pods whose containers use it.

        A pod's tenant here is read from the containers that use this claim (a sidecar that uses none decides
        nothing). The kubelet prepares a claim once and gives all its pods the same CDI devices, so pods of two
        tenants cannot each reach their own daemon through one claim: such a claim is refused with what to change.
        """
        if self._mps.multi_user:
            return MULTI_USER_TENANT
        tenants: dict[str, list[str]] = {}
        for r in claim.status.reserved_for:
            if r.resource != "pods":
                # Not a pod (a workload reserving for its pods): which containers use the claim, as whom, is not
                # known here. The claim is a tenant of its own (its UID is no pod's).
                tenants.setdefault(own_tenant(plan.uid), []).append(f"{r.resource} {r.name}")
                continue
            try:
                pod = await self._claims.get_pod(plan.namespace, r.name)
            except Exception as e:
                raise ClaimError(f"claim {plan.key}: cannot read its pod {r.name!r}: {e}") from None
            if r.uid and pod.metadata.uid and pod.metadata.uid != r.uid:
                continue  # the pod it was reserved for is gone; another pod has its name
            try:
                tenant = claim_tenant(pod, plan.name)
            except TenantConflict as e:
                raise ClaimError(f"claim {plan.key}: pod {r.name}: {e}") from None
            if tenant is not None:
                tenants.setdefault(tenant, []).append(f"pod {r.name}")
        if len(tenants) > 1:
            listed = "; ".join(f"{', '.join(who)}: {describe(t)}" for t, who in sorted(tenants.items()))
            raise ClaimError(
                f"claim {plan.key} is used by pods of different MPS tenants ({listed}). The kubelet prepares a claim "
                "once and gives all its pods the same devices, so they would all reach one MPS server, which serves "
                "one Unix user at a time: declare the same securityContext.runAsUser in every pod that uses the claim "
                "(and leave hostUsers unset), give each pod a claim of its own (a ResourceClaimTemplate), or run the "
                "driver with --mps-multi-user"
            )
        return next(iter(tenants), own_tenant(plan.uid))

    async def _make_ready(self, plan: ClaimPlan) -> tuple[str, ...]:
        if any(d.mechanism is Mechanism.MPS for d in plan.devices) and len(plan.devices) > 1:
            raise ClaimError(
                f"claim {plan.key}: an MPS client talks to one MPS daemon, which serves one GPU or MIG instance; "
                "put each MPS share in its own claim"
            )
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
                # The tenant's daemon holds the client to (at least) its share before the container can start.
                limits = MpsLimits.of_share(d.compute_percent * 10, d.memory_mib, self._daemon_milli(plan, d, unit))
                await self._mps.ensure(unit, plan.tenant, limits)
            if d.mechanism is Mechanism.TIME_SLICING:
                await self._time_slicer.set(d.gpu_uuid, d.time_slice)
                self._sliced.add(d.gpu_uuid)
            units.append(unit)
        return tuple(units)

    def _daemon_milli(self, plan: ClaimPlan, device: DevicePlan, unit: str) -> int:
        """The compute (milli) of every MPS share the daemon of ``plan``'s tenant on ``unit`` serves, ``device``
        included: a client's thread cap is its share against these (:func:`sharegpu.node.mps.thread_percentage`)."""
        key = self._mps.key(unit, plan.tenant)
        others = sum(
            d.compute_percent * 10
            for uid, key_d in self._daemon_devices().items()
            if uid != plan.uid
            for k, d in key_d
            if k == key
        )
        return device.compute_percent * 10 + others

    def _daemon_devices(self) -> dict[str, list[tuple[DaemonKey, DevicePlan]]]:
        """Per prepared claim, its MPS devices with the daemon that serves each."""
        out: dict[str, list[tuple[DaemonKey, DevicePlan]]] = {}
        for uid, plan in self.checkpoint.claims.items():
            for d, unit in zip(plan.devices, self.checkpoint.units[uid], strict=True):
                if d.mechanism is Mechanism.MPS:
                    out.setdefault(uid, []).append((self._mps.key(unit, plan.tenant), d))
        return out

    def _cdi_devices(self, plan: ClaimPlan, units: tuple[str, ...]) -> tuple[CdiDevice, ...]:
        # Every device of the claim names all its units, so that merging their edits never hides one of them.
        visible = (NVIDIA_VISIBLE_DEVICES_ENV, ",".join(dict.fromkeys(units)))
        out: list[CdiDevice] = []
        for d, unit in zip(plan.devices, units, strict=True):
            env = [visible, (MECHANISM_ENV, d.mechanism.value)]
            mounts: list[CdiMount] = []
            if d.mechanism is Mechanism.MPS:
                # Only its tenant's pipe directory: a client reaches its own daemon and no other tenant's.
                spec = self._mps.spec(unit, plan.tenant)
                milli = self._daemon_milli(plan, d, unit)
                env += mps_client_env(MPS_PIPE_IN_CONTAINER, d.compute_percent * 10, d.memory_mib, milli).items()
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
        daemons: dict[DaemonKey, list[DevicePlan]] = {}
        # Per unit, the claims with an MPS share on it: a unit's legacy daemon (the driver's one daemon per unit before
        # tenants) is kept while a claim prepared into it before the upgrade is still prepared (its CDI spec mounts it).
        holders: dict[str, set[str]] = {}
        for uid, devices in self._daemon_devices().items():
            for key, d in devices:
                daemons.setdefault(key, []).append(d)
                holders.setdefault(key.unit_uuid, set()).add(uid)
        limits: dict[DaemonKey, MpsLimits] = {}
        for key, ds in daemons.items():
            milli = sum(d.compute_percent * 10 for d in ds)
            for d in ds:
                limits[key] = MpsLimits.of_share(d.compute_percent * 10, d.memory_mib, milli).union(limits.get(key))
        await self._mps.reconcile(set(limits), limits, holders=holders)
        in_use = {d.gpu_uuid for d, _ in prepared if d.mechanism is Mechanism.TIME_SLICING}
        for gpu in sorted(self._sliced - in_use):
            try:
                await self._time_slicer.set(gpu, TimeSlice.DEFAULT)
                self._sliced.discard(gpu)
            except BackendError as e:
                log.warning("cannot reset the time slice of %s: %s", gpu, e)


def claim_tenant(pod: Pod, claim_name: str) -> str | None:
    """The tenant of ``pod`` as a user of ResourceClaim ``claim_name``: from the containers that use the claim only
    (None: none does). Raises :class:`~sharegpu.model.tenant.TenantConflict` when they declare different UIDs."""
    users = [(c.name, pod.run_as_user(c)) for c in pod.claim_containers(claim_name)]
    if not users:
        return None
    return tenant_of(pod.metadata.namespace, pod.metadata.uid or pod.key, users, pod.spec.host_users)
