"""The control plane's commands: ``scheduler-extender``, ``webhook`` and ``status`` (registered in sharegpu.cli)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
import uuid
from pathlib import Path

import typer
import uvloop
from rich.console import Console

from sharegpu.k8s.serving.body_limit import EXTENDER_MAX_BODY
from sharegpu.k8s.serving.tls import ServerTls, TlsError
from sharegpu.k8s.webhook.admission import WebhookConfig, serve_webhook, trusted
from sharegpu.kube.api import LightkubeClusterApi
from sharegpu.kube.errors import ConfigError, KubeError
from sharegpu.kube.kubeconfig import KUBECONFIG_HELP, quiet_http_logging
from sharegpu.kube.quantity import MIB
from sharegpu.ledger import (
    DEFAULT_DAEMONS_PER_UNIT,
    MPS_DAEMON_MEMORY_MIB,
    MPS_MAX_CLIENTS,
    MpsTenancy,
    daemon_memory_problem,
)
from sharegpu.model.contract import DEFAULT_SCHEDULER_NAME
from sharegpu.placement.policies import POLICIES, UnknownPolicy

log = logging.getLogger(__name__)


class SetupError(Exception):
    """A flag that stops a command from starting; the message says what to change."""


def parse_listen(text: str, flag: str = "--listen") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise SetupError(f"{flag} {text!r} must be HOST:PORT, e.g. 127.0.0.1:8888 (0.0.0.0 listens on every address)")
    if not 0 < int(port) < 65536:
        # The format is right: only the number is wrong, and the host as given stays.
        raise SetupError(f"{flag} {text!r}: port {int(port)} is out of range; a TCP port is 1 to 65535")
    return host.strip("[]") or "0.0.0.0", int(port)


# A Kubernetes object name of the DNS-1123 subdomain kind (what spec.schedulerName and a scheduler profile's
# schedulerName must be): lowercase alphanumerics, '-' and '.', starting and ending alphanumeric, at most 253.
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def check_scheduler_name(name: str) -> str:
    """``name`` when it can be a pod's ``spec.schedulerName``; a name the API server would never accept in a pod
    would leave the extender with no pod to bind (and the webhook sending every pod nowhere)."""
    if not name:
        raise SetupError(
            "--scheduler-name is empty; give the sharegpu scheduler profile's name, e.g. sharegpu-scheduler"
        )
    if len(name) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(name):
        raise SetupError(
            f"--scheduler-name {name!r} is not a valid scheduler name: it must be a DNS-1123 subdomain (lowercase "
            "letters, digits, '-' and '.', starting and ending with a letter or digit, at most 253 characters), "
            "e.g. sharegpu-scheduler"
        )
    return name


def _service_account_namespace() -> str:
    path = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    try:
        return path.read_text().strip()
    except OSError:
        return ""


MPS_DAEMONS_HELP = (
    "Most MPS daemons on one GPU or MIG instance: one per tenant there (the pods of one namespace that declare one "
    "runAsUser, or a pod alone; docs/placement.md). A share of a tenant that runs none on a GPU at the cap goes "
    "elsewhere. The control plane's ledgers all count with it: give the extender and `sharegpu status` the same."
)


MPS_DAEMON_MEMORY_HELP = (
    f"GPU memory (MiB) each MPS daemon's server takes of its GPU or MIG instance, counted beside its pods' shares: "
    f"{MPS_DAEMON_MEMORY_MIB} as NVML listed on an H200 (driver 580); bench/gpu_node_check.py measures your GPUs'. "
    "Give the extender and `sharegpu status` the same."
)


def mps_tenancy(daemons_per_gpu: int, daemon_memory_mib: int = MPS_DAEMON_MEMORY_MIB) -> MpsTenancy:
    """The ledgers' MPS tenancy from ``--mps-daemons-per-gpu`` and ``--mps-daemon-memory``; raises
    :class:`SetupError` out of range."""
    if not 1 <= daemons_per_gpu <= MPS_MAX_CLIENTS:
        raise SetupError(
            f"--mps-daemons-per-gpu {daemons_per_gpu} is out of range: 1 to {MPS_MAX_CLIENTS} daemons a GPU or MIG "
            f"instance (each serves at least one client, and an MPS unit takes at most {MPS_MAX_CLIENTS}), e.g. "
            f"{DEFAULT_DAEMONS_PER_UNIT}"
        )
    if problem := daemon_memory_problem(daemon_memory_mib):
        raise SetupError(f"--mps-daemon-memory {problem}")
    return MpsTenancy(daemons_per_unit=daemons_per_gpu, daemon_memory_mib=daemon_memory_mib)


def _fail(message: str) -> typer.Exit:
    typer.echo(f"sharegpu: {message}", err=True)
    return typer.Exit(2)


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_http_logging()  # one line per API request is noise at INFO and costs time on a busy scheduler


# The on/off pairs in a panel of their own: their --no-X column beside the longest option names would leave the help
# text too narrow a column on an 80-column terminal, and the names would be cut.
SWITCHES = "Switches"
PACE = "Preemption and consolidation pace"  # the longest option name, on its own: the others keep a wide help column


def scheduler_extender(
    kubeconfig: Path | None = typer.Option(None, "--kubeconfig", help=KUBECONFIG_HELP),
    listen: str = typer.Option("0.0.0.0:8888", "--listen", help="HOST:PORT to serve the extender on."),
    policy: str = typer.Option("sharegpu", "--policy", help=f"Placement policy: {', '.join(POLICIES)}."),
    seed: int = typer.Option(0, "--seed", help="Seed of the policies that draw random numbers."),
    scheduler_name: str = typer.Option(
        DEFAULT_SCHEDULER_NAME, "--scheduler-name", help="The sharegpu scheduler's name: /bind binds only its pods."
    ),
    leader_elect: bool = typer.Option(
        False,
        "--leader-elect/--no-leader-elect",
        rich_help_panel=SWITCHES,
        help="Run as one of several replicas: only the holder of a coordination.k8s.io Lease binds and is ready.",
    ),
    lease_name: str = typer.Option(
        "sharegpu-extender", "--lease-name", help="The Lease replicas elect their leader on."
    ),
    lease_namespace: str = typer.Option(
        "", "--lease-namespace", help="Namespace of the Lease (default: $POD_NAMESPACE, else the service account's)."
    ),
    identity: str = typer.Option("", "--identity", help="This replica's name in the Lease (default: $POD_NAME)."),
    tls_cert: Path | None = typer.Option(
        None, "--tls-cert", help="PEM certificate to serve HTTPS with (the scheduler checks it with tlsConfig.caFile)."
    ),
    tls_key: Path | None = typer.Option(None, "--tls-key", help="PEM private key of --tls-cert."),
    client_ca: Path | None = typer.Option(
        None,
        "--client-ca",
        help="PEM CA of the client certificates allowed to call the extender (the scheduler's tlsConfig.certFile); "
        "a client without one is refused.",
    ),
    plain_http: bool = typer.Option(
        False,
        "--plain-http",
        help="Serve plain HTTP with no client certificates instead: anything that reaches the port can bind pods. "
        "For local use only.",
    ),
    health_listen: str = typer.Option(
        "",
        "--health-listen",
        help="HOST:PORT of a plain-HTTP port with only /healthz and /readyz, for the kubelet's probes (which present "
        "no client certificate).",
    ),
    max_request_mib: int = typer.Option(
        EXTENDER_MAX_BODY // MIB,
        "--max-request-mib",
        help="Largest request body accepted (413 beyond); the default fits 10,000 nodes with nodeCacheCapable: true.",
    ),
    metrics_listen: str | None = typer.Option(
        None, "--metrics-listen", help="HOST:PORT to serve Prometheus /metrics on (its own port), e.g. 0.0.0.0:9403."
    ),
    dra_steering: bool = typer.Option(
        False,
        "--dra-steering",
        help="Follow ResourceSlices and ResourceClaims and serve /dra/filter, which leaves the kube-scheduler only "
        "the node sharegpu picks for a pod whose GPUs come from sharegpu DRA claims (the chart's "
        "draSteering setting of the scheduler).",
    ),
    preemption: bool = typer.Option(
        True,
        "--preemption/--no-preemption",
        rich_help_panel=SWITCHES,
        help="As the leader, evict lower-priority pods (Eviction API, PodDisruptionBudgets honoured) for a pending pod "
        "that fits nowhere for GPU room, and hold the freed room for it (docs: multi-tenant.md).",
    ),
    preemption_interval: float = typer.Option(
        2.0,
        "--preemption-interval",
        rich_help_panel=PACE,
        help="Seconds between two looks at the pending pods for preemption.",
    ),
    consolidation: bool = typer.Option(
        False,
        "--consolidation/--no-consolidation",
        rich_help_panel=SWITCHES,
        help="As the leader, move pods whose sharegpu.io/movable annotation is true (controller-owned, "
        "PodDisruptionBudgets honoured) so that a pod waiting only for fragmented GPU room fits, when preemption "
        "cannot help it; needs --preemption (the chart's consolidation setting of the extender).",
    ),
    consolidation_moves_per_minute: int = typer.Option(
        4,
        "--consolidation-moves-per-minute",
        rich_help_panel=PACE,
        help="Most pods consolidation moves (evicts) in any minute.",
    ),
    mps_daemons_per_gpu: int = typer.Option(DEFAULT_DAEMONS_PER_UNIT, "--mps-daemons-per-gpu", help=MPS_DAEMONS_HELP),
    mps_daemon_memory: int = typer.Option(
        MPS_DAEMON_MEMORY_MIB, "--mps-daemon-memory", metavar="MIB", help=MPS_DAEMON_MEMORY_HELP
    ),
) -> None:
    """Serve the kube-scheduler extender (filter, prioritize, bind, preempt) on the simulator's ledger and policies."""
    from sharegpu.k8s.cache.view import ClusterView
    from sharegpu.k8s.controllers.consolidation import ConsolidationConfig
    from sharegpu.k8s.controllers.preemption import PreemptionConfig
    from sharegpu.k8s.extender.leader import LeaderElector
    from sharegpu.k8s.extender.schedulers import check_policy
    from sharegpu.k8s.extender.server import run_extender

    _logging()
    try:
        check_scheduler_name(scheduler_name)
        host, port = parse_listen(listen)
        health = parse_listen(health_listen, "--health-listen") if health_listen else None
        tls = _extender_tls(tls_cert, tls_key, client_ca, plain_http)
        if max_request_mib < 1:
            raise SetupError(f"--max-request-mib {max_request_mib} must be 1 or more")
        metrics = parse_listen(metrics_listen, "--metrics-listen") if metrics_listen is not None else None
        if not preemption_interval > 0:
            raise SetupError(f"--preemption-interval {preemption_interval} must be more than 0 seconds, e.g. 2")
        if consolidation and not preemption:
            raise SetupError("--consolidation runs in preemption's rounds: drop --no-preemption, or --consolidation")
        if consolidation_moves_per_minute < 1:
            raise SetupError(
                f"--consolidation-moves-per-minute {consolidation_moves_per_minute} must be 1 or more, e.g. 4"
            )
        check_policy(policy)
        tenancy = mps_tenancy(mps_daemons_per_gpu, mps_daemon_memory)
        view = ClusterView(scheduler_name=scheduler_name, follow_dra=dra_steering, tenancy=tenancy)
        log.info("scheduler extender for %s, policy %s: loading credentials", scheduler_name, policy)
        api = LightkubeClusterApi(kubeconfig)
    except (SetupError, UnknownPolicy, TlsError) as e:
        raise _fail(str(e)) from None
    except ConfigError as e:
        raise _fail(f"cannot load Kubernetes credentials: {e}") from None
    log.info("API server %s (credentials: %s); following its nodes and pods", api.server, api.credentials_source)
    elector = None
    if leader_elect:
        ns = lease_namespace or os.environ.get("POD_NAMESPACE") or _service_account_namespace() or "default"
        me = identity or os.environ.get("POD_NAME") or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
        elector = LeaderElector(api, ns, lease_name, me)
        log.info("leader election on lease %s/%s as %s", ns, lease_name, me)
    try:
        uvloop.run(
            run_extender(
                view,
                api,
                host,
                port,
                scheduler_name=scheduler_name,
                tls=tls,
                health=health,
                max_request_bytes=max_request_mib * MIB,
                elector=elector,
                metrics_listen=metrics,
                preemption=(PreemptionConfig(interval_s=preemption_interval), api) if preemption else None,
                consolidation=ConsolidationConfig(max_moves_per_minute=consolidation_moves_per_minute)
                if consolidation
                else None,
                policy=policy,
                seed=seed,
                freeze_heap=True,
            )
        )
    except OSError as e:
        raise _fail(f"cannot serve the extender: {e.strerror or e}") from None


