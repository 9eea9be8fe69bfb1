"""The control plane's commands: ``scheduler-extender``, ``webhook`` and ``status`` (registered in sharegpu.cli)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import typer
from rich.console import Console

from sharegpu.k8s.api import ApiError, LightkubeClusterApi
from sharegpu.k8s.pod_request import DEFAULT_SCHEDULER_NAME
from sharegpu.k8s.webhook import WebhookConfig, serve_webhook, trusted
from sharegpu.placement.policies import POLICIES, UnknownPolicy


class SetupError(Exception):
    """A flag that stops a command from starting; the message says what to change."""


def parse_listen(text: str, flag: str = "--listen") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise SetupError(f"{flag} {text!r} must be HOST:PORT, e.g. 0.0.0.0:8888")
    return host.strip("[]") or "0.0.0.0", int(port)


def _fail(message: str) -> typer.Exit:
    typer.echo(f"sharegpu: {message}", err=True)
    return typer.Exit(2)


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def scheduler_extender(
    kubeconfig: Path | None = typer.Option(None, "--kubeconfig", help="Kubeconfig file; in-cluster config if omitted."),
    listen: str = typer.Option("0.0.0.0:8888", "--listen", help="HOST:PORT to serve the extender on."),
    policy: str = typer.Option("sharegpu", "--policy", help=f"Placement policy: {', '.join(POLICIES)}."),
    seed: int = typer.Option(0, "--seed", help="Seed of the policies that draw random numbers."),
    scheduler_name: str = typer.Option(
        DEFAULT_SCHEDULER_NAME, "--scheduler-name", help="The sharegpu scheduler's name: /bind binds only its pods."
    ),
    metrics_listen: str | None = typer.Option(
        None, "--metrics-listen", help="HOST:PORT to serve Prometheus /metrics on (its own port), e.g. 0.0.0.0:9403."
    ),
) -> None:
    """Serve the kube-scheduler extender (filter, prioritize, bind, preempt) on the simulator's ledger and policies."""
    from sharegpu.k8s.extender import run_extender
    from sharegpu.k8s.view import ClusterView

    _logging()
    try:
        host, port = parse_listen(listen)
        metrics = parse_listen(metrics_listen, "--metrics-listen") if metrics_listen is not None else None
        view = ClusterView(policy=policy, seed=seed)
        api = LightkubeClusterApi(kubeconfig)
    except (SetupError, UnknownPolicy, ApiError) as e:
        raise _fail(str(e)) from None
    try:
        asyncio.run(run_extender(view, api, host, port, scheduler_name=scheduler_name, metrics_listen=metrics))
    except OSError as e:
        where = listen if metrics_listen is None else f"{listen} (API) and {metrics_listen} (metrics)"
        raise _fail(f"cannot serve on {where}: {e}") from None


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
    watch: bool = typer.Option(False, "--watch", help="Follow the cluster and redraw every --interval seconds."),
    interval: float = typer.Option(2.0, "--interval", help="Seconds between redraws (--watch) or page refreshes."),
    serve: str | None = typer.Option(
        None, "--serve", help="HOST:PORT to serve the live read-only status page on (e.g. 127.0.0.1:8080)."
    ),
) -> None:
    """Show every sharegpu GPU: model, mechanism, used memory and compute, MIG layout and the pods sharing it."""
    from sharegpu.k8s.status import FollowedStatus, print_status, status_report, watch_status
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
        return status_report(view)

    async def follow(api: LightkubeClusterApi) -> None:
        from sharegpu.k8s.page import serve_page

        try:
            if addr is not None:
                await serve_page(FollowedStatus(), api, addr[0], addr[1], interval)
            else:
                await watch_status(FollowedStatus(), api, Console(), interval, asyncio.Event())
        finally:
            await api.close()

    logging.basicConfig(level=logging.ERROR)  # problems are part of the report, not log noise
    addr: tuple[str, int] | None = None
    try:
        if sum((as_json, watch, serve is not None)) > 1:
            raise SetupError("choose one of --json, --watch and --serve")
        if not 0.2 <= interval <= 3600:
            raise SetupError(f"--interval {interval:g} must be between 0.2 and 3600 seconds")
        if serve is not None:
            addr = parse_listen(serve, "--serve")
    except SetupError as e:
        raise _fail(str(e)) from None
    if watch or addr is not None:
        try:
            asyncio.run(follow(LightkubeClusterApi(kubeconfig)))
        except ApiError as e:
            raise _fail(str(e)) from None
        except OSError as e:
            raise _fail(f"cannot serve the status page on {serve}: {e}") from None
        except KeyboardInterrupt:
            pass
        return
    try:
        report = asyncio.run(load())
    except ApiError as e:
        raise _fail(str(e)) from None
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        print_status(Console(), report)
