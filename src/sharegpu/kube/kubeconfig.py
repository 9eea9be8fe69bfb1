"""Kubernetes credentials — a kubeconfig file, ``$KUBECONFIG``, ``~/.kube/config`` or the in-cluster service account —
loaded for lightkube, with errors that name the file and say what is wrong in it.

lightkube reads a kubeconfig with ``yaml.safe_load`` and indexes the result: a file that is not YAML, ``[]``, ``{}``
or one whose context names a missing cluster ends in a traceback, and a directory is reported as "not found".
Everything is checked here first; the one exception type, :class:`~sharegpu.kube.errors.ConfigError`, carries a message a user can act
on. The node agent and the control plane both load their credentials through :func:`load_credentials`.
"""

from __future__ import annotations

import base64
import binascii
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from sharegpu.kube.errors import ConfigError

if TYPE_CHECKING:
    import httpx2
    from lightkube import AsyncClient
    from lightkube.config.kubeconfig import SingleConfig

    from sharegpu.kube.exec_auth import ExecSpec
    from sharegpu.kube.transport import AiohttpTransport

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DEFAULT_KUBECONFIG = Path("~/.kube/config")
# The --kubeconfig help of every command: the order load_credentials follows.
KUBECONFIG_HELP = (
    "Kubeconfig file. Default: the in-cluster service account when running in a pod, else the first file of "
    "$KUBECONFIG, else ~/.kube/config."
)
SHAPE = "a kubeconfig is a mapping with clusters, contexts, users and current-context (as kubectl writes it)"


# lightkube's HTTP clients log every request at INFO ("HTTP Request: GET ... 200 OK"): every bind, watch and list.
HTTP_LOGGERS = ("httpx", "httpx2")


def quiet_http_logging() -> None:
    """Keep the HTTP clients' per-request lines out of every command's log (their warnings stay)."""
    import logging

    for name in HTTP_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


@dataclass(frozen=True, slots=True)
class Credentials:
    config: SingleConfig
    source: str  # where they came from, for messages: "kubeconfig /x", "the in-cluster service account"
    # The user's exec plugin, run by sharegpu.kube.exec_auth (lightkube's own runs neither v1 nor KUBERNETES_EXEC_INFO)
    exec_spec: ExecSpec | None = None
    proxy: str = ""  # the cluster's proxy-url (lightkube's model has no such field)

    @property
    def server(self) -> str:
        """The API server's URL."""
        return str(self.config.cluster.server)

    def client(self, field_manager: str) -> AsyncClient:
        """A lightkube client whose requests travel over aiohttp (:mod:`sharegpu.kube.transport`); certificate and key
        files the credentials name are read (and checked) here."""
        from lightkube import AsyncClient
        from lightkube.config.client_adapter import verify_cluster
        from lightkube.core.exceptions import ConfigError as LkConfigError

        from sharegpu.kube.transport import AiohttpTransport

        config = self.config
        try:
            assert config.user is not None  # every SingleConfig this module builds has one
            # httpx hands its TLS context only to its own transport; the transport gets the context lightkube
            # builds (the cluster's CA or insecure-skip-tls-verify, the user's client certificate).
            tls = (
                verify_cluster(config.cluster, config.user, config.abs_file)
                if self.server.startswith("https")
                else None
            )
            transport = AiohttpTransport(tls, ca=_ca_of(config, self.source), proxy=self.proxy)
            client = AsyncClient(config=config, field_manager=field_manager, transport=transport)
        except ssl.SSLError as e:
            raise ConfigError(
                f"cannot use the credentials of {self.source}: {_client_cert_problem(config, e)}"
            ) from None
        except (LkConfigError, OSError, ValueError) as e:
            raise ConfigError(f"cannot use the credentials of {self.source}: {_reason(e)}") from None
        if self.exec_spec is not None:
            _use_exec(client, self.exec_spec, self.source, tls, transport)
        elif config.user.username is not None and not config.user.password:
            # client-go sends a username without a password as basic auth with an empty password; lightkube sends
            # basic auth only when both are set.
            _set_auth(client, self.source, _basic_auth(config.user.username, ""))
        return client


def _basic_auth(username: str, password: str) -> httpx2.Auth:
    import httpx2

    return httpx2.BasicAuth(username, password)


