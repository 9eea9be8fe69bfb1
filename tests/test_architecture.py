"""The pure core imports nothing of HTTP, gRPC, Kubernetes, NVML or the adapters (DESIGN §3)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "sharegpu"
CORE = ["model", "ledger.py", "placement", "partition"]
CORE_PACKAGES = ("sharegpu.model", "sharegpu.ledger", "sharegpu.placement", "sharegpu.partition")
ALLOWED_THIRD_PARTY = {"numpy"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_core_imports_only_stdlib_numpy_and_core() -> None:
    files = [p for c in CORE for p in ((SRC / c).rglob("*.py") if (SRC / c).is_dir() else [SRC / c])]
    assert len(files) >= 10
    bad = []
    for f in files:
        for name in _imports(f):
            top = name.split(".")[0]
            if top == "sharegpu":
                if not name.startswith(CORE_PACKAGES):
                    bad.append(f"{f.relative_to(SRC)} imports {name}")
            elif top not in sys.stdlib_module_names and top not in ALLOWED_THIRD_PARTY:
                bad.append(f"{f.relative_to(SRC)} imports {name}")
    assert not bad, "the core must stay pure:\n" + "\n".join(bad)
