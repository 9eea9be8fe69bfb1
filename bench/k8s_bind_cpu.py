"""CPU per Binding: the extender's own client (lightkube over aiohttp, :mod:`sharegpu.kube.transport`) against lightkube
on httpx's default transport, side by side against the rig's real API server.

Needs a running ../shared/k8s-rig and SHAREGPU_TEST_KUBECONFIG set to its kubeconfig.

    uv run python bench/k8s_bind_cpu.py --pods 200 --rounds 3

Each round creates ``--pods`` pending pods (no scheduler picks them) in a fresh namespace, then binds them all with
``LightkubeClusterApi.bind_pod`` (8 in flight, each Binding carrying an assignment annotation, as the extender sends
them) and reads this process's CPU time over the binds; the two clients alternate, medians are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "k8s"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from rig import KUBECONFIG, Rig

from sharegpu.kube.api import LightkubeClusterApi

ASSIGNMENT = json.dumps({"gpus": [{"index": 0, "memory_mib": 2048, "compute_milli": 50}], "mechanism": "mps"})


def pending_pod(i: int) -> dict[str, Any]:
    spec = {"schedulerName": "nobody", "containers": [{"name": "main", "image": "x"}]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"p-{i:04d}"}, "spec": spec}


def httpx_default(kubeconfig: Path) -> LightkubeClusterApi:
    """The same API object, its lightkube client rebuilt on httpx's own transport (what lightkube does unasked)."""
    from lightkube import AsyncClient

    api = LightkubeClusterApi(kubeconfig)
    config = api.client.lightkube._client.config
    api.client.lightkube = AsyncClient(config=config, field_manager="sharegpu-scheduler-extender")
    return api


async def bind_all(api: LightkubeClusterApi, ns: str, n: int, node: str) -> float:
    """CPU milliseconds of this process per Binding."""
    c0 = time.process_time()
    await asyncio.gather(
        *(api.bind_pod(ns, f"p-{i:04d}", "", node, {"sharegpu.io/assignment": ASSIGNMENT}) for i in range(n))
    )
    return 1000 * (time.process_time() - c0) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not KUBECONFIG:
        print("set SHAREGPU_TEST_KUBECONFIG to a running k8s-rig's kubeconfig (see ../shared/k8s-rig/README.md)")
        return 2
    import uvloop

    clients = {
        "aiohttp (sharegpu)": lambda: LightkubeClusterApi(Path(KUBECONFIG)),
        "httpx default": lambda: httpx_default(Path(KUBECONFIG)),
    }
    cpu: dict[str, list[float]] = {k: [] for k in clients}
    with Rig.open() as rig:
        rig.add_node("bind", [], agent=False)
        node = f"{rig.prefix}-bind"

        async def run() -> None:
            apis = {k: make() for k, make in clients.items()}
            try:
                for r in range(args.rounds):
                    for kind in list(apis) if r % 2 == 0 else list(reversed(apis)):
                        ns = rig.namespace()
                        await asyncio.to_thread(rig.create_pods, ns, [pending_pod(i) for i in range(args.pods)])
                        cpu[kind].append(await bind_all(apis[kind], ns, args.pods, node))
                        print(json.dumps({"client": kind, "round": r, "cpu_ms_per_binding": round(cpu[kind][-1], 3)}))
            finally:
                for api in apis.values():
                    await api.close()

        uvloop.run(run())
    med = {k: round(statistics.median(v), 3) for k, v in cpu.items()}
    print(json.dumps({"pods": args.pods, "rounds": args.rounds, "cpu_ms_per_binding_median": med}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
