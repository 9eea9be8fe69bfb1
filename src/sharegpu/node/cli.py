"""``sharegpu node-agent``: the command the node agent DaemonSet runs.

Register it on the main typer app with ``app.command("node-agent")(node_agent)``.
Three settings are environment variables rather than flags: ``SHAREGPU_STATE_DIR`` (default /var/lib/sharegpu;
MPS pipe directories live there, so it must be the same path on the host and in the agent's container),
``SHAREGPU_MPS_CONTROL`` (default nvidia-cuda-mps-control) and ``POD_NAMESPACE`` (the agent's own namespace, where
the chart's ``sharegpu bench`` Job runs: its pod's use of the GPUs is not audited; unset: no pod is taken for it).
``sharegpu dra-driver`` reads the same three.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from sharegpu.kube.kubeconfig import KUBECONFIG_HELP
from sharegpu.kube.names import name_problem
from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog
from sharegpu.node.agent import AgentConfig, NodeAgent
from sharegpu.node.attribution import DEFAULT_POD_RESOURCES_SOCKET
from sharegpu.node.backends.base import GpuBackend
from sharegpu.node.cdi import DEFAULT_CDI_DIR, CdiError, CdiWriter
from sharegpu.node.device_plugin import DEFAULT_PLUGIN_DIR, check_plugin_dir
from sharegpu.node.enforcement import PodNotifier
from sharegpu.node.errors import COMMAND_ERRORS, NodeError
from sharegpu.node.kube import KubeApi
from sharegpu.node.metrics import parse_listen
from sharegpu.node.mps import MPS_CONTROL, MpsDaemon, MpsManager, NvidiaMpsDaemon, SimMpsDaemon
from sharegpu.node.state import AgentState

if TYPE_CHECKING:
    from sharegpu.node.dra.kube import DraKube
    from sharegpu.node.dra.service import DraDriverService

DEFAULT_STATE_DIR = Path("/var/lib/sharegpu")
DEFAULT_METRICS = "0.0.0.0:9402"


class BackendKind(StrEnum):
    NVML = "nvml"
    SIM = "sim"


class AgentSetupError(NodeError):
    """A flag or file that stops the agent from starting; the message says which and what to change."""


def check_node_name(name: str) -> str:
    """``name`` when a Node can have it: with any other the agent would wait forever for a Node that cannot exist."""
    if not name.strip():
        raise AgentSetupError("--node-name is empty; pass the node's name, e.g. --node-name $(NODE_NAME)")
    if problem := name_problem("node", name):  # the one rule of sharegpu.kube.names: the API server's own
        raise AgentSetupError(
            f"--node-name: {problem}; pass the node's name as `kubectl get nodes` shows it, e.g. --node-name "
            "$(NODE_NAME) from spec.nodeName"
        )
    return name


def check_cdi_dir(cdi_dir: Path) -> None:
    """The CDI directory is (or can be made) a directory this process can write specs in: checked at start, not at
    the first container that needs a spec."""
    if cdi_dir.exists() and not cdi_dir.is_dir():
        raise AgentSetupError(f"--cdi-dir {cdi_dir} exists and is not a directory; give the runtime's CDI directory")
    try:
        CdiWriter(cdi_dir).check()
    except CdiError as e:
        raise AgentSetupError(
            f"--cdi-dir {cdi_dir}: {e}; give a writable directory the container runtime reads CDI specs from "
            f"(containerd's cdi_spec_dirs, e.g. {DEFAULT_CDI_DIR})"
        ) from None


def node_agent(
    node_name: str = typer.Option(..., "--node-name", help="This node's Kubernetes name (spec.nodeName of its pods)."),
    kubeconfig: Path | None = typer.Option(None, "--kubeconfig", help=KUBECONFIG_HELP),
    backend: BackendKind = typer.Option(..., "--backend", help="nvml on a GPU node, sim for a simulated one."),
    sim_config: Path | None = typer.Option(
        None, "--sim-config", help="YAML of the simulated GPUs (with --backend sim)."
    ),
    # Long paths are said in words in the help: the help column of an 80-column terminal cuts a path longer than it.
    device_plugin_dir: Path = typer.Option(
        DEFAULT_PLUGIN_DIR,
        "--device-plugin-dir",
        help="The kubelet's device plugin directory (holds kubelet.sock). Default: device-plugins in /var/lib/kubelet.",
        show_default=False,
    ),
    metrics_listen: str = typer.Option(
        DEFAULT_METRICS, "--metrics-listen", help="HOST:PORT of the Prometheus endpoint."
    ),
    pod_resources_socket: Path = typer.Option(
        DEFAULT_POD_RESOURCES_SOCKET,
        "--pod-resources-socket",
        help="The kubelet's pod-resources socket (kubelet.sock in the pod-resources folder of the kubelet's root): whose "
        "container starts. Default: the one in /var/lib/kubelet.",
        show_default=False,
    ),
    cdi_dir: Path = typer.Option(
        DEFAULT_CDI_DIR, "--cdi-dir", help="Where the container runtime reads CDI specs (containerd's cdi_spec_dirs)."
    ),
    evict_on_audit: bool = typer.Option(
        False,
        "--evict-on-audit",
        help="Evict (Eviction API) a pod the enforcement audit finds on a GPU it holds no share of, bypassing MPS, "
        "or above its memory share. Off: such pods get a Warning Event and a metric only.",
    ),
    mps_multi_user: bool = typer.Option(
        False,
        "--mps-multi-user",
        help="One multi-user MPS daemon (nvidia-cuda-mps-control -M) per GPU or MIG instance for the pods of every "
        "user, instead of a daemon per tenant. It gives up isolation between users: all clients share one server and "
        "its fault domain. Volta or later only. Off by default.",
    ),
) -> None:
    """Run the sharegpu node agent: inventory, device plugin, MIG and MPS managers, metrics."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        agent = build_agent(
            node_name,
            kubeconfig,
            backend,
            sim_config,
            device_plugin_dir,
            metrics_listen,
            pod_resources_socket=pod_resources_socket,
            cdi_dir=cdi_dir,
            evict_on_audit=evict_on_audit,
            mps_multi_user=mps_multi_user,
        )
        asyncio.run(_serve(agent))
    except COMMAND_ERRORS as e:
        typer.echo(f"sharegpu node-agent: {e}", err=True)
        raise typer.Exit(2) from None


