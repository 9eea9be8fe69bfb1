"""Serving sharegpu's HTTP apps (the extender, its probe port, the webhook, metrics, the status page) with hypercorn
on sockets bound up front.

Binding first makes a port that is taken an error the command reports with its address, and lets "listening on
..." be logged when it is true. Several apps are served side by side (the extender's mTLS port and its plain-HTTP
probe port); SIGTERM and SIGINT stop them all, gracefully.

HTTPS ports offer HTTP/2 (ALPN ``h2``), which the kube-scheduler and the API server use when offered: their Go
clients keep only two idle HTTP/1.1 connections per host, so concurrent binds opened (and closed) a new TLS
connection for most pods, a full handshake on both sides; over HTTP/2 every call shares one connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import ssl
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from hypercorn.asyncio.tcp_server import TCPServer
from hypercorn.asyncio.worker_context import WorkerContext
from hypercorn.config import Config
from hypercorn.protocol import ProtocolWrapper
from hypercorn.typing import AppWrapper
from hypercorn.utils import wrap_app
from starlette.applications import Starlette
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp

from sharegpu.k8s.serving.h2_direct import direct
from sharegpu.k8s.serving.tls import ServerTls

log = logging.getLogger(__name__)
# hypercorn's own log: its errors (an app that raised, a broken connection) at WARNING and above; its "Running on"
# lines would repeat this module's "listening on".
_server_log = logging.getLogger(f"{__name__}.hypercorn")
_server_log.setLevel(logging.WARNING)

PROBE_PATHS = ("/healthz", "/readyz")
GRACE_S = 5
ALPN = ["h2", "http/1.1"]


@dataclass(frozen=True, slots=True)
class Listener:
    host: str
    port: int
    tls: ServerTls | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    def bind(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # proto=IPPROTO_TCP: only then does asyncio set TCP_NODELAY on the accepted connections. Without it Nagle's
        # algorithm and the client's delayed ACK hold every response (headers and body are written apart) for
        # 40 ms: two extender calls per pod made the scheduler 7 times slower.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(2048)
        except OSError as e:
            sock.close()
            raise OSError(e.errno, f"cannot listen on {self.host}:{self.port}: {e.strerror or e}") from None
        sock.setblocking(False)
        return sock


@dataclass(frozen=True, slots=True)
class Site:
    app: ASGIApp
    listener: Listener
    what: str  # for the log: "scheduler extender", "health probes", ...


def probes_only(app: Starlette) -> Starlette:
    """The same app's /healthz and /readyz alone (the very route objects): for a plain-HTTP probe port beside an
    mTLS one, since the kubelet's probes present no client certificate."""
    routes: list[BaseRoute] = [r for r in app.routes if isinstance(r, Route) and r.path in PROBE_PATHS]
    return Starlette(routes=routes)


# hypercorn ends a connection after 1,000 requests by default, and on HTTP/2 it does so with the client's next requests
# already in flight: the kube-scheduler keeps one connection to the extender, and every 500 pods 24-35 of its calls
# failed with GOAWAY PROTOCOL_ERROR (bench/extender_profile.py on the rig, BENCHMARKS.md "Where the extender's time
# goes"). A connection is ended by its client or by stopping the server, never after a count.
UNLIMITED_REQUESTS = 2**62


def _config() -> Config:
    """hypercorn's settings for a connection: no access log, its errors into this module's logger, no request limit."""
    config = Config()
    config.accesslog = None
    config.errorlog = _server_log
    config.keep_alive_max_requests = UNLIMITED_REQUESTS
    return config


def _ssl_context(tls: ServerTls) -> ssl.SSLContext:
    """The context :class:`ServerTls` builds (the files checked there, by name), offering HTTP/2."""
    ctx = tls.context()
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2  # HTTP/2 requires TLS 1.2 or later (RFC 9113, 9.2)
    ctx.options |= ssl.OP_NO_COMPRESSION
    ctx.set_alpn_protocols(ALPN)
    return ctx


