"""``sharegpu bench --publish``: the recommendations as an annotation on this node's Node object.

Imported only with ``--publish``: it is the bench's one use of Kubernetes (lightkube and the kubeconfig). Before the
bench measures (minutes on the GPU), :func:`check_publish` sends the same patch as a server-side dry run, so that a
Node that does not exist, credentials that may not patch it or an API server out of reach end the command at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path

from sharegpu.k8s.status.bench_note import BenchNote, BenchPick
from sharegpu.kube.client import KubeClient
from sharegpu.kube.errors import ConfigError, Forbidden, KubeError, NotFound, translate
from sharegpu.kube.names import check_path
from sharegpu.model.contract import BENCH_ANNOTATION
from sharegpu.strategybench.recommend import Recommendation
from sharegpu.strategybench.runner import BenchError, Unit


def note_of(unit: Unit, recs: Sequence[Recommendation], at: float | None = None) -> BenchNote:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at if at is not None else time.time()))
    picks = tuple(BenchPick(r.kind, r.clients, r.strategy, r.margin_pct, r.versus) for r in recs)
    return BenchNote(unit.name, unit.uuid, stamp, picks)


def _body(note: BenchNote) -> dict[str, object]:
    return {"metadata": {"annotations": {BENCH_ANNOTATION: note.to_annotation()}}}


async def _patch(node: str, note: BenchNote, kubeconfig: Path | None) -> None:
    from lightkube.resources.core_v1 import Node

    client = KubeClient(kubeconfig, "sharegpu-bench")
    try:
        await client.merge_patch(Node, node, _body(note), f"annotate node {node}")
    finally:
        await client.close()


async def _dry_run(node: str, kubeconfig: Path | None) -> None:
    from lightkube.resources.core_v1 import Node
    from lightkube.types import PatchType

    what = f"annotate node {node}"
    check_path(what, node)
    client = KubeClient(kubeconfig, "sharegpu-bench")
    try:
        # The patch publish_note sends, of a note without picks, which the API server checks (the Node, the
        # permission, admission) and does not store.
        body = _body(BenchNote("", "", "", ()))
        await client.lightkube.patch(Node, node, body, patch_type=PatchType.MERGE, dry_run=True)
    except Exception as e:
        raise translate(e, what) from None
    finally:
        await client.close()


def check_publish(node: str, kubeconfig: Path | None) -> None:
    """That ``--publish`` can annotate ``node``, checked before anything is measured; raises :class:`BenchError`
    saying what to change."""
    try:
        asyncio.run(_dry_run(node, kubeconfig))
    except NotFound:
        raise BenchError(
            f"--node {node}: the cluster has no Node of that name, so --publish could not annotate it; give this "
            "node's name as kubectl get nodes shows it (the chart's Job sets $NODE_NAME). Nothing was measured"
        ) from None
    except Forbidden as e:
        raise BenchError(
            f"--publish: the credentials may not annotate node {node} ({e}). Nothing was measured"
        ) from None
    except (ConfigError, KubeError) as e:
        raise BenchError(f"--publish: cannot check node {node} before measuring ({e}). Nothing was measured") from None


def publish_note(node: str, note: BenchNote, kubeconfig: Path | None) -> None:
    try:
        asyncio.run(_patch(node, note, kubeconfig))
    except (ConfigError, KubeError) as e:
        raise BenchError(f"cannot publish the result on node {node}: {e}") from None
