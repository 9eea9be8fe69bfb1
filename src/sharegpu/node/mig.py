"""The MIG manager: makes the MIG instances that this node's assignments name exist, and only those it made.

Instances are always created at the placement the assignment names (never where the driver would pick), the
larger ones first, so a layout the ledger accepted is one the hardware accepts. Instances sharegpu did not
create are a static layout and are never destroyed; an instance that runs processes is never destroyed.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from sharegpu.model.assignment import MigSlot
from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog, CatalogError
from sharegpu.node.backends.base import BackendError, GpuBackend, MigInstanceInfo, MigModePending, device
from sharegpu.node.errors import NodeError
from sharegpu.node.state import AgentState

log = logging.getLogger(__name__)


class MigError(NodeError):
    """A MIG instance an assignment needs cannot be made; the message says what is in the way."""


class MigInvalid(MigError):
    """The instance can never exist on this GPU (unknown GPU, profile or placement): waiting will not help."""


@dataclass(frozen=True, slots=True, order=True)
class MigNeed:
    gpu_index: int
    start: int
    profile: str


@dataclass(frozen=True, slots=True)
class MigReport:
    created: tuple[MigInstanceInfo, ...] = ()
    destroyed: tuple[MigInstanceInfo, ...] = ()
    errors: tuple[str, ...] = ()


class MigManager:
    def __init__(self, backend: GpuBackend, state: AgentState, catalog: Catalog = DEFAULT_CATALOG) -> None:
        self._backend = backend
        self._state = state
        self._catalog = catalog
        self._needs: set[MigNeed] = set()
        self._non_mig_users: dict[int, set[str]] = {}  # GPU index → who uses it without MIG, for messages
        self._told: set[str] = set()  # instances of ours this run has logged (made, or found made before it)

    def is_managed(self, mig_uuid: str) -> bool:
        return mig_uuid in self._state.managed_mig

    def mig_mode_ours(self, gpu_uuid: str) -> bool:
        """Whether sharegpu turned this GPU's MIG mode on (else an administrator did, and it is theirs to change)."""
        return gpu_uuid in self._state.mig_mode_set

    def ensure(self, gpu_index: int, gpu_uuid: str, slot: MigSlot) -> MigInstanceInfo:
        """The instance for one share, created now if it is missing (what Allocate calls)."""
        need = MigNeed(gpu_index, slot.start, slot.profile)
        self._check_need(need, gpu_uuid)
        self._needs.add(need)
        for inst in self._backend.mig_instances(gpu_index):
            if inst.start == slot.start and inst.profile == slot.profile:
                self._tell_kept(inst)
                return inst
        return self._create(need)

    def reconcile(self, needs: set[MigNeed], non_mig_users: Mapping[int, Collection[str]]) -> MigReport:
        """Bring every GPU to ``needs``: destroy what sharegpu made and nobody uses, then create what is missing.

        ``non_mig_users`` names, per GPU, the pods (or claims) that use it whole or shared without MIG; a GPU that
        sharegpu put in MIG mode goes back when it has no instances and such a user needs it.
        """
        self._needs = set(needs)
        self._non_mig_users = {g: set(users) for g, users in non_mig_users.items() if users}
        created: list[MigInstanceInfo] = []
        destroyed: list[MigInstanceInfo] = []
        errors: list[str] = []
        for dev in self._backend.devices():
            try:
                present = self._backend.mig_instances(dev.index) if dev.mig_enabled else ()
            except BackendError as e:
                errors.append(f"GPU {dev.index}: cannot list MIG instances: {e}")
                continue
            wanted = {n for n in needs if n.gpu_index == dev.index}
            for inst in present:
                self._tell_kept(inst)
                if MigNeed(dev.index, inst.start, inst.profile) not in wanted and self._destroy_if_free(inst):
                    destroyed.append(inst)
            have = {(i.start, i.profile) for i in self._backend.mig_instances(dev.index)} if dev.mig_enabled else set()
            # Larger instances first: their aligned placements are the scarce ones.
            for need in sorted(wanted, key=lambda n: (-self._width(dev.model, n.profile), n.start)):
                if (need.start, need.profile) in have:
                    continue
                try:
                    self._check_need(need, dev.uuid)
                    created.append(self._create(need))
                except (MigError, BackendError) as e:
                    errors.append(str(e))
            if not wanted and dev.index in self._non_mig_users:
                self._maybe_leave_mig(dev.index, dev.uuid, errors)
        for message in errors:
            log.warning("MIG reconcile: %s", message)
        return MigReport(tuple(created), tuple(destroyed), tuple(errors))

    # ----- internals ------------------------------------------------------------------------------------------
    def _tell_kept(self, inst: MigInstanceInfo) -> None:
        """Log, once per run, an instance of ours made before this run: an agent killed between making an instance
        and logging it would otherwise leave the instance a container uses named nowhere in the node's log."""
        if inst.uuid not in self._told and self.is_managed(inst.uuid):
            self._told.add(inst.uuid)
            log.info(
                "kept MIG instance %s (%s at slot %d) on GPU %d, made by sharegpu before this start",
                inst.uuid, inst.profile, inst.start, inst.gpu_index,
            )  # fmt: skip

    def _width(self, model_name: str, profile: str) -> int:
        try:
            return self._catalog.get(model_name).profile(profile).memory_slots
        except CatalogError:
            return 0

    def _check_need(self, need: MigNeed, gpu_uuid: str) -> None:
        try:
            dev = device(self._backend, need.gpu_index)
        except BackendError as e:
            raise MigInvalid(str(e)) from None
        if dev.uuid != gpu_uuid:
            raise MigInvalid(f"GPU {need.gpu_index} of this node is {dev.uuid}, not {gpu_uuid}")
        try:
            profile = self._catalog.get(dev.model).profile(need.profile)
        except CatalogError as e:
            raise MigInvalid(f"GPU {need.gpu_index}: {e}") from None
        if need.start not in profile.starts:
            raise MigInvalid(
                f"GPU {need.gpu_index}: {profile.name} cannot start at slot {need.start}; "
                f"valid starts: {list(profile.starts)}"
            )

    def _create(self, need: MigNeed) -> MigInstanceInfo:
        dev = device(self._backend, need.gpu_index)
        where = f"GPU {need.gpu_index}: {need.profile} at slot {need.start}"
        if not dev.mig_enabled:
            self._enter_mig(need.gpu_index, dev.uuid, where)
        width = self._width(dev.model, need.profile)
        for inst in self._backend.mig_instances(need.gpu_index):
            if (
                inst.start < need.start + width
                and need.start < inst.start + inst.size
                and not self._destroy_if_free(inst)
            ):
                owner = "sharegpu, in use" if self.is_managed(inst.uuid) else "a static layout made outside sharegpu"
                raise MigError(f"{where} overlaps {inst.profile} at slot {inst.start} ({inst.uuid}, {owner})")
        try:
            inst = self._backend.create_mig_instance(need.gpu_index, need.profile, need.start)
        except BackendError as e:
            raise MigError(f"{where}: the driver refused: {e}") from None
        self._state.add_managed_mig(inst.uuid)
        self._told.add(inst.uuid)
        log.info(
            "created MIG instance %s (%s at slot %d) on GPU %d", inst.uuid, inst.profile, inst.start, inst.gpu_index
        )
        return inst

    def _destroy_if_free(self, inst: MigInstanceInfo) -> bool:
        """Destroy an instance sharegpu made that no assignment needs and no process uses."""
        if not self.is_managed(inst.uuid) or MigNeed(inst.gpu_index, inst.start, inst.profile) in self._needs:
            return False
        if any(p.unit_uuid == inst.uuid for p in self._backend.processes(inst.gpu_index)):
            return False
        try:
            self._backend.destroy_mig_instance(inst.gpu_index, inst.start)
        except BackendError as e:
            log.warning("cannot destroy unused MIG instance %s: %s", inst.uuid, e)
            return False
        self._state.drop_managed_mig(inst.uuid)
        log.info("destroyed unused MIG instance %s on GPU %d", inst.uuid, inst.gpu_index)
        return True

    def _enter_mig(self, gpu_index: int, gpu_uuid: str, where: str) -> None:
        users = sorted(self._non_mig_users.get(gpu_index, ()))
        if users:
            more = f" and {len(users) - 3} more" if len(users) > 3 else ""
            verb = "uses" if len(users) == 1 else "use"
            raise MigError(f"{where}: MIG mode is off and {', '.join(users[:3])}{more} {verb} the GPU without MIG")
        try:
            self._backend.set_mig_mode(gpu_index, True)
        except MigModePending as e:
            if e.still_pending:
                # It will turn on at the next reset: record it as ours, so that it is turned off again when a
                # non-MIG share needs the GPU, rather than taken for an administrator's choice.
                self._state.set_mig_mode_by_us(gpu_uuid, True)
            raise MigError(f"{where}: MIG mode is off and cannot be turned on: {e}") from None
        except BackendError as e:
            raise MigError(f"{where}: MIG mode is off and cannot be turned on: {e}") from None
        self._state.set_mig_mode_by_us(gpu_uuid, True)
        log.info("turned MIG mode on for GPU %d", gpu_index)

    def release_for_whole_gpu(self, gpu_index: int, gpu_uuid: str, user: str) -> str | None:
        """Take a GPU out of MIG mode for a non-MIG share, if sharegpu put it there and nothing uses it.

        Returns None when the GPU is out of MIG mode, else why it is not.
        """
        self._non_mig_users.setdefault(gpu_index, set()).add(user)
        errors: list[str] = []
        try:
            for inst in self._backend.mig_instances(gpu_index):
                self._destroy_if_free(inst)
            self._maybe_leave_mig(gpu_index, gpu_uuid, errors)
            dev = device(self._backend, gpu_index)
        except BackendError as e:
            return str(e)
        if not dev.mig_enabled:
            return None
        if errors:
            return errors[-1]
        if not self.mig_mode_ours(gpu_uuid):
            return "an administrator put it in MIG mode (sharegpu leaves that to them)"
        return "it still has MIG instances in use"

    def _maybe_leave_mig(self, gpu_index: int, gpu_uuid: str, errors: list[str]) -> None:
        dev = device(self._backend, gpu_index)
        if not dev.mig_enabled or not self.mig_mode_ours(gpu_uuid):
            return  # MIG mode that an administrator chose is theirs to change
        if self._backend.mig_instances(gpu_index):
            return
        try:
            self._backend.set_mig_mode(gpu_index, False)
        except BackendError as e:
            errors.append(f"GPU {gpu_index}: cannot leave MIG mode for non-MIG assignments: {e}")
            return
        self._state.set_mig_mode_by_us(gpu_uuid, False)
        log.info("turned MIG mode off for GPU %d", gpu_index)
