"""The MPS manager: one MPS control daemon per (GPU or MIG instance, tenant) that hosts MPS shares.

An MPS server serves one Unix user at a time, and its clients share one fault domain; two control daemons on one
GPU, each with its own pipe directory, serve two users at once and take turns on the GPU (measured on an H200). So a
unit runs one daemon per tenant (:mod:`sharegpu.model.tenant`: the pods of one namespace and one declared UID, or a
pod alone), each with its own pipe and log directories under ``<root>/<unit UUID>/<tenant dir>/``, so that a client
selects its daemon with ``CUDA_MPS_PIPE_DIRECTORY`` alone and a container is given only its tenant's pipe. Daemons
are started when a grant first needs them, health-checked on every reconcile, restarted after a failure and stopped
when their tenant has no client pod left on the unit. In multi-user mode (an administrator's opt-in, Volta or later)
a unit runs one ``-M`` daemon for every user instead.

An agent (or DRA driver) from before tenants ran one daemon per unit for every pod, at ``<root>/<unit UUID>/pipe`` and
``.../log``. After an upgrade such a daemon still serves the containers started before it: the manager adopts it as
the unit's *legacy* daemon (:data:`LEGACY_TENANT`), gives it no new client, keeps it while a holder of an MPS share on
its unit at adoption (a pod, or a DRA claim) still holds one, then stops it and removes its directory; one that no
longer answers is removed at once (:meth:`MpsManager.recover`, :meth:`MpsManager.reconcile`).

Limits are set on the daemon, not only in the client's environment: right after a daemon starts, and whenever
its tenant's shares on the unit change, the manager sends it ``set_default_active_thread_percentage`` and
``set_default_device_pinned_mem_limit`` (and the per-server forms for servers already running). A daemon's clients
run together and the unit's daemons take turns, so a client's thread cap is its share against the other clients of
its daemon only (:func:`thread_percentage`), not against tenants it never runs beside: a cap below 100 % on a daemon
alone in its turn would leave SMs idle (H200: 25 % and 50 % caps on two daemons ran at 45 % of their solo rates).
A client's own ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` can lower its share below the daemon's, never raise it.
The daemon itself sits behind :class:`MpsDaemon`: :class:`NvidiaMpsDaemon` drives ``nvidia-cuda-mps-control``
on a real node; :class:`SimMpsDaemon` stands in for it with the simulated backend.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from sharegpu.model.contract import MPS_MEMORY_LIMIT_ENV, MPS_PIPE_DIRECTORY_ENV, MPS_THREAD_PERCENTAGE_ENV
from sharegpu.model.tenant import MULTI_USER_TENANT, NO_TENANT, describe, tenant_dir
from sharegpu.node.backends.base import BackendError
from sharegpu.node.errors import NodeError

if TYPE_CHECKING:
    from sharegpu.node.backends.sim import SimBackend

log = logging.getLogger(__name__)

MPS_CONTROL = "nvidia-cuda-mps-control"
_COMMAND_TIMEOUT_S = 10.0


class MpsError(NodeError):
    """An MPS daemon cannot be started or stopped; the message carries what the daemon said."""


# The tenant key of a unit's daemon of the layout before tenants (one daemon per unit, for every pod, at
# <root>/<unit>/pipe): no pod's tenant (model.tenant keys are "", "*multi-user", "<ns>/uid-<n>" or "pod/<id>").
LEGACY_TENANT = "*before-tenants"
# In <root>/<unit>/ beside a legacy daemon's pipe and log: the holders it may serve, fixed when it was first adopted,
# so that an agent restarted meanwhile does not count holders that came after the upgrade (their containers never
# reached it).
LEGACY_HOLDERS_FILE = "legacy-holders.json"


def tenant_words(tenant: str) -> str:
    """Whose daemon a tenant key names, in words (the legacy daemon's too)."""
    if tenant == LEGACY_TENANT:
        return "the pods started before the upgrade: the unit's one daemon of the layout before tenants"
    return describe(tenant)


@dataclass(frozen=True, slots=True, order=True)
class DaemonKey:
    """One daemon: the unit it serves and the tenant whose clients it serves there."""

    unit_uuid: str  # GPU-… or MIG-…
    tenant: str  # sharegpu.model.tenant key (MULTI_USER_TENANT for a multi-user daemon)

    def __str__(self) -> str:
        return f"{self.unit_uuid} ({tenant_words(self.tenant)})"

    @property
    def legacy(self) -> bool:
        """The unit's daemon of the layout before tenants, adopted after an upgrade: it takes no new client."""
        return self.tenant == LEGACY_TENANT


@dataclass(frozen=True, slots=True)
class MpsDaemonSpec:
    unit_uuid: str  # GPU-… or MIG-…: the one device the daemon serves
    pipe_dir: Path
    log_dir: Path
    tenant: str = NO_TENANT
    multi_user: bool = False  # started with -M: one root-owned server for clients of every user

    @property
    def key(self) -> DaemonKey:
        return DaemonKey(self.unit_uuid, self.tenant)


def thread_percentage(compute_milli: int, tenant_milli: int) -> int:
    """A client's cap of SM threads: its share of compute against its daemon's other clients (``tenant_milli``: the
    compute of every share of the daemon's tenant on the unit, its own included), rounded down, never below what was
    asked: the daemon's clients run together, and the unit's daemons take turns."""
    if tenant_milli <= 0:
        return min(100, max(1, compute_milli // 10))
    return min(100, max(1, compute_milli // 10, compute_milli * 100 // max(tenant_milli, compute_milli)))


@dataclass(frozen=True, slots=True, order=True)
class MpsLimits:
    """The ceiling a daemon puts on each of its clients: the largest share of its tenant on its unit."""

    thread_percentage: int  # 1..100
    pinned_mem_mib: int | None  # None: no memory limit (some share of the daemon has none)

    @staticmethod
    def of_share(compute_milli: int, memory_mib: int, tenant_milli: int = 0) -> MpsLimits:
        """The limits of one share; ``tenant_milli`` as in :func:`thread_percentage` (0: the share's own, as a
        fraction of the whole unit)."""
        return MpsLimits(thread_percentage(compute_milli, tenant_milli), memory_mib if memory_mib > 0 else None)

    def union(self, other: MpsLimits | None) -> MpsLimits:
        """The limits that hold both: the larger thread percentage, and the larger memory limit (None wins)."""
        if other is None:
            return self
        mem = (
            None
            if self.pinned_mem_mib is None or other.pinned_mem_mib is None
            else max(self.pinned_mem_mib, other.pinned_mem_mib)
        )
        return MpsLimits(max(self.thread_percentage, other.thread_percentage), mem)


def mps_client_env(pipe_dir: str, compute_milli: int, memory_mib: int, tenant_milli: int = 0) -> dict[str, str]:
    """The MPS settings a client of a share of ``compute_milli`` and ``memory_mib`` (0: no memory limit) runs with:
    its daemon's pipe and its own limits, which can only lower what the daemon enforces (Allocate and
    ``sharegpu bench`` give a client exactly this); ``tenant_milli`` as in :func:`thread_percentage`."""
    env = {
        MPS_PIPE_DIRECTORY_ENV: pipe_dir,
        MPS_THREAD_PERCENTAGE_ENV: str(thread_percentage(compute_milli, tenant_milli)),
    }
    if memory_mib > 0:
        env[MPS_MEMORY_LIMIT_ENV] = f"0={memory_mib}M"  # device 0: the client sees only its unit
    return env


class MpsDaemon(Protocol):
    async def start(self, spec: MpsDaemonSpec) -> None: ...

    async def healthy(self, spec: MpsDaemonSpec) -> bool: ...

    async def stop(self, spec: MpsDaemonSpec) -> None: ...

    async def set_limits(self, spec: MpsDaemonSpec, limits: MpsLimits) -> None:
        """Make ``limits`` the daemon's defaults and apply them to the servers it already runs."""
        ...


@dataclass(frozen=True, slots=True)
class MpsDaemonStatus:
    unit_uuid: str
    up: bool
    restarts: int
    tenant: str = NO_TENANT


@dataclass(frozen=True, slots=True)
class _LegacyEnd:
    """Why a unit's legacy daemon goes, and whether it still runs (then it is stopped; else only its directory goes)."""

    running: bool
    why: str


TENANT_FILE = "tenant"  # in a daemon's directory: the tenant it serves (a directory name cannot be read back as one)


class MpsManager:
    """The node's MPS daemons, one per (unit, tenant); ``multi_user``: one -M daemon per unit for every tenant."""

    def __init__(self, root: Path, daemon: MpsDaemon, multi_user: bool = False) -> None:
        self.root = root
        self.multi_user = multi_user
        self._daemon = daemon
        self._running: set[DaemonKey] = set()
        self._restarts: dict[DaemonKey, int] = {}
        self._limits: dict[DaemonKey, MpsLimits] = {}  # what each running daemon was last told
        # Adopted daemons of the layout before tenants, by unit: the holders each may serve (None: not fixed yet; the
        # next reconcile that names the unit's holders fixes them).
        self._legacy: dict[str, frozenset[str] | None] = {}
        self._lock = asyncio.Lock()  # Allocate and the reconcile loop must not start one daemon twice

    def tenant_key(self, tenant: str) -> str:
        """The daemon that serves ``tenant`` on this node: its own, or the one multi-user daemon (a legacy daemon's key
        stays its own in either mode)."""
        if tenant == LEGACY_TENANT:
            return tenant
        return MULTI_USER_TENANT if self.multi_user else tenant

    def key(self, unit_uuid: str, tenant: str) -> DaemonKey:
        return DaemonKey(unit_uuid, self.tenant_key(tenant))

    def spec(self, unit_uuid: str, tenant: str = NO_TENANT) -> MpsDaemonSpec:
        if not unit_uuid or "/" in unit_uuid or unit_uuid.startswith("."):
            raise MpsError(f"{unit_uuid!r} is not a GPU or MIG UUID")
        tenant = self.tenant_key(tenant)
        if tenant == LEGACY_TENANT:  # the layout before tenants: the unit's one daemon right in its directory
            return MpsDaemonSpec(unit_uuid, self.root / unit_uuid / "pipe", self.root / unit_uuid / "log", tenant)
        base = self.root / unit_uuid / tenant_dir(tenant)
        return MpsDaemonSpec(unit_uuid, base / "pipe", base / "log", tenant, tenant == MULTI_USER_TENANT)

    def spec_of(self, key: DaemonKey) -> MpsDaemonSpec:
        return self.spec(key.unit_uuid, key.tenant)

    def _on_disk(self) -> dict[DaemonKey, Path]:
        """The daemons whose directories exist, by the tenant file each holds."""
        found: dict[DaemonKey, Path] = {}
        if not self.root.is_dir():
            return found
        for unit in sorted(self.root.iterdir()):
            if not unit.is_dir():
                continue
            for entry in sorted(unit.iterdir()):
                try:
                    tenant = (entry / TENANT_FILE).read_text().strip()
                except OSError:
                    continue
                if tenant_dir(tenant) == entry.name:
                    found[DaemonKey(unit.name, tenant)] = entry
        return found

    def _legacy_on_disk(self) -> list[str]:
        """The units with a daemon directory of the layout before tenants (``<root>/<unit>/pipe``)."""
        if not self.root.is_dir():
            return []
        return [
            unit.name
            for unit in sorted(self.root.iterdir())
            if not unit.name.startswith(".") and (unit / "pipe").is_dir()
        ]

    async def recover(self) -> set[DaemonKey]:
        """After a restart: adopt the daemons that still answer, so their clients are not disturbed.

        A daemon of the layout before tenants that still answers is adopted as its unit's legacy daemon (it keeps its
        clients, gets no new one); the directory of one that no longer answers is removed."""
        found: set[DaemonKey] = set()
        async with self._lock:
            for key, entry in self._on_disk().items():
                spec = replace(self.spec_of(key), pipe_dir=entry / "pipe", log_dir=entry / "log")
                spec = replace(spec, tenant=key.tenant, multi_user=key.tenant == MULTI_USER_TENANT)
                if await self._daemon.healthy(spec):
                    self._running.add(key)
                    found.add(key)
            for unit in self._legacy_on_disk():
                spec = self.spec(unit, LEGACY_TENANT)
                if not await self._daemon.healthy(spec):
                    self._remove_legacy(unit)
                    log.info(
                        "removed the directory of the MPS daemon of the layout before tenants for %s: the daemon no "
                        "longer answers",
                        unit,
                    )
                    continue
                self._running.add(spec.key)
                self._legacy[unit] = self._read_legacy_holders(unit)
                found.add(spec.key)
                log.info(
                    "adopted the MPS daemon of the layout before tenants for %s: its clients from before the upgrade "
                    "keep it, new clients go to their tenant's daemon, and it is stopped once no pod it served is left",
                    unit,
                )
        if found:
            log.info("adopted running MPS daemons for %s", ", ".join(str(k) for k in sorted(found)))
        return found

    def legacy(self) -> dict[DaemonKey, frozenset[str] | None]:
        """The adopted daemons of the layout before tenants, each with the holders of MPS shares it may serve (pod
        UIDs on the device-plugin path, claim UIDs on the DRA path; None: not fixed yet, any holder on its unit)."""
        return {DaemonKey(unit, LEGACY_TENANT): serves for unit, serves in sorted(self._legacy.items())}

    def _read_legacy_holders(self, unit: str) -> frozenset[str] | None:
        path = self.root / unit / LEGACY_HOLDERS_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None  # adopted for the first time: fixed by the next reconcile
        except (OSError, ValueError) as e:
            log.warning("cannot read %s (%s): the legacy daemon's holders are taken from the next reconcile", path, e)
            return None
        if not isinstance(data, list) or not all(isinstance(h, str) for h in data):
            log.warning(
                "%s is not a list of holders: the legacy daemon's holders are taken from the next reconcile", path
            )
            return None
        return frozenset(data)

    async def _legacy_done(self, unit: str, holders: Mapping[str, Iterable[str]] | None) -> _LegacyEnd | None:
        """Whether the legacy daemon of ``unit`` is done: None while it is kept.

        It is kept while it answers and one of the holders of an MPS share on its unit when it was adopted still holds
        one there (``holders``: per unit, the holders now; None: the caller does not say, and it is kept)."""
        if not await self._daemon.healthy(self.spec(unit, LEGACY_TENANT)):
            return _LegacyEnd(False, "it no longer answers (its clients ended with it)")
        if holders is None:
            return None
        now = frozenset(holders.get(unit, ()))
        serves = self._legacy.get(unit)
        if serves is None:
            # The first reconcile after its adoption: whoever holds an MPS share on the unit now may be its client
            # (started before the upgrade); holders that come later get their tenant's daemon only.
            serves = self._legacy[unit] = now
            try:
                (self.root / unit / LEGACY_HOLDERS_FILE).write_text(json.dumps(sorted(serves)) + "\n")
            except OSError as e:
                log.warning("cannot record the legacy MPS daemon's holders for %s: %s", unit, e.strerror or e)
        if serves & now:
            return None
        return _LegacyEnd(True, "no pod it served before the upgrade holds an MPS share on the unit any more")

    async def _retire_legacy(self, unit: str, running: bool, why: str) -> None:
        """Stop (where it still ``running``) the legacy daemon of ``unit`` and remove its directory; raises
        :class:`MpsError` where it refuses to quit (it stays adopted, and is tried again next reconcile)."""
        spec = self.spec(unit, LEGACY_TENANT)
        if running:
            await self._daemon.stop(spec)
        self._remove_legacy(unit)
        self._running.discard(spec.key)
        self._limits.pop(spec.key, None)
        self._legacy.pop(unit, None)
        log.info(
            "%s the MPS daemon of the layout before tenants for %s: %s", "stopped" if running else "removed", unit, why
        )

    def _remove_legacy(self, unit: str) -> None:
        """A legacy daemon's pipe and log directories and holders file; its unit's directory too, where now empty."""
        unit_dir = self.root / unit
        shutil.rmtree(unit_dir / "pipe", ignore_errors=True)
        shutil.rmtree(unit_dir / "log", ignore_errors=True)
        (unit_dir / LEGACY_HOLDERS_FILE).unlink(missing_ok=True)
        if unit_dir.is_dir() and not any(unit_dir.iterdir()):
            unit_dir.rmdir()

    def daemon_of_pipe(self, pipe_dir: str | None) -> DaemonKey | None:
        """The running daemon whose pipe directory ``pipe_dir`` is, or None. ``pipe_dir`` is a path as a process's
        mounts resolve it (:meth:`~sharegpu.node.backends.base.GpuBackend.mps_pipe_dir`), which may be relative to
        the filesystem that holds the state directory: it is matched by its last parts,
        ``<root name>/<unit>/<tenant dir>/pipe``."""
        parts = [p for p in (pipe_dir or "").split("/") if p]
        if len(parts) < 3 or parts[-1] != "pipe":
            return None
        if len(parts) >= 4 and parts[-4] == self.root.name:
            unit, name = parts[-3], parts[-2]
            found = next((k for k in self._running if k.unit_uuid == unit and tenant_dir(k.tenant) == name), None)
            if found is not None:
                return found
        # The layout before tenants: ``<root name>/<unit>/pipe``, the unit's legacy daemon.
        legacy = DaemonKey(parts[-2], LEGACY_TENANT)
        return legacy if parts[-3] == self.root.name and legacy in self._running else None

    def limits(self, key: DaemonKey) -> MpsLimits | None:
        """The limits daemon ``key`` enforces now (None: none set, or no daemon)."""
        return self._limits.get(key)

    async def ensure(
        self, unit_uuid: str, tenant: str, limits: MpsLimits | None = None, *, grow: bool = True
    ) -> MpsDaemonSpec:
        """A healthy daemon of ``tenant`` for ``unit_uuid``, started if needed (what Allocate calls before it answers).

        With ``limits`` the daemon is made to enforce them before this returns; ``grow`` (Allocate) only ever
        widens what the daemon already enforces, so the clients already admitted keep their room, while the
        reconcile loop passes the exact limits of the tenant's shares. Raises :class:`MpsError` when the daemon
        cannot be started or refuses its limits: a client must never be told to use a daemon that does not
        hold it to its share.
        """
        spec = self.spec(unit_uuid, tenant)
        key = spec.key
        if key.legacy:
            raise MpsError(
                f"the MPS daemon of the layout before tenants for {unit_uuid} takes no new client: ask for the "
                "daemon of the client's tenant"
            )
        async with self._lock:
            if key in self._running and not await self._daemon.healthy(spec):
                self._restarts[key] = self._restarts.get(key, 0) + 1
                log.warning("MPS daemon for %s failed its health check; restarting it", key)
                await self._stop_quietly(spec)
            if key not in self._running:
                self._limits.pop(key, None)  # a new daemon starts with the driver's defaults
                await self._start(spec)
            if limits is not None:
                current = self._limits.get(key)
                wanted = limits.union(current) if grow else limits
                if wanted != current:
                    self._limits.pop(key, None)  # unknown until the daemon has taken them
                    try:
                        await self._daemon.set_limits(spec, wanted)
                    except MpsError as e:
                        raise MpsError(f"the MPS daemon for {key} refused its limits: {e}") from None
                    self._limits[key] = wanted
                    log.info(
                        "MPS daemon for %s: clients limited to %d%% of threads, %s pinned memory",
                        key,
                        wanted.thread_percentage,
                        f"{wanted.pinned_mem_mib} MiB" if wanted.pinned_mem_mib is not None else "unlimited",
                    )
        return spec

    async def reconcile(
        self,
        needed: Iterable[DaemonKey],
        limits: Mapping[DaemonKey, MpsLimits] | None = None,
        keep: Iterable[DaemonKey] = (),
        holders: Mapping[str, Iterable[str]] | None = None,
    ) -> list[str]:
        """Start or restart the ``needed`` daemons and stop the others; returns the errors met.

        ``limits`` are the exact limits per daemon (the largest share of its tenant on its unit); ``keep`` names
        daemons that must not be stopped although ``needed`` lacks them (Allocate just handed them out).
        ``holders``: per unit, who holds an MPS share on it now (pod UIDs, or claim UIDs), which decides how long a
        legacy daemon is kept (:meth:`recover`): while it answers and a holder it may serve is still there (None:
        kept, the caller does not say).
        """
        wanted = {self.key(k.unit_uuid, k.tenant) for k in needed}
        exact = {self.key(k.unit_uuid, k.tenant): v for k, v in (limits or {}).items()}
        errors: list[str] = []
        for key in sorted(wanted):
            try:
                await self.ensure(key.unit_uuid, key.tenant, exact.get(key), grow=False)
            except MpsError as e:
                errors.append(str(e))
        wanted |= {self.key(k.unit_uuid, k.tenant) for k in keep}
        async with self._lock:
            for unit in sorted(self._legacy):
                done = await self._legacy_done(unit, holders)
                if done is None:
                    continue
                try:
                    await self._retire_legacy(unit, done.running, done.why)
                except MpsError as e:
                    errors.append(f"stopping the MPS daemon of the layout before tenants for {unit}: {e}")
            on_disk = self._on_disk()
            for key in sorted({k for k in self._running | set(on_disk) if not k.legacy} - wanted):
                spec = self.spec_of(key)
                try:
                    if key in self._running or await self._daemon.healthy(spec):
                        await self._daemon.stop(spec)
                        log.info("stopped MPS daemon for %s: no client pod of its tenant is left", key)
                    shutil.rmtree(on_disk.get(key, spec.pipe_dir.parent), ignore_errors=True)
                    unit_dir = self.root / key.unit_uuid
                    if unit_dir.is_dir() and not any(unit_dir.iterdir()):
                        unit_dir.rmdir()
                except (MpsError, OSError) as e:
                    errors.append(str(e))
                    continue
                self._running.discard(key)
                self._limits.pop(key, None)
        for message in errors:
            log.warning("MPS reconcile: %s", message)
        return errors

    async def after_fault(self, key: DaemonKey) -> None:
        """Daemon ``key`` after its clients died of a fault: checked, and where it no longer answers restarted with
        the limits it enforced (an Allocate that widened them meanwhile is kept); a healthy one keeps its state (its
        server serves the next client once the faulting clients have exited, as the H200's did). A legacy daemon
        that no longer answers is removed, never restarted: its clients ended with it, new ones go to their
        tenant's daemon. Raises :class:`MpsError` where a daemon cannot be restarted."""
        if key not in self._running:
            return
        if key.legacy:
            async with self._lock:
                if key in self._running and not await self._daemon.healthy(self.spec_of(key)):
                    await self._retire_legacy(key.unit_uuid, False, "it no longer answers after a fault of its clients")
            return
        await self.ensure(key.unit_uuid, key.tenant, self.limits(key))

    def running(self) -> frozenset[DaemonKey]:
        """The daemons this manager started or adopted and has not stopped."""
        return frozenset(self._running)

    def running_units(self) -> frozenset[str]:
        """The units with at least one running daemon."""
        return frozenset(k.unit_uuid for k in self._running)

    def status(self) -> tuple[MpsDaemonStatus, ...]:
        keys = self._running | set(self._restarts)
        return tuple(
            MpsDaemonStatus(k.unit_uuid, k in self._running, self._restarts.get(k, 0), k.tenant) for k in sorted(keys)
        )

    async def _start(self, spec: MpsDaemonSpec) -> None:
        try:
            spec.pipe_dir.mkdir(parents=True, exist_ok=True)
            spec.log_dir.mkdir(parents=True, exist_ok=True)
            (spec.pipe_dir.parent / TENANT_FILE).write_text(spec.tenant + "\n")
        except OSError as e:
            raise MpsError(f"cannot create the MPS directories under {self.root}: {e.strerror or e}") from None
        await self._daemon.start(spec)
        if not await self._daemon.healthy(spec):
            self._running.discard(spec.key)
            raise MpsError(f"the MPS daemon for {spec.key} started but does not answer; see {spec.log_dir}")
        self._running.add(spec.key)
        log.info("started MPS daemon for %s (pipe %s)", spec.key, spec.pipe_dir)

    async def _stop_quietly(self, spec: MpsDaemonSpec) -> None:
        try:
            await self._daemon.stop(spec)
        except MpsError as e:
            log.warning("stopping the failed MPS daemon for %s: %s", spec.key, e)
        self._running.discard(spec.key)
        self._limits.pop(spec.key, None)


class NvidiaMpsDaemon:
    """``nvidia-cuda-mps-control`` on a real node: ``-d`` starts it, ``get_server_list`` probes it, ``quit`` stops it."""

    def __init__(self, control: str = MPS_CONTROL, timeout_s: float = _COMMAND_TIMEOUT_S) -> None:
        self._control = control
        self._timeout_s = timeout_s

    async def start(self, spec: MpsDaemonSpec) -> None:
        # -M: multi-user mode, one root-owned server for clients of every user (isolation between users disregarded).
        code, out = await self._run(spec, ["-d", "-M"] if spec.multi_user else ["-d"], None)
        if code != 0:
            raise MpsError(f"{self._control} -d for {spec.unit_uuid} exited with {code}: {out.strip() or 'no output'}")

    async def healthy(self, spec: MpsDaemonSpec) -> bool:
        if not spec.pipe_dir.is_dir():
            return False
        try:
            code, _ = await self._run(spec, [], "get_server_list\n")
        except MpsError:
            return False
        return code == 0

    async def stop(self, spec: MpsDaemonSpec) -> None:
        code, out = await self._run(spec, [], "quit\n")
        if code != 0:
            raise MpsError(f"quitting the MPS daemon for {spec.unit_uuid} failed ({code}): {out.strip()}")

    async def set_limits(self, spec: MpsDaemonSpec, limits: MpsLimits) -> None:
        # The defaults hold every server the daemon starts from now on; servers already running (they start with
        # their first client) take the per-server commands, which hold their clients connecting from now on.
        # Device 0 is the unit itself: the daemon runs with CUDA_VISIBLE_DEVICES=<unit UUID>.
        commands = [f"set_default_active_thread_percentage {limits.thread_percentage}"]
        if limits.pinned_mem_mib is not None:
            commands.append(f"set_default_device_pinned_mem_limit 0 {limits.pinned_mem_mib}M")
        code, out = await self._run(spec, [], "get_server_list\n")
        if code != 0:
            raise MpsError(f"get_server_list failed ({code}): {out.strip() or 'no output'}")
        for pid in (line.strip() for line in out.splitlines()):
            if pid.isdigit():
                commands.append(f"set_active_thread_percentage {pid} {limits.thread_percentage}")
                if limits.pinned_mem_mib is not None:
                    commands.append(f"set_device_pinned_mem_limit {pid} 0 {limits.pinned_mem_mib}M")
        for command in commands:
            code, out = await self._run(spec, [], command + "\n")
            if code != 0:
                raise MpsError(f"{command!r} failed ({code}): {out.strip() or 'no output'}")

    async def _run(self, spec: MpsDaemonSpec, args: list[str], stdin: str | None) -> tuple[int, str]:
        env = dict(os.environ)
        # The daemon sees only its unit, so a client's device 0 (and its pinned memory limit "0=…") is that unit.
        env["CUDA_VISIBLE_DEVICES"] = spec.unit_uuid
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(spec.pipe_dir)
        env["CUDA_MPS_LOG_DIRECTORY"] = str(spec.log_dir)
        try:
            proc = await asyncio.create_subprocess_exec(
                self._control,
                *args,
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
            )
        except OSError as e:
            raise MpsError(f"cannot run {self._control}: {e.strerror or e}; is the NVIDIA driver installed?") from None
        try:
            out, _ = await asyncio.wait_for(
                proc.communicate(stdin.encode() if stdin is not None else None), self._timeout_s
            )
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise MpsError(f"{self._control} did not answer within {self._timeout_s:g}s") from None
        return proc.returncode if proc.returncode is not None else -1, out.decode(errors="replace")


class SimMpsDaemon:
    """A stand-in daemon for the simulated backend: its "process" is a file in the pipe directory.

    Being on disk, it outlives an agent restart exactly like a real daemon; deleting the file is a crash. The file
    says which unit and tenant the daemon serves (a container that mounts the pipe directory can read it). Given the
    simulated backend, the daemon is registered there under its pipe directory, so that clients connect to it and a
    daemon that quits (or crashes) ends its own server and clients only.
    """

    MARKER = "sim-mps-daemon.json"

    def __init__(self, backend: SimBackend | None = None) -> None:
        self.starts = 0
        self._backend = backend

    async def start(self, spec: MpsDaemonSpec) -> None:
        spec.pipe_dir.mkdir(parents=True, exist_ok=True)
        marker = {"unit": spec.unit_uuid, "tenant": spec.tenant, "multiUser": spec.multi_user}
        (spec.pipe_dir / self.MARKER).write_text(json.dumps(marker))
        self.starts += 1
        self._register(spec)

    async def healthy(self, spec: MpsDaemonSpec) -> bool:
        if not (spec.pipe_dir / self.MARKER).is_file():
            return False
        self._register(spec)  # a daemon an earlier agent (and backend) started: its clients connect to it here
        return True

    async def stop(self, spec: MpsDaemonSpec) -> None:
        (spec.pipe_dir / self.MARKER).unlink(missing_ok=True)
        if self._backend is not None:
            self._backend.stop_mps_daemon(spec.pipe_dir)

    async def set_limits(self, spec: MpsDaemonSpec, limits: MpsLimits) -> None:
        marker = spec.pipe_dir / self.MARKER
        if not marker.is_file():
            raise MpsError(f"the simulated MPS daemon for {spec.key} is not running")
        data = json.loads(marker.read_text())
        data["threadPercentage"], data["pinnedMemMiB"] = limits.thread_percentage, limits.pinned_mem_mib
        marker.write_text(json.dumps(data))

    def limits(self, spec: MpsDaemonSpec) -> MpsLimits | None:
        """What the simulated daemon was told (for tests and the simulated node's users)."""
        try:
            data = json.loads((spec.pipe_dir / self.MARKER).read_text())
        except (OSError, ValueError):
            return None
        if "threadPercentage" not in data:
            return None
        return MpsLimits(int(data["threadPercentage"]), data["pinnedMemMiB"])

    def crash(self, spec: MpsDaemonSpec) -> None:
        (spec.pipe_dir / self.MARKER).unlink(missing_ok=True)
        if self._backend is not None:
            self._backend.stop_mps_daemon(spec.pipe_dir)

    def _register(self, spec: MpsDaemonSpec) -> None:
        if self._backend is None or str(spec.pipe_dir) in self._backend.mps_daemons(spec.unit_uuid):
            return
        try:
            self._backend.start_mps_daemon(
                spec.unit_uuid, spec.pipe_dir, multi_user=spec.multi_user, log_dir=spec.log_dir
            )
        except BackendError as e:  # a unit the simulated node no longer has: no client can reach it anyway
            log.info("simulated MPS daemon for %s: %s", spec.key, e)
