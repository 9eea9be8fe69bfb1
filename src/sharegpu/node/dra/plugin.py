"""The kubelet's two sockets of a DRA driver: plugin registration and the DRAPlugin service (v1 and v1beta1).

The kubelet watches ``<kubelet dir>/plugins_registry``; on a new socket there it calls
``pluginregistration.Registration/GetInfo`` (answered with type ``DRAPlugin``, the driver name, the service socket
and the service versions served there) and then ``NotifyRegistrationStatus``. It then calls
``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`` (or v1beta1, whichever it prefers) on the service socket. A claim that
cannot be prepared gets its error in its own entry of the response; the call itself succeeds. The same socket serves
the device health stream (:mod:`sharegpu.node.dra.health`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from sharegpu.model.contract import DRIVER
from sharegpu.node.dra.driver import ClaimRef, DraDriver
from sharegpu.node.dra.health import HealthService
from sharegpu.node.errors import NodeError
from sharegpu.node.proto import dra_v1_pb2 as v1
from sharegpu.node.proto import dra_v1beta1_pb2 as v1beta1
from sharegpu.node.proto import pluginregistration_pb2 as reg

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
DEFAULT_KUBELET_DIR = Path("/var/lib/kubelet")
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes including the terminating NUL


class PluginSocketError(NodeError):
    """A socket cannot be served; the message says which path and which flag changes it."""


@dataclass(frozen=True, slots=True)
class SocketPaths:
    registration: Path
    service: Path

    @staticmethod
    def under(kubelet_dir: Path, driver: str = DRIVER) -> SocketPaths:
        return SocketPaths(
            kubelet_dir / "plugins_registry" / f"{driver}-reg.sock", kubelet_dir / "plugins" / driver / "dra.sock"
        )

    def check(self) -> None:
        for path, flag in ((self.registration, "--registration-socket"), (self.service, "--plugin-socket")):
            if path.is_dir():
                # Checked here: found only when the socket is made, it ended the driver in a traceback.
                raise PluginSocketError(
                    f"{flag} {path} is a directory; name the socket file inside it, e.g. {path / _default_name(flag)}"
                )
            if path.parent.exists() and not path.parent.is_dir():
                raise PluginSocketError(f"{flag} {path}: {path.parent} is a file, not a directory")
            if len(str(path).encode()) > MAX_SOCKET_PATH:
                raise PluginSocketError(
                    f"socket path {path} is longer than the {MAX_SOCKET_PATH} bytes a unix socket allows; "
                    f"give a shorter {flag} or --kubelet-dir"
                )


def _default_name(flag: str) -> str:
    defaults = SocketPaths.under(Path("/"))
    return (defaults.registration if flag == "--registration-socket" else defaults.service).name


class DraPluginServer:
    def __init__(self, driver: DraDriver, paths: SocketPaths, health: HealthService | None = None) -> None:
        paths.check()
        self.paths = paths
        self._driver = driver
        self._servers: list[grpc.aio.Server] = []
        self.registered: bool | None = None  # what the kubelet last told us
        self.registration_error = ""
        self.registrations = 0  # how often the kubelet registered us (once per kubelet start)
        self.health = health or HealthService(driver.node_name, driver.backend.devices)
        # Called when the kubelet (re)registers the plugin: a restarted kubelet deleted the node's ResourceSlices,
        # and the service republishes them at once instead of at its next tick.
        self.on_registered: Callable[[], None] | None = None

    async def start(self) -> None:
        # The service first: the kubelet dials it as soon as it has read the registration socket.
        self._servers.append(
            await self._serve(
                self.paths.service,
                [self._dra_handlers(v1, "v1"), self._dra_handlers(v1beta1, "v1beta1"), self.health.handler()],
            )
        )
        self._servers.append(await self._serve(self.paths.registration, [self._registration_handlers()]))
        log.info("DRA plugin %s: registration %s, service %s", DRIVER, self.paths.registration, self.paths.service)

    async def stop(self) -> None:
        for server in self._servers:
            await server.stop(grace=0.5)
        self._servers.clear()
        for path in (self.paths.registration, self.paths.service):
            path.unlink(missing_ok=True)

    async def _serve(self, path: Path, handlers: list[grpc.GenericRpcHandler]) -> grpc.aio.Server:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)  # a stale socket from an earlier run would make bind fail
        except OSError as e:
            raise PluginSocketError(f"cannot prepare {path}: {e.strerror or e}") from None
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(tuple(handlers))
        try:
            server.add_insecure_port(f"unix://{path}")
        except RuntimeError as e:
            raise PluginSocketError(f"cannot listen on {path}: {e}") from None
        await server.start()
        return server

    # ----- registration ----------------------------------------------------------------------------------------
    def _registration_handlers(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            "pluginregistration.Registration",
            {
                "GetInfo": grpc.unary_unary_rpc_method_handler(
                    self._get_info, reg.InfoRequest.FromString, reg.PluginInfo.SerializeToString
                ),
                "NotifyRegistrationStatus": grpc.unary_unary_rpc_method_handler(
                    self._notify, reg.RegistrationStatus.FromString, reg.RegistrationStatusResponse.SerializeToString
                ),
            },
        )

    async def _get_info(self, request: reg.InfoRequest, context: Any) -> reg.PluginInfo:
        # The kubelet asks on every (re)start, before NotifyRegistrationStatus: the earliest sign of a new kubelet.
        self._wake()
        return reg.PluginInfo(
            type=PLUGIN_TYPE, name=DRIVER, endpoint=str(self.paths.service), supported_versions=list(SUPPORTED_VERSIONS)
        )

    async def _notify(self, request: reg.RegistrationStatus, context: Any) -> reg.RegistrationStatusResponse:
        self.registered, self.registration_error = request.plugin_registered, request.error
        if request.plugin_registered:
            self.registrations += 1
            log.info("the kubelet registered DRA driver %s", DRIVER)
            self._wake()
        else:
            log.error("the kubelet refused DRA driver %s: %s", DRIVER, request.error)
        return reg.RegistrationStatusResponse()

    def _wake(self) -> None:
        if self.on_registered is not None:
            self.on_registered()

    # ----- DRAPlugin -------------------------------------------------------------------------------------------
    def _dra_handlers(self, pb: Any, version: str) -> grpc.GenericRpcHandler:
        async def prepare(request: Any, context: Any) -> Any:
            refs = [ClaimRef(c.namespace, c.uid, c.name) for c in request.claims]
            results = await self._driver.prepare(refs)
            out = pb.NodePrepareResourcesResponse()
            for uid, r in results.items():
                entry = out.claims[uid]
                if r.error:
                    entry.error = r.error
                    continue
                for d in r.devices:
                    dev = entry.devices.add(
                        request_names=[d.request], pool_name=d.pool, device_name=d.device, cdi_device_ids=d.cdi_ids
                    )
                    if d.share_id and version == "v1":
                        dev.share_id = d.share_id
            return out

        async def unprepare(request: Any, context: Any) -> Any:
            refs = [ClaimRef(c.namespace, c.uid, c.name) for c in request.claims]
            errors = await self._driver.unprepare(refs)
            out = pb.NodeUnprepareResourcesResponse()
            for uid, error in errors.items():
                out.claims[uid].error = error
            return out

        return grpc.method_handlers_generic_handler(
            f"k8s.io.kubelet.pkg.apis.dra.{version}.DRAPlugin",
            {
                "NodePrepareResources": grpc.unary_unary_rpc_method_handler(
                    prepare,
                    pb.NodePrepareResourcesRequest.FromString,
                    pb.NodePrepareResourcesResponse.SerializeToString,
                ),
                "NodeUnprepareResources": grpc.unary_unary_rpc_method_handler(
                    unprepare,
                    pb.NodeUnprepareResourcesRequest.FromString,
                    pb.NodeUnprepareResourcesResponse.SerializeToString,
                ),
            },
        )
