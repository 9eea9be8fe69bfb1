"""The control plane's commands: ``scheduler-extender``, ``webhook`` and ``status`` (registered in sharegpu.cli)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import uuid
from pathlib import Path

import typer
from rich.console import Console

from sharegpu.k8s.api import ApiError, LightkubeClusterApi
from sharegpu.k8s.pod_request import DEFAULT_SCHEDULER_NAME
from sharegpu.k8s.webhook import WebhookConfig, serve_webhook, trusted
from sharegpu.placement.policies import POLICIES, UnknownPolicy


class SetupError(Exception):
    """A flag that stops a command from starting; the message says what to change."""


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise SetupError(f"--listen {text!r} must be HOST:PORT, e.g. 0.0.0.0:8888")
    return host.strip("[]") or "0.0.0.0", int(port)


def _service_account_namespace() -> str:
    path = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _fail(message: str) -> typer.Exit:
    typer.echo(f"sharegpu: {message}", err=True)
    return typer.Exit(2)


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One line per API request (every bind, every watch) is noise at INFO and costs time on a busy scheduler.
    for noisy in ("httpx", "httpx2"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def scheduler_extender(
    kubeconfig: Path | None = typer.Option(None, "--kubeconfig", help="Kubeconfig file; in-cluster config if omitted."),
    listen: str = typer.Option("0.0.0.0:8888", "--listen", help="HOST:PORT to serve the extender on."),
    policy: str = typer.Option("sharegpu", "--policy", help=f"Placement policy: {', '.join(POLICIES)}."),
    seed: int = typer.Option(0, "--seed", help="Seed of the policies that draw random numbers."),
    scheduler_name: str = typer.Option(
        DEFAULT_SCHEDULER_NAME, "--scheduler-name", help="The sharegpu scheduler's name: /bind binds only its pods."
    ),
    leader_elect: bool = typer.Option(
        False,
        "--leader-elect/--no-leader-elect",
        help="Run as one of several replicas: only the holder of a coordination.k8s.io Lease binds and is ready.",
    ),
    lease_name: str = typer.Option(
        "sharegpu-extender", "--lease-name", help="The Lease replicas elect their leader on."
    ),
    lease_namespace: str = typer.Option(
        "", "--lease-namespace", help="Namespace of the Lease (default: $POD_NAMESPACE, else the service account's)."
    ),
    identity: str = typer.Option("", "--identity", help="This replica's name in the Lease (default: $POD_NAME)."),
) -> None:
    """Serve the kube-scheduler extender (filter, prioritize, bind, preempt) on the simulator's ledger and policies."""
    from sharegpu.k8s.extender import run_extender
    from sharegpu.k8s.leader import LeaderElector
    from sharegpu.k8s.view import ClusterView

    _logging()
    try:
        host, port = parse_listen(listen)
        view = ClusterView(policy=policy, seed=seed, scheduler_name=scheduler_name)
        api = LightkubeClusterApi(kubeconfig)
    except (SetupError, UnknownPolicy, ApiError) as e:
        raise _fail(str(e)) from None
    elector = None
    if leader_elect:
        ns = lease_namespace or os.environ.get("POD_NAMESPACE") or _service_account_namespace() or "default"
        me = identity or os.environ.get("POD_NAME") or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
        elector = LeaderElector(api, ns, lease_name, me)
    try:
        asyncio.run(run_extender(view, api, host, port, scheduler_name=scheduler_name, elector=elector))
    except OSError as e:
        raise _fail(f"cannot serve on {listen}: {e}") from None


def webhook(
    listen: str = typer.Option("0.0.0.0:8443", "--listen", help="HOST:PORT to serve HTTPS on."),
    tls_cert: Path = typer.Option(..., "--tls-cert", help="PEM certificate the API server trusts (caBundle)."),
    tls_key: Path = typer.Option(..., "--tls-key", help="PEM private key of the certificate."),
    scheduler_name: str = typer.Option(DEFAULT_SCHEDULER_NAME, "--scheduler-name", help="schedulerName to set."),
    trusted_user: list[str] = typer.Option(
        [], "--trusted-user", help="User allowed to change sharegpu.io/assignment (the extender's service account)."
    ),
) -> None:
    """Serve the admission webhook: /mutate and /validate (AdmissionReview v1) over HTTPS."""
    _logging()
    try:
        host, port = parse_listen(listen)
        for f in (tls_cert, tls_key):
            if not f.is_file():
                raise SetupError(f"{f} does not exist; give the webhook's TLS certificate and key files")
    except SetupError as e:
        raise _fail(str(e)) from None
    cfg = WebhookConfig(scheduler_name=scheduler_name, trusted_users=trusted(trusted_user))
    try:
        serve_webhook(host, port, str(tls_cert), str(tls_key), cfg)
    except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
        raise _fail(f"cannot serve the webhook on {listen}: {e}") from None


def status(
    kubeconfig: Path | None = typer.Option(None, "--kubeconfig", help="Kubeconfig file; in-cluster config if omitted."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    """Show every sharegpu GPU: model, mechanism, used memory and compute, MIG layout and the pods sharing it."""
    from sharegpu.k8s.dra_view import load_dra_status
    from sharegpu.k8s.status import print_status, status_report
    from sharegpu.k8s.view import ClusterView

    async def load() -> dict[str, object]:
        api = LightkubeClusterApi(kubeconfig)
        try:
            nodes, _ = await api.list_nodes()
            pods, _ = await api.list_pods()
        finally:
            await api.close()
        view = ClusterView(policy="bestfit")
        view.reset(nodes, pods)
        return status_report(view, await load_dra_status(kubeconfig))

    logging.basicConfig(level=logging.ERROR)  # problems are part of the report, not log noise
    try:
        report = asyncio.run(load())
    except ApiError as e:
        raise _fail(str(e)) from None
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        print_status(Console(), report)
