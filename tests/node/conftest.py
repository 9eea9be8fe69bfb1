from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def sock_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory for unix sockets: tmp_path when its paths fit in sun_path (108 bytes), else a short one."""
    if len(str(tmp_path)) <= 70:
        yield tmp_path
        return
    short = Path(tempfile.mkdtemp(prefix="sg-", dir="/tmp"))
    try:
        yield short
    finally:
        shutil.rmtree(short, ignore_errors=True)