def _client_cert_problem(config: SingleConfig, e: ssl.SSLError) -> str:
    """What is wrong with the user's client certificate and key, by file or field: ssl says only "[SSL] PEM lib"."""
    user = config.user
    assert user is not None
    pairs = [
        ("client-certificate", user.client_cert, user.client_cert_data, "CERTIFICATE-----"),
        ("client-key", user.client_key, user.client_key_data, "PRIVATE KEY-----"),
    ]
    texts: dict[str, tuple[str, str]] = {}
    for key, file, data, _ in pairs:
        if data:
            try:
                texts[key] = (
                    f"the {key}-data of user {config.context.user!r}",
                    base64.b64decode(data).decode("ascii", "replace"),
                )
            except (binascii.Error, ValueError):
                texts[key] = (f"the {key}-data of user {config.context.user!r}", "")
        elif file:
            name = str(config.abs_file(file))
            try:
                texts[key] = (f"the {key} {name}", Path(name).read_text(encoding="ascii", errors="replace"))
            except OSError:
                texts[key] = (f"the {key} {name}", "")
    if len(texts) < 2:
        return _reason(e)
    (cert_what, cert_text), (key_what, key_text) = texts["client-certificate"], texts["client-key"]
    cert_ok, key_ok = "CERTIFICATE-----" in cert_text, "PRIVATE KEY-----" in key_text
    if not cert_ok and not key_ok and "PRIVATE KEY-----" in cert_text and "CERTIFICATE-----" in key_text:
        return (
            f"{cert_what} holds a private key and {key_what} a certificate: the two are swapped; give the "
            "certificate as client-certificate and its key as client-key"
        )
    if not cert_ok:
        return f"{cert_what} holds no PEM certificate (-----BEGIN CERTIFICATE-----); give the user's client certificate"
    if not key_ok:
        return f"{key_what} holds no PEM private key (-----BEGIN ... PRIVATE KEY-----); give the certificate's key"
    return f"{cert_what} and {key_what} do not belong together ({_reason(e)}); give the private key of that certificate"


def _ca_of(config: SingleConfig, source: str) -> str:
    """Where the CA that verifies the API server comes from, for a message when it does not verify it."""
    cluster, name = config.cluster, config.context.cluster
    if cluster.certificate_auth:
        return f"the certificate-authority {config.abs_file(cluster.certificate_auth)} of cluster {name!r} ({source})"
    if cluster.certificate_auth_data:
        return f"the certificate-authority-data of cluster {name!r} in {source}"
    return f"this machine's trusted CAs ({source} gives no certificate-authority for cluster {name!r})"


def _use_exec(
    client: AsyncClient, spec: ExecSpec, source: str, tls: ssl.SSLContext | None, transport: AiohttpTransport
) -> None:
    """Authenticate ``client``'s requests with the exec plugin (a token; a client certificate goes into ``tls``, and
    ``transport``'s connections are closed when it changes)."""
    from sharegpu.kube.exec_auth import ExecAuth

    _set_auth(client, source, ExecAuth(spec, source, tls, transport.aclose))


def _set_auth(client: AsyncClient, source: str, auth: httpx2.Auth) -> None:
    """lightkube offers no way to pass an httpx ``Auth`` of one's own, so it is set on the httpx client lightkube made
    (checked, so that a lightkube that changed shape fails here, by name, rather than sending requests without
    credentials)."""
    import httpx2

    inner = getattr(getattr(client, "_client", None), "_client", None)
    if not isinstance(inner, httpx2.AsyncClient):
        raise ConfigError(f"{source}: cannot install its credentials on this lightkube's client")
    inner.auth = auth


def load_credentials(path: Path | None) -> Credentials:
    """``path``, or else the in-cluster service account, ``$KUBECONFIG``, ``~/.kube/config`` (kubectl's order)."""
    if path is not None:
        return _from_file(path, f"kubeconfig {path}")
    if os.environ.get("KUBERNETES_SERVICE_HOST") and (SERVICE_ACCOUNT / "token").exists():
        return _in_cluster()
    env = os.environ.get("KUBECONFIG", "")
    # kubectl merges a list of files; the first one is the one that holds the current context in practice.
    first = next((p for p in env.split(os.pathsep) if p), "")
    if first:
        return _from_file(Path(first), f"kubeconfig {first} (from $KUBECONFIG)")
    default = DEFAULT_KUBECONFIG.expanduser()
    if not default.exists():
        raise ConfigError(
            "no Kubernetes credentials: not running in a pod (no service account), $KUBECONFIG is unset and "
            f"{default} does not exist; pass --kubeconfig FILE"
        )
    return _from_file(default, f"kubeconfig {default}")


