"""When the ``real_node`` fixture skips and when it fails (issue 33): with SHAREGPU_TEST_K8S_REAL set (as the docs say,
for the TLS test) on a rig without a real node, the nine real-node tests errored instead of skipping. A rig whose API
server has no kubelet node registered skips them, saying why; under CI, or where a real node is registered but does
not run (an earlier test broke its kubelet), a missing real node still fails. The API server's answer and the
kubelet's pid are played here, so this runs without a rig."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import realnode
from realnode import NONE_REGISTERED, RIG_MISSING_MARKS, real_node_or_skip


def _node(name: str, ready: bool = True) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {realnode.REAL_NODE_LABEL: "true"}},
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


@pytest.fixture
def rig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A rig's folder with the real node's script and config, named by SHAREGPU_TEST_K8S_REAL, outside CI."""
    (tmp_path / "kubelet-node.sh").write_text("#!/bin/sh\n")
    (tmp_path / "node").mkdir()
    (tmp_path / "node" / "kubelet-config.yaml").write_text("port: 10780\n")
    monkeypatch.setenv("SHAREGPU_TEST_K8S_REAL", str(tmp_path))
    monkeypatch.delenv("CI", raising=False)
    return tmp_path


def _api(monkeypatch: pytest.MonkeyPatch, answer: list[dict[str, Any]] | str, kubelet_alive: bool) -> None:
    monkeypatch.setattr(realnode, "_labelled_nodes", lambda kubeconfig: answer)
    monkeypatch.setattr(realnode, "_kubelet_alive", lambda k8s_real: kubelet_alive)


def test_a_rig_without_a_registered_kubelet_node_skips_saying_why(rig: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _api(monkeypatch, [], kubelet_alive=False)
    with pytest.raises(pytest.skip.Exception) as e:
        real_node_or_skip(rig / "kubeconfig", rig)
    why = str(e.value)
    assert why == NONE_REGISTERED.format(kubeconfig=rig / "kubeconfig", k8s_real=rig)
    assert "has no kubelet node" in why and f"K8S_REAL={rig} {rig}/kubelet-node.sh start" in why
    # tests/conftest.py's report hook turns a skip with one of these words into a failure where the rig is expected
    assert not any(mark in why for mark in RIG_MISSING_MARKS), why
    # without the real node's files too (install-node.sh never ran on this rig)
    (rig / "kubelet-node.sh").unlink()
    with pytest.raises(pytest.skip.Exception):
        real_node_or_skip(rig / "kubeconfig", rig)


def test_under_ci_a_missing_real_node_fails(rig: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    _api(monkeypatch, [], kubelet_alive=False)
    with pytest.raises(pytest.fail.Exception, match=r"the rig should be there .* has no kubelet node"):
        real_node_or_skip(rig / "kubeconfig", rig)


@pytest.mark.parametrize(
    ("answer", "alive", "says"),
    [
        ([_node("host")], False, "no real node runs in"),  # its kubelet died (an earlier test broke it)
        ([_node("host", ready=False)], True, "node host is registered but not Ready"),
        ([_node("a"), _node("b")], True, "expected one node labelled k8s-rig/real-node=true, found ['a', 'b']"),
        ("cannot list the rig's nodes: connection refused", True, "cannot list the rig's nodes"),
    ],
)
def test_a_registered_but_broken_real_node_or_no_api_server_fails(
    rig: Path, monkeypatch: pytest.MonkeyPatch, answer: list[dict[str, Any]] | str, alive: bool, says: str
) -> None:
    _api(monkeypatch, answer, kubelet_alive=alive)
    with pytest.raises(pytest.fail.Exception) as e:
        real_node_or_skip(rig / "kubeconfig", rig)
    assert "the rig should be there" in str(e.value) and says in str(e.value), str(e.value)


def test_a_running_ready_real_node_is_found(rig: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _api(monkeypatch, [_node("host")], kubelet_alive=True)
    node = real_node_or_skip(rig / "kubeconfig", rig)
    assert (node.name, node.k8s_real, node.port_offset) == ("host", rig, 530)
