"""The extender's filter and prioritize answers, joined from JSON pieces that are encoded once per node.

At thousands of nodes a cycle's cost was per-node Python: a reason looked up, classified, made event-safe and put
in a dict for every rejected node, then the dicts and lists encoded to JSON, on every call, although a rejected
node's reason changes only when that node changes. Here every piece is encoded once — a node's name, its host
entry of a prioritize answer, each distinct reason — and a rejected node's reason is remembered per request shape
at the node's ledger version (as the scheduler's own caches are); an answer is then numpy indexing plus a C-level
join of ready bytes.

The pieces belong to one ledger: a rebuilt ledger (its node versions start again) gets new ones.
"""

from __future__ import annotations

import json
import operator
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sharegpu.kube.schema import MAX_EXTENDER_PRIORITY, ExtenderFilterResult
from sharegpu.ledger import Ledger
from sharegpu.model.request import GpuRequest
from sharegpu.placement.framework import BoolArray, IntArray, Scheduler
from sharegpu.placement.reasons import FilterReason

ObjArray = npt.NDArray[np.object_]

MAX_SHAPES = 256  # request shapes whose reasons are kept (each costs 12 bytes per node)
MAX_REASONS = 1 << 16  # distinct reasons kept before all are forgotten and encoded afresh


def event_safe(reason: str) -> str:
    """The kube-scheduler uses an extender's reasons as a format string (Go's fmt): a bare % would garble them."""
    if "%" not in reason:
        return reason
    return reason.replace("%", " percent").replace("  percent", " percent")


def encode(value: object) -> bytes:
    """Compact JSON, UTF-8 as pydantic writes it."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _objects(items: Iterable[object]) -> ObjArray:
    """A 1-d object array (np.array would make a 2-d one of equal-length sequences, or a str array of strs)."""
    values = list(items)
    out: ObjArray = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _join(*columns: list[bytes]) -> bytes:
    """Comma-joined concatenation of the columns' rows."""
    if len(columns) == 1:
        return b",".join(columns[0])
    return b",".join(map(operator.add, *columns))


_SCORES: ObjArray = _objects(f"{s}}}".encode() for s in range(MAX_EXTENDER_PRIORITY + 1))


@dataclass(frozen=True, slots=True)
class FilterAnswer:
    """A filter answer as sent (``body``), with what the metrics count: nodes passed, and whether the view was out
    of sync."""

    body: bytes
    passed: int
    not_synced: bool = False

    @classmethod
    def of(cls, result: ExtenderFilterResult, not_synced: bool = False) -> FilterAnswer:
        passed = len(result.NodeNames or []) if result.Nodes is None else len(result.Nodes.get("items") or [])
        return cls(result.model_dump_json().encode(), passed, not_synced)

    def result(self) -> ExtenderFilterResult:
        return ExtenderFilterResult.model_validate_json(self.body)


