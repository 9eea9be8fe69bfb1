"""The FGD paper's baselines give exactly what they gave at commit a518376 (before the scheduler's fast paths).

Every value below was measured on that commit (`sharegpu sim --nodes … --pods … --policy P --seeds S --tune 1.3`):
placed and skipped pods, and allocation % at arrived 50, 90, 100, 110 and 130 %. Speed work must not move any
of them. Needs ../shared/data/openb next to the repository and skips when it is absent.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sharegpu.sim.openb import load_nodes, load_pods
from sharegpu.sim.runner import Experiment, run_one

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "openb"
NODES = DATA / "openb_node_list_gpu_node.csv"

PINNED = [
    ("default", "fgd", 42, 8361, 2464, (50.01, 90.01, 95.36, 95.4, 95.48)),
    ("gpuspec10", "fgd", 47, 8372, 2468, (48.79, 85.69, 94.81, 95.0, 95.08)),
    ("multigpu20", "clustering", 42, 7158, 2284, (50.0, 89.96, 92.77, 92.88, 93.03)),
    ("default", "random", 47, 8192, 2648, (49.99, 85.25, 86.56, 87.02, 87.64)),
    ("gpushare40", "packing", 42, 8709, 3012, (49.99, 89.97, 90.45, 90.53, 90.69)),
    ("cpu050", "bestfit", 47, 7303, 2536, (50.01, 89.99, 93.76, 93.81, 93.95)),
    ("cpu050", "dotprod", 42, 7291, 2631, (50.01, 90.02, 93.1, 93.21, 93.29)),
]


@pytest.mark.trace
@pytest.mark.parametrize(("trace", "policy", "seed", "placed", "failed", "alloc"), PINNED)
def test_baselines_allocate_exactly_as_before(
    trace: str, policy: str, seed: int, placed: int, failed: int, alloc: tuple[float, ...]
) -> None:
    pods = DATA / f"openb_pod_list_{trace}.csv"
    if not (NODES.is_file() and pods.is_file()):
        pytest.skip(f"the openb trace is not at {DATA} (needs {NODES.name} and {pods.name})")
    exp = Experiment(trace, tuple(load_nodes(NODES)), tuple(load_pods(pods)), (policy,), (seed,))
    r = run_one(exp, exp.workload(), policy, seed)
    assert (r.placed, r.failed) == (placed, failed)
    assert tuple(r.alloc_at(x) for x in (50, 90, 100, 110, 130)) == alloc