def _extender_tls(cert: Path | None, key: Path | None, client_ca: Path | None, plain_http: bool) -> ServerTls | None:
    given = [flag for flag, v in (("--tls-cert", cert), ("--tls-key", key), ("--client-ca", client_ca)) if v]
    if plain_http:
        if given:
            raise SetupError(f"--plain-http serves without TLS; drop {', '.join(given)} or --plain-http")
        log.warning(
            "serving plain HTTP without client certificates (--plain-http): anything that reaches the port "
            "can bind pods; use it only where nothing else can reach the port"
        )
        return None
    if cert is None or key is None or client_ca is None:
        missing = [f for f in ("--tls-cert", "--tls-key", "--client-ca") if f not in given]
        raise SetupError(
            f"missing {', '.join(missing)}: the extender serves HTTPS and serves only clients with a certificate "
            "from --client-ca (the kube-scheduler's tlsConfig); the Helm chart makes them. For local use without "
            "TLS pass --plain-http instead"
        )
    tls = ServerTls(cert, key, client_ca)
    tls.context()  # every file checked now, by name
    return tls


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
        check_scheduler_name(scheduler_name)
        host, port = parse_listen(listen)
    except SetupError as e:
        raise _fail(str(e)) from None
    cfg = WebhookConfig(scheduler_name=scheduler_name, trusted_users=trusted(trusted_user))
    try:
        serve_webhook(host, port, str(tls_cert), str(tls_key), cfg)
    except TlsError as e:  # junk, swapped or mismatched files, by name
        raise _fail(str(e)) from None
    except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
        raise _fail(f"cannot serve the webhook on {listen}: {e}") from None


