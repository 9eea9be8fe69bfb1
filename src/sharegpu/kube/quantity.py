"""Kubernetes quantities ("2", "500m", "10Gi", "1E3"), parsed one way and rounded one way per direction, for the
control plane and the node alike.

A quantity becomes whole MiB (memory) or milli (CPU) in many places, and the control plane and the node must agree
on a share to the MiB. One rule per direction, named by what the quantity is:

- what a pod or a claim ASKS is rounded UP (:func:`asked_mib`, :func:`asked_milli`, :func:`asked_whole`): the
  workload gets at least what it asked for ("10G" is 9536.74 MiB: 9537 MiB), and a model never fits an ask into
  less room than the node will give it;
- what a device or a node HAS (its capacity, or what a process holds of it, as measured) is rounded DOWN
  (:func:`capacity_mib`, :func:`capacity_milli`): nothing promises room it does not have ("10G" of a device is
  9536 MiB).

The byte units live here, in the Kubernetes client layer, because every layer that turns bytes into MiB (the
control plane, the node, the DRA driver) sits above it; the pure core counts in MiB only and needs none of them.
"""

from __future__ import annotations

import functools
import math
import re
from decimal import Decimal, InvalidOperation

KIB = 1024  # bytes
MIB = 1024 * KIB  # bytes
GIB = 1024 * MIB  # bytes
MILLI = 1000  # milli per unit (CPU)

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
    # Imported here, not with the module: the node code that only counts bytes (the GPU check on a bare GPU machine)
    # imports this module without a Kubernetes client installed; the import is paid once, the results are cached.
    from lightkube.utils.quantity import parse_quantity as lightkube_parse

    if m := _UPPER_EXPONENT.fullmatch(text.strip()):
        text = f"{m[1]}e{m[2]}"
    try:
        value = lightkube_parse(text)
    except (ValueError, InvalidOperation):
        return None
    return None if value is None else Decimal(value)


def quantity_or_zero(value: object) -> Decimal:
    """For fields the API server has validated already: 0 when absent (or, never expected, malformed)."""
    parsed = parse_quantity(value)
    return Decimal(0) if parsed is None else parsed


def _away_from_zero(value: Decimal) -> int:
    # Up in magnitude: an ask that is not positive stays so (-0.5Mi is -1 MiB, never 0), for the request's own
    # checks to refuse it rather than read it as "nothing asked".
    return math.ceil(value) if value > 0 else math.floor(value)


def asked_mib(q: Decimal | int) -> int:
    """Bytes a pod or claim asks for, in whole MiB rounded up ("10G" → 9537)."""
    return _away_from_zero(Decimal(q) / MIB)


def asked_milli(q: Decimal | int) -> int:
    """CPUs a pod asks for, in whole milli-CPU rounded up ("0.0001" → 1)."""
    return _away_from_zero(Decimal(q) * MILLI)


def asked_whole(q: Decimal | int) -> int:
    """A count or percent a pod or claim asks for, in whole units rounded up (a claim's compute "33.4" → 34: the
    driver publishes compute in steps of 1, and the scheduler rounds an ask up to the step)."""
    return _away_from_zero(Decimal(q))


def capacity_mib(q: Decimal | int) -> int:
    """Bytes a device or node has (or a process holds, as measured), in whole MiB rounded down ("10G" → 9536)."""
    return math.floor(Decimal(q) / MIB)


def capacity_milli(q: Decimal | int) -> int:
    """CPUs a node has, in whole milli-CPU rounded down."""
    return math.floor(Decimal(q) * MILLI)
