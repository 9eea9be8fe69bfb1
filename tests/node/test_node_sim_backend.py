from __future__ import annotations

from pathlib import Path

import pytest

from sharegpu.node.backends.base import (
    InstanceInUse,
    InsufficientResources,
    InvalidPlacement,
    MigInstanceNotFound,
    MigNotEnabled,
    MigUnsupported,
)
from sharegpu.node.backends.sim import SimBackend
from sharegpu.node.backends.sim_config import SimConfigError, load_sim_config, parse_sim_config

ACCEPTANCE = "gpus: [{model: H100-80GB, count: 2}, {model: A30-24GB, count: 1}]"


def _sim(text: str = ACCEPTANCE, seed: str = "node-a") -> SimBackend:
    return SimBackend(parse_sim_config(text), seed=seed)


def test_acceptance_config_gives_three_gpus_with_catalog_facts(tmp_path: Path) -> None:
    f = tmp_path / "sim.yaml"
    f.write_text(ACCEPTANCE)
    sim = SimBackend(load_sim_config(f), seed="node-a")
    devs = sim.devices()
    assert [d.model for d in devs] == ["H100-80GB", "H100-80GB", "A30-24GB"]
    assert [d.index for d in devs] == [0, 1, 2]
    assert devs[0].memory_mib == 80 * 1024 and devs[0].sms == 132 and devs[2].sms == 56
    assert len({d.uuid for d in devs}) == 3 and all(d.uuid.startswith("GPU-") for d in devs)
    assert not any(d.mig_enabled for d in devs)
    # UUIDs are stable for a node and differ between nodes.
    assert [d.uuid for d in _sim().devices()] == [d.uuid for d in devs]
    assert _sim(seed="node-b").devices()[0].uuid != devs[0].uuid


def test_profiles_and_placements_follow_the_catalog() -> None:
    sim = _sim()
    h100 = {p.name: p for p in sim.mig_profiles(0)}
    assert [(pl.start, pl.size) for pl in h100["3g.40gb"].placements] == [(0, 4), (4, 4)]
    assert [pl.start for pl in h100["1g.10gb"].placements] == list(range(7))
    a30 = {p.name for p in sim.mig_profiles(2)}
    assert a30 == {"1g.6gb", "2g.12gb", "4g.24gb"}


def test_mig_needs_mig_mode_and_rejects_bad_placements() -> None:
    sim = _sim()
    with pytest.raises(MigNotEnabled):
        sim.create_mig_instance(0, "3g.40gb", 0)
    sim.set_mig_mode(0, True)
    with pytest.raises(InvalidPlacement, match="valid"):
        sim.create_mig_instance(0, "3g.40gb", 2)
    with pytest.raises(MigUnsupported, match="does not exist"):
        sim.create_mig_instance(0, "1g.6gb", 0)
    sim.create_mig_instance(0, "3g.40gb", 0)
    with pytest.raises(InsufficientResources, match="overlaps"):
        sim.create_mig_instance(0, "1g.10gb", 3)
    sim.create_mig_instance(0, "3g.40gb", 4)
    with pytest.raises(InsufficientResources, match="no free placement"):
        sim.create_mig_instance(0, "1g.10gb", None)
    sim.set_mig_mode(1, True)
    for start in range(7):
        sim.create_mig_instance(1, "1g.10gb", start)
    with pytest.raises(InsufficientResources, match="compute slices"):
        sim.create_mig_instance(1, "1g.10gb", None)


def test_driver_placement_lets_small_instances_block_a_later_3g() -> None:
    """The same three instances block a 3g when the driver places them, and leave room at explicit placements."""
    sim = _sim()
    sim.set_mig_mode(0, True)
    for profile in ("1g.10gb", "1g.10gb", "2g.20gb"):
        sim.create_mig_instance(0, profile)
    assert sorted(i.start for i in sim.mig_instances(0)) == [2, 5, 6]
    with pytest.raises(InsufficientResources):
        sim.create_mig_instance(0, "3g.40gb")
    sim.set_mig_mode(1, True)
    for profile, start in (("1g.10gb", 0), ("1g.10gb", 1), ("2g.20gb", 2)):
        sim.create_mig_instance(1, profile, start)
    assert sim.create_mig_instance(1, "3g.40gb").start == 4


