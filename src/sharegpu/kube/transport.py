"""lightkube's HTTP requests carried by aiohttp: an httpx transport (lightkube builds on ``httpx2``).

httpx's own transport runs TLS through anyio's stream, which encrypts and decrypts in Python around an ``ssl``
memory BIO; aiohttp hands the socket to the event loop's TLS transport (C under uvloop) and parses HTTP in C. On
the rig a Binding through lightkube cost 1.38 ms of CPU on httpx's transport and 0.95 ms on this one
(``bench/k8s_bind_cpu.py``; BENCHMARKS.md, "Throughput through the real kube-scheduler"); a scheduler binds every
pod, and its watches carry every pod event. lightkube keeps building the requests, authenticating them (httpx ``Auth``: tokens, exec
plugins) and reading the answers; only the bytes on the wire move here.

httpx decodes ``Content-Encoding`` itself, so aiohttp hands the body over as it came. Errors are raised as the
httpx exceptions lightkube's callers already handle (:func:`sharegpu.kube.errors.request_server` reads the
request from them to name the server).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx2

# Connections open at once (watches hold one each for minutes): httpx's own default, so that nothing waits for a
# connection that did not wait before.
POOL = 100


class CertificateRejected(httpx2.ConnectError):
    """The API server answered, with a certificate the client's CA does not verify; the message names that CA's
    source and what to change (retrying cannot help until the kubeconfig changes)."""


class AiohttpTransport(httpx2.AsyncBaseTransport):
    """An ``httpx2.AsyncBaseTransport`` over one aiohttp session (created on the first request, in the loop that
    makes it: aiohttp's connections belong to one event loop)."""

    def __init__(self, ssl_context: ssl.SSLContext | None, ca: str = "", proxy: str = "") -> None:
        self._ssl = ssl_context
        self._ca = ca  # where the CA that verifies the server comes from, named when it does not verify it
        self._proxy = proxy or None  # the kubeconfig's proxy-url: an HTTP(S) proxy (CONNECT for https servers)
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(ssl=self._ssl if self._ssl is not None else False, limit=POOL)
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,  # httpx decodes by the answer's Content-Encoding
                cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            )
        return self._session

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        body = await request.aread()
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw]
        headers = [(k, v) for k, v in headers if k.lower() not in ("host", "content-length", "transfer-encoding")]
        try:
            response = await self._open().request(
                request.method,
                str(request.url),
                headers=headers,
                data=body or None,
                timeout=_timeout(request.extensions.get("timeout")),
                allow_redirects=False,  # httpx follows (or not) by its own setting
                proxy=self._proxy,
            )
        except Exception as e:
            raise _as_httpx(e, request, self._ca) from e
        return httpx2.Response(
            status_code=response.status,
            headers=[(k, v) for k, v in response.raw_headers],
            stream=_Body(response, request),
            extensions={"http_version": f"HTTP/{response.version.major}.{response.version.minor}".encode()}
            if response.version
            else {},
            request=request,
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class _Body(httpx2.AsyncByteStream):
    def __init__(self, response: aiohttp.ClientResponse, request: httpx2.Request) -> None:
        self._response, self._request = response, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except Exception as e:
            raise _as_httpx(e, self._request) from e

    async def aclose(self) -> None:
        # A body not read to its end (a watch given up) closes its connection rather than waiting for the rest.
        self._response.release()


def _timeout(t: Any) -> aiohttp.ClientTimeout:
    """httpx's per-request timeouts (connect, read, pool; None = none) as aiohttp's: read is per socket read, so a
    watch with no read timeout waits for events as long as the server keeps it open. httpx's write timeout has no
    counterpart: what sharegpu sends (a Binding, a patch, a Lease) fits in the socket's buffer at once."""
    t = t or {}
    return aiohttp.ClientTimeout(
        total=None, connect=t.get("pool"), sock_connect=t.get("connect"), sock_read=t.get("read")
    )


def _as_httpx(e: Exception, request: httpx2.Request, ca: str = "") -> Exception:
    """The httpx exception that stands for aiohttp's ``e`` (with the request, whose URL names the server)."""
    why = str(e) or type(e).__name__
    if isinstance(e, aiohttp.ClientConnectorCertificateError):
        # Retrying cannot help, and "CERTIFICATE_VERIFY_FAILED" names neither the file nor the fix.
        return CertificateRejected(_certificate_advice(e, request, ca), request=request)
    if isinstance(e, aiohttp.ConnectionTimeoutError):
        return httpx2.ConnectTimeout(why, request=request)
    if isinstance(e, asyncio.TimeoutError):  # aiohttp's read timeouts are TimeoutErrors too
        return httpx2.ReadTimeout(why, request=request)
    if isinstance(e, aiohttp.ClientConnectorError):
        return httpx2.ConnectError(why, request=request)
    if isinstance(e, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return httpx2.RemoteProtocolError(why, request=request)
    if isinstance(e, aiohttp.ClientError | OSError):  # a reset or a failed write or read: sent or not, unknown
        return httpx2.NetworkError(why, request=request)
    return e


def _certificate_advice(e: aiohttp.ClientConnectorCertificateError, request: httpx2.Request, ca: str) -> str:
    cert_error = e.certificate_error
    detail = getattr(cert_error, "verify_message", "") or str(cert_error)
    host = request.url.host
    if "hostname mismatch" in detail.lower() or "doesn't match" in detail or "IP address mismatch" in detail:
        return (
            f"the API server's certificate is not valid for {host} ({detail}); use the server name or address that "
            "the certificate was issued for in the kubeconfig's server URL"
        )
    of = f" by {ca}" if ca else ""
    return (
        f"the API server's certificate is not signed{of} ({detail}); set the cluster's certificate-authority (or "
        "certificate-authority-data) to the CA that signed the API server's certificate (`kubectl config view --raw` "
        "shows the one kubectl uses)"
    )
