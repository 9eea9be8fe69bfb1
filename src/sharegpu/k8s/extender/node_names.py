"""The kube-scheduler's node list recognised by its bytes (issue 34).

With ``nodeCacheCapable`` the scheduler sends every filter the names of all the nodes it considers, the same list
cycle after cycle: at 10,000 nodes decoding it was 0.53-0.71 ms of a 1.1-1.7 ms warm cycle, and comparing it with
the last list 0.18-0.29 ms more (BENCHMARKS.md, "Where the extender's time goes"). :class:`ArgsDecoder` keeps the
last list's bytes: a body that ends with them is decoded without them and given the very list object decoded
before, which the decisions' name lookup then recognises by identity.

The scheduler encodes ``ExtenderArgs`` in its struct's order (``Pod``, ``Nodes``, ``NodeNames``), so the names are
the body's end. A tail is remembered only once it is checked to be exactly the top-level ``NodeNames`` member;
anything else (another order, a changed list, a malformed body) is decoded whole, as before, with its errors.
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from sharegpu.kube.schema import ExtenderArgs

__all__ = ["ArgsDecoder"]

_KEY = b'"NodeNames":'
_MIN_TAIL = 4096  # below this a list decodes in microseconds: not worth the check


class ArgsDecoder:
    """``ExtenderArgs`` from a request body, for one verb (filter and prioritize send different lists)."""

    def __init__(self) -> None:
        self._tail = b""  # the last node list's bytes, from its key to the body's end
        self._names: list[str] | None = None

    def decode(self, body: bytes) -> ExtenderArgs:
        """Raises what ``ExtenderArgs.model_validate_json`` raises for a body that is not valid."""
        tail = self._tail
        if tail and body.endswith(tail):
            head = body[: len(body) - len(tail)].rstrip()
            if head.endswith(b","):
                try:
                    args = ExtenderArgs.model_validate_json(head[:-1] + b"}")
                except ValidationError:
                    pass  # decoded whole below, for its own error
                else:
                    if args.NodeNames is None:
                        args.NodeNames = self._names
                        return args
        args = ExtenderArgs.model_validate_json(body)
        self._remember(body, args)
        return args

    def _remember(self, body: bytes, args: ExtenderArgs) -> None:
        at = body.rfind(_KEY)
        if args.NodeNames is None or at < 0 or len(body) - at < _MIN_TAIL:
            self._tail, self._names = b"", None
            return
        tail = body[at:]
        try:
            alone = json.loads(b"{" + tail)
        except ValueError:
            alone = None
        if alone == {"NodeNames": args.NodeNames}:
            self._tail, self._names = tail, args.NodeNames
        else:
            self._tail, self._names = b"", None