def build_agent(
    node_name: str,
    kubeconfig: Path | None,
    backend_kind: BackendKind,
    sim_config: Path | None,
    device_plugin_dir: Path,
    metrics_listen: str,
    kube: KubeApi | None = None,
    pod_resources_socket: Path = DEFAULT_POD_RESOURCES_SOCKET,
    cdi_dir: Path = DEFAULT_CDI_DIR,
    evict_on_audit: bool = False,
    notifier: PodNotifier | None = None,
    mps_multi_user: bool = False,
) -> NodeAgent:
    check_node_name(node_name)
    listen = parse_listen(metrics_listen) if metrics_listen else None
    check_plugin_dir(device_plugin_dir)
    for flag, path in (("--pod-resources-socket", pod_resources_socket), ("--cdi-dir", cdi_dir)):
        if not path.is_absolute():
            raise AgentSetupError(f"{flag} {path} is relative; give an absolute path")
    if pod_resources_socket.is_dir():
        raise AgentSetupError(
            f"--pod-resources-socket {pod_resources_socket} is a directory; name the socket inside it, "
            f"e.g. {pod_resources_socket / 'kubelet.sock'}"
        )
    check_cdi_dir(cdi_dir)
    backend, daemon = make_backend(node_name, backend_kind, sim_config)
    if mps_multi_user:
        check_multi_user(backend)
    if kube is None:
        from sharegpu.kube.api import LightkubeClusterApi
        from sharegpu.node.kube import LightkubeApi

        kube = LightkubeApi(kubeconfig)
        # Events and evictions of the enforcement audit and the MPS fault watch go through the shared client layer.
        notifier = LightkubeClusterApi(kubeconfig, field_manager="sharegpu-node-agent")
    config = AgentConfig(
        node_name,
        device_plugin_dir,
        state_dir_from_env(),
        listen,
        pod_resources_socket=pod_resources_socket,
        cdi_dir=cdi_dir,
        evict_on_audit=evict_on_audit,
        mps_multi_user=mps_multi_user,
        namespace=os.environ.get("POD_NAMESPACE", "").strip(),
    )
    return NodeAgent(config, backend, kube, daemon, notifier=notifier)


def check_multi_user(backend: GpuBackend, catalog: Catalog = DEFAULT_CATALOG) -> None:
    """Multi-user MPS (``-M``) needs Volta or later on every GPU: on Pascal the flag is accepted, but clients that are
    not root fail in CUDA initialisation. A GPU the catalog does not know is not known to be Volta: refused too."""
    old = []
    for d in backend.devices():
        model = catalog.get(d.model)
        major = model.compute_capability.split(".", 1)[0]
        if model.generic or not model.mps_capable or not major.isdigit() or int(major) < 7:
            old.append(f"GPU {d.index} ({d.product}, compute capability {model.compute_capability})")
    if old:
        raise AgentSetupError(
            f"--mps-multi-user needs Volta or later (compute capability 7.0+); this node has {', '.join(old)}: there "
            "a multi-user MPS daemon serves no client that is not root. Leave --mps-multi-user off on this node (a "
            "daemon per tenant needs no such mode)"
        )