def test_in_use_instances_and_gpus_refuse_destruction_and_mode_changes() -> None:
    sim = _sim()
    sim.set_mig_mode(0, True)
    inst = sim.create_mig_instance(0, "2g.20gb", 0)
    sim.add_process(100, inst.uuid, 2048)
    with pytest.raises(InstanceInUse):
        sim.destroy_mig_instance(0, 0)
    with pytest.raises(InstanceInUse):
        sim.set_mig_mode(0, False)
    sim.remove_process(100)
    with pytest.raises(InstanceInUse, match="still has MIG instances"):
        sim.set_mig_mode(0, False)
    sim.destroy_mig_instance(0, 0)
    with pytest.raises(MigInstanceNotFound):
        sim.destroy_mig_instance(0, 0)
    sim.set_mig_mode(0, False)
    sim.add_process(7, sim.devices()[1].uuid, 100)
    with pytest.raises(InstanceInUse):
        sim.set_mig_mode(1, True)
    with pytest.raises(MigUnsupported):
        _sim("gpus: [{model: T4}]").set_mig_mode(0, True)


def test_processes_utilisation_and_health_are_reported() -> None:
    sim = _sim()
    gpu = sim.devices()[1].uuid
    sim.add_process(42, gpu, 1500, pod_uid="pod-1", sm_percent=30)
    sim.set_utilization(1, 55, 20)
    sim.set_health(2, False)
    assert [(p.pid, p.gpu_index, p.used_memory_mib) for p in sim.processes(1)] == [(42, 1, 1500)]
    assert sim.processes(0) == ()
    assert sim.utilization(1).gpu_percent == 55
    assert sim.process_utilization(1) == {42: 30}
    assert sim.pod_uid_of(42) == "pod-1" and sim.pod_uid_of(43) is None
    assert not sim.devices()[2].healthy


def test_state_file_keeps_the_mig_layout_like_hardware(tmp_path: Path) -> None:
    text = f"{ACCEPTANCE}\nstateFile: {tmp_path / 'state.json'}\n"
    first = _sim(text)
    first.set_mig_mode(0, True)
    inst = first.create_mig_instance(0, "3g.40gb", 4)
    again = _sim(text)
    assert again.devices()[0].mig_enabled
    assert again.mig_instances(0) == (inst,)


def test_static_layout_from_config() -> None:
    sim = _sim("gpus: [{model: A30-24GB, count: 2, mig: true, migInstances: [{profile: 2g.12gb, start: 2}]}]")
    assert [(i.gpu_index, i.profile, i.start) for g in (0, 1) for i in sim.mig_instances(g)] == [
        (0, "2g.12gb", 2),
        (1, "2g.12gb", 2),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gpus: [{model: H100-80GB, count: 0}]", "count"),
        ("gpus: [{model: Z9000}]", "unknown GPU model 'Z9000'"),
        ("gpus: []", "non-empty list"),
        ("gpu: [{model: H100-80GB}]", "unknown keys"),
        ("gpus: [{model: T4, mig: true}]", "has no MIG"),
        ("gpus: [{model: H100-80GB, migInstances: [{profile: 1g.10gb, start: 0}]}]", "needs 'mig: true'"),
        ("gpus: [{model: H100-80GB, mig: true, migInstances: [{profile: 3g.40gb, start: 1}]}]", "impossible"),
        ("gpus: [{model: H100-80GB, colour: red}]", "unknown keys"),
        ("gpus: [oops", "not valid YAML"),
        ("- 1", "expected a mapping"),
    ],
)
def test_bad_config_gives_a_clear_error(text: str, message: str) -> None:
    with pytest.raises(SimConfigError, match=message):
        SimBackend(parse_sim_config(text, "sim.yaml"))


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(SimConfigError, match="cannot read"):
        load_sim_config(tmp_path / "nope.yaml")
