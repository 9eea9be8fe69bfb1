"""Credentials from a kubeconfig's exec plugin (``users[].user.exec``), in every ExecCredential version current
clients write: ``client.authentication.k8s.io/v1`` (what today's cloud CLIs emit: ``gke-gcloud-auth-plugin``,
``aws eks get-token``, ``kubelogin``), ``v1beta1`` and ``v1alpha1``.

lightkube runs only v1alpha1 and v1beta1 plugins ("auth exec api version ... not implemented" for v1) and does not
pass ``KUBERNETES_EXEC_INFO``, which client-go-based plugins read to choose the version they answer in. This is
client-go's protocol (k8s.io/client-go/plugin/pkg/client/auth/exec): the plugin runs with ``KUBERNETES_EXEC_INFO``
(an ExecCredential whose spec says whether it may prompt), its stdout is an ExecCredential of the same version, and
its ``status.token`` is sent as a bearer token, and its ``status.clientCertificateData`` and ``clientKeyData`` (PEM)
presented as the TLS client certificate, until its ``expirationTimestamp`` or a 401.

One difference from client-go, on purpose: client-go waits for a plugin as long as it runs; sharegpu gives it
``RUN_TIMEOUT_S`` and then stops it and everything it started (its process group), so that a plugin waiting for a
browser login or a prompt that never comes makes a command fail with a message naming the plugin instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import ssl
import tempfile
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx2

from sharegpu.kube.errors import Unavailable

V1 = "client.authentication.k8s.io/v1"
VERSIONS = (V1, "client.authentication.k8s.io/v1beta1", "client.authentication.k8s.io/v1alpha1")
INTERACTIVE_MODES = ("Never", "IfAvailable", "Always")
RUN_TIMEOUT_S = 60.0  # a plugin that asks a cloud for a token; one that waits for a terminal never ends
REAP_TIMEOUT_S = 5.0  # after the kill: a child that left the plugin's process group may still hold its pipes


class ExecSpecError(ValueError):
    """An exec section that cannot be run; the message says what to change (the caller names the kubeconfig)."""


class ExecPluginError(Unavailable):
    """The plugin did not give a token (not found, failed, timed out, answered something else): no request can be
    authenticated; like an API server that does not answer, it is tried again."""


@dataclass(frozen=True, slots=True)
class ExecSpec:
    api_version: str
    command: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    install_hint: str = ""
    interactive_mode: str = ""
    cluster: Mapping[str, Any] | None = None  # provideClusterInfo: the cluster's server and CA, for the plugin

    @classmethod
    def parse(cls, raw: Any, cluster: Mapping[str, Any] | None = None) -> ExecSpec:
        """The kubeconfig's ``user.exec`` mapping, checked as kubectl checks it."""
        if not isinstance(raw, Mapping):
            raise ExecSpecError("exec is not a mapping of apiVersion, command, args, env")
        version = raw.get("apiVersion")
        if version not in VERSIONS:
            raise ExecSpecError(f"exec apiVersion {version!r} is not one of {', '.join(VERSIONS)}")
        command = raw.get("command")
        if not isinstance(command, str) or not command:
            raise ExecSpecError("exec has no command")
        args = raw.get("args") or []
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ExecSpecError("exec args is not a list of strings")
        env = raw.get("env") or []
        if not isinstance(env, list) or not all(isinstance(e, Mapping) and isinstance(e.get("name"), str) for e in env):
            raise ExecSpecError("exec env is not a list of {name, value}")
        mode = raw.get("interactiveMode") or ""
        if version == V1 and not mode:
            # client-go refuses it too: v1 made the field required.
            raise ExecSpecError(f"exec of {V1} needs interactiveMode (Never or IfAvailable)")
        if mode and mode not in INTERACTIVE_MODES:
            raise ExecSpecError(f"exec interactiveMode {mode!r} is not one of {', '.join(INTERACTIVE_MODES)}")
        if mode == "Always":
            raise ExecSpecError(
                "exec interactiveMode is Always, but sharegpu runs the plugin without a terminal; use a plugin "
                "mode that needs no prompt (interactiveMode: IfAvailable or Never)"
            )
        return cls(
            api_version=version,
            command=command,
            args=tuple(args),
            env=tuple((str(e["name"]), str(e.get("value", ""))) for e in env),
            install_hint=str(raw.get("installHint") or ""),
            interactive_mode=mode,
            cluster=cluster if raw.get("provideClusterInfo") else None,
        )

    def exec_info(self) -> str:
        """``KUBERNETES_EXEC_INFO``: the version asked for, and that no terminal is there to prompt on."""
        spec: dict[str, Any] = {"interactive": False}
        if self.cluster is not None:
            spec["cluster"] = dict(self.cluster)
        return json.dumps({"apiVersion": self.api_version, "kind": "ExecCredential", "spec": spec})