def status(
    kubeconfig: Path | None = typer.Option(None, "--kubeconfig", help=KUBECONFIG_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    watch: bool = typer.Option(False, "--watch", help="Follow the cluster and redraw every --interval seconds."),
    interval: float = typer.Option(2.0, "--interval", help="Seconds between redraws (--watch) or page refreshes."),
    serve: str | None = typer.Option(
        None, "--serve", help="HOST:PORT to serve the live read-only status page on (e.g. 127.0.0.1:8080)."
    ),
    mps_daemons_per_gpu: int = typer.Option(DEFAULT_DAEMONS_PER_UNIT, "--mps-daemons-per-gpu", help=MPS_DAEMONS_HELP),
    mps_daemon_memory: int = typer.Option(
        MPS_DAEMON_MEMORY_MIB, "--mps-daemon-memory", metavar="MIB", help=MPS_DAEMON_MEMORY_HELP
    ),
) -> None:
    """Show every sharegpu GPU: model, mechanism, used memory and compute, MIG layout, the MPS daemons (tenants and
    their clients) and the pods sharing it."""
    from sharegpu.k8s.cache.view import ClusterView
    from sharegpu.k8s.status.report import FollowedStatus, print_status, status_report, watch_status

    if serve is not None:
        _logging()  # a server: it says where it listens (and what goes wrong) in its log
    else:
        logging.basicConfig(level=logging.ERROR)  # problems are part of the report, not log noise
    addr: tuple[str, int] | None = None
    try:
        if sum((as_json, watch, serve is not None)) > 1:
            raise SetupError("choose one of --json, --watch and --serve")
        if not 0.2 <= interval <= 3600:
            raise SetupError(f"--interval {interval:g} must be between 0.2 and 3600 seconds")
        if serve is not None:
            addr = parse_listen(serve, "--serve")
        tenancy = mps_tenancy(mps_daemons_per_gpu, mps_daemon_memory)
    except SetupError as e:
        raise _fail(str(e)) from None
    try:
        api = LightkubeClusterApi(kubeconfig)
    except ConfigError as e:
        raise _fail(f"cannot load Kubernetes credentials: {e}") from None

    async def load() -> dict[str, object]:
        view = ClusterView(follow_dra=True, tenancy=tenancy)
        try:
            await view.load(api)
        finally:
            await api.close()
        if view.dra_forbidden:  # the rest of the report does not need them: said once, on stderr
            typer.echo(f"sharegpu: warning: not showing DRA GPUs: {view.dra_unavailable}", err=True)
        return status_report(view)

    async def follow() -> None:
        from sharegpu.k8s.status.page import serve_page

        followed = FollowedStatus(ClusterView(follow_dra=True, tenancy=tenancy))

        try:
            if addr is not None:
                await serve_page(followed, api, addr[0], addr[1], interval)
            else:
                await watch_status(followed, api, Console(), interval, asyncio.Event())
        finally:
            await api.close()

    if watch or addr is not None:
        try:
            asyncio.run(follow())
        except KubeError as e:
            raise _fail(str(e)) from None
        except OSError as e:
            raise _fail(f"cannot serve the status page on {serve}: {e}") from None
        except KeyboardInterrupt:
            pass
        return
    try:
        report = asyncio.run(load())
    except KubeError as e:
        where = "" if api.server in str(e) else f"API server {api.server}, "
        raise _fail(f"{e} ({where}credentials: {api.credentials_source})") from None
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        print_status(Console(), report)
