"""What parsing one Pod into kube.schema's typed model costs (the webhook and the extender parse every Pod they are
sent; the cluster view every one it lists or watches).

    uv run python bench/pod_parse.py [--repeat 20000]

Times ``Pod.model_validate`` on two shapes as the API server writes them: a full pending pod (owner, claims,
ephemeral container, conditions: tests/k8s/test_kube_schema.py's API_POD) and a running pod of five conditions and
one owner. Run it from another checkout's directory (``cd OTHER && uv run python /path/to/bench/pod_parse.py``) to
compare schemas: it reads only the public Pod model. Best of five rounds, microseconds per parse.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "k8s"))
from test_kube_schema import API_POD

from sharegpu.kube.schema import Pod


def running_pod() -> dict[str, Any]:
    pod = copy.deepcopy(API_POD)
    pod["spec"].pop("ephemeralContainers", None)
    pod["spec"].pop("resourceClaims", None)
    pod["spec"]["nodeName"] = "gpu-node-1"
    when = "2026-11-26T09:14:09Z"
    pod["status"] = {
        "phase": "Running",
        "startTime": when,
        "conditions": [
            {"type": t, "status": "True", "lastProbeTime": None, "lastTransitionTime": when}
            for t in ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady", "PodScheduled")
        ],
    }
    return pod


def per_parse_us(obj: dict[str, Any], repeat: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeat):
            Pod.model_validate(obj)
        best = min(best, time.perf_counter() - t0)
    return best / repeat * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20000)
    args = ap.parse_args()
    for name, obj in (("full pending pod", API_POD), ("running pod", running_pod())):
        print(f"{name:18} {per_parse_us(obj, args.repeat):6.1f} µs per Pod.model_validate")


if __name__ == "__main__":
    main()
