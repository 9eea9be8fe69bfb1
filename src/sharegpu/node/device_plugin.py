"""The kubelet device plugin (API v1beta1) for ``sharegpu.io/gpu``, over gRPC on unix sockets.

The plugin advertises interchangeable device tokens (``<GPU UUID>::<n>``, as many per GPU as shares can sit on
it), reporting each token healthy or not with its GPU. It registers with the kubelet at ``kubelet.sock`` and
registers again whenever the kubelet restarts: a restarting kubelet deletes the plugin's socket and creates a
new ``kubelet.sock``, and both are watched. It asks for PreStartContainer (``pre_start_required``): Allocate names a
CDI device, and PreStartContainer, once the kubelet has recorded whose container it is, fills it in; both are
answered by :class:`~sharegpu.node.allocation.Allocator`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import stat
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc
import grpc.aio

from sharegpu.model.contract import GPU_RESOURCE
from sharegpu.node.allocation import AllocateAnswer, AllocationError, ContainerGrant
from sharegpu.node.backends.base import DeviceInfo
from sharegpu.node.errors import NodeError
from sharegpu.node.proto import deviceplugin_pb2 as pb

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
PLUGIN_SOCKET = "sharegpu.sock"
DEFAULT_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
# Enough tokens for the most shares one GPU can hold (7 MIG instances × 48 MPS clients is more than any node
# runs; the scheduler, not the kubelet, decides what fits, so tokens only need never to run out first).
TOKENS_PER_GPU = 64
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes including the terminating NUL
NO_KUBELET_WARN_EVERY_S = 60.0  # while kubelet.sock is missing, say so at start and then this often
# A restarted kubelet re-admits every pod whose containers are not running within a few hundred milliseconds of
# creating kubelet.sock, and rejects those that ask for a resource no plugin has re-registered yet
# ("UnexpectedAdmissionError: … no healthy devices present"; kubernetes/kubernetes#133382, #125579, #118559): the
# sooner the plugin registers, the fewer pods are lost, so the sockets are looked at this often.
POLL_S = 0.1
REGISTER_RETRY_WARN_EVERY_S = 10.0  # failed registrations are retried every poll; say so at first and then this often


class DevicePluginError(NodeError):
    """The device plugin cannot listen or register; the message says where and why."""


class ContainerAllocator(Protocol):
    def allocate(self, device_ids: Sequence[str]) -> AllocateAnswer: ...

    async def prestart(self, device_ids: Sequence[str]) -> ContainerGrant: ...


# PreStartContainer finds the container's pod in the kubelet's records; Allocate cannot (the kubelet records it after).
OPTIONS = {"pre_start_required": True, "get_preferred_allocation_available": False}


@dataclass(frozen=True, slots=True)
class DeviceToken:
    id: str
    healthy: bool


def device_tokens(devices: Sequence[DeviceInfo], per_gpu: int = TOKENS_PER_GPU) -> tuple[DeviceToken, ...]:
    return tuple(DeviceToken(f"{d.uuid}::{n}", d.healthy) for d in devices for n in range(per_gpu))


def answer_to_response(answer: AllocateAnswer) -> pb.ContainerAllocateResponse:
    return pb.ContainerAllocateResponse(envs=dict(answer.envs), cdi_devices=[pb.CDIDevice(name=answer.cdi_device)])


def _socket_path(directory: Path, name: str) -> Path:
    path = directory / name
    if len(str(path).encode()) > MAX_SOCKET_PATH:
        raise DevicePluginError(
            f"socket path {path} is longer than the {MAX_SOCKET_PATH} bytes a unix socket allows; use a shorter "
            "--device-plugin-dir"
        )
    return path


def check_plugin_dir(directory: Path) -> None:
    """Fail early, with the flag to change, when the sockets could not be created there."""
    if directory.exists() and not directory.is_dir():
        raise DevicePluginError(
            f"--device-plugin-dir {directory} is not a directory; give the kubelet's device plugin directory "
            f"({DEFAULT_PLUGIN_DIR} by default)"
        )
    _socket_path(directory, PLUGIN_SOCKET)
    _socket_path(directory, KUBELET_SOCKET)


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_ctime_ns


class DevicePluginServer:
    def __init__(
        self,
        plugin_dir: Path,
        allocator: ContainerAllocator,
        resource_name: str = GPU_RESOURCE,
        poll_s: float = POLL_S,
        register_timeout_s: float = 5.0,
    ) -> None:
        self.plugin_dir = plugin_dir
        self.socket = _socket_path(plugin_dir, PLUGIN_SOCKET)
        self.kubelet_socket = _socket_path(plugin_dir, KUBELET_SOCKET)
        self.resource_name = resource_name
        self._allocator = allocator
        self._poll_s = poll_s
        self._register_timeout_s = register_timeout_s
        self._tokens: tuple[DeviceToken, ...] = ()
        self._version = 0
        self._changed = asyncio.Condition()
        self._server: grpc.aio.Server | None = None
        self._socket_id: tuple[int, int] | None = None
        self._registered_with: tuple[int, int] | None = None
        self.registrations = 0  # how often the kubelet accepted us (observability and tests)
        self._created_dir = False  # the plugin directory did not exist: we made it (a wrong path, most likely)
        self._no_kubelet_since: float | None = None
        self._next_no_kubelet_warning = 0.0
        self._register_failures = 0
        self._next_register_warning = 0.0

    # ----- devices ---------------------------------------------------------------------------------------------
    async def set_devices(self, tokens: tuple[DeviceToken, ...]) -> None:
        """Publish a new device list; open ListAndWatch streams send it only when it changed."""
        async with self._changed:
            if tokens == self._tokens:
                return
            self._tokens = tokens
            self._version += 1
            self._changed.notify_all()

    # ----- life cycle ------------------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, re-serving and re-registering after every kubelet restart."""
        try:
            while not stop.is_set():
                await self.tick()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self._poll_s)
        finally:
            await self.close()

    async def tick(self) -> None:
        """One watch step: make sure our socket is served and the current kubelet knows us."""
        if self._server is None or _identity(self.socket) != self._socket_id:
            await self._serve()
            self._registered_with = None  # a new socket must be announced again
        kubelet = _identity(self.kubelet_socket)
        if not self._kubelet_present(kubelet):
            return
        if kubelet is not None and kubelet != self._registered_with:
            try:
                await self._register()
            except DevicePluginError as e:
                self._register_failures += 1
                now = time.monotonic()
                if self._register_failures == 1 or now >= self._next_register_warning:
                    log.warning("%s; retrying every %.1fs (%d tries)", e, self._poll_s, self._register_failures)
                    self._next_register_warning = now + REGISTER_RETRY_WARN_EVERY_S
                return
            self._register_failures = 0
            self._registered_with = kubelet
            self.registrations += 1
            log.info("registered %s with the kubelet at %s", self.resource_name, self.kubelet_socket)

    def _kubelet_present(self, kubelet: tuple[int, int] | None) -> bool:
        """Whether kubelet.sock is there to register with; while it is not, warn (at once, then every
        :data:`NO_KUBELET_WARN_EVERY_S`) and keep waiting, as the kubelet may start later (as the NVIDIA plugin does)."""
        now = time.monotonic()
        try:
            is_socket = stat.S_ISSOCK(self.kubelet_socket.stat().st_mode)
        except FileNotFoundError:
            is_socket, kubelet = False, None  # gone since it was looked at
        if kubelet is not None and is_socket:
            if self._no_kubelet_since is not None:
                log.info("%s appeared after %.0fs; registering", self.kubelet_socket, now - self._no_kubelet_since)
                self._no_kubelet_since = None
            return True
        if self._no_kubelet_since is None:
            self._no_kubelet_since = self._next_no_kubelet_warning = now
        if now >= self._next_no_kubelet_warning:
            what = "is not a unix socket" if kubelet is not None else "does not exist"
            created = " (the directory did not exist; sharegpu created it)" if self._created_dir else ""
            log.warning(
                "%s %s%s, waited %.0fs: is the kubelet running, and is --device-plugin-dir its device plugin "
                "directory (%s by default)? Pods cannot be given %s until the plugin registers; still waiting",
                self.kubelet_socket,
                what,
                created,
                now - self._no_kubelet_since,
                DEFAULT_PLUGIN_DIR,
                self.resource_name,
            )
            self._next_no_kubelet_warning = now + NO_KUBELET_WARN_EVERY_S
        return False

    async def close(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=0.5)
            self._server = None
        if self._socket_id is not None and _identity(self.socket) == self._socket_id:
            self.socket.unlink(missing_ok=True)
        self._socket_id = None

    async def _serve(self) -> None:
        await self.close()
        self._created_dir = self._created_dir or not self.plugin_dir.exists()
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)  # a stale socket from an earlier run would make bind fail
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((self._handlers(),))
        try:
            server.add_insecure_port(f"unix://{self.socket}")
        except RuntimeError as e:
            raise DevicePluginError(f"cannot listen on {self.socket}: {e}") from None
        await server.start()
        self._server = server
        self._socket_id = _identity(self.socket)
        log.info("device plugin serving on %s", self.socket)

    async def _register(self) -> None:
        request = pb.RegisterRequest(
            version=API_VERSION,
            endpoint=self.socket.name,
            resource_name=self.resource_name,
            options=pb.DevicePluginOptions(**OPTIONS),
        )
        try:
            # A channel of its own subchannels: gRPC otherwise shares one per address across channels, and a
            # refused connect leaves it backing off (1 s, growing), failing every new channel at once meanwhile.
            local = [("grpc.use_local_subchannel_pool", 1)]
            async with grpc.aio.insecure_channel(f"unix://{self.kubelet_socket}", options=local) as channel:
                register = channel.unary_unary(
                    "/v1beta1.Registration/Register",
                    request_serializer=pb.RegisterRequest.SerializeToString,
                    response_deserializer=pb.Empty.FromString,
                )
                # Not wait_for_ready: a kubelet.sock that nobody listens on (a kubelet stopping or not yet serving)
                # fails at once and the next poll tries the socket again, instead of holding the call for the whole
                # timeout while a new kubelet is already admitting pods.
                await register(request, timeout=self._register_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise DevicePluginError(
                f"the kubelet at {self.kubelet_socket} refused registration: {e.code().name}: {e.details()}"
            ) from None

    # ----- the DevicePlugin service ----------------------------------------------------------------------------
    def _handlers(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            "v1beta1.DevicePlugin",
            {
                "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(
                    self._options, pb.Empty.FromString, pb.DevicePluginOptions.SerializeToString
                ),
                "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                    self._list_and_watch, pb.Empty.FromString, pb.ListAndWatchResponse.SerializeToString
                ),
                "GetPreferredAllocation": grpc.unary_unary_rpc_method_handler(
                    self._preferred,
                    pb.PreferredAllocationRequest.FromString,
                    pb.PreferredAllocationResponse.SerializeToString,
                ),
                "Allocate": grpc.unary_unary_rpc_method_handler(
                    self._allocate, pb.AllocateRequest.FromString, pb.AllocateResponse.SerializeToString
                ),
                "PreStartContainer": grpc.unary_unary_rpc_method_handler(
                    self._pre_start,
                    pb.PreStartContainerRequest.FromString,
                    pb.PreStartContainerResponse.SerializeToString,
                ),
            },
        )

    async def _options(
        self, request: pb.Empty, context: grpc.aio.ServicerContext[pb.Empty, pb.DevicePluginOptions]
    ) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(**OPTIONS)

    async def _list_and_watch(
        self, request: pb.Empty, context: grpc.aio.ServicerContext[pb.Empty, pb.ListAndWatchResponse]
    ) -> AsyncIterator[pb.ListAndWatchResponse]:
        seen = -1
        while True:
            async with self._changed:
                await self._changed.wait_for(self._newer_than(seen))
                seen, tokens = self._version, self._tokens
            yield pb.ListAndWatchResponse(
                devices=[pb.Device(ID=t.id, health=HEALTHY if t.healthy else UNHEALTHY) for t in tokens]
            )

    def _newer_than(self, seen: int) -> Callable[[], bool]:
        return lambda: self._version != seen

    async def _preferred(
        self,
        request: pb.PreferredAllocationRequest,
        context: grpc.aio.ServicerContext[pb.PreferredAllocationRequest, pb.PreferredAllocationResponse],
    ) -> pb.PreferredAllocationResponse:
        # Tokens are interchangeable (the assignment picks the GPU), so any choice is as good as another.
        out = []
        for r in request.container_requests:
            ids = list(r.must_include_deviceIDs)
            ids += [d for d in r.available_deviceIDs if d not in ids][: max(0, r.allocation_size - len(ids))]
            out.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return pb.PreferredAllocationResponse(container_responses=out)

    async def _allocate(
        self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext[pb.AllocateRequest, pb.AllocateResponse]
    ) -> pb.AllocateResponse:
        responses = []
        for creq in request.container_requests:
            try:
                responses.append(answer_to_response(self._allocator.allocate(list(creq.devices_ids))))
            except AllocationError as e:
                log.warning("Allocate refused: %s", e)
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return pb.AllocateResponse(container_responses=responses)

    async def _pre_start(
        self,
        request: pb.PreStartContainerRequest,
        context: grpc.aio.ServicerContext[pb.PreStartContainerRequest, pb.PreStartContainerResponse],
    ) -> pb.PreStartContainerResponse:
        error: tuple[grpc.StatusCode, str] | None = None
        try:
            await self._allocator.prestart(list(request.devices_ids))
        except AllocationError as e:
            error = (grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except Exception as e:  # a bug must fail one container, never the plugin that serves all others
            log.exception("PreStartContainer failed unexpectedly")
            error = (grpc.StatusCode.INTERNAL, f"sharegpu node agent failed: {type(e).__name__}: {e}")
        if error is not None:
            log.warning("PreStartContainer refused: %s", error[1])
            await context.abort(error[0], error[1])
        return pb.PreStartContainerResponse()
