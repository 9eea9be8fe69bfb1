"""Cost of the extender's per-call metrics hook (ClusterMetrics.record) for filter, prioritize and bind: best of 5
repeats of 20,000 calls, a filter over 1,213 node names of which 558 pass (the openb bench's median).

    uv run python bench/metrics_hook_cost.py
"""

import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "k8s"))
from k8s_helpers import pod_obj

from sharegpu.k8s.cluster_metrics import ClusterMetrics
from sharegpu.k8s.view import NOT_SYNCED, ClusterView
from sharegpu.kube.schema import ExtenderArgs, ExtenderBindingResult, ExtenderFilterResult

m = ClusterMetrics(ClusterView(policy="bestfit"))
args = ExtenderArgs.model_validate({"Pod": pod_obj("p", memory="5Gi"), "NodeNames": [f"n{i}" for i in range(1213)]})
res = ExtenderFilterResult(NodeNames=[f"n{i}" for i in range(558)])
n = 20000
for label, fn in (
    ("filter record", lambda: m.record("filter", args, res, 0.003, NOT_SYNCED)),
    ("prioritize record", lambda: m.record("prioritize", args, [], 0.003, NOT_SYNCED)),
    ("bind record", lambda: m.record("bind", args, ExtenderBindingResult(Error=""), 0.01, NOT_SYNCED)),
):
    best = min(timeit.repeat(fn, number=n, repeat=5)) / n
    print(f"{label:18s} {best * 1e6:6.1f} us per call")
