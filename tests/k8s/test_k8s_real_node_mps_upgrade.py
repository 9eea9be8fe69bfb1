"""An upgrade on the real node from one MPS daemon per unit (the code of 5c4dca3) to a daemon per tenant (issue 32).

The agent of 5c4dca3 ran one daemon per GPU at ``<state>/mps/<GPU>/pipe``; the containers it started mount that
directory. This test runs that version's extender and agent (``git archive`` of 5c4dca3's ``src`` first on
``PYTHONPATH``) with the real kubelet, starts two MPS pods of one user, then upgrades both processes to this tree on
the same state, as a Helm upgrade rolls them. The old pods must run on undisturbed through their daemon, adopted as
the GPU's legacy daemon; a pod created after the upgrade (of the very tenant of the old pods) must get its tenant's
daemon, never the legacy one; the legacy daemon must stay while one old pod is left and go, with its directory, once
none is.
"""

from __future__ import annotations

import subprocess
import tarfile
import time
from io import BytesIO
from pathlib import Path
from typing import Any

import pytest
from rig import KUBECONFIG, SKIP_REASON, Rig
from test_k8s_real_node_device_plugin import logs_of
from test_k8s_real_node_mps_users import ONE_GPU, mps_pod, oci_pipe_source

from realnode import RealNode, wait_until
from sharegpu.model.tenant import tenant_dir, user_tenant

pytestmark = pytest.mark.skipif(not KUBECONFIG, reason=SKIP_REASON)

BEFORE_TENANTS = "5c4dca3"  # the last commit with one MPS daemon per unit (issue 32 came after it)
REPO = Path(__file__).resolve().parents[2]
RECONCILE_S = 10.0  # the node agent's default --interval
SIM_MARKER = "sim-mps-daemon.json"  # the simulated daemon's "process" in its pipe directory


def source_of(commit: str, into: Path) -> Path:
    """``src`` of ``commit``, unpacked under ``into``; skips, saying why, where the clone lacks that commit."""
    out = subprocess.run(["git", "-C", str(REPO), "archive", commit, "src"], capture_output=True, check=False)
    if out.returncode != 0:
        pytest.skip(f"this clone has no commit {commit} to upgrade from ({out.stderr.decode().strip()}): clone fully")
    with tarfile.open(fileobj=BytesIO(out.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def test_an_upgrade_keeps_the_old_daemon_for_its_pods_only_then_stops_it(
    rig: Rig, real_node: RealNode, tmp_path: Path
) -> None:
    old = {"PYTHONPATH": str(source_of(BEFORE_TENANTS, tmp_path))}
    node = rig.attach_real_node(real_node, ONE_GPU, env=old)
    rig.wait_nodes_published(90)
    extender, url = rig.start_extender(0, env=old)
    rig.start_scheduler(url)
    state = rig.real_state[node]
    ns = rig.namespace()

    def running(names: set[str]) -> list[dict[str, Any]] | None:
        now = [p for p in rig.pods(ns) if p["metadata"]["name"] in names]
        if len(now) != len(names) or any(p["status"].get("phase") != "Running" for p in now):
            return None
        return now if all("SHAREGPU_DONE" in logs_of(rig, ns, p)["app"] for p in now) else None

    def pipe_source(p: dict[str, Any]) -> Path:
        (status,) = p["status"]["containerStatuses"]
        return Path(oci_pipe_source(real_node, status["containerID"]))

    olds = {"old-a", "old-b"}
    rig.create_pods(ns, [mps_pod(name, node, 1000) for name in sorted(olds)])
    before = wait_until(lambda: running(olds), "the two MPS pods of the old version to run", 180, every=0.5)
    (gpu,) = {pipe_source(p).parent.name for p in before}
    legacy = state / "mps" / gpu / "pipe"
    assert {pipe_source(p) for p in before} == {legacy}  # the old layout: one daemon per GPU, right in its directory
    assert (legacy / SIM_MARKER).is_file()
    ids = {p["metadata"]["name"]: p["status"]["containerStatuses"][0]["containerID"] for p in before}

    # The upgrade: the extender and the agent of this tree, on the same state (PYTHONPATH emptied: this tree's code).
    extender.stop()
    rig.start_extender(int(url.rsplit(":", 1)[1]), env={"PYTHONPATH": ""})
    rig.restart_real_agent(node, kill=False, env={"PYTHONPATH": ""})
    agent = rig.nodes[node].agent
    assert agent is not None
    wait_until(lambda: "adopted the MPS daemon of the layout before tenants" in agent.text(), "the adoption", 60)

    # A pod of the old pods' very tenant, created after the upgrade, gets its tenant's daemon, never the legacy one.
    rig.create_pods(ns, [mps_pod("new-c", node, 1000)])
    (new,) = wait_until(lambda: running({"new-c"}), "the pod created after the upgrade to run", 180, every=0.5)
    own = state / "mps" / gpu / tenant_dir(user_tenant(ns, 1000)) / "pipe"
    assert pipe_source(new) == own and (own / SIM_MARKER).is_file()
    # The old pods ran on through the upgrade: the same containers, never restarted, their daemon still there.
    for p in rig.pods(ns):
        if p["metadata"]["name"] in olds:
            (status,) = p["status"]["containerStatuses"]
            assert status["containerID"] == ids[p["metadata"]["name"]] and status["restartCount"] == 0, status
    assert (legacy / SIM_MARKER).is_file()

    from lightkube.resources.core_v1 import Pod

    # Kept while one of its pods is left: two and a half of the agent's reconcile passes (every 10 s) after old-a went.
    rig.client.delete(Pod, "old-a", namespace=ns, grace_period=0)
    wait_until(lambda: not any(p["metadata"]["name"] == "old-a" for p in rig.pods(ns)), "old-a to be gone", 60)
    time.sleep(RECONCILE_S * 2.5)
    assert (legacy / SIM_MARKER).is_file(), agent.text()[-3000:]
    # Gone, with its directory, once none is; the new tenant's daemon stays for new-c.
    rig.client.delete(Pod, "old-b", namespace=ns, grace_period=0)
    stopped = "stopped the MPS daemon of the layout before tenants for " + gpu
    wait_until(lambda: stopped in agent.text(), "the legacy daemon to be stopped", 90)
    assert not legacy.exists() and (own / SIM_MARKER).is_file()
    assert agent.text().count(stopped) == 1
    assert not [line for line in agent.text().splitlines() if "Traceback" in line or " ERROR " in line]