@dataclass(frozen=True, slots=True)
class ExecCredential:
    """What a plugin answered: a bearer token, a client certificate and key (PEM), or both; and until when."""

    token: str = ""
    cert_pem: str = ""
    key_pem: str = ""
    expires: float = float("inf")  # time.time() after which it is not used again


class ExecAuth(httpx2.Auth):
    """The plugin's credential, fetched again when it expires or the API server answers 401: a token is sent as
    ``Authorization: Bearer``; a client certificate is loaded into ``tls``, the TLS context of the client's
    connections, and ``reconnect`` is awaited when it changes (connections made with the old one are closed)."""

    def __init__(
        self,
        spec: ExecSpec,
        source: str,
        tls: ssl.SSLContext | None = None,
        reconnect: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.spec = spec
        self.source = source  # "kubeconfig /x, user 'u'", for messages
        self._tls = tls
        self._reconnect = reconnect
        self._cred: ExecCredential | None = None
        self._lock = asyncio.Lock()

    def _fresh(self) -> bool:
        return self._cred is not None and time.time() < self._cred.expires

    async def async_auth_flow(self, request: httpx2.Request) -> AsyncGenerator[httpx2.Request, httpx2.Response]:
        if not self._fresh():
            await self._refresh(stale=self._cred)
        sent = self._cred
        assert sent is not None
        _authorize(request, sent)
        response = yield request
        if response.status_code != 401:
            return
        # Refused (revoked, or expired early): the plugin runs again and the request is tried once more (lightkube
        # does the same; client-go refreshes for the next request).
        await self._refresh(stale=sent)
        assert self._cred is not None
        _authorize(request, self._cred)
        yield request

    async def _refresh(self, stale: ExecCredential | None) -> None:
        async with self._lock:  # concurrent requests run the plugin once
            if self._cred is not stale and self._fresh():
                return  # another request got a fresh credential meanwhile
            cred = await self._run()
            old = self._cred
            if cred.cert_pem:
                self._load_cert(cred)
            self._cred = cred
            changed = old is not None and (old.cert_pem, old.key_pem) != (cred.cert_pem, cred.key_pem)
            if changed and self._reconnect is not None:
                await self._reconnect()

    def _load_cert(self, cred: ExecCredential) -> None:
        what = f"the exec plugin {self.spec.command!r} of {self.source}"
        if self._tls is None:
            raise ExecPluginError(
                f"{what} gave a client certificate, but the API server is reached over plain HTTP, where there is "
                "no TLS to present it in; use the server's https:// URL"
            )
        load_cert_chain(self._tls, cred.cert_pem, cred.key_pem, what)

    async def _run(self) -> ExecCredential:
        spec = self.spec
        env = dict(os.environ) | dict(spec.env) | {"KUBERNETES_EXEC_INFO": spec.exec_info()}
        what = f"the exec plugin {spec.command!r} of {self.source}"
        try:
            proc = await asyncio.create_subprocess_exec(
                spec.command,
                *spec.args,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,  # never a terminal to prompt on
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                # Its own process group, so that a timeout stops what it started too (a shell script's `sleep`,
                # a browser helper): a child left alive keeps the pipes open and the wait for them would never end.
                start_new_session=True,
            )
        except OSError as e:
            hint = f"; {spec.install_hint.strip()}" if spec.install_hint.strip() else ""
            raise ExecPluginError(f"cannot run {what}: {e.strerror or e}{hint}") from None
        try:
            out, err = await asyncio.wait_for(proc.communicate(), RUN_TIMEOUT_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), REAP_TIMEOUT_S)
            raise ExecPluginError(
                f"{what} gave no answer in {RUN_TIMEOUT_S:g} s and was stopped; run it by hand to see what it waits "
                "for (a login in a browser, a prompt): sharegpu runs it without a terminal"
            ) from None
        if proc.returncode != 0:
            tail = " ".join(err.decode(errors="replace").split())[-300:]
            raise ExecPluginError(f"{what} exited with {proc.returncode}: {tail or '(nothing on stderr)'}")
        return _token_of(out, spec.api_version, what)


