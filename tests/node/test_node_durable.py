"""The node's record files: versioned, checksummed, migrated forward, refused when they cannot be trusted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sharegpu.node.dra.checkpoint import Checkpoint, CheckpointError
from sharegpu.node.durable import RecordError, load_record, save_record, write_atomic
from sharegpu.node.state import AgentState, StateError


def test_a_record_round_trips_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    save_record(tmp_path / "r.json", "k", 3, {"a": [1, 2]})
    assert load_record(tmp_path / "r.json", "k", 3) == {"a": [1, 2]}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    write_atomic(tmp_path / "sub" / "t.txt", "x")
    assert (tmp_path / "sub" / "t.txt").read_text() == "x"


def test_a_changed_newer_or_foreign_record_is_refused_with_what_to_do(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    save_record(path, "k", 2, {"a": 1})
    raw = json.loads(path.read_text())
    raw["data"]["a"] = 2
    path.write_text(json.dumps(raw))
    with pytest.raises(RecordError, match="checksum does not match"):
        load_record(path, "k", 2)
    save_record(path, "k", 3, {"a": 1})
    with pytest.raises(RecordError, match="newer than this sharegpu reads"):
        load_record(path, "k", 2)
    with pytest.raises(RecordError, match="'k' record, not 'other'"):
        load_record(path, "other", 3)
    save_record(path, "k", 1, {"a": 1})
    with pytest.raises(RecordError, match="cannot read"):
        load_record(path, "k", 2)  # no migration from 1
    assert load_record(path, "k", 2, {1: lambda d: {**d, "b": 0}}) == {"a": 1, "b": 0}


def test_the_agent_state_of_an_older_sharegpu_is_read_and_rewritten_as_a_record(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"managedMig": ["MIG-1"], "cdiSpecs": {"uid-a": ["dp-1"]}}))
    state = AgentState(path)
    assert state.managed_mig == {"MIG-1"} and state.all_cdi_specs() == {"dp-1"}
    state.add_managed_mig("MIG-2")
    assert json.loads(path.read_text())["kind"] == "sharegpu-agent-state"
    assert AgentState(path).managed_mig == {"MIG-1", "MIG-2"}
    path.write_text(path.read_text().replace("MIG-2", "MIG-9"))
    with pytest.raises(StateError, match="checksum"):
        AgentState(path)


def test_a_version_1_dra_checkpoint_is_read_its_mps_claims_a_tenant_of_their_own(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    device = {
        "request": "gpu", "device": "gpu-0", "pool": "n1", "share_id": "s", "gpu_index": 0, "gpu_uuid": "GPU-0",
        "mechanism": "mps", "compute_percent": 20, "memory_mib": 1024, "mig_profile": None, "mig_start": None,
        "time_slice": "Default",
    }  # fmt: skip
    claims = {"u1": {"namespace": "ns", "name": "c", "devices": [device], "units": ["GPU-0"]}}
    path.write_text(json.dumps({"version": 1, "claims": claims}))
    cp = Checkpoint(path)
    # Its pods' users unknown: the MPS claim shares a daemon with no claim prepared later (a tenant named after it).
    assert cp.claims["u1"].tenant == "pod/u1" and cp.units["u1"] == ("GPU-0",)
    path.write_text(json.dumps({"version": 7, "claims": claims}))
    with pytest.raises(CheckpointError, match="move the file away"):
        Checkpoint(path)
