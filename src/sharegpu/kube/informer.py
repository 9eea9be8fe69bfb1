"""List then watch: the one loop that follows the API server (client-go's reflector and informer, in small).

An :class:`Informer` lists every :class:`Source` (one kind of object each), hands the lists over at once, then
watches them all from the lists' resourceVersions and applies each event, until it is stopped. Any error (a watch
that breaks, a 410 Gone for a version too old, an object that cannot be read) ends the watches and lists afresh
after a backoff; a watch that simply ends, or :meth:`Informer.relist`, lists again at once. What it guards against:

- **a connection that died silently** (no FIN, no RST): each watch asks the server to end it after a random
  240–300 s (as client-go does) and is given up when no event came for longer than that (the idle deadline);
- **a watch that will not close**: a streaming read cancelled mid-line can outlive its cancellation (the HTTP stack
  may absorb it and read on; a watch has no read timeout). Waiting for it without a bound once kept a new leader out
  of sync for good, so a cancelled watch that has not closed within ``close_s`` is abandoned, its events no longer
  applied;
- **events out of order**: an event older (by resourceVersion) than the last one applied for its object is dropped,
  and so is a copy of an object already deleted (a tombstone remembers it) — no late copy brings a deleted object
  back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from sharegpu.kube.errors import KubeError

log = logging.getLogger(__name__)
T = TypeVar("T")

ADDED, MODIFIED, DELETED = "ADDED", "MODIFIED", "DELETED"
WATCH_TIMEOUT_S = (240, 300)  # the server-side timeout of a watch, drawn at random in this range (as client-go)
WATCH_IDLE_GRACE_S = 60.0  # how much longer than the server's timeout a watch may stay silent
WATCH_CLOSE_S = 5.0  # how long a cancelled watch may take to close before the informer lists again without it
MAX_TOMBSTONES = 4096  # deleted objects remembered, so that a late copy of one never brings it back


class WatchEnded(KubeError):
    """A watch ended without an error (the server's timeout) or went silent; the informer lists again and stays in
    sync."""


def _rv(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def older(incoming: str, recorded: str) -> bool:
    """Whether an object at resourceVersion ``incoming`` is older than one at ``recorded``.

    Kubernetes calls resourceVersions opaque, but every API server in use (etcd's revision, and the in-memory one)
    writes increasing integers, and client-go's informers rely on the same order. When either does not parse as an
    integer the versions are not compared: the last writer wins.
    """
    a, b = _rv(incoming), _rv(recorded)
    return a is not None and b is not None and a < b


class Tombstones:
    """The deleted objects' keys and their last resourceVersions (the most recent ``limit`` of them)."""

    def __init__(self, limit: int = MAX_TOMBSTONES) -> None:
        self._limit = limit
        self._gone: OrderedDict[str, str] = OrderedDict()

    def bury(self, key: str, rv: str) -> None:
        self._gone[key] = rv
        self._gone.move_to_end(key)
        while len(self._gone) > self._limit:
            self._gone.popitem(last=False)

    def admits(self, key: str, rv: str) -> bool:
        """Whether a copy of ``key`` at ``rv`` may be applied: not the copy of an object already deleted. A newer
        object of that name (a new one, or versions not comparable: the last writer wins) lifts the tombstone."""
        gone = self._gone.get(key)
        if gone is None:
            return True
        if not older(rv, gone) and rv != gone:
            del self._gone[key]
            return True
        return False

    def clear(self) -> None:
        self._gone.clear()

    def __len__(self) -> int:
        return len(self._gone)


@dataclass(slots=True)
class _Order:
    """What the watches of one kind applied last: per object its resourceVersion, and the deleted ones."""

    versions: dict[str, str] = field(default_factory=dict)
    tombstones: Tombstones = field(default_factory=Tombstones)

    def reset(self, listed: Mapping[str, str]) -> None:
        self.versions = dict(listed)
        self.tombstones.clear()

    def admits(self, event: str, key: str, rv: str) -> bool:
        """Whether the event is newer than what was applied of its object (and records it when it is)."""
        recorded = self.versions.get(key)
        if recorded is not None and older(rv, recorded):
            return False
        if event == DELETED:
            self.versions.pop(key, None)
            self.tombstones.bury(key, rv)
            return True
        if not self.tombstones.admits(key, rv):
            return False
        self.versions[key] = rv
        return True


@dataclass(frozen=True, slots=True)
class Source(Generic[T]):
    """One kind of object to follow, and what to do with its events."""

    kind: str  # "node", "pod", ...: named in logs and messages
    list: Callable[[], Awaitable[tuple[Sequence[T], str]]]  # every object and the list's resourceVersion
    # (ADDED | MODIFIED | DELETED, object) after a resourceVersion; the int is the server-side timeout in seconds
    watch: Callable[[str, int], AsyncIterator[tuple[str, T]]]
    apply: Callable[[str, T], None]  # one event, in order
    identity: Callable[[T], tuple[str, str]]  # an object's key (namespace/name) and resourceVersion


def of_json(obj: Mapping[str, Any]) -> tuple[str, str]:
    """:attr:`Source.identity` of an object as the API server writes it (JSON)."""
    meta = obj.get("metadata") or {}
    ns, name = meta.get("namespace"), meta.get("name")
    return (f"{ns}/{name}" if ns else str(name)), str(meta.get("resourceVersion") or "")


@dataclass(frozen=True, slots=True)
class Timing:
    watch_timeout_s: tuple[int, int] = WATCH_TIMEOUT_S  # the server ends each watch after a random time in this range
    idle_s: float | None = None  # no event for this long: the connection is taken for dead (default: timeout + grace)
    close_s: float = WATCH_CLOSE_S  # a cancelled watch not closed by then is abandoned
    backoff_s: float = 0.2  # the first wait after an error; doubled after each error that follows
    max_backoff_s: float = 30.0

    @property
    def idle_deadline_s(self) -> float:
        return self.idle_s if self.idle_s is not None else self.watch_timeout_s[1] + WATCH_IDLE_GRACE_S


class Informer:
    """Lists then watches ``sources``; ``on_list`` gets every kind's list at once (by :attr:`Source.kind`) after
    each full list, ``on_lost`` the error and the seconds until the next try when following stopped."""

    def __init__(
        self,
        name: str,
        sources: Sequence[Source[Any]],
        on_list: Callable[[Mapping[str, Sequence[Any]]], None],
        on_lost: Callable[[Exception, float], None] | None = None,
        timing: Timing | None = None,
    ) -> None:
        self.name = name  # "cluster view": in log lines
        self.sources = tuple(sources)
        self.on_list, self.on_lost = on_list, on_lost
        self.timing = timing or Timing()
        self.synced = False  # True while listed and watching
        self.relists = 0  # full lists taken
        self._relist = asyncio.Event()
        self._order = {s.kind: _Order() for s in self.sources}
        self._abandoned: set[asyncio.Future[Any]] = set()  # watches that outlived their cancellation (kept referenced)

    def relist(self) -> None:
        """End the watches and list afresh (a replica that just became the leader must see what the last one did)."""
        self._relist.set()

    @property
    def abandoned(self) -> int:
        """Cancelled watches still reading on (not closed within ``close_s``)."""
        return len(self._abandoned)

    async def run(self, stop: asyncio.Event) -> None:
        """List, then watch, until ``stop``; on any error list again after a backoff, for ever."""
        timing = self.timing
        backoff = timing.backoff_s
        try:
            while not stop.is_set():
                try:
                    listed: dict[str, Sequence[Any]] = {}
                    versions: dict[str, str] = {}
                    for s in self.sources:
                        listed[s.kind], versions[s.kind] = await s.list()
                    for s in self.sources:
                        self._order[s.kind].reset(dict(s.identity(o) for o in listed[s.kind]))
                    self.on_list(listed)
                    self.relists += 1
                    self.synced = True
                    backoff = timing.backoff_s
                    await self._watch(versions, stop)
                except WatchEnded as e:
                    log.debug("%s: %s; listing again", self.name, e)  # still in sync: a failing list says otherwise
                except Exception as e:  # an API error, or an object that cannot be read: list again, never go stale
                    if not isinstance(e, KubeError):
                        log.exception("%s: unexpected error while following the API server; listing again", self.name)
                    self.synced = False
                    if self.on_lost is not None:
                        self.on_lost(e, backoff)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), backoff)
                    backoff = min(backoff * 2, timing.max_backoff_s)
        finally:
            self.synced = False

    async def _watch(self, versions: Mapping[str, str], stop: asyncio.Event) -> None:
        lo, hi = self.timing.watch_timeout_s
        idle_s = self.timing.idle_deadline_s
        rng = random.Random()
        current = [True]  # False once these watches are given up: a late event of theirs is not applied

        loop = asyncio.get_running_loop()

        async def follow(source: Source[Any], last: list[float]) -> None:
            events = source.watch(versions[source.kind], rng.randint(lo, hi))
            order = self._order[source.kind]
            try:
                async for event, obj in events:
                    last[0] = loop.time()
                    if not current[0]:
                        return
                    if order.admits(event, *source.identity(obj)):
                        source.apply(event, obj)
                raise WatchEnded(f"the {source.kind} watch ended")
            finally:
                close = getattr(events, "aclose", None)
                if close is not None:
                    with contextlib.suppress(Exception):
                        await close()

        async def silent(kind: str, last: list[float]) -> None:
            # One timer per watch, not one per event: a bound on each event's wait (asyncio.wait_for) made a task
            # and a timer for every pod event the extender reads (issue 34).
            while (left := last[0] + idle_s - loop.time()) > 0:
                await asyncio.sleep(left)
            raise WatchEnded(f"no {kind} event for {idle_s:g}s")

        tasks: list[asyncio.Future[Any]] = []
        for s in self.sources:
            last = [loop.time()]
            tasks += [asyncio.ensure_future(follow(s, last)), asyncio.ensure_future(silent(s.kind, last))]
        tasks += [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._relist.wait())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if self._relist.is_set():
                self._relist.clear()
                raise WatchEnded("asked to list again")
            for t in done:
                t.result()  # re-raises a watch's KubeError (or WatchEnded)
        finally:
            current[0] = False
            for t in tasks:
                t.cancel()
            _, pending = await asyncio.wait(tasks, timeout=self.timing.close_s)
            if pending:
                log.warning(
                    "%s: a cancelled watch did not close within %gs; listing again without it",
                    self.name,
                    self.timing.close_s,
                )
                self._abandoned.update(pending)
                for t in pending:
                    t.add_done_callback(self._abandoned.discard)
