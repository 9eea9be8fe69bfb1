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


REASONS_HOME = SRC / "placement" / "reasons.py"


def _literals(path: Path, names: set[str]) -> list[str]:
    """Where ``path`` writes one of ``names`` as a string literal."""
    return [
        f"{path.relative_to(SRC.parents[1])}:{node.lineno}: {node.value!r}"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Constant) and node.value in names
    ]


def test_reason_names_are_written_only_in_placement_reasons() -> None:
    """One vocabulary of why a request is not placed (issue 27): ``sharegpu status``, its metric and the simulator
    take the names from ``placement.reasons.ReasonKind``; no other module spells one, so none maps names to words.
    "cpu" is also the Kubernetes resource's name and may appear; a mapping of reasons would hold the others."""
    from sharegpu.placement.reasons import ReasonKind

    names = {k.value for k in ReasonKind} - {"cpu"}
    home = {line.rsplit(": ", 1)[1] for line in _literals(REASONS_HOME, names)}
    assert home == {repr(n) for n in names}  # the scan sees the names where they are defined
    files = [*SRC.rglob("*.py"), *(SRC.parents[1] / "bench").rglob("*.py")]
    bad = [hit for f in files if f != REASONS_HOME for hit in _literals(f, names)]
    assert not bad, "reason names belong in placement/reasons.py (use ReasonKind):\n" + "\n".join(bad)
