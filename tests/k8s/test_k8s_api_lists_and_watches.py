"""Lists and watches of :class:`LightkubeClusterApi` read as plain JSON, against a real API server
(SHAREGPU_TEST_KUBECONFIG): pages joined, a watch the server ends resumed from the last version seen, an ERROR event
(a version too old) raised as an :class:`ApiError`, and the objects equal to what lightkube's typed client reads."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from pathlib import Path

import pytest
from k8s_helpers import pod_obj

from sharegpu.k8s import api as api_module
from sharegpu.k8s.api import ADDED, DELETED, ApiError, LightkubeClusterApi
from sharegpu.k8s.schema import Pod

KUBECONFIG = os.environ.get("SHAREGPU_TEST_KUBECONFIG")
pytestmark = pytest.mark.skipif(
    not KUBECONFIG, reason="no API server: set SHAREGPU_TEST_KUBECONFIG to a kubeconfig to run the integration suite"
)


def test_lists_come_in_pages_and_watches_resume_where_the_server_ended_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightkube import AsyncClient, KubeConfig
    from lightkube.models.meta_v1 import ObjectMeta
    from lightkube.resources.core_v1 import Namespace
    from lightkube.resources.core_v1 import Pod as KPod

    assert KUBECONFIG is not None
    monkeypatch.setattr(api_module, "LIST_CHUNK", 2)  # five pods: three pages
    ns = f"sharegpu-lw-{uuid.uuid4().hex[:6]}"
    scheduler = f"sched-{ns}"  # a field selector that only this test's pods match

    async def create(client: AsyncClient, name: str) -> None:
        obj = pod_obj(name, ns, memory="1Gi")
        for server_set in ("uid", "resourceVersion"):
            del obj["metadata"][server_set]
        obj["spec"]["schedulerName"] = scheduler
        await client.create(KPod.from_dict(obj | {"status": {}}), namespace=ns)

    async def main() -> None:
        client = AsyncClient(config=KubeConfig.from_file(KUBECONFIG))
        api = LightkubeClusterApi(Path(KUBECONFIG))
        try:
            await client.create(Namespace(metadata=ObjectMeta(name=ns)))
            for i in range(5):
                await create(client, f"p{i}")
            pods, version = await api.list_pods(scheduler)
            assert sorted(p.metadata.name for p in pods) == [f"p{i}" for i in range(5)]
            assert int(version) > 0
            typed = {p.metadata.name: p async for p in client.list(KPod, namespace=ns)}
            for p in pods:  # the same object lightkube's typed client reads, field for field that sharegpu uses
                want = Pod.model_validate(typed[p.metadata.name].to_dict())
                assert (p.metadata, p.spec.containers, p.spec.scheduler_name) == (
                    want.metadata,
                    want.spec.containers,
                    want.spec.scheduler_name,
                )

            # The server ends the watch after 1 s; events after that still arrive (resumed from the last version).
            seen: list[tuple[str, str]] = []

            async def watch() -> None:
                async for kind, pod in api.watch_pods(version, timeout_s=1, scheduler_name=scheduler):
                    seen.append((kind, pod.metadata.name))
                    if kind == DELETED:
                        return

            task = asyncio.ensure_future(watch())
            await create(client, "early")
            await asyncio.sleep(2.5)  # past two server-side timeouts
            await create(client, "late")
            await client.delete(KPod, "late", namespace=ns, grace_period=0)
            await asyncio.wait_for(task, 20)
            assert (ADDED, "early") in seen and (ADDED, "late") in seen and seen[-1] == (DELETED, "late")
            assert all(name in ("early", "late") for _, name in seen)  # nothing before the version watched from

            # A version the server no longer has: the ERROR event (410 Gone) raises.
            with pytest.raises(ApiError, match="410"):
                async for _ in api.watch_pods("1", timeout_s=5, scheduler_name=scheduler):
                    pass
        finally:
            with contextlib.suppress(Exception):
                await client.delete(Namespace, ns)
            await api.close()
            await client.close()

    asyncio.run(main())