def _in_cluster() -> Credentials:
    from lightkube import KubeConfig
    from lightkube.core.exceptions import ConfigError as LkConfigError

    try:
        config = KubeConfig.from_service_account(str(SERVICE_ACCOUNT)).get()
    except (LkConfigError, OSError, KeyError) as e:
        raise ConfigError(f"cannot load the in-cluster service account from {SERVICE_ACCOUNT}: {_reason(e)}") from None
    assert config is not None
    return Credentials(config, "the in-cluster service account")


def _from_file(path: Path, source: str) -> Credentials:
    path = path.expanduser()
    if path.is_dir():
        raise ConfigError(f"{source} is a directory, not a file (kubectl's file is usually {path / 'config'})")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{source} does not exist; pass the path of a kubeconfig file") from None
    except OSError as e:
        raise ConfigError(f"cannot read {source}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{source} is not a text file (byte {e.start} is not UTF-8); {SHAPE}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source} is not valid YAML: {_yaml_reason(e)}") from None
    data = _validated(data, source)
    config = _select(data, path, source)
    spec = _exec_spec(data, config, source)
    proxy = _proxy_url(data, source)
    if spec is not None:
        import msgspec

        assert config.user is not None
        # lightkube would run the plugin itself, and refuse a v1 one: sharegpu.kube.exec_auth runs it instead.
        config = config._replace(user=msgspec.structs.replace(config.user, exec=None))
    return Credentials(config, source, spec, proxy)


PROXY_SCHEMES = ("http://", "https://")


def _proxy_url(data: dict[str, Any], source: str) -> str:
    """The current context's cluster's ``proxy-url``: requests go through that HTTP(S) proxy (CONNECT for an https
    server). A SOCKS proxy, which kubectl also takes, is refused by name rather than bypassed."""
    ctx = next(c["context"] for c in data["contexts"] if c["name"] == data["current-context"])
    cluster = next(c["cluster"] for c in data["clusters"] if c["name"] == ctx["cluster"])
    proxy = cluster.get("proxy-url")
    if proxy is None or proxy == "":
        return ""
    if not isinstance(proxy, str) or not proxy.startswith(PROXY_SCHEMES):
        raise ConfigError(
            f"{source}: cluster {ctx['cluster']!r} has proxy-url {proxy!r}; sharegpu goes through http:// and https:// "
            "proxies only (not socks5://): give an HTTP proxy's URL, or reach the API server without one"
        )
    return proxy


def _exec_spec(data: dict[str, Any], config: SingleConfig, source: str) -> ExecSpec | None:
    """The exec plugin of the current context's user, when its credentials come from one (a token given with it
    wins, as in lightkube)."""
    from sharegpu.kube.exec_auth import ExecSpec, ExecSpecError

    user = config.user
    if user is None or user.exec is None or user.token is not None or user.token_file is not None:
        return None
    ctx = next(c["context"] for c in data["contexts"] if c["name"] == data["current-context"])
    raw = next(u["user"] for u in data.get("users") or [] if u["name"] == ctx.get("user"))
    cluster = next(c["cluster"] for c in data["clusters"] if c["name"] == ctx["cluster"])
    info = {
        k: v for k, v in cluster.items() if k in ("server", "certificate-authority-data", "insecure-skip-tls-verify")
    }
    try:
        return ExecSpec.parse(raw.get("exec"), info)
    except ExecSpecError as e:
        raise ConfigError(f"{source}: user {ctx.get('user')!r}: {e}") from None


