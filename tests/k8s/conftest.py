"""The ``rig`` fixture of the tests on the real control plane: a fresh :class:`Rig` per test, whose processes' logs
are printed when the test ends (pytest shows them for a failed test)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from rig import Rig


@pytest.fixture
def rig() -> Iterator[Rig]:
    with Rig.open() as r:
        try:
            yield r
        finally:
            print(r.dump())
