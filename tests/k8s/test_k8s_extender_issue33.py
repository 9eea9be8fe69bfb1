"""The extender applies the webhook's floor on GPU memory (issue 33): a pod in a namespace the webhook skips, with
``sharegpu.io/gpu-memory: "10"`` (10 bytes, a forgotten unit), was bound as a 1 MiB MPS share and the node set a 1 MiB
limit. Filter refuses it on every node with the webhook's own words (what is wrong, what to write), and bind refuses
it too; over real loopback HTTP in the kube-scheduler's JSON shapes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from k8s_helpers import LoopbackServer, node_spec, nodes, pod_obj
from memory_api import MemoryClusterApi

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.extender.server import Extender, make_app
from sharegpu.k8s.webhook.admission import WebhookConfig, admit_pod

NODES = ["node-a", "node-b"]


@pytest.fixture
def srv() -> Iterator[tuple[LoopbackServer, MemoryClusterApi]]:
    api = MemoryClusterApi()
    for name in NODES:
        api.put_node(name, node_spec(name, gpus=2))
    view = ClusterView()
    view.reset(nodes(list(api.nodes.values())), [])
    view.synced = True
    with LoopbackServer(make_app(Extender(view, api, policy="bestfit"))) as s:
        yield s, api


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("10", ["'10' is only 10 bytes", "sharegpu.io/gpu-memory: 10Gi"]),
        ("500m", ["'500m' is 0.5 bytes", "m is milli", "sharegpu.io/gpu-memory: 500Mi"]),
        ("100M", ["'100M' is", "less than the 256Mi", "sharegpu.io/gpu-memory: 10Gi"]),
    ],
)
def test_filter_refuses_gpu_memory_below_the_webhooks_floor_on_every_node(
    srv: tuple[LoopbackServer, MemoryClusterApi], text: str, says: list[str]
) -> None:
    s, _ = srv
    pod = pod_obj("tiny", namespace="skipped-by-the-webhook", memory=text)
    status, answer = s.post("/filter", {"Pod": pod, "NodeNames": NODES})
    assert status == 200
    assert answer["NodeNames"] == [], answer  # no node passes: the pod is not bound
    # No node and no preemption can help: unresolvable, each node with the reason, as the webhook words it.
    reasons = answer["FailedAndUnresolvableNodes"]
    assert set(reasons) == set(NODES), answer
    webhook = admit_pod(pod, "CREATE", None, "alice", True, WebhookConfig())
    assert not webhook.allowed
    for reason in reasons.values():
        assert webhook.message in reason, (reason, webhook.message)
        for words in says:
            assert words in reason, reason
        assert "a number without a unit is bytes; write the unit" in reason


def test_bind_refuses_gpu_memory_below_the_floor(srv: tuple[LoopbackServer, MemoryClusterApi]) -> None:
    s, api = srv
    stored = api.put_pod(pod_obj("tiny", memory="10"))
    status, body = s.post(
        "/bind", {"PodName": "tiny", "PodNamespace": "default", "PodUID": stored["metadata"]["uid"], "Node": "node-a"}
    )
    assert status == 200 and "'10' is only 10 bytes" in body["Error"], body
    assert "nodeName" not in api.pods["default/tiny"]["spec"]


def test_filter_passes_the_floor_itself(srv: tuple[LoopbackServer, MemoryClusterApi]) -> None:
    s, _ = srv
    status, answer = s.post("/filter", {"Pod": pod_obj("p", memory="256Mi"), "NodeNames": NODES})
    # (the extender narrows filter's answer to its policy's pick)
    assert status == 200 and answer["NodeNames"] and set(answer["NodeNames"]) <= set(NODES), answer
    assert answer["FailedAndUnresolvableNodes"] == {}, answer
