"""One quantity parser, and one rounding rule per direction, for the control plane and the node (kube/quantity.py).

What a pod or a claim asks is rounded up to whole MiB (milli-CPU, percent); what a device or a node has is rounded
down. "10G" is 9536.74 MiB: an ask of 10G is 9537 MiB wherever it is read, a device of 10G has 9536 MiB.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from sharegpu.k8s.cache.assume import AssumeCache
from sharegpu.k8s.cache.dra_ledger import DraLedger, parse_use
from sharegpu.k8s.extender.dra_steer import claim_request
from sharegpu.k8s.pod_request import cpu_and_memory, pod_request
from sharegpu.k8s.status.dra import dra_status
from sharegpu.kube.quantity import (
    MIB,
    asked_mib,
    asked_milli,
    asked_whole,
    capacity_mib,
    capacity_milli,
    parse_quantity,
    quantity_or_zero,
)
from sharegpu.kube.schema import Node, Pod, ResourceClaim, ResourceSlice
from sharegpu.model.contract import DRIVER
from sharegpu.node.backends.base import DeviceInfo
from sharegpu.node.dra.claims import plan_claim
from sharegpu.node.kube import node_info, pod_info

TEN_G = "10G"  # 10^10 bytes = 9536.74 MiB
ASKED = 9537
HAS = 9536


@pytest.mark.parametrize(
    ("text", "value"),
    [("2", 2), ("500m", Decimal("0.5")), ("10Gi", 10 * 2**30), ("1E3", 1000), ("1e3", 1000), ("1E", 10**18)],
)
def test_quantities_parse_as_kubernetes_writes_them(text: str, value: Decimal) -> None:
    assert parse_quantity(text) == value


def test_what_is_not_a_quantity_is_none_or_zero() -> None:
    for bad in ("ten", "", "1.2.3"):
        assert parse_quantity(bad) is None and quantity_or_zero(bad) == 0
    assert parse_quantity(None) is None


def q(text: str) -> Decimal:
    value = parse_quantity(text)
    assert value is not None
    return value


def test_an_ask_rounds_up_and_what_is_had_rounds_down() -> None:
    assert MIB == 2**20
    assert asked_mib(q(TEN_G)) == ASKED and capacity_mib(q(TEN_G)) == HAS
    assert asked_mib(q("10Gi")) == capacity_mib(q("10Gi")) == 10240  # whole MiB: no rounding either way
    assert asked_mib(q("1")) == 1 and capacity_mib(q("1")) == 0  # one byte
    assert asked_mib(10**10) == ASKED and capacity_mib(10**10) == HAS  # bytes as NVML reports them
    # (The parser keeps milli precision, rounding a finer quantity up, as Kubernetes does: the functions round
    # whatever precision they are given.)
    assert asked_milli(Decimal("0.0001")) == 1 and capacity_milli(Decimal("0.0009")) == 0
    # Through Decimal, never float: 1.001 * 1000 is 1000.9999999999999 in floats.
    assert asked_milli(q("1.001")) == capacity_milli(q("1.001")) == 1001
    assert asked_whole(q("33.4")) == 34 and asked_whole(q("30")) == 30


def test_an_ask_that_is_not_positive_stays_so_for_the_request_to_refuse() -> None:
    assert asked_mib(q("-1")) == -1 and asked_mib(q("-0.5Mi")) == -1 and asked_mib(0) == 0
    assert asked_milli(Decimal("-0.0001")) == -1 and asked_whole(q("-0.5")) == -1


# ----- every reader of an ask agrees ---------------------------------------------------------------------------------
A100 = DeviceInfo(0, "GPU-a100", "NVIDIA A100-SXM4-80GB", "A100-80GB", 81920, 108, False)


def allocated_claim(consumed: dict[str, str]) -> dict[str, Any]:
    result = {"request": "gpu", "driver": DRIVER, "pool": "n1", "device": "gpu-0", "shareID": "s-1"}
    return {
        "metadata": {"namespace": "ns", "name": "c", "uid": "u1"},
        "spec": {
            "devices": {
                "requests": [
                    {"name": "gpu", "exactly": {"deviceClassName": DRIVER, "capacity": {"requests": consumed}}}
                ]
            }
        },
        "status": {"allocation": {"devices": {"results": [result | {"consumedCapacity": consumed}]}}},
    }


def gpu_slice(memory: str) -> dict[str, Any]:
    device = {
        "name": "gpu-0",
        "attributes": {
            "type": {"string": "gpu"},
            "index": {"int": 0},
            "uuid": {"string": "GPU-a100"},
            "model": {"string": "A100-80GB"},
        },
        "capacity": {"memory": {"value": memory}, "compute": {"value": "100"}},
    }
    return {"metadata": {"name": "s"}, "spec": {"driver": DRIVER, "nodeName": "n1", "pool": {"name": "n1"},
                                                "devices": [device]}}  # fmt: skip


def test_a_claim_asking_10G_is_9537_MiB_everywhere_its_ask_is_read() -> None:
    asked = {"memory": TEN_G, "compute": "30"}
    claim = allocated_claim(asked)
    # the node: what the driver enforces
    plan = plan_claim(ResourceClaim.model_validate(claim), "u1", "n1", (A100,)).devices[0]
    assert plan.memory_mib == ASKED and plan.compute_percent == 30
    # the extender's DRA steering: the claim's ask, and its allocation
    req = claim_request("ns/p", [ResourceClaim.model_validate(claim)], 0, 0)
    assert req.memory_mib == ASKED and req.compute_milli == 300
    use = parse_use(ResourceClaim.model_validate(claim))
    assert use is not None and use.devices[0][2:4] == (ASKED, 300)
    # sharegpu status
    (node,) = dra_status([ResourceSlice.model_validate(gpu_slice("80Gi"))], [ResourceClaim.model_validate(claim)])
    assert node["gpus"][0]["memory_mib_used"] == ASKED


def test_a_claim_compute_of_a_fraction_of_a_percent_is_rounded_up_alike() -> None:
    claim = allocated_claim({"memory": "1Gi", "compute": "33.4"})
    assert plan_claim(ResourceClaim.model_validate(claim), "u1", "n1", (A100,)).devices[0].compute_percent == 34
    assert claim_request("ns/p", [ResourceClaim.model_validate(claim)], 0, 0).compute_milli == 340
    use = parse_use(ResourceClaim.model_validate(claim))
    assert use is not None and use.devices[0][3] == 340


def test_the_dra_claim_path_and_the_extender_path_agree_on_a_10G_share() -> None:
    pod = Pod.model_validate(
        {
            "metadata": {"namespace": "ns", "name": "p"},
            "spec": {
                "containers": [
                    {
                        "name": "m",
                        "resources": {
                            "limits": {"sharegpu.io/gpu": "1", "sharegpu.io/gpu-memory": TEN_G},
                            "requests": {"cpu": "0.0001", "memory": TEN_G},
                        },
                    }
                ]
            },
        }
    )
    extender = pod_request(pod)
    assert extender is not None
    claim = allocated_claim({"memory": TEN_G})
    assert extender.memory_mib == claim_request("ns/p", [ResourceClaim.model_validate(claim)], 0, 0).memory_mib == ASKED
    assert plan_claim(ResourceClaim.model_validate(claim), "u1", "n1", (A100,)).devices[0].memory_mib == ASKED
    assert cpu_and_memory(pod) == (1, ASKED)  # the pod's own CPU and memory asks: rounded up too


# ----- every reader of what a device or node has agrees --------------------------------------------------------------
def test_a_device_or_node_of_10G_has_9536_MiB_everywhere() -> None:
    (node,) = dra_status([ResourceSlice.model_validate(gpu_slice(TEN_G))], [])
    assert node["gpus"][0]["memory_mib_total"] == HAS
    state = DraLedger(AssumeCache())
    parsed = state._parse_slice(ResourceSlice.model_validate(gpu_slice(TEN_G)))
    assert parsed is not None and parsed[1][0].memory_mib == HAS
    state.apply_node("ADDED", Node.model_validate({"metadata": {"name": "n1", "labels": {"sharegpu.io/device-path": "dra"}},
                                  "status": {"allocatable": {"cpu": "1.001", "memory": TEN_G}}}))  # fmt: skip
    assert state._nodes["n1"] == (1001, HAS)
    info = node_info(
        Node.model_validate({"metadata": {"name": "n1"}, "status": {"allocatable": {"cpu": "1.001", "memory": TEN_G}}})
    )
    assert (info.cpu_milli, info.memory_mib) == (1001, HAS)


def test_the_node_reads_a_pods_gpu_count_through_the_same_parser() -> None:
    pod = pod_info(
        Pod.model_validate(
            {
                "metadata": {"name": "p"},
                "spec": {"containers": [{"name": "a", "resources": {"limits": {"sharegpu.io/gpu": "2"}}}]},
            }
        )
    )
    assert pod.gpu_demand == 2