def _authorize(request: httpx2.Request, cred: ExecCredential) -> None:
    if cred.token:
        request.headers["Authorization"] = f"Bearer {cred.token}"
    else:
        request.headers.pop("Authorization", None)


def load_cert_chain(tls: ssl.SSLContext, cert_pem: str, key_pem: str, what: str) -> None:
    """Load a PEM certificate and key given as text into ``tls`` (``ssl`` reads them only from files: written to a
    private temporary folder, removed at once)."""
    with tempfile.TemporaryDirectory(prefix="sharegpu-exec-") as d:
        cert, key = Path(d, "tls.crt"), Path(d, "tls.key")
        for path, text in ((cert, cert_pem), (key, key_pem)):
            path.touch(mode=0o600)
            path.write_text(text, encoding="ascii", errors="replace")
        try:
            tls.load_cert_chain(cert, key)
        except ssl.SSLError as e:
            cert_ok = "CERTIFICATE-----" in cert_pem
            key_ok = "PRIVATE KEY-----" in key_pem
            if not cert_ok or not key_ok:
                wrong = "clientCertificateData holds no PEM certificate" if not cert_ok else ""
                wrong += (" and " if wrong else "") + ("clientKeyData holds no PEM private key" if not key_ok else "")
                raise ExecPluginError(f"{what}: its {wrong}") from None
            raise ExecPluginError(
                f"{what}: its clientCertificateData and clientKeyData do not load together ({e.reason or e}); the "
                "key must be the private key of the certificate"
            ) from None


def _token_of(out: bytes, version: str, what: str) -> ExecCredential:
    try:
        cred = json.loads(out)
    except ValueError:
        raise ExecPluginError(f"{what} did not print an ExecCredential (JSON) on stdout") from None
    if not isinstance(cred, dict) or cred.get("kind") != "ExecCredential":
        raise ExecPluginError(f"{what} printed something other than an ExecCredential")
    if cred.get("apiVersion") != version:
        raise ExecPluginError(f"{what} answered in {cred.get('apiVersion')!r}, not the {version} the kubeconfig names")
    status = cred.get("status")
    if not isinstance(status, dict):
        raise ExecPluginError(f"{what} gave no status (a token, or a client certificate and key)")
    token = status.get("token") or ""
    cert, key = status.get("clientCertificateData") or "", status.get("clientKeyData") or ""
    if not all(isinstance(v, str) for v in (token, cert, key)):
        raise ExecPluginError(f"{what} gave a status.token, clientCertificateData or clientKeyData that is not text")
    if bool(cert) != bool(key):
        # client-go's rule: the two come together.
        given, missing = (
            ("clientCertificateData", "clientKeyData") if cert else ("clientKeyData", "clientCertificateData")
        )
        raise ExecPluginError(f"{what} gave {given} without {missing}; a client certificate needs both")
    if not token and not cert:
        raise ExecPluginError(f"{what} gave neither a status.token nor a clientCertificateData and clientKeyData")
    expires = float("inf")
    stamp = status.get("expirationTimestamp")
    if isinstance(stamp, str) and stamp:
        try:
            expires = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
        except ValueError:
            raise ExecPluginError(f"{what} gave an expirationTimestamp that is not RFC 3339: {stamp!r}") from None
    return ExecCredential(token, cert, key, expires)