class Fragments:
    """The JSON pieces of one ledger's nodes and of the reasons its nodes were rejected for."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        names = [n.name for n in ledger.nodes]
        self.names = _objects(names)
        self.keys = _objects(encode(n) for n in names)  # b'"name"'
        self.hosts = _objects(b'{"Host":' + k + b',"Score":' for k in self.keys)
        self._reason_ids: dict[FilterReason, int] = {}
        self._texts: list[str] = []  # readable (event-safe)
        self._values: list[bytes] = []  # b':"readable"'
        self._never: list[bool] = []
        self._arrays: tuple[ObjArray, BoolArray] | None = None
        # Per request shape: (node versions the reasons were taken at, reason id per node).
        self._by_shape: OrderedDict[Hashable, tuple[IntArray, npt.NDArray[np.int32]]] = OrderedDict()

    # ----- reasons -----------------------------------------------------------------------------------------------
    def reasons(self, sched: Scheduler, req: GpuRequest, usable: BoolArray, nodes: IntArray) -> npt.NDArray[np.int32]:
        """Reason ids of ``nodes`` (rejected by the filter for ``req``), explained anew only where a node changed
        since its reason was taken."""
        led = self.ledger
        assert sched.ledger is led
        if len(self._texts) > MAX_REASONS:
            self._forget()
        key = req.shape_key()
        entry = self._by_shape.get(key)
        if entry is None:
            entry = (np.full(len(led.nodes), -1, dtype=np.int64), np.zeros(len(led.nodes), dtype=np.int32))
            self._by_shape[key] = entry
            if len(self._by_shape) > MAX_SHAPES:
                self._by_shape.popitem(last=False)
        else:
            self._by_shape.move_to_end(key)
        versions, ids = entry
        stale = nodes[versions[nodes] != led.version[nodes]]
        if len(stale):
            reasons = sched.explain_nodes(req, usable, stale)
            for reason in dict.fromkeys(reasons):  # the distinct ones (few): interned one by one
                self._intern(reason)
            ids[stale] = list(map(self._reason_ids.__getitem__, reasons))
            versions[stale] = led.version[stale]
        out: npt.NDArray[np.int32] = ids[nodes]
        return out

    def _intern(self, reason: FilterReason) -> int:
        rid = self._reason_ids.get(reason)
        if rid is None:
            rid = len(self._texts)
            self._reason_ids[reason] = rid
            readable = event_safe(reason.text)
            self._texts.append(readable)
            self._values.append(b":" + encode(readable))
            self._never.append(reason.unresolvable)
            self._arrays = None
        return rid

    def _forget(self) -> None:
        self._reason_ids.clear()
        self._texts.clear()
        self._values.clear()
        self._never.clear()
        self._by_shape.clear()
        self._arrays = None

    def _reason_arrays(self) -> tuple[ObjArray, BoolArray]:
        if self._arrays is None:
            self._arrays = (_objects(self._values), np.array(self._never, dtype=bool))
        return self._arrays

    def never(self, ids: npt.NDArray[np.int32]) -> BoolArray:
        out: BoolArray = self._reason_arrays()[1][ids]
        return out

    def text(self, rid: int) -> str:
        return self._texts[rid]

    # ----- answers -----------------------------------------------------------------------------------------------
    def filter_body(
        self,
        passed: IntArray,
        failed: IntArray,
        failed_ids: npt.NDArray[np.int32],
        unresolvable: IntArray,
        unresolvable_ids: npt.NDArray[np.int32],
        others: dict[str, str],
    ) -> bytes:
        """The ExtenderFilterResult of node-name mode: ``passed`` node indices in the order given, the rejected
        ones by reason id, and ``others`` (names not in the ledger → readable reason) among the unresolvable."""
        values = self._reason_arrays()[0]
        failed_json = _join(self.keys[failed].tolist(), values[failed_ids].tolist())
        unres_json = _join(self.keys[unresolvable].tolist(), values[unresolvable_ids].tolist())
        if others:
            extra = b",".join(encode(k) + b":" + encode(v) for k, v in others.items())
            unres_json = extra + b"," + unres_json if unres_json else extra
        return b"".join(
            (
                b'{"Nodes":null,"NodeNames":[',
                _join(self.keys[passed].tolist()),
                b'],"FailedNodes":{',
                failed_json,
                b'},"FailedAndUnresolvableNodes":{',
                unres_json,
                b'},"Error":""}',
            )
        )

    def prioritize_body(self, names: list[str], idx: IntArray, scores: IntArray) -> bytes:
        """The HostPriorityList: ``names`` in order (``idx`` their ledger indices, -1 for others) with ``scores``."""
        known = idx >= 0
        hosts = self.hosts[np.where(known, idx, 0)].tolist() if len(self.hosts) else [b""] * len(names)
        if not known.all():
            for i in np.flatnonzero(~known).tolist():
                hosts[i] = b'{"Host":' + encode(names[i]) + b',"Score":'
        return b"[" + _join(hosts, _SCORES[scores].tolist()) + b"]"


def first_each(nodes: IntArray, size: int) -> IntArray:
    """Each node index of ``nodes`` once (in index order): a name given twice is answered once."""
    seen = np.zeros(size, dtype=bool)
    seen[nodes] = True
    return np.flatnonzero(seen)


def fragments_of(current: Fragments | None, ledger: Ledger) -> Fragments:
    """``current`` while it is of ``ledger``, else new pieces for it."""
    if current is not None and current.ledger is ledger:
        return current
    return Fragments(ledger)
