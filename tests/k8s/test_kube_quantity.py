"""One quantity parser for the control plane and the node (kube/quantity.py)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from sharegpu.k8s.dra_view import _mib, _num
from sharegpu.kube.quantity import parse_quantity, quantity_or_zero
from sharegpu.node.dra.claims import quantity_int, quantity_mib
from sharegpu.node.kube import pod_info_from_dict


@pytest.mark.parametrize(
    ("text", "value"),
    [("2", 2), ("500m", Decimal("0.5")), ("10Gi", 10 * 2**30), ("1E3", 1000), ("1e3", 1000), ("1E", 10**18)],
)
def test_quantities_parse_as_kubernetes_writes_them(text: str, value: Decimal) -> None:
    assert parse_quantity(text) == value


def test_what_is_not_a_quantity_is_none_or_zero_or_refused_as_each_caller_needs() -> None:
    for bad in ("ten", "", "1.2.3"):
        assert parse_quantity(bad) is None and quantity_or_zero(bad) == 0
        assert _mib(bad) == 0 and _num(bad) == 0.0
        with pytest.raises(ValueError, match="is not a quantity"):
            quantity_int(bad)
    assert parse_quantity(None) is None
    assert quantity_mib("10Gi") == 10240 and quantity_int("1E3") == 1000 and _mib("1Gi") == 1024


def test_the_node_reads_a_pods_gpu_count_through_the_same_parser() -> None:
    pod = pod_info_from_dict(
        {
            "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "a", "resources": {"limits": {"sharegpu.io/gpu": "2"}}}]},
        }
    )
    assert pod.gpu_demand == 2
