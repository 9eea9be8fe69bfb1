"""The one list-then-watch loop (sharegpu.kube.informer): bounded cancellation, tombstones, resourceVersion order,
relist on 410 Gone; and the DRA steering follower on it, against a stand-in API server over real HTTP."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from proc_helpers import kubeconfig
from sharegpu.k8s.cache.view import ClusterView
from sharegpu.kube.api import LightkubeClusterApi
from sharegpu.kube.errors import Gone
from sharegpu.kube.informer import ADDED, DELETED, MODIFIED, Informer, Source, Timing, of_json

Obj = dict[str, Any]


def obj(name: str, rv: str, **extra: Any) -> Obj:
    return {"metadata": {"name": name, "namespace": "ns", "resourceVersion": rv}, **extra}


async def until(cond: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class FakeKind:
    """One kind's list and watches; each watch plays the next script (events, then silence or an error)."""

    def __init__(self, scripts: list[list[tuple[str, Obj] | Exception]]) -> None:
        self.scripts = scripts
        self.lists = 0
        self.applied: list[tuple[str, str, str]] = []  # (event, key, rv)

    async def list(self) -> tuple[Sequence[Obj], str]:
        self.lists += 1
        return [], "1"

    async def watch(self, rv: str, timeout_s: int) -> AsyncIterator[tuple[str, Obj]]:
        script = self.scripts.pop(0) if self.scripts else []
        for step in script:
            if isinstance(step, Exception):
                raise step
            yield step
        await asyncio.Event().wait()  # then silent, as a healthy watch with nothing to say

    def apply(self, event: str, o: Obj) -> None:
        self.applied.append((event, *of_json(o)))

    def source(self) -> Source[Obj]:
        return Source("thing", self.list, self.watch, self.apply, of_json)


def informer_of(kind: FakeKind, lost: list[Exception] | None = None, **timing: Any) -> Informer:
    def on_lost(e: Exception, retry_s: float) -> None:
        if lost is not None:
            lost.append(e)

    def on_list(lists: Mapping[str, Sequence[Any]]) -> None:
        pass

    return Informer("test", [kind.source()], on_list, on_lost, Timing(backoff_s=0.01, **timing))


def test_events_older_than_the_last_applied_and_copies_of_deleted_objects_are_dropped() -> None:
    script: list[tuple[str, Obj] | Exception] = [
        (ADDED, obj("a", "5")),
        (MODIFIED, obj("a", "4")),  # older than what was applied: dropped
        (DELETED, obj("a", "6")),
        (MODIFIED, obj("a", "6")),  # the deleted object's own copy: dropped (tombstone)
        (ADDED, obj("a", "3")),  # older still: dropped
        (ADDED, obj("a", "8")),  # a new object of that name: applied
        (MODIFIED, obj("b", "x")),  # versions that do not compare: the last writer wins
        (MODIFIED, obj("b", "2")),
    ]
    kind = FakeKind([script])

    async def main() -> None:
        informer = informer_of(kind)
        stop = asyncio.Event()
        task = asyncio.ensure_future(informer.run(stop))
        await until(lambda: len(kind.applied) >= 5, "the events")
        await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert kind.applied == [
        (ADDED, "ns/a", "5"),
        (DELETED, "ns/a", "6"),
        (ADDED, "ns/a", "8"),
        (MODIFIED, "ns/b", "x"),
        (MODIFIED, "ns/b", "2"),
    ]


def test_a_410_gone_is_reported_and_followed_by_a_fresh_list() -> None:
    kind = FakeKind([[(ADDED, obj("a", "5")), Gone("watch things: too old resource version: 1 (5)", 410)], []])
    lost: list[Exception] = []

    async def main() -> None:
        informer = informer_of(kind, lost)
        stop = asyncio.Event()
        task = asyncio.ensure_future(informer.run(stop))
        await until(lambda: kind.lists >= 2 and informer.synced, "the relist after Gone")
        stop.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert len(lost) == 1 and isinstance(lost[0], Gone)


