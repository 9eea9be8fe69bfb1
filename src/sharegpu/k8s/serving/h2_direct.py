"""HTTP/2 answers written at once (issue 34).

hypercorn sends an HTTP/2 answer in three writes and through a task: the HEADERS frame is flushed on its own, then
the body goes into a per-stream buffer that a per-connection send task drains, walking a priority tree of every
open stream, and the END_STREAM frame is flushed on its own again. For the extender's answers (one body of a few
KiB, sent at once) that machinery cost 0.4-0.8 ms of CPU per pod in the send task alone, the largest item of the
pod's path (BENCHMARKS.md, "Where the extender's time goes").

:class:`DirectH2Protocol` writes HEADERS, the body's DATA frames and END_STREAM into h2 as they come and flushes
once: an answer whose body fits the stream's flow-control window never enters the buffer, the priority tree or the
send task. Everything else (a body larger than the window, a stream the send task already serves, trailers, server
push, WebSocket data) takes hypercorn's own path unchanged. A write held for the end of the answer is flushed on the
event loop's next turn if the end does not come in the same one (a streamed answer), so nothing waits for more
data than it did.
"""

from __future__ import annotations

import asyncio

import h2.exceptions
from hypercorn.events import Updated
from hypercorn.protocol.events import Body, EndBody, Response, StreamClosed
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.h2 import BufferCompleteError, H2Protocol
from priority.priority import MissingStreamError

__all__ = ["DirectH2Protocol", "direct"]

_GONE = (BufferCompleteError, KeyError, MissingStreamError, h2.exceptions.ProtocolError)


class DirectH2Protocol(H2Protocol):
    """hypercorn's HTTP/2 connection, with answers that fit the flow-control window written in one flush."""

    # Set by :func:`direct` (the object is made by hypercorn as an H2Protocol, then given this class).
    _held: set[int]  # streams with frames written into h2 and not yet flushed
    _direct: set[int]  # streams whose body went straight to h2 (the send task never serves them)
    _answered: set[int]  # streams ended here, whose close needs nothing of the send task

    async def stream_send(self, event: StreamEvent) -> None:
        sid = event.stream_id
        try:
            if isinstance(event, Response):
                self.connection.send_headers(
                    sid, [(b":status", b"%d" % event.status_code), *event.headers, *self.config.response_headers("h2")]
                )
                self._hold(sid)
                return
            if isinstance(event, Body) and self._can_write(sid, len(event.data)):
                data, step = event.data, self.connection.max_outbound_frame_size
                for at in range(0, len(data), step):
                    self.connection.send_data(sid, data[at : at + step])
                self._direct.add(sid)
                self._hold(sid)
                return
            if isinstance(event, EndBody) and self._ends_here(sid):
                self.connection.end_stream(sid)
                self._held.discard(sid)
                self._direct.discard(sid)
                del self.stream_buffers[sid]
                self.priority.remove_stream(sid)
                self._answered.add(sid)
                await self._flush()
                return
        except _GONE:
            return  # the connection or the stream closed meanwhile, as hypercorn's own path treats it
        if isinstance(event, StreamClosed) and sid in self._answered:
            self._answered.discard(sid)
            if sid in self.streams:  # hypercorn's _close_stream less its wake-up of the send task
                await self.streams.pop(sid).handle(StreamClosed(stream_id=sid))
            await self._closed_stream()
            return
        if sid in self._held and not isinstance(event, Body | EndBody):
            await self._flush()  # hypercorn's path from here: what this one held goes first
        if sid in self._direct and isinstance(event, Body | EndBody):
            self._direct.discard(sid)  # the rest of this body goes through the buffer, after what went straight
        self._held.discard(sid)
        await super().stream_send(event)

    def _can_write(self, sid: int, size: int) -> bool:
        buffer = self.stream_buffers.get(sid)
        return (
            buffer is not None
            and not buffer.buffer
            and not buffer._complete
            and (sid in self._direct or sid in self._held)  # the send task has not been handed this stream
            and 0 < size <= self.connection.local_flow_control_window(sid)
        )

    def _ends_here(self, sid: int) -> bool:
        buffer = self.stream_buffers.get(sid)
        return buffer is not None and not buffer.buffer and (sid in self._direct or sid in self._held)

    def _hold(self, sid: int) -> None:
        if sid not in self._held:
            self._held.add(sid)
            asyncio.get_running_loop().call_soon(self._flush_if_held, sid)

    def _flush_if_held(self, sid: int) -> None:
        if sid in self._held:  # a streamed answer: its part so far goes out now
            self._held.discard(sid)
            self.task_group.spawn(self._flush)

    async def _closed_stream(self) -> None:
        # What hypercorn's StreamClosed handling does after _close_stream (idle tracking, a graceful close).
        idle = len(self.streams) == 0 or all(stream.idle for stream in self.streams.values())
        if idle and self.context.terminated.is_set():
            self.connection.close_connection()
            await self._flush()
        await self.send(Updated(idle=idle))


def direct(protocol: object) -> None:
    """Give a connection hypercorn has just made for HTTP/2 the direct answers (a connection of another protocol is
    left as it is)."""
    if type(protocol) is H2Protocol:
        protocol.__class__ = DirectH2Protocol
        assert isinstance(protocol, DirectH2Protocol)
        protocol._held, protocol._direct, protocol._answered = set(), set(), set()
