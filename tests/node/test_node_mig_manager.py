from __future__ import annotations

import logging
from pathlib import Path

import pytest

from sharegpu.model.assignment import MigSlot
from sharegpu.node.backends.sim import SimBackend
from sharegpu.node.backends.sim_config import parse_sim_config
from sharegpu.node.mig import MigError, MigInvalid, MigManager, MigNeed
from sharegpu.node.state import AgentState

ACCEPTANCE = "gpus: [{model: H100-80GB, count: 2}, {model: A30-24GB, count: 1}]"


def _setup(text: str = ACCEPTANCE, state_path: Path | None = None) -> tuple[SimBackend, MigManager, AgentState]:
    sim = SimBackend(parse_sim_config(text), seed="node-a")
    state = AgentState(state_path)
    return sim, MigManager(sim, state), state


def _layout(sim: SimBackend, gpu: int) -> list[tuple[int, str]]:
    return [(i.start, i.profile) for i in sim.mig_instances(gpu)]


def test_reconcile_creates_a_layout_the_driver_would_block_when_left_to_choose() -> None:
    sim, mig, _ = _setup()
    needs = {MigNeed(0, 0, "1g.10gb"), MigNeed(0, 1, "1g.10gb"), MigNeed(0, 2, "2g.20gb"), MigNeed(0, 4, "3g.40gb")}
    report = mig.reconcile(needs, {})
    assert report.errors == ()
    assert _layout(sim, 0) == [(0, "1g.10gb"), (1, "1g.10gb"), (2, "2g.20gb"), (4, "3g.40gb")]
    assert sim.devices()[0].mig_enabled  # turned on because an assignment needs MIG
    assert next(i.profile for i in report.created) == "3g.40gb"  # larger first
    assert mig.reconcile(needs, {}).created == ()  # idempotent


def test_unused_managed_instances_go_but_in_use_and_static_ones_stay() -> None:
    sim, mig, _ = _setup("gpus: [{model: H100-80GB, mig: true, migInstances: [{profile: 1g.10gb, start: 6}]}]")
    mig.reconcile({MigNeed(0, 0, "3g.40gb"), MigNeed(0, 4, "2g.20gb")}, {})
    busy = next(i for i in sim.mig_instances(0) if i.start == 4)
    sim.add_process(11, busy.uuid, 512)
    report = mig.reconcile(set(), {})
    assert [i.start for i in report.destroyed] == [0]
    assert _layout(sim, 0) == [(4, "2g.20gb"), (6, "1g.10gb")]  # in use, and static
    sim.remove_process(11)
    mig.reconcile(set(), {})
    assert _layout(sim, 0) == [(6, "1g.10gb")]


def test_ensure_creates_on_demand_and_reuses() -> None:
    sim, mig, state = _setup()
    uuid0 = sim.devices()[1].uuid
    first = mig.ensure(1, uuid0, MigSlot("3g.40gb", 4))
    assert first in sim.mig_instances(1) and first.uuid in state.managed_mig
    assert mig.ensure(1, uuid0, MigSlot("3g.40gb", 4)) == first


def test_ensure_refuses_what_cannot_exist_with_clear_messages() -> None:
    sim, mig, _ = _setup(
        "gpus: [{model: H100-80GB, mig: true, migInstances: [{profile: 1g.10gb, start: 4}]}, {model: T4}]"
    )
    gpu = sim.devices()[0].uuid
    with pytest.raises(MigInvalid, match="cannot start at slot 2"):
        mig.ensure(0, gpu, MigSlot("3g.40gb", 2))
    with pytest.raises(MigInvalid, match="does not exist"):
        mig.ensure(0, gpu, MigSlot("2g.12gb", 0))
    with pytest.raises(MigInvalid, match="not GPU-other"):
        mig.ensure(0, "GPU-other", MigSlot("3g.40gb", 0))
    with pytest.raises(MigInvalid, match="no GPU with index 5"):
        mig.ensure(5, gpu, MigSlot("3g.40gb", 0))
    with pytest.raises(MigError, match="static layout"):
        mig.ensure(0, gpu, MigSlot("3g.40gb", 4))


