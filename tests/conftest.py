"""Fixtures shared by every folder of tests: the real node of ../shared/k8s-rig, held exclusively.

Where the rig should be there (CI: env ``CI`` set, or ``SHAREGPU_TEST_K8S_REAL`` set, as ``.ci/run`` does), a missing
API server is a failure, not a skip, and so is a missing real node under CI or where the rig's API server has one
registered: a kubelet that an earlier test broke would otherwise skip every later real-node test and leave the run
green. A rig that never had a real node (SHAREGPU_TEST_K8S_REAL set for the TLS test, which needs only the rig's
folder) skips the real-node tests, saying why, and so does a developer's machine without a rig.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from realnode import RIG_MISSING_MARKS, RealNode, exclusive, real_node_or_skip, rig_expected, rig_unavailable


@pytest.fixture
def real_node() -> Iterator[RealNode]:
    """The rig's real node (kubelet + containerd), for this test alone; skips, saying why, where there is none (fails
    under CI, where there must be one, and where one is registered but broken: :func:`real_node_or_skip`)."""
    kubeconfig = os.environ.get("SHAREGPU_TEST_KUBECONFIG", "")
    if not kubeconfig:
        rig_unavailable("no API server: set SHAREGPU_TEST_KUBECONFIG (and start the rig's real node) to run real pods")
    k8s_real = Path(os.environ.get("SHAREGPU_TEST_K8S_REAL") or Path(kubeconfig).parent)
    node = real_node_or_skip(Path(kubeconfig), k8s_real)
    with exclusive():
        yield node


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    """Under CI, a test skipped because the rig is not there (the modules' ``skipif(not KUBECONFIG, ...)``) fails."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if not (report.skipped and rig_expected()) or getattr(report, "wasxfail", None) is not None:
        return
    reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if any(mark in reason for mark in RIG_MISSING_MARKS):
        report.outcome = "failed"
        report.longrepr = f"the rig should be there (CI or SHAREGPU_TEST_K8S_REAL is set) but is not: {reason}"
