"""Cost of the extender's per-call metrics hook (ClusterMetrics.record) for filter, prioritize and bind: best of 5
repeats of 20,000 calls, a filter over 1,213 node names of which 558 pass (the openb bench's median).

    uv run python bench/metrics_hook_cost.py
"""

import argparse
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "k8s"))
from k8s_helpers import pod_obj

from sharegpu.k8s.cache.view import NOT_SYNCED, ClusterView
from sharegpu.k8s.extender.metrics import ClusterMetrics
from sharegpu.kube.schema import ExtenderArgs, ExtenderBindingResult, ExtenderFilterResult


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20000, help="calls per repeat (default 20000)")
    ap.add_argument("--repeats", type=int, default=5, help="repeats; the best is printed (default 5)")
    a = ap.parse_args()
    if a.calls < 1 or a.repeats < 1:
        ap.error("--calls and --repeats must be 1 or more")
    m = ClusterMetrics(ClusterView())
    args = ExtenderArgs.model_validate({"Pod": pod_obj("p", memory="5Gi"), "NodeNames": [f"n{i}" for i in range(1213)]})
    res = ExtenderFilterResult(NodeNames=[f"n{i}" for i in range(558)])
    for label, fn in (
        ("filter record", lambda: m.record("filter", args, res, 0.003, NOT_SYNCED)),
        ("prioritize record", lambda: m.record("prioritize", args, [], 0.003, NOT_SYNCED)),
        ("bind record", lambda: m.record("bind", args, ExtenderBindingResult(Error=""), 0.01, NOT_SYNCED)),
    ):
        best = min(timeit.repeat(fn, number=a.calls, repeat=a.repeats)) / a.calls
        print(f"{label:18s} {best * 1e6:6.1f} us per call")


if __name__ == "__main__":
    main()
