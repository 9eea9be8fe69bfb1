"""Issue 28: the chart's kube-scheduler is the cluster's own version unless a tag is set (it was v1.31.4 whatever
the cluster ran)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (a dev dependency) renders the chart")
from test_k8s_helm_chart import by_kind, render  # noqa: E402


def _scheduler_image(values: dict[str, Any] | None) -> str:
    pod = by_kind(render(values), "Deployment")["sg-scheduler"]["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "kube-scheduler"]
    return str(container["image"])


def _helm_kube_version(tmp_path: Path) -> str:
    """The version Helm's engine gives .Capabilities.KubeVersion when it renders without a cluster, read by
    rendering a chart of one ConfigMap."""
    chart = tmp_path / "probe"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: probe\nversion: 0.1.0\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: probe}\n"
        'data: {v: "{{ .Capabilities.KubeVersion.Version }}"}\n'
    )
    out = helm.Chart.load(str(chart)).render(None, name="p", namespace="n", is_install=True)
    (doc,) = [yaml.safe_load(text) for path, text in out.items() if path.endswith("cm.yaml")]
    return str(doc["data"]["v"])


def test_the_scheduler_image_defaults_to_the_clusters_version(tmp_path: Path) -> None:
    version = _helm_kube_version(tmp_path)
    tag = re.match(r"v?\d+\.\d+\.\d+", version)
    assert tag is not None, version
    expected = tag.group(0) if tag.group(0).startswith("v") else f"v{tag.group(0)}"
    assert _scheduler_image(None) == f"registry.k8s.io/kube-scheduler:{expected}"


def test_a_set_scheduler_tag_wins() -> None:
    image = _scheduler_image({"scheduler": {"image": {"tag": "v1.33.2", "repository": "my.registry/ks"}}})
    assert image == "my.registry/ks:v1.33.2"