def make_backend(node_name: str, backend_kind: BackendKind, sim_config: Path | None) -> tuple[GpuBackend, MpsDaemon]:
    """The GPU backend and MPS daemon driver of a node (shared by the node agent and the DRA driver)."""
    backend: GpuBackend
    daemon: MpsDaemon
    if backend_kind is BackendKind.SIM:
        from sharegpu.node.backends.sim import SimBackend
        from sharegpu.node.backends.sim_config import load_sim_config

        if sim_config is None:
            raise AgentSetupError("--backend sim needs --sim-config FILE, e.g. gpus: [{model: H100-80GB, count: 2}]")
        sim = SimBackend(load_sim_config(sim_config), seed=node_name)
        backend, daemon = sim, SimMpsDaemon(sim)
    else:
        if sim_config is not None:
            raise AgentSetupError("--sim-config is only for --backend sim")
        from sharegpu.node.backends.nvml import NvmlBackend
        from sharegpu.node.backends.nvml_api import PynvmlApi

        backend = NvmlBackend(PynvmlApi())
        daemon = NvidiaMpsDaemon(os.environ.get("SHAREGPU_MPS_CONTROL", MPS_CONTROL))
    return backend, daemon


def state_dir_from_env() -> Path:
    state_dir = Path(os.environ.get("SHAREGPU_STATE_DIR", str(DEFAULT_STATE_DIR)))
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise AgentSetupError(
            f"cannot create the state directory {state_dir} ({e.strerror or e}); set SHAREGPU_STATE_DIR to a writable path"
        ) from None
    return state_dir


async def _serve(agent: NodeAgent) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        if sys.platform != "win32":
            loop.add_signal_handler(sig, stop.set)
    try:
        await agent.run(stop)
    finally:
        await agent.kube.close()
        if agent.notifier is not None:
            await agent.notifier.close()
        agent.backend.close()