async def serve(sites: Sequence[Site], stop: asyncio.Event | None = None, signals: bool = True) -> None:
    """Serve every site until ``stop``, SIGTERM/SIGINT (in the main thread, with ``signals``), or until one of them
    stops; raises OSError when a port cannot be bound (before anything is served)."""
    socks: list[socket.socket] = []
    try:
        for site in sites:
            socks.append(site.listener.bind())
        await serve_bound(list(zip(sites, socks, strict=True)), stop, signals)
    finally:
        for sock in socks:
            sock.close()


async def serve_bound(
    bound: Sequence[tuple[Site, socket.socket]], stop: asyncio.Event | None = None, signals: bool = True
) -> None:
    """:func:`serve` on sockets the caller bound (``Listener.bind``) and closes."""
    stopping = asyncio.Event()
    tasks = []
    for site, sock in bound:
        tasks.append(asyncio.ensure_future(_serve_site(site, sock, stopping)))
        tls = site.listener.tls
        how = tls.describe() + " (HTTP/2 or HTTP/1.1)" if tls else "plain HTTP"
        url = Listener(site.listener.host, sock.getsockname()[1], tls).url  # the port given, or the one 0 got
        log.info("%s listening on %s (%s)", site.what, url, how)

    def on_signal() -> None:
        log.info("stopping: signal received")
        stopping.set()

    stopped = asyncio.ensure_future(stop.wait()) if stop is not None else None
    with _on_signals(on_signal, signals):
        try:
            await asyncio.wait([*tasks, *([stopped] if stopped else [])], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.set()
            if stopped is not None:
                stopped.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    for t in tasks:
        t.result()  # a server that failed (not one that was stopped) is the caller's error


class _TCPServer(TCPServer):
    """hypercorn's connection handler, whose HTTP/2 connections write each answer at once (:mod:`h2_direct`): it
    makes its protocol object in ``run`` and keeps it here."""

    @property
    def protocol(self) -> ProtocolWrapper:
        return self._wrapper

    @protocol.setter
    def protocol(self, wrapper: ProtocolWrapper) -> None:
        direct(wrapper.protocol)
        self._wrapper = wrapper


async def _serve_site(site: Site, sock: socket.socket, stopping: asyncio.Event) -> None:
    """Accept connections on ``sock`` for hypercorn's connection handler (HTTP/1.1, or HTTP/2 where ALPN chose it)
    until ``stopping``; then requests in flight get GRACE_S and every connection is closed.

    The accept loop is this module's, not ``hypercorn.asyncio.serve``'s, for one setting: the TLS shutdown timeout.
    asyncio waits 30 s for a peer's close_notify, and an idle keep-alive client (the kube-scheduler keeps one) sends
    none, so every stop took 30 s. TCPServer and WorkerContext are hypercorn's own building blocks, not its documented
    API: the lock file pins the version they were written against, and the TLS and serving tests exercise them."""
    loop = asyncio.get_running_loop()
    config = _config()
    app: AppWrapper = wrap_app(site.app, 0, "asgi")  # type: ignore[arg-type]  # an ASGI 3 app
    context = WorkerContext(None)
    connections: set[asyncio.Task[None]] = set()

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            connections.add(task)
            task.add_done_callback(connections.discard)
        try:
            await _TCPServer(app, loop, config, context, {}, reader, writer)
        except (TimeoutError, ConnectionError, ssl.SSLError) as e:
            # The peer's side of a close: no close_notify in time (an idle client at a stop), a reset, bad TLS.
            log.debug("%s: a connection ended uncleanly: %s", site.what, e)

    tls = site.listener.tls
    if tls is None:
        server = await asyncio.start_server(accepted, sock=sock)
    else:
        server = await asyncio.start_server(
            accepted, sock=sock, ssl=_ssl_context(tls), ssl_handshake_timeout=GRACE_S, ssl_shutdown_timeout=GRACE_S
        )
    try:
        await stopping.wait()
    finally:
        server.close()
        await context.terminated.set()  # connections finish what they serve and close
        if connections:
            _, late = await asyncio.wait(set(connections), timeout=GRACE_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)


@contextlib.contextmanager
def _on_signals(handler: Callable[[], None], wanted: bool) -> Iterator[None]:
    if not wanted or threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    sigs = (signal.SIGTERM, signal.SIGINT)
    for sig in sigs:
        loop.add_signal_handler(sig, handler)
    try:
        yield
    finally:
        for sig in sigs:
            loop.remove_signal_handler(sig)
