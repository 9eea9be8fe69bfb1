from __future__ import annotations

from pathlib import Path

import pytest

from sharegpu.node.backends.base import (
    BackendError,
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


# ----- MPS as the H200 (driver 580) showed it ------------------------------------------------------------------------
def test_one_mps_server_serves_one_user_and_another_users_client_waits_until_it_is_free() -> None:
    """H200: a root client beside a running uid-1000 client on one daemon waited in CUDA initialisation until the
    uid-1000 client had exited, then ran alone on a new server; a client of the running user joins at once."""
    sim = _sim()
    g = sim.devices()[0].uuid
    assert sim.add_process(10, g, 500, "pod-a", 20, mps=True, daemon="/d/pipe", user=1000)
    first = sim.mps_server_pid(g)
    assert sim.mps_server_user("/d/pipe") == 1000
    assert sim.add_process(11, g, 500, "pod-b", 10, mps=True, daemon="/d/pipe", user=1000)  # same user: joins
    assert not sim.add_process(12, g, 700, "pod-c", 30, mps=True, daemon="/d/pipe", user=0)  # root: waits
    assert not sim.add_process(13, g, 300, "pod-d", 5, mps=True, daemon="/d/pipe", user=1000)  # behind it
    assert sim.mps_waiting("/d/pipe") == (12, 13)
    # Waiting clients hold no context: listed nowhere, counted nowhere.
    assert {p.pid for p in sim.processes(0)} == {first, 10, 11}
    assert {p.pid for p in sim.mps_processes(0) or ()} == {10, 11}
    assert sim.process_utilization(0) == {first: 30}
    sim.remove_process(10)
    assert sim.mps_waiting() == (12, 13)  # uid 1000 still runs there
    sim.remove_process(11)
    # The last uid-1000 client is gone: a new server for root runs root's client; uid 1000's later one waits again.
    second = sim.mps_server_pid(g)
    assert second not in (None, first) and sim.mps_server_user("/d/pipe") == 0
    assert {p.pid for p in sim.processes(0)} == {second, 12} and sim.mps_waiting() == (13,)
    sim.remove_process(12)
    assert sim.mps_server_user("/d/pipe") == 1000 and sim.mps_waiting() == ()
    assert {p.pid for p in sim.mps_processes(0) or ()} == {13}


def test_an_idle_server_of_another_user_is_replaced_at_once() -> None:
    sim = _sim()
    g = sim.devices()[0].uuid
    sim.start_mps_daemon(g, "/d/pipe")
    assert sim.add_process(10, g, 500, mps=True, daemon="/d/pipe", user=1000)
    sim.remove_process(10)
    idle = sim.mps_server_pid(g)
    assert idle is not None  # an idle server stays up until its daemon quits…
    assert sim.add_process(11, g, 500, mps=True, daemon="/d/pipe", user=0)  # …and gives way to another user's client
    assert sim.mps_server_pid(g) not in (None, idle) and sim.mps_server_user("/d/pipe") == 0


def test_daemons_side_by_side_each_run_their_own_server_and_users() -> None:
    """H200: two control daemons on one GPU, each with its own pipe directory, served a root client and a uid-1000
    client at the same time."""
    sim = _sim()
    g = sim.devices()[0].uuid
    a = sim.start_mps_daemon(g, "/a/pipe")
    b = sim.start_mps_daemon(g, "/b/pipe")
    assert sim.mps_daemons(g) == (a, b)
    with pytest.raises(BackendError, match="name the client's daemon"):
        sim.add_process(9, g, 100, mps=True)  # two daemons: a client reaches one through its pipe directory
    assert sim.add_process(10, g, 500, "pod-a", 25, mps=True, daemon=a, user=0)
    assert sim.add_process(11, g, 600, "pod-b", 40, mps=True, daemon=b, user=1000)
    sa, sb = sim.mps_server_pid(g, a), sim.mps_server_pid(g, b)
    assert sa is not None and sb is not None and sa != sb
    with pytest.raises(BackendError, match="name the daemon"):
        sim.mps_server_pid(g)
    assert {(p.pid, p.used_memory_mib) for p in sim.processes(0)} == {(sa, 66), (sb, 66), (10, 500), (11, 600)}
    assert sim.process_utilization(0) == {sa: 25, sb: 40}  # each server's pid with its own clients' figure
    assert (sim.mps_pipe_dir(10), sim.mps_pipe_dir(sb), sim.mps_pipe_dir(11)) == (a, b, b)
    sim.stop_mps_daemon(a)  # the daemon quits: its server and clients end, the other daemon's run on
    assert {p.pid for p in sim.processes(0)} == {sb, 11}


def test_a_multi_user_daemon_serves_every_user_at_once() -> None:
    sim = _sim()
    g = sim.devices()[0].uuid
    m = sim.start_mps_daemon(g, "/m/pipe", multi_user=True)
    assert all(sim.add_process(10 + u, g, 100, mps=True, daemon=m, user=u) for u in (0, 1000, 4242))
    assert sim.mps_waiting() == () and len(sim.processes(0)) == 4 and sim.mps_server_user(m) is None


def test_a_fault_ends_its_servers_clients_only_reports_no_xid_and_the_daemon_serves_again(tmp_path: Path) -> None:
    sim = _sim()
    g = sim.devices()[0].uuid
    a = sim.start_mps_daemon(g, tmp_path / "a" / "pipe", log_dir=tmp_path / "a" / "log")
    b = sim.start_mps_daemon(g, tmp_path / "b" / "pipe", log_dir=tmp_path / "b" / "log")
    sim.add_process(10, g, 100, "pod-a", mps=True, daemon=a)
    sim.add_process(11, g, 100, "pod-a2", mps=True, daemon=a)
    sim.add_process(12, g, 100, "pod-b", mps=True, daemon=b, user=1000)
    sim.add_process(13, sim.devices()[1].uuid, 100, "pod-ts")  # a time-sliced process on another GPU
    server = sim.mps_server_pid(g, a)
    assert sim.mps_fault(g, daemon=a) == (10, 11)
    assert sim.xid_events() == ()  # driver 580 reported none
    assert {p.pid for p in sim.processes(0)} == {server, sim.mps_server_pid(g, b), 12}
    assert {p.pid for p in sim.processes(1)} == {13}
    assert sim.add_process(14, g, 100, "pod-c", mps=True, daemon=a) and sim.mps_server_pid(g, a) == server
    assert (tmp_path / "a" / "log" / "server.log").read_text().count("\n") == 2
    assert not (tmp_path / "b" / "log" / "server.log").exists()
    # Where a test wants the Xid a fault may raise elsewhere, it asks for one.
    sim.mps_fault(g, daemon=a, xid=31)
    assert [x.xid for x in sim.xid_events()] == [31]
