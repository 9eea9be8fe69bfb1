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


# ----- wire names and byte units: one home each (issue 27) -----------------------------------------------------------
CONTRACT = SRC / "model" / "contract.py"
# Strings that cross a process boundary and are ours alone: the DRA driver's ResourceSlice attributes, counters and
# capacities, and the fully qualified CDI device ID. Written anywhere but the contract, a writer and its readers can
# drift apart.
WIRE_STRINGS = (
    "placementStart",
    "placementSize",
    "parentUUID",
    "productName",
    "cudaComputeCapability",
    "migCapable",
    "mpsCapable",
    "multiprocessors",
    "memory-slice",
    "compute-slices",
    "-counters",
    "sharegpu.io/gpu=",
)
# Names too plain to forbid everywhere ("index", "memory" are also JSON keys of sharegpu's own outputs, "memory" a
# Node's allocatable): in the DRA modules an attribute may not be read from a device (``.get``), an attribute or
# capacity not written (a key whose value is a typed-value dict), and a capacity not looked up in a claim's
# capacity map (``[…]``, ``in``).
DRA_MODULES = ("node/dra", "k8s/extender/dra_steer.py", "k8s/status/dra.py", "k8s/dra_objects.py")
PLAIN_ATTRIBUTES = {"type", "index", "uuid", "model", "profile"}
CAPACITIES = {"memory", "compute"}


def _strings(tree: ast.AST) -> list[ast.Constant]:
    """The string constants of a module that are not docstrings (f-strings' literal parts included)."""
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
    ]


def _wire_literals(source: str, dra: bool) -> list[str]:
    tree = ast.parse(source)
    found = [f"{n.value!r}" for n in _strings(tree) if any(w in n.value for w in WIRE_STRINGS)]
    if not dra:
        return found

    def plain(n: ast.AST | None, names: set[str]) -> bool:
        return isinstance(n, ast.Constant) and n.value in names

    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" and n.args:
            if plain(n.args[0], PLAIN_ATTRIBUTES):
                found.append(f".get({ast.unparse(n.args[0])})")
        elif isinstance(n, ast.Dict):
            found += [f"{{{ast.unparse(k)}: {{...}}}}" for k, v in zip(n.keys, n.values, strict=True)
                      if plain(k, PLAIN_ATTRIBUTES | CAPACITIES) and isinstance(v, ast.Dict)]  # fmt: skip
        elif isinstance(n, ast.Subscript) and plain(n.slice, CAPACITIES):
            found.append(f"[{ast.unparse(n.slice)}]")
        elif isinstance(n, ast.Compare) and plain(n.left, CAPACITIES) and isinstance(n.ops[0], (ast.In, ast.NotIn)):
            found.append(f"{ast.unparse(n.left)} in …")
    return found


def test_the_wire_check_finds_a_literal_written_again() -> None:
    assert _wire_literals('attrs.get("placementStart")', dra=False) == ["'placementStart'"]
    assert _wire_literals('x = f"sharegpu.io/gpu={name}"', dra=False)
    assert _wire_literals('d = {"memory": {"value": "1Gi"}}', dra=True)
    assert _wire_literals('(attrs.get("index") or {}).get("int")', dra=True)
    assert _wire_literals('m = c["memory"] if "memory" in c else 0', dra=True)
    assert not _wire_literals('"""Docs may name placementStart."""\nrow = {"index": 1}', dra=True)


def test_wire_names_are_written_only_in_the_contract() -> None:
    bad = []
    for f in sorted(SRC.rglob("*.py")):
        rel = f.relative_to(SRC).as_posix()
        if f == CONTRACT or rel.startswith("node/proto/"):
            continue
        dra = any(rel == m or rel.startswith(f"{m}/") for m in DRA_MODULES)
        bad += [f"{rel}: {lit}" for lit in _wire_literals(f.read_text(encoding="utf-8"), dra)]
    assert not bad, "write these through sharegpu.model.contract's names:\n" + "\n".join(bad)


def test_byte_units_are_defined_once() -> None:
    """MIB and its kin live in sharegpu.kube.quantity (with the rounding rules); nothing else spells 1024 * 1024."""
    home = SRC / "kube" / "quantity.py"
    bad = []
    for f in sorted(SRC.rglob("*.py")):
        if f == home:
            continue
        for n in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
            if any(isinstance(t, ast.Name) and t.id in ("KIB", "MIB") for t in targets):
                bad.append(f"{f.relative_to(SRC)}: defines {ast.unparse(targets[0])}")
            if isinstance(n, ast.BinOp) and ast.unparse(n) == "1024 * 1024":
                bad.append(f"{f.relative_to(SRC)}: {ast.unparse(n)}")
    assert not bad, "import the byte units from sharegpu.kube.quantity:\n" + "\n".join(bad)


# ----- one shape per Kubernetes object (issue 27) -------------------------------------------------------------------
NODE_READERS = [SRC / "node" / "kube.py", SRC / "node" / "dra" / "kube.py"]
OBJECT_KEYS = {"metadata", "spec", "status", "items"}


