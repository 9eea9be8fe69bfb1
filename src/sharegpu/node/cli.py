"""``sharegpu node-agent``: the command the node agent DaemonSet runs.

Register it on the main typer app with ``app.command("node-agent")(node_agent)``.
Two settings are environment variables rather than flags: ``SHAREGPU_STATE_DIR`` (default /var/lib/sharegpu;
MPS pipe directories live there, so it must be the same path on the host and in the agent's container) and
``SHAREGPU_MPS_CONTROL`` (default nvidia-cuda-mps-control).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from enum import StrEnum
from pathlib import Path

import typer

from sharegpu.node.agent import AgentConfig, NodeAgent
from sharegpu.node.backends.base import BackendError, GpuBackend
from sharegpu.node.backends.sim_config import SimConfigError
from sharegpu.node.device_plugin import DEFAULT_PLUGIN_DIR, DevicePluginError, check_plugin_dir
from sharegpu.node.kube import KubeApi, KubeError
from sharegpu.node.metrics import MetricsError, parse_listen
from sharegpu.node.mps import MPS_CONTROL, MpsDaemon, MpsError, NvidiaMpsDaemon, SimMpsDaemon
from sharegpu.node.state import StateError

DEFAULT_STATE_DIR = Path("/var/lib/sharegpu")
DEFAULT_METRICS = "0.0.0.0:9402"


class BackendKind(StrEnum):
    NVML = "nvml"
    SIM = "sim"


class AgentSetupError(Exception):
    """A flag or file that stops the agent from starting; the message says which and what to change."""


def node_agent(
    node_name: str = typer.Option(..., "--node-name", help="This node's Kubernetes name (spec.nodeName of its pods)."),
    kubeconfig: Path | None = typer.Option(None, "--kubeconfig", help="Kubeconfig file; in-cluster config if omitted."),
    backend: BackendKind = typer.Option(..., "--backend", help="nvml on a GPU node, sim for a simulated one."),
    sim_config: Path | None = typer.Option(
        None, "--sim-config", help="YAML of the simulated GPUs (with --backend sim)."
    ),
    device_plugin_dir: Path = typer.Option(
        DEFAULT_PLUGIN_DIR, "--device-plugin-dir", help="The kubelet's device plugin directory (holds kubelet.sock)."
    ),
    metrics_listen: str = typer.Option(
        DEFAULT_METRICS, "--metrics-listen", help="HOST:PORT of the Prometheus endpoint."
    ),
) -> None:
    """Run the sharegpu node agent: inventory, device plugin, MIG and MPS managers, metrics."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        agent = build_agent(node_name, kubeconfig, backend, sim_config, device_plugin_dir, metrics_listen)
        asyncio.run(_serve(agent))
    except (
        AgentSetupError,
        SimConfigError,
        BackendError,
        KubeError,
        DevicePluginError,
        MetricsError,
        StateError,
        MpsError,
    ) as e:
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
) -> NodeAgent:
    if not node_name.strip():
        raise AgentSetupError("--node-name is empty; pass the node's name, e.g. --node-name $(NODE_NAME)")
    listen = parse_listen(metrics_listen) if metrics_listen else None
    check_plugin_dir(device_plugin_dir)
    backend: GpuBackend
    daemon: MpsDaemon
    if backend_kind is BackendKind.SIM:
        from sharegpu.node.backends.sim import SimBackend
        from sharegpu.node.backends.sim_config import load_sim_config

        if sim_config is None:
            raise AgentSetupError("--backend sim needs --sim-config FILE, e.g. gpus: [{model: H100-80GB, count: 2}]")
        backend = SimBackend(load_sim_config(sim_config), seed=node_name)
        daemon = SimMpsDaemon()
    else:
        if sim_config is not None:
            raise AgentSetupError("--sim-config is only for --backend sim")
        from sharegpu.node.backends.nvml import NvmlBackend, PynvmlApi

        backend = NvmlBackend(PynvmlApi())
        daemon = NvidiaMpsDaemon(os.environ.get("SHAREGPU_MPS_CONTROL", MPS_CONTROL))
    if kube is None:
        from sharegpu.node.kube import LightkubeApi

        kube = LightkubeApi(kubeconfig)
    state_dir = Path(os.environ.get("SHAREGPU_STATE_DIR", str(DEFAULT_STATE_DIR)))
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise AgentSetupError(
            f"cannot create the state directory {state_dir} ({e.strerror or e}); set SHAREGPU_STATE_DIR to a writable path"
        ) from None
    config = AgentConfig(node_name, device_plugin_dir, state_dir, listen)
    return NodeAgent(config, backend, kube, daemon)


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
        agent.backend.close()
