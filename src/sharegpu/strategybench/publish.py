"""``sharegpu bench --publish``: the recommendations as an annotation on this node's Node object.

Imported only with ``--publish``: it is the bench's one use of Kubernetes (lightkube and the kubeconfig).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path

from sharegpu.k8s.status.bench_note import BenchNote, BenchPick
from sharegpu.kube.client import KubeClient
from sharegpu.kube.errors import ConfigError, KubeError
from sharegpu.model.contract import BENCH_ANNOTATION
from sharegpu.strategybench.recommend import Recommendation
from sharegpu.strategybench.runner import BenchError, Unit


def note_of(unit: Unit, recs: Sequence[Recommendation], at: float | None = None) -> BenchNote:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at if at is not None else time.time()))
    picks = tuple(BenchPick(r.kind, r.clients, r.strategy, r.margin_pct, r.versus) for r in recs)
    return BenchNote(unit.name, unit.uuid, stamp, picks)


async def _patch(node: str, note: BenchNote, kubeconfig: Path | None) -> None:
    from lightkube.resources.core_v1 import Node

    client = KubeClient(kubeconfig, "sharegpu-bench")
    try:
        body = {"metadata": {"annotations": {BENCH_ANNOTATION: note.to_annotation()}}}
        await client.merge_patch(Node, node, body, f"annotate node {node}")
    finally:
        await client.close()


def publish_note(node: str, note: BenchNote, kubeconfig: Path | None) -> None:
    try:
        asyncio.run(_patch(node, note, kubeconfig))
    except (ConfigError, KubeError) as e:
        raise BenchError(f"cannot publish the result on node {node}: {e}") from None