class StubbornKind(FakeKind):
    """Its watch absorbs every cancellation, as a streaming HTTP read cancelled mid-line can (no read timeout)."""

    def __init__(self) -> None:
        super().__init__([])
        self.release = asyncio.Event()

    async def watch(self, rv: str, timeout_s: int) -> AsyncIterator[tuple[str, Obj]]:
        while not self.release.is_set():
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                continue
        yield ADDED, obj("late", "99")


def test_stopping_does_not_wait_beyond_the_bound_for_a_watch_that_ignores_its_cancellation() -> None:
    # The DRA follower (before the one cluster view) awaited its cancelled watches without a bound: a watch like this one kept it (and the extender's
    # shutdown) waiting for ever.
    async def main() -> None:
        kind = StubbornKind()
        informer = informer_of(kind, close_s=0.2)
        stop = asyncio.Event()
        task = asyncio.ensure_future(informer.run(stop))
        await until(lambda: informer.synced, "sync")
        t0 = time.monotonic()
        stop.set()
        await asyncio.wait_for(task, 2)  # hangs (TimeoutError) without the bound
        assert time.monotonic() - t0 < 1.0
        assert informer.abandoned == 1
        kind.release.set()  # the abandoned watch reads on: its late event is not applied
        await until(lambda: informer.abandoned == 0, "the abandoned watch to end")
        assert kind.applied == []

    asyncio.run(main())


def test_the_cluster_view_follows_slices_and_claims_over_http_with_dra_steering(tmp_path: Path) -> None:
    node = {
        "metadata": {"name": "n1", "resourceVersion": "3", "labels": {"sharegpu.io/device-path": "dra"}},
        "status": {"allocatable": {"cpu": "8", "memory": "16Gi"}},
    }
    lists = {
        "/api/v1/nodes": [node],
        "/api/v1/pods": [],
        "/apis/resource.k8s.io/v1/resourceslices": [],
        "/apis/resource.k8s.io/v1/resourceclaims": [],
    }
    claim = {"metadata": {"name": "c1", "namespace": "ns", "resourceVersion": "12"}, "spec": {}}
    seen: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            target = head.split(b"\r\n")[0].decode().split(" ")[1]
            path = target.split("?")[0]
            seen.append(target)
            if "watch=" in target:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
                if path.endswith("resourceclaims"):
                    line = json.dumps({"type": "ADDED", "object": claim}).encode() + b"\n"
                    writer.write(b"%x\r\n%s\r\n" % (len(line), line))
                await writer.drain()
                await asyncio.sleep(3600)
                return
            body = json.dumps({"metadata": {"resourceVersion": "10"}, "items": lists[path]}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
            writer.write(body)
            await writer.drain()
        except (asyncio.CancelledError, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        kc = kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{port}")
        api = LightkubeClusterApi(kc)
        view = ClusterView(follow_dra=True, scheduler_name="sharegpu-scheduler")
        assert view.dra is not None
        dra = view.dra
        stop = asyncio.Event()
        task = asyncio.ensure_future(view.follow(api, stop))
        try:
            await until(lambda: view.synced and "ns/c1" in dra.claims, "the claim from the watch")
            assert dra.counts() == (1, 0, 1)
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
            await api.close()
            srv.close()
        assert not view.synced
        # One informer for everything: one watch per kind, each from its list's version, with a server-side timeout.
        watches = [t for t in seen if "watch=" in t]
        assert len(watches) == 4 and all("timeoutSeconds=" in t and "resourceVersion=10" in t for t in watches)
        assert any("fieldSelector=spec.driver" in t for t in watches)
        # With steering, every pod is followed (no scheduler field selector): those bound to DRA nodes take cpu.
        assert all("schedulerName" not in t for t in seen if t.startswith("/api/v1/pods"))

    asyncio.run(main())