def _model_extra_reads(path: Path) -> list[int]:
    """The lines where ``path`` reads ``model_extra``: a field the schema does not declare, read around it."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Attribute) and node.attr == "model_extra"
    ]


def _raw_object_reads(path: Path) -> list[tuple[int, str]]:
    """Where ``path`` indexes an API object as a dict: ``.get("spec")``, ``["metadata"]``, or any camelCase key
    (``.get("nodeName")``), which only the API's JSON spells; a resource name (``"cpu"``) is a typed map's key."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            key = node.args[0] if node.args else None
        elif isinstance(node, ast.Subscript):
            key = node.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            camel = key.value[:1].islower() and any(c.isupper() for c in key.value)
            if key.value in OBJECT_KEYS or camel:
                out.append((node.lineno, key.value))
    return sorted(out)


def test_no_module_reads_fields_the_schema_does_not_declare() -> None:
    """Every Kubernetes field sharegpu reads is declared in kube/schema.py (typed, with its API name as alias): a
    ``model_extra`` read is a field read around the schema, untyped and undefaulted."""
    bad = [f"{f.relative_to(SRC)}:{line}" for f in sorted(SRC.rglob("*.py")) for line in _model_extra_reads(f)]
    assert not bad, "declare the field in sharegpu.kube.schema and read it typed:\n" + "\n".join(bad)


def test_the_node_reads_the_schemas_objects_not_raw_dicts() -> None:
    bad = [f"{f.relative_to(SRC)}:{line}: {key!r}" for f in NODE_READERS for line, key in _raw_object_reads(f)]
    assert not bad, "parse the object into sharegpu.kube.schema and read its fields:\n" + "\n".join(bad)


def test_the_shape_checks_find_what_they_look_for(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f(pod, d):\n"
        "    a = pod.spec.model_extra\n"
        "    b = d.get('metadata') or {}\n"
        "    c = d['spec']\n"
        "    e = d.get('nodeName')\n"
        "    g = d.get('cpu'), d['memory'], pod.status.conditions\n",
        encoding="utf-8",
    )
    assert _model_extra_reads(probe) == [2]
    assert _raw_object_reads(probe) == [(3, "metadata"), (4, "spec"), (5, "nodeName")]


# ----- issue 27: one cluster cache ---------------------------------------------------------------------------------
def _assigned_names(tree: ast.AST) -> set[str]:
    return {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}


def _calls(tree: ast.AST, name: str) -> int:
    return sum(
        1
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name | ast.Attribute)
        and (n.func.id if isinstance(n.func, ast.Name) else n.func.attr) == name
    )  # fmt: skip


def _modules() -> list[tuple[str, ast.AST, str]]:
    return [(str(p.relative_to(SRC)), ast.parse(p.read_text()), p.read_text()) for p in sorted(SRC.rglob("*.py"))]


def test_one_cache_one_drift_rule_one_cycle_builder() -> None:
    """One home each: the workload drift rule (placement.fragmentation), the cycle state a scheduler scores with
    (Scheduler.cycle), and the ledger name of room kept for a preemptor (the assume cache's KeptRoom); no second
    informer over the cluster outside the cluster view (kube.informer's own module aside)."""
    drift, cycles, kept, informers = [], [], [], []
    for rel, tree, text in _modules():
        if "WORKLOAD_DRIFT" in _assigned_names(tree):
            drift.append(rel)
        if _calls(tree, "CycleState"):
            cycles.append(rel)
        if "kept-for" in text:
            kept.append(rel)
        if _calls(tree, "Informer"):
            informers.append(rel)
    assert drift == ["placement/fragmentation.py"]
    assert cycles == ["placement/framework.py"]
    assert kept == ["k8s/cache/assume.py"]
    # The node agent and the DRA driver follow their own node's objects; the control plane has one informer.
    assert [m for m in informers if m.startswith("k8s/")] == ["k8s/cache/view.py"], informers


def test_the_cache_builds_no_scheduler() -> None:
    for rel, tree, _ in _modules():
        if rel.startswith("k8s/cache/"):
            assert not _calls(tree, "Scheduler") and not _calls(tree, "make_policy"), rel


def test_no_bench_script_shadows_an_installed_package() -> None:
    """A script run from bench/ has bench/ first on its path: bench/priority.py once shadowed the ``priority`` package
    that hypercorn's HTTP/2 imports, and the extender failed to import in the benches."""
    import importlib.util

    bench = Path(__file__).resolve().parents[1] / "bench"
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != bench]
    try:
        shadowing = []
        for script in sorted(bench.glob("*.py")):
            loaded = sys.modules.get(script.stem)
            if loaded is not None:  # imported already: by a bench test (the script itself) or as a package
                if Path(getattr(loaded, "__file__", "") or "").resolve().parent != bench:
                    shadowing.append(script.stem)
            elif importlib.util.find_spec(script.stem) is not None:
                shadowing.append(script.stem)
    finally:
        sys.path[:] = saved
    assert shadowing == [], f"bench/ scripts named as installed packages: {shadowing}"
