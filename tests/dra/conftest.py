"""Fixtures of the DRA driver's tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def root() -> Iterator[Path]:
    """A fresh directory with a short path: the gRPC sockets and MPS pipe paths under it have length limits."""
    d = Path(tempfile.mkdtemp(prefix="drat", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)