def _validated(data: Any, source: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ConfigError(f"{source} holds {_describe(data)}, not a kubeconfig; {SHAPE}")
    for section, key, required in (
        ("clusters", "cluster", True),
        ("contexts", "context", True),
        ("users", "user", False),
    ):
        entries = data.get(section)
        if entries is None:
            if required:
                raise ConfigError(f"{source} has no {section}; {SHAPE}")
            continue
        if not isinstance(entries, list):
            raise ConfigError(f"{source}: {section} is {_describe(entries)}, not a list of {{name, {key}}}")
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
                raise ConfigError(f"{source}: {section}[{i}] has no name")
            if not isinstance(entry.get(key), dict):
                raise ConfigError(f"{source}: {section}[{i}] ({entry['name']}) has no {key} mapping")
    current = data.get("current-context")
    if current is not None and not isinstance(current, str):
        raise ConfigError(f"{source}: current-context is {_describe(current)}, not a context name")
    return data


def _select(data: dict[str, Any], path: Path, source: str) -> SingleConfig:
    import msgspec
    from lightkube import KubeConfig
    from lightkube.config.models import User

    try:
        kc = KubeConfig.from_dict(data, fname=path)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {e}") from None
    name = kc.current_context
    if not name:
        raise ConfigError(f"{source} sets no current-context; choose one: kubectl config use-context NAME")
    ctx = kc.contexts.get(name)
    if ctx is None:
        raise ConfigError(f"{source}: current-context {name!r} is not among its contexts ({_names(kc.contexts)})")
    cluster = kc.clusters.get(ctx.cluster)
    if cluster is None:
        raise ConfigError(
            f"{source}: context {name!r} names cluster {ctx.cluster!r}, which is not among its clusters "
            f"({_names(kc.clusters)})"
        )
    if ctx.user and ctx.user not in kc.users:
        raise ConfigError(
            f"{source}: context {name!r} names user {ctx.user!r}, which is not among its users ({_names(kc.users)})"
        )
    if not cluster.server.startswith(("https://", "http://")):
        raise ConfigError(
            f"{source}: cluster {ctx.cluster!r} has server {cluster.server!r}, not an https:// URL (or http:// for a "
            "plain-HTTP endpoint such as kubectl proxy)"
        )
    config = kc.get()
    assert config is not None
    # A context without a user means no authentication (kubectl's reading); lightkube needs a User object.
    config = config if config.user is not None else config._replace(user=User())
    assert config.user is not None
    files = [(f"cluster {ctx.cluster!r}", "certificate-authority", cluster.certificate_auth)]
    who = f"user {ctx.user!r}"
    files += [(who, "client-certificate", config.user.client_cert), (who, "client-key", config.user.client_key)]
    files += [(who, "tokenFile", config.user.token_file)]
    for owner, key, name in files:
        if name and not Path(config.abs_file(name)).is_file():
            raise ConfigError(f"{source}: the {key} of {owner}, {config.abs_file(name)}, is not a file")
    inline = [(f"cluster {ctx.cluster!r}", "certificate-authority-data", cluster.certificate_auth_data, "CERTIFICATE")]
    inline += [(who, "client-certificate-data", config.user.client_cert_data, "CERTIFICATE")]
    inline += [(who, "client-key-data", config.user.client_key_data, "PRIVATE KEY")]
    for owner, key, value, kind in inline:
        if value:
            _check_inline_pem(value, kind, f"{source}: the {key} of {owner}")
    return config


def _check_inline_pem(value: str, kind: str, what: str) -> None:
    """An inline ``*-data`` field: base64 of a PEM file (kubectl's reading). Without this check lightkube fails with
    "Invalid base64-encoded string" or "[X509] PEM lib", which name neither the field nor the file."""
    how = f"it must be the base64 of a PEM file (e.g. base64 -w0 {'ca.crt' if kind == 'CERTIFICATE' else 'tls.key'})"
    try:
        pem = base64.b64decode("".join(value.split()), validate=True).decode("ascii")
    except (binascii.Error, ValueError):
        raise ConfigError(f"{what} is not base64; {how}") from None
    if f"-----BEGIN {kind}-----" not in pem and not (kind == "PRIVATE KEY" and "PRIVATE KEY-----" in pem):
        raise ConfigError(f"{what} holds no PEM {kind.lower()} once decoded; {how}")
    if kind == "CERTIFICATE":
        try:
            ssl.create_default_context(cadata=pem)
        except (ssl.SSLError, ValueError) as e:
            raise ConfigError(f"{what} holds a certificate that does not parse ({_reason(e)}); {how}") from None


def _names(mapping: dict[str, Any]) -> str:
    return ", ".join(sorted(mapping)) or "none"


def _describe(value: Any) -> str:
    if value is None:
        return "nothing (it is empty)"
    if isinstance(value, list):
        return "an empty YAML list" if not value else "a YAML list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__} ({str(value)[:40]!r})"


def _yaml_reason(e: yaml.YAMLError) -> str:
    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
        mark = e.problem_mark
        return f"line {mark.line + 1}, column {mark.column + 1}: {e.problem or e.context or 'syntax error'}"
    return str(e).splitlines()[0]


def _reason(e: Exception) -> str:
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    return str(e) or type(e).__name__
