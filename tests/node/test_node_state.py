"""The agent's on-disk record of pods: what forgetting a finished pod may remove."""

from __future__ import annotations

from pathlib import Path

from sharegpu.model.contract import cdi_allocation_name
from sharegpu.node.state import AgentState


def test_forgetting_a_finished_pod_keeps_the_cdi_spec_a_live_pod_got_under_the_same_name(tmp_path: Path) -> None:
    # issue 28: a spec's name depends only on the device IDs; pod B, given finished pod A's IDs, has A's spec name.
    # Forgetting A removed B's spec while the state still listed it under B.
    name = cdi_allocation_name(["GPU-0::3"])
    state = AgentState(tmp_path / "state.json")
    state.record_allocation("uid-a", "app", ("GPU-0",), name)
    state.record_allocation("uid-b", "app", ("GPU-0",), name)
    state.record_allocation("uid-a", "side", ("GPU-0",), cdi_allocation_name(["GPU-0::4"]))
    assert state.forget_pods({"uid-a"}) == {cdi_allocation_name(["GPU-0::4"])}
    assert state.all_cdi_specs() == {name}
    assert AgentState(tmp_path / "state.json").all_cdi_specs() == {name}  # and so it stays after a restart
    assert state.forget_pods({"uid-b"}) == {name}
