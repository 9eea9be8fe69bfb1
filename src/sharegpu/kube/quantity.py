"""Kubernetes quantities ("2", "500m", "10Gi", "1E3"), parsed one way for the control plane and the node."""

from __future__ import annotations

import functools
import re
from decimal import Decimal, InvalidOperation

from lightkube.utils.quantity import parse_quantity as _lightkube_parse

MIB = 1024 * 1024

_UPPER_EXPONENT = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))E([+-]?\d+)")


def parse_quantity(value: object) -> Decimal | None:
    """The quantity's value, or None when ``value`` is None or not a Kubernetes quantity."""
    return None if value is None else _parsed(str(value))


# Every watch event and every filter call parses its pod's quantities again, and a cluster's pods repeat a few
# dozen of them ("2Gi", "500m"); lightkube's parser is Decimal arithmetic behind regular expressions.
@functools.lru_cache(maxsize=4096)
def _parsed(text: str) -> Decimal | None:
    # Kubernetes writes a decimal exponent as "e" or "E" ("1E3" is 1000; "1E" alone is exa, "1Ei" exbi), and
    # lightkube reads "E" only as exa.
    if m := _UPPER_EXPONENT.fullmatch(text.strip()):
        text = f"{m[1]}e{m[2]}"
    try:
        value = _lightkube_parse(text)
    except (ValueError, InvalidOperation):
        return None
    return None if value is None else Decimal(value)


def quantity_or_zero(value: object) -> Decimal:
    """For fields the API server has validated already: 0 when absent (or, never expected, malformed)."""
    parsed = parse_quantity(value)
    return Decimal(0) if parsed is None else parsed
