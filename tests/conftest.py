"""Fixtures shared by every folder of tests: the real node of ../shared/k8s-rig, held exclusively."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from realnode import RealNode, exclusive, find_real_node


@pytest.fixture
def real_node() -> Iterator[RealNode]:
    """The rig's real node (kubelet + containerd), for this test alone; skips, saying why, where there is none."""
    kubeconfig = os.environ.get("SHAREGPU_TEST_KUBECONFIG", "")
    if not kubeconfig:
        pytest.skip("no API server: set SHAREGPU_TEST_KUBECONFIG (and start the rig's real node) to run real pods")
    k8s_real = Path(os.environ.get("SHAREGPU_TEST_K8S_REAL") or Path(kubeconfig).parent)
    node, why = find_real_node(Path(kubeconfig), k8s_real)
    if node is None:
        pytest.skip(f"no real node: {why}")
    with exclusive():
        yield node
