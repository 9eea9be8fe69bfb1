"""The whole agent running: kubelet peer over gRPC, metrics over HTTP, inventory on the fake API."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from node_fakes import SIM_YAML, FakeKube, FakeKubelet, agent_config, assignment, cdi_spec, pod, record_for, share
from prometheus_client.parser import text_string_to_metric_families

from sharegpu.model.assignment import Mechanism, MigSlot
from sharegpu.model.contract import INVENTORY_ANNOTATION
from sharegpu.node.agent import NodeAgent
from sharegpu.node.backends.sim import SimBackend
from sharegpu.node.backends.sim_config import parse_sim_config
from sharegpu.node.kube import NodeInfo
from sharegpu.node.metrics import MetricsError, parse_listen
from sharegpu.node.mps import SimMpsDaemon
from sharegpu.node.proto import deviceplugin_pb2 as pb


async def _get(port: int, path: str) -> tuple[str, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    data = (await reader.read()).decode()
    writer.close()
    head, _, body = data.partition("\r\n\r\n")
    return head.splitlines()[0], body


def _samples(body: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(body)
        for s in fam.samples
    }


def _value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_running_agent_serves_kubelet_inventory_and_metrics(sock_dir: Path) -> None:
    async def main() -> None:
        sim = SimBackend(parse_sim_config(SIM_YAML), seed="node-a")
        g = [d.uuid for d in sim.devices()]
        kube = FakeKube(NodeInfo("node-a", cpu_milli=8000, memory_mib=65536))
        infer = kube.add(pod("infer", assignment("infer", share(0, g[0], Mechanism.MPS, 300, 10240))))
        kube.add(
            pod(
                "train",
                assignment(
                    "train", share(1, g[1], Mechanism.MIG, 1000, 40960, MigSlot("3g.40gb", 4), Mechanism.EXCLUSIVE)
                ),
                created="2024-05-01T11:00:00+00:00",
            )
        )
        config = agent_config(
            sock_dir,
            sock_dir,
            plugin_dir=sock_dir,
            metrics_listen=("127.0.0.1", 0),
            interval_s=0.05,
            tokens_per_gpu=2,
            allocate_wait_s=15.0,
        )
        agent = NodeAgent(config, sim, kube, SimMpsDaemon())
        kubelet = FakeKubelet(sock_dir)
        await kubelet.start()
        record = record_for(config)
        await record.start()
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        try:
            await asyncio.wait_for(kubelet.registered.wait(), 5)
            tokens = await kubelet.plugin().ListAndWatch(pb.Empty()).read()
            ids = [tokens.devices[0].ID]  # the kubelet hands out one of the advertised tokens
            answer = await kubelet.run_container(record, infer, "c0", ids)
            assert dict(answer.envs) == {"NVIDIA_VISIBLE_DEVICES": "void"}
            assert cdi_spec(config.cdi_dir, ids)["env"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"
            sim.add_process(4242, g[0], 3000, pod_uid="uid-default-infer", sm_percent=27)
            sim.set_utilization(0, 64, 12)
            while agent.snapshot.pod_usage == () or INVENTORY_ANNOTATION not in kube.nodes["node-a"].annotations:
                await asyncio.sleep(0.02)
            assert agent.metrics_server is not None
            status, body = await _get(agent.metrics_server.port, "/metrics")
            assert status == "HTTP/1.1 200 OK"
            s = _samples(body)
            assert _value(s, "DCGM_FI_DEV_GPU_UTIL", UUID=g[0], Hostname="node-a", modelName="H100-80GB") == 64
            assert _value(s, "DCGM_FI_DEV_FB_USED", UUID=g[0]) == 3000
            assert _value(s, "DCGM_FI_DEV_FB_FREE", UUID=g[0]) == 80 * 1024 - 3000
            assert _value(s, "sharegpu_pod_gpu_memory_used_bytes", pod="infer", UUID=g[0]) == 3000 * 2**20
            assert _value(s, "sharegpu_pod_gpu_sm_utilization_percent", pod="infer") == 27
            assert _value(s, "sharegpu_pod_gpu_memory_promised_bytes", pod="infer", mechanism="mps") == 10240 * 2**20
            assert _value(s, "sharegpu_pod_gpu_compute_promised_ratio", pod="infer") == pytest.approx(0.3)
            assert _value(s, "sharegpu_gpu_shares", UUID=g[1]) == 1
            assert _value(s, "sharegpu_gpu_compute_promised_ratio", UUID=g[1]) == pytest.approx(3 / 7)
            assert _value(s, "sharegpu_gpu_memory_present_bytes", UUID=g[1]) == 80 * 1024 * 2**20
            assert _value(s, "sharegpu_mps_daemon_up", UUID=g[0], tenant=infer.tenant) == 1
            assert _value(s, "sharegpu_mig_instance", profile="3g.40gb", start="4", managed="true") == 1
            assert (await _get(agent.metrics_server.port, "/nope"))[0] == "HTTP/1.1 404 Not Found"
        finally:
            stop.set()
            await task
            await kubelet.stop()
            await record.stop()
        assert not (sock_dir / "sharegpu.sock").exists()  # a clean stop leaves no stale socket
        assert sim.mig_instances(1) != ()  # …and leaves MIG instances for the pods still running

    asyncio.run(main())


def test_metrics_listen_parsing() -> None:
    assert parse_listen("0.0.0.0:9402") == ("0.0.0.0", 9402)
    assert parse_listen(":9402") == ("0.0.0.0", 9402)
    assert parse_listen("[::1]:80") == ("::1", 80)
    for bad in ("9402", "host:", "h:99999", "h:x"):
        with pytest.raises(MetricsError, match="HOST:PORT"):
            parse_listen(bad)