def test_mig_mode_is_not_forced_on_a_gpu_used_without_mig_and_is_given_back() -> None:
    sim, mig, state = _setup()
    gpu = sim.devices()[0].uuid
    report = mig.reconcile({MigNeed(0, 0, "7g.80gb")}, {0: {"pod ns/whole"}})
    assert "MIG mode is off and pod ns/whole uses the GPU without MIG" in report.errors[0]
    assert not sim.devices()[0].mig_enabled
    mig.reconcile({MigNeed(0, 0, "7g.80gb")}, {})
    assert gpu in state.mig_mode_set
    mig.reconcile(set(), {0: {"pod ns/whole"}})  # the MIG pod left; a whole-GPU pod needs the GPU
    assert not sim.devices()[0].mig_enabled and gpu not in state.mig_mode_set


def test_administrators_mig_mode_is_left_alone() -> None:
    sim, mig, _ = _setup("gpus: [{model: H100-80GB, mig: true}]")
    mig.reconcile(set(), {0: {"pod ns/whole"}})
    assert sim.devices()[0].mig_enabled


def test_restarted_manager_knows_its_instances_from_the_state_file(tmp_path: Path) -> None:
    text = f"{ACCEPTANCE}\nstateFile: {tmp_path / 'sim.json'}"
    sim, mig, _ = _setup(text, tmp_path / "agent.json")
    mig.reconcile({MigNeed(0, 0, "3g.40gb")}, {})
    created = sim.mig_instances(0)
    # A new agent process: same hardware, same state file. The instance is still needed: nothing changes.
    sim2, mig2, _ = _setup(text, tmp_path / "agent.json")
    report = mig2.reconcile({MigNeed(0, 0, "3g.40gb")}, {})
    assert (report.created, report.destroyed, report.errors) == ((), (), ())
    assert sim2.mig_instances(0) == created
    # The pod is gone after the next restart: the manager still recognises the instance as its own.
    _sim3, mig3, _ = _setup(text, tmp_path / "agent.json")
    assert [i.uuid for i in mig3.reconcile(set(), {}).destroyed] == [created[0].uuid]
    # Without the agent's state the same instance would be taken for a static layout and kept.
    sim4, mig4, _ = _setup(text.replace("sim.json", "sim4.json"))
    sim4.set_mig_mode(0, True)
    sim4.create_mig_instance(0, "3g.40gb", 0)
    assert mig4.reconcile(set(), {}).destroyed == ()


def test_a_new_run_logs_each_instance_of_ours_made_before_it_once(caplog: pytest.LogCaptureFixture) -> None:
    """An agent killed between making an instance and logging it: the next run names the instance, with its place
    (the real-node restart test reads the node's log to know where each instance sits)."""
    caplog.set_level(logging.INFO, logger="sharegpu.node.mig")
    sim, mig, state = _setup("gpus: [{model: H100-80GB, mig: true, migInstances: [{profile: 1g.10gb, start: 6}]}]")
    made = mig.ensure(0, sim.devices()[0].uuid, MigSlot("3g.40gb", 0))
    assert "created MIG instance" in caplog.text and "kept MIG instance" not in caplog.text

    caplog.clear()
    again = MigManager(sim, state)  # the next run, over the same GPU and state
    again.ensure(0, sim.devices()[0].uuid, MigSlot("3g.40gb", 0))
    again.reconcile({MigNeed(0, 0, "3g.40gb")}, {})
    kept = [r.getMessage() for r in caplog.records if "kept MIG instance" in r.getMessage()]
    assert kept == [f"kept MIG instance {made.uuid} (3g.40gb at slot 0) on GPU 0, made by sharegpu before this start"]