def dra_driver(
    node_name: str = typer.Option(..., "--node-name", help="This node's Kubernetes name (its pool's name)."),
    kubeconfig: Path | None = typer.Option(None, "--kubeconfig", help=KUBECONFIG_HELP),
    backend: BackendKind = typer.Option(..., "--backend", help="nvml on a GPU node, sim for a simulated one."),
    sim_config: Path | None = typer.Option(
        None, "--sim-config", help="YAML of the simulated GPUs (with --backend sim)."
    ),
    kubelet_dir: Path = typer.Option(
        Path("/var/lib/kubelet"), "--kubelet-dir", help="The kubelet's root directory (plugins_registry, plugins)."
    ),
    registration_socket: Path | None = typer.Option(
        None,
        "--registration-socket",
        help="The socket the kubelet finds the plugin by. Default: gpu.sharegpu.io-reg.sock in the plugins_registry "
        "folder of --kubelet-dir.",
    ),
    plugin_socket: Path | None = typer.Option(
        None,
        "--plugin-socket",
        help="The plugin's own socket. Default: dra.sock in the gpu.sharegpu.io folder of the plugins folder of "
        "--kubelet-dir.",
    ),
    cdi_dir: Path = typer.Option(
        Path("/var/run/cdi"), "--cdi-dir", help="Where the container runtime reads CDI specs."
    ),
    interval_s: float = typer.Option(
        10.0, "--interval", help="Seconds between ResourceSlice, cleanup and enforcement-audit passes."
    ),
    mps_multi_user: bool = typer.Option(
        False,
        "--mps-multi-user",
        help="One multi-user MPS daemon (nvidia-cuda-mps-control -M) per GPU or MIG instance for the claims of every "
        "user, instead of a daemon per tenant (a claim shared by pods of several users then works). It gives up "
        "isolation between users: all clients share one server and its fault domain. Volta or later only. Off by "
        "default.",
    ),
    evict_on_audit: bool = typer.Option(
        False,
        "--evict-on-audit",
        help="Evict (Eviction API) a pod the enforcement audit finds on a GPU its claims do not give it, bypassing or "
        "beside its MPS daemon, or above its memory share. Off: such pods get a Warning Event only.",
    ),
) -> None:
    """Run the sharegpu DRA driver (gpu.sharegpu.io): ResourceSlices, kubelet plugin, MIG/MPS enforcement, audit."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        service = build_dra_service(
            node_name,
            kubeconfig,
            backend,
            sim_config,
            kubelet_dir,
            registration_socket,
            plugin_socket,
            cdi_dir,
            interval_s,
            mps_multi_user=mps_multi_user,
            evict_on_audit=evict_on_audit,
        )
        asyncio.run(_serve_dra(service))
    except COMMAND_ERRORS as e:
        typer.echo(f"sharegpu dra-driver: {e}", err=True)
        raise typer.Exit(2) from None


def build_dra_service(
    node_name: str,
    kubeconfig: Path | None,
    backend_kind: BackendKind,
    sim_config: Path | None,
    kubelet_dir: Path,
    registration_socket: Path | None,
    plugin_socket: Path | None,
    cdi_dir: Path,
    interval_s: float = 10.0,
    kube: DraKube | None = None,
    *,
    mps_multi_user: bool = False,
    evict_on_audit: bool = False,
    notifier: PodNotifier | None = None,
) -> DraDriverService:
    import math

    from sharegpu.node.cdi import CdiError, CdiWriter
    from sharegpu.node.dra.checkpoint import Checkpoint
    from sharegpu.node.dra.driver import DraDriver, NvidiaSmiTimeSlicer, SimTimeSlicer, TimeSlicer
    from sharegpu.node.dra.plugin import DraPluginServer, SocketPaths
    from sharegpu.node.dra.publisher import SlicePublisher
    from sharegpu.node.dra.service import DraDriverService, ServiceConfig
    from sharegpu.node.dra.watch import DraWatch
    from sharegpu.node.mig import MigManager

    check_node_name(node_name)
    if not math.isfinite(interval_s) or interval_s <= 0:
        raise AgentSetupError(f"--interval {interval_s} must be a finite number of seconds above 0, e.g. 10")
    # Relative paths are taken from the working directory: the kubelet dials the endpoint that GetInfo names from
    # its own working directory, and gRPC reads "unix://relative/x" as host "relative", so only absolute paths work.
    defaults = SocketPaths.under(kubelet_dir.absolute())
    paths = SocketPaths(
        (registration_socket or defaults.registration).absolute(), (plugin_socket or defaults.service).absolute()
    )
    paths.check()
    backend, daemon = make_backend(node_name, backend_kind, sim_config)
    if mps_multi_user:
        check_multi_user(backend)
    cdi = CdiWriter(cdi_dir.absolute())
    try:
        cdi.check()
    except CdiError as e:
        raise AgentSetupError(f"--cdi-dir {cdi_dir}: {e}; give the directory the container runtime reads") from None
    slicer: TimeSlicer = SimTimeSlicer() if backend_kind is BackendKind.SIM else NvidiaSmiTimeSlicer()
    if kube is None:
        from sharegpu.kube.api import LightkubeClusterApi
        from sharegpu.node.dra.kube import FIELD_MANAGER, LightkubeDraApi

        kube = LightkubeDraApi(kubeconfig)
        # Events (and evictions) of the audit and the MPS fault watch, as the node agent posts them.
        notifier = LightkubeClusterApi(kubeconfig, field_manager=FIELD_MANAGER)
    state_dir = state_dir_from_env()
    # Its own state file: during a switch of paths the node agent may still run beside it for a moment.
    mig = MigManager(backend, AgentState(state_dir / "dra-mig-state.json"))
    mps = MpsManager(state_dir / "mps", daemon, multi_user=mps_multi_user)
    driver = DraDriver(node_name, backend, kube, mig, mps, Checkpoint(state_dir / "dra-checkpoint.json"), cdi, slicer)
    return DraDriverService(
        ServiceConfig(node_name, interval_s),
        driver,
        DraPluginServer(driver, paths),
        kube,
        SlicePublisher(node_name, kube, mps_multi_user=mps_multi_user),
        # A process of no pod is told on the Node through the driver's own client, as the agent tells it.
        DraWatch(
            driver,
            notifier,
            evict=evict_on_audit,
            namespace=os.environ.get("POD_NAMESPACE", "").strip(),
            node_events=kube,
        ),
    )


async def _serve_dra(service: DraDriverService) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        if sys.platform != "win32":
            loop.add_signal_handler(sig, stop.set)
    try:
        await service.run(stop)
    finally:
        await service.kube.close()
        if service.watch is not None and service.watch.notifier is not None:
            await service.watch.notifier.close()
        service.driver.backend.close()
