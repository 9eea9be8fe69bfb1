from __future__ import annotations

import json

import pytest

from sharegpu.ledger import Ledger
from sharegpu.model.assignment import MigSlot
from sharegpu.model.inventory import GpuDevice, InvalidInventory, MigDevice, NodeSpec


def _spec() -> NodeSpec:
    return NodeSpec(
        "node-a",
        64000,
        512 * 1024,
        (
            GpuDevice(
                0,
                "GPU-0",
                "H100-80GB",
                mig_instances=(MigSlot("1g.10gb", 0),),
                memory_mib=81559,
                sms=132,
                product="NVIDIA H100 80GB HBM3",
                mig_enabled=True,
                mig_devices=(MigDevice("1g.10gb", 0, "MIG-a", managed=False), MigDevice("3g.40gb", 4, "MIG-b")),
            ),
            GpuDevice(1, "GPU-1", "A30-24GB", healthy=False, memory_mib=24576, sms=56),
        ),
        labels=(("zone", "a"),),
    )


def test_round_trip_is_exact_and_canonical() -> None:
    spec = _spec()
    text = spec.to_json()
    assert NodeSpec.from_json(text) == spec
    assert NodeSpec.from_json(text).to_json() == text
    d = json.loads(text)
    assert d["gpus"][0]["migInstances"][1] == {"profile": "3g.40gb", "start": 4, "uuid": "MIG-b", "managed": True}
    assert d["gpus"][1]["healthy"] is False


def test_old_constructor_still_works_and_ledger_accepts_parsed_inventory() -> None:
    plain = NodeSpec("n", 1000, 1024, (GpuDevice(0, "GPU-x", "H100-80GB"),))
    assert NodeSpec.from_json(plain.to_json()) == plain
    ledger = Ledger([NodeSpec.from_json(_spec().to_json())])
    # The static instance is kept by the ledger; the managed one is not a persistent instance.
    assert set(ledger.instances_on(0, 0)) == {0}


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(version=7), "version 7"),
        (lambda d: d["gpus"][0].update(index="0"), "expected an integer"),
        (lambda d: d["gpus"][0].update(healthy="yes"), "true or false"),
        (lambda d: d["gpus"][0]["migInstances"][1].update(start=2), "cannot start at slot 2"),
        (lambda d: d["gpus"][0]["migInstances"][1].update(profile="3g.99gb"), "does not exist"),
        (lambda d: d["gpus"][0]["migInstances"].append({"profile": "1g.10gb", "start": 4, "uuid": "MIG-c"}), "overlap"),
        (lambda d: d["gpus"][0].update(migEnabled=False), "MIG mode is off"),
        (lambda d: d["gpus"][1].update(uuid="GPU-0"), "unique"),
        (lambda d: d["gpus"].reverse(), "in order"),
        (lambda d: d.pop("node"), "malformed"),
        (lambda d: d.update(gpus={}), "must be a list"),
    ],
)
def test_bad_inventory_is_rejected_with_a_message(mutate: object, message: str) -> None:
    d = json.loads(_spec().to_json())
    mutate(d)  # type: ignore[operator]
    with pytest.raises(InvalidInventory, match=message):
        NodeSpec.from_json(json.dumps(d))


def test_not_json_is_invalid_inventory() -> None:
    with pytest.raises(InvalidInventory, match="not valid JSON"):
        NodeSpec.from_json("{oops")
    with pytest.raises(InvalidInventory, match="not a JSON object"):
        NodeSpec.from_json("[]")
