"""Credentials from a kubeconfig's exec plugin (``users[].user.exec``), in every ExecCredential version current
clients write: ``client.authentication.k8s.io/v1`` (what today's cloud CLIs emit: ``gke-gcloud-auth-plugin``,
``aws eks get-token``, ``kubelogin``), ``v1beta1`` and ``v1alpha1``.

lightkube runs only v1alpha1 and v1beta1 plugins ("auth exec api version ... not implemented" for v1) and does not
pass ``KUBERNETES_EXEC_INFO``, which client-go-based plugins read to choose the version they answer in. This is
client-go's protocol (k8s.io/client-go/plugin/pkg/client/auth/exec): the plugin runs with ``KUBERNETES_EXEC_INFO``
(an ExecCredential whose spec says whether it may prompt), its stdout is an ExecCredential of the same version, and
its ``status.token`` is sent as a bearer token until its ``expirationTimestamp`` or a 401.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx2

from sharegpu.kube.errors import Unavailable

V1 = "client.authentication.k8s.io/v1"
VERSIONS = (V1, "client.authentication.k8s.io/v1beta1", "client.authentication.k8s.io/v1alpha1")
INTERACTIVE_MODES = ("Never", "IfAvailable", "Always")
RUN_TIMEOUT_S = 60.0  # a plugin that asks a cloud for a token; one that waits for a terminal never ends


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


class ExecAuth(httpx2.Auth):
    """A bearer token from the plugin, run again when the token expires or the API server answers 401."""

    def __init__(self, spec: ExecSpec, source: str) -> None:
        self.spec = spec
        self.source = source  # "kubeconfig /x, user 'u'", for messages
        self._token = ""
        self._expires = float("inf")  # time.time() after which the token is not sent again
        self._lock = asyncio.Lock()

    async def async_auth_flow(self, request: httpx2.Request) -> AsyncGenerator[httpx2.Request, httpx2.Response]:
        if not self._token or time.time() >= self._expires:
            await self._refresh(stale=self._token)
        sent = self._token
        request.headers["Authorization"] = f"Bearer {sent}"
        response = yield request
        if response.status_code != 401:
            return
        # Refused (revoked, or expired early): the plugin runs again and the request is tried once more (lightkube
        # does the same; client-go refreshes for the next request).
        await self._refresh(stale=sent)
        request.headers["Authorization"] = f"Bearer {self._token}"
        yield request

    async def _refresh(self, stale: str) -> None:
        async with self._lock:  # concurrent requests run the plugin once
            if self._token != stale and time.time() < self._expires:
                return  # another request got a fresh token meanwhile
            self._token, self._expires = await self._run()

    async def _run(self) -> tuple[str, float]:
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
            )
        except OSError as e:
            hint = f"; {spec.install_hint.strip()}" if spec.install_hint.strip() else ""
            raise ExecPluginError(f"cannot run {what}: {e.strerror or e}{hint}") from None
        try:
            out, err = await asyncio.wait_for(proc.communicate(), RUN_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise ExecPluginError(f"{what} gave no answer in {RUN_TIMEOUT_S:g} s") from None
        if proc.returncode != 0:
            tail = " ".join(err.decode(errors="replace").split())[-300:]
            raise ExecPluginError(f"{what} exited with {proc.returncode}: {tail or '(nothing on stderr)'}")
        return _token_of(out, spec.api_version, what)


def _token_of(out: bytes, version: str, what: str) -> tuple[str, float]:
    try:
        cred = json.loads(out)
    except ValueError:
        raise ExecPluginError(f"{what} did not print an ExecCredential (JSON) on stdout") from None
    if not isinstance(cred, dict) or cred.get("kind") != "ExecCredential":
        raise ExecPluginError(f"{what} printed something other than an ExecCredential")
    if cred.get("apiVersion") != version:
        raise ExecPluginError(f"{what} answered in {cred.get('apiVersion')!r}, not the {version} the kubeconfig names")
    status = cred.get("status")
    token = status.get("token") if isinstance(status, dict) else None
    if not isinstance(token, str) or not token:
        if isinstance(status, dict) and status.get("clientCertificateData"):
            raise ExecPluginError(f"{what} gave a client certificate; sharegpu takes tokens only from exec plugins")
        raise ExecPluginError(f"{what} gave no status.token")
    assert isinstance(status, dict)
    expires = float("inf")
    stamp = status.get("expirationTimestamp")
    if isinstance(stamp, str) and stamp:
        try:
            expires = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
        except ValueError:
            raise ExecPluginError(f"{what} gave an expirationTimestamp that is not RFC 3339: {stamp!r}") from None
    return token, expires
