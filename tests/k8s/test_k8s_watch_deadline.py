"""Watches carry a server-side timeout and an idle deadline: a silently dead connection is noticed."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

from k8s_helpers import node_spec, pod_obj
from memory_api import MemoryClusterApi

from proc_helpers import kubeconfig
from sharegpu.k8s.cache.view import ClusterView
from sharegpu.kube.api import LightkubeClusterApi
from sharegpu.kube.schema import Pod


async def until(cond: object, what: str, timeout: float = 5.0) -> None:
    assert callable(cond)
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def test_a_silent_watch_is_given_up_and_the_view_goes_out_of_sync_until_the_api_is_back() -> None:
    async def main() -> None:
        api = MemoryClusterApi()
        api.put_node("node-a", node_spec("node-a", gpus=1))
        view = ClusterView(watch_timeout_s=(40, 50), watch_idle_s=0.3)
        stop = asyncio.Event()
        task = asyncio.ensure_future(view.follow(api, stop, max_backoff_s=0.05))
        try:
            await until(lambda: view.synced, "sync")
            assert all(t is not None and 40 <= t <= 50 for t in api.watch_timeouts)
            # The API server vanishes without closing anything: the open watches just go quiet.
            api.down = True
            await until(lambda: not view.synced, "the view to notice the silent watch", timeout=3)
            api.down = False
            await until(lambda: view.synced, "resync")
            api.put_pod(pod_obj("p", gpu=1))
            await until(lambda: view.pod("default/p") is not None, "the watch to follow again")
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)

    asyncio.run(main())


def test_a_watch_the_server_ends_is_followed_by_a_relist_without_going_out_of_sync() -> None:
    async def main() -> None:
        api = MemoryClusterApi()
        api.put_node("node-a", node_spec("node-a", gpus=1))
        view = ClusterView(watch_timeout_s=(1, 1), watch_idle_s=5)
        stop = asyncio.Event()
        task = asyncio.ensure_future(view.follow(api, stop, max_backoff_s=0.05))
        seen: list[bool] = []
        try:
            await until(lambda: view.synced, "sync")
            t0 = time.monotonic()
            while time.monotonic() - t0 < 1.6:
                seen.append(view.synced)
                await asyncio.sleep(0.01)
            assert api.calls.count("list pods") >= 2  # the server ended the watch after 1 s: relisted
            assert all(seen)
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)

    asyncio.run(main())


def test_lightkube_watches_ask_for_a_server_timeout_and_a_silent_one_is_relisted(tmp_path: Path) -> None:
    state = {"watches": 0, "lists": 0, "lines": []}
    lists = {
        "/nodes": {"kind": "NodeList", "apiVersion": "v1", "metadata": {"resourceVersion": "10"}, "items": []},
        "/pods": {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "10"}, "items": []},
    }

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            line = head.split(b"\r\n")[0].decode()
            if "watch=" in line:
                state["watches"] += 1  # type: ignore[operator]
                state["lines"].append(line)  # type: ignore[attr-defined]
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
                await writer.drain()
                await asyncio.sleep(3600)  # silent, like a peer that vanished
                return
            state["lists"] += 1  # type: ignore[operator]
            body = json.dumps(lists["/nodes" if "/nodes" in line else "/pods"]).encode()
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
        view = ClusterView(watch_timeout_s=(240, 300), watch_idle_s=0.4)
        stop = asyncio.Event()
        task = asyncio.ensure_future(view.follow(api, stop))
        try:
            await until(lambda: state["lists"] >= 6, "relists after silent watches", timeout=5)  # type: ignore[operator]
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)
            await api.close()
            srv.close()
        assert state["watches"] >= 4  # type: ignore[operator]
        for line in state["lines"]:  # type: ignore[attr-defined]
            seconds = int(line.split("timeoutSeconds=")[1].split("&")[0].split(" ")[0])
            assert 240 <= seconds <= 300

    asyncio.run(main())


class _StubbornWatchApi(MemoryClusterApi):
    """Its first pod watch absorbs cancellation and reads on, as a streaming HTTP read cancelled mid-line can (a
    watch has no read timeout): only ``release`` ends the wait, and the watch then delivers one late event."""

    def __init__(self) -> None:
        super().__init__()
        self.stubborn = True
        self.release = asyncio.Event()

    async def watch_pods(
        self, resource_version: str, timeout_s: int | None = None, scheduler_name: str | None = None
    ) -> AsyncIterator[tuple[str, Pod]]:
        if not self.stubborn:
            async for event in super().watch_pods(resource_version, timeout_s, scheduler_name):
                yield event
            return
        self.stubborn = False
        while not self.release.is_set():
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                continue
        yield "ADDED", Pod.model_validate(pod_obj("late", gpu=1))


def test_a_watch_that_outlives_its_cancellation_does_not_keep_the_view_from_relisting() -> None:
    # A replica that had just become the leader asked for a relist and never got back in sync: the view waited without
    # bound for its cancelled pod watch to close.
    async def main() -> None:
        api = _StubbornWatchApi()
        api.put_node("node-a", node_spec("node-a", gpus=1))
        view = ClusterView(watch_timeout_s=(40, 50), watch_idle_s=30, watch_close_s=0.2)
        stop = asyncio.Event()
        task = asyncio.ensure_future(view.follow(api, stop, max_backoff_s=0.05))
        try:
            await until(lambda: view.synced, "sync")
            view.resync()
            await until(lambda: view.synced, "the relist despite the watch that did not close", timeout=3)
            api.put_pod(pod_obj("p", gpu=1))
            await until(lambda: view.pod("default/p") is not None, "the new watch to follow")
            api.release.set()  # the abandoned watch reads on: its late event is not applied
            await asyncio.sleep(0.1)
            assert view.pod("default/late") is None
        finally:
            api.release.set()
            stop.set()
            await asyncio.wait_for(task, 5)

    asyncio.run(main())
