"""Serving sharegpu's HTTP apps (the extender, its probe port, the webhook) with uvicorn on sockets bound up front.

Binding first makes a port that is taken an error the command reports with its address (uvicorn alone logs it and
calls ``sys.exit``), and lets "listening on ..." be logged when it is true. Several apps are served side by side
(the extender's mTLS port and its plain-HTTP probe port); SIGTERM and SIGINT stop them all, gracefully.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import uvicorn
from starlette.applications import Starlette
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp

from sharegpu.k8s.tls import ServerTls

log = logging.getLogger(__name__)

PROBE_PATHS = ("/healthz", "/readyz")
GRACE_S = 5


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
        # algorithm and the client's delayed ACK hold every response (uvicorn writes headers and body apart) for
        # 40 ms: two extender calls per pod made the scheduler 7 times slower.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(2048)
        except OSError as e:
            sock.close()
            raise OSError(e.errno, f"cannot listen on {self.host}:{self.port}: {e.strerror or e}") from None
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


async def serve(sites: Sequence[Site], stop: asyncio.Event | None = None) -> None:
    """Serve every site until SIGTERM/SIGINT (in the main thread), ``stop``, or until one of them stops; raises
    OSError when a port cannot be bound (before anything is served)."""
    socks: list[socket.socket] = []
    try:
        for site in sites:
            socks.append(site.listener.bind())
        servers: list[_Server] = []
        for site in sites:
            tls = site.listener.tls
            config = uvicorn.Config(
                site.app,
                log_level="warning",
                access_log=False,
                lifespan="off",
                # An idle keep-alive TLS connection (the kube-scheduler keeps one) would hold a stop for the 30 s of
                # asyncio's TLS shutdown; requests in flight get this long to finish.
                timeout_graceful_shutdown=GRACE_S,
                **(tls.uvicorn_options() if tls else {}),
            )
            servers.append(_Server(config))
            how = tls.describe() if tls else "plain HTTP"
            log.info("%s listening on %s (%s)", site.what, site.listener.url, how)
        tasks = [asyncio.ensure_future(s.serve(sockets=[sock])) for s, sock in zip(servers, socks, strict=True)]

        def stop_all() -> None:
            for s in servers:
                s.should_exit = True

        def on_signal() -> None:
            log.info("stopping: signal received")
            stop_all()

        stopped = asyncio.ensure_future(stop.wait()) if stop is not None else None
        with _on_signals(on_signal):
            try:
                await asyncio.wait([*tasks, *([stopped] if stopped else [])], return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop_all()
                if stopped is not None:
                    stopped.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        for t in tasks:
            t.result()  # a server that failed (not one that was stopped) is the caller's error
    finally:
        for sock in socks:
            sock.close()


class _Server(uvicorn.Server):
    """uvicorn.Server without its own signal handling: :func:`serve` stops every server on one signal."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.contextmanager
def _on_signals(handler: Callable[[], None]) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
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
