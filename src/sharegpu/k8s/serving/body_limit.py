"""A cap on request bodies, as ASGI middleware: a request above the cap is answered 413 without reading its body
into memory — refused at once by its Content-Length, or, when it streams (chunked, or a Content-Length that lies
low), as soon as the bytes received pass the cap.

Without it a single large POST takes the server's memory with it (the extender reads a body whole to parse it: a
600 MB POST took it to 1.3 GB, above its 1Gi limit). Add it with
``Starlette(..., middleware=[Middleware(BodyLimit, max_bytes=N, what="...")])``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sharegpu.kube.quantity import MIB

LINGER_S = 1.0  # at most this long spent dropping the rest of a refused body

# The extender's cap: the largest body the kube-scheduler sends it for a 10,000-node cluster with
# nodeCacheCapable: true (the chart's setting), measured by bench/extender_body_size.py, plus a Pod of at most 3 MiB
# (the API server's request limit; etcd keeps objects under 1.5 MiB). filter/prioritize: the Pod and 10,000 node
# names of 253 characters (the longest) = 2.5 + 3 MiB. preempt: the Pod and the candidate nodes (DefaultPreemption
# tries max(10 % of nodes, 100) = 1,000), each with its victims' UIDs (maxPods 250 each) = 12.0 + 3 MiB. 16 MiB
# covers both. With nodeCacheCapable: false whole Node objects come instead of names: 120 MiB at 10,000 nodes (a
# kubelet's Node with 50 images and an 8-GPU inventory is 12.6 KB) and 395 MiB once parsed, beyond the chart's
# 1Gi limit with a response to build: raise --max-request-mib and the memory limit together for that mode.
EXTENDER_MAX_BODY = 16 * MIB
# The webhook's cap: an AdmissionReview carries the object and, on UPDATE, the old object (3 MiB each at most).
WEBHOOK_MAX_BODY = 8 * MIB


class _TooLarge(Exception):
    pass


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, what: str = "request") -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes {max_bytes} must be positive")
        self.app = app
        self.max_bytes = max_bytes
        self.what = what

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            # The server (h11/httptools) has already refused a Content-Length that is not a number.
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._refuse(send, receive, f"declares {int(value)} bytes")
                return
        received = 0
        started = False

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _TooLarge
            return message

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except _TooLarge:
            if started:  # the app answered before it read the whole body: nothing more can be said
                return
            await self._refuse(send, receive, f"sent more than {self.max_bytes} bytes")

    async def _refuse(self, send: Send, receive: Receive, why: str) -> None:
        cap = f"{self.max_bytes // MIB} MiB" if self.max_bytes % MIB == 0 else f"{self.max_bytes} bytes"
        body = json.dumps({"error": f"request body too large: this {self.what} {why}; the cap is {cap}"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                # The rest of the body is not read: the connection cannot be reused for another request.
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": True})
        await _linger(receive)
        await send({"type": "http.response.body", "body": b""})  # the server closes the connection now


async def _linger(receive: Receive) -> None:
    """Read and drop what the client still sends, for a moment, before the connection is closed: closing a socket
    with unread data makes the kernel reset it, and the client may lose the 413 it was sent (a lingering close, as
    web servers do). Nothing is kept; a client that stops sending, ends its body or hangs up ends it sooner. (The
    answer has started, so the server sends no "100 Continue" to a client that waits for one.)"""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(LINGER_S):
            while True:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return
