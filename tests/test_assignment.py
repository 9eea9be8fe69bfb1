"""Assignment: the ``sharegpu.io/assignment`` annotation round-trips exactly and its parser rejects junk."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from sharegpu.model.assignment import (
    ASSIGNMENT_VERSION,
    Assignment,
    GpuShare,
    InvalidAssignment,
    Mechanism,
    MigSlot,
)

EXCL = GpuShare(0, "GPU-a", Mechanism.EXCLUSIVE, 1000, 80 * 1024)
TS = GpuShare(1, "GPU-b", Mechanism.TIME_SLICING, 250, 0)
MPS = GpuShare(2, "GPU-c", Mechanism.MPS, 300, 10 * 1024)
MIG_EXCL = GpuShare(3, "GPU-d", Mechanism.MIG, 1000, 40 * 1024, MigSlot("3g.40gb", 4), Mechanism.EXCLUSIVE)
MIG_MPS = GpuShare(3, "GPU-d", Mechanism.MIG, 500, 5 * 1024, MigSlot("3g.40gb", 0), Mechanism.MPS)
MIG_TS = GpuShare(4, "GPU-e", Mechanism.MIG, 100, 0, MigSlot("1g.10gb", 6), Mechanism.TIME_SLICING)

SAMPLES = [
    Assignment("ns/cpu-only", "node-1", ()),
    Assignment("ns/whole", "node-1", (EXCL,), cpu_milli=4000, host_memory_mib=16384),
    Assignment("ns/ts", "node-2", (TS,)),
    Assignment("ns/mps", "node-2", (MPS,), cpu_milli=1),
    Assignment("ns/mig", "node-3", (MIG_EXCL, MIG_MPS, MIG_TS)),
    Assignment("ns/multi", "node-3", (EXCL, TS, MPS, MIG_TS), 100, 200),
    Assignment('ns/ünïcödé "quoted"', "node/ä", (TS,)),
]


def valid_dict() -> dict[str, Any]:
    return json.loads(SAMPLES[4].to_json())


# ----- the round trip -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("a", SAMPLES, ids=lambda a: a.pod)
def test_json_round_trip_is_exact(a: Assignment) -> None:
    text = a.to_json()
    back = Assignment.from_json(text)
    assert back == a
    assert back.to_json() == text
    assert Assignment.from_dict(a.to_dict()) == a
    assert Assignment.from_dict(json.loads(text)) == a


def test_json_is_canonical() -> None:
    a = SAMPLES[5]
    text = a.to_json()
    assert " " not in text.replace("ns/", "")  # compact separators
    assert text == json.dumps(json.loads(text), separators=(",", ":"), sort_keys=True)
    # the order of keys in the input does not matter
    d = a.to_dict()
    shuffled = json.dumps(dict(reversed(list(d.items()))))
    assert Assignment.from_json(shuffled).to_json() == text


def test_to_dict_schema() -> None:
    d = SAMPLES[4].to_dict()
    assert d["version"] == ASSIGNMENT_VERSION == 1
    assert d["pod"] == "ns/mig" and d["node"] == "node-3"
    assert d["cpuMilli"] == 0 and d["hostMemoryMiB"] == 0
    g0 = d["gpus"][0]
    assert g0 == {
        "index": 3,
        "uuid": "GPU-d",
        "mechanism": "mig",
        "computeMilli": 1000,
        "memoryMiB": 40 * 1024,
        "memoryEnforced": True,
        "computeEnforced": True,
        "mig": {"profile": "3g.40gb", "start": 4},
        "inner": "exclusive",
    }
    ts = SAMPLES[2].to_dict()["gpus"][0]
    assert "mig" not in ts and "inner" not in ts


@pytest.mark.parametrize(
    ("share", "memory", "compute"),
    [
        (EXCL, True, True),
        (TS, False, False),  # time-slicing enforces nothing, and the assignment says so
        # MPS: memory held per client; compute capped against the daemon's own clients only, daemons take turns.
        (MPS, True, False),
        (MIG_EXCL, True, True),
        (MIG_MPS, True, False),
        (MIG_TS, True, False),  # the instance bounds memory; compute inside it is time-sliced
    ],
)
def test_enforcement_flags(share: GpuShare, memory: bool, compute: bool) -> None:
    assert share.memory_enforced is memory
    assert share.compute_enforced is compute
    d = Assignment("p", "n", (share,)).to_dict()["gpus"][0]
    assert d["memoryEnforced"] is memory and d["computeEnforced"] is compute


def test_sharing_is_the_inner_mechanism_for_mig() -> None:
    assert MIG_MPS.sharing is Mechanism.MPS
    assert MIG_TS.sharing is Mechanism.TIME_SLICING
    assert TS.sharing is Mechanism.TIME_SLICING


def test_optional_fields_default() -> None:
    d = valid_dict()
    del d["cpuMilli"], d["hostMemoryMiB"]
    for g in d["gpus"]:
        del g["memoryMiB"], g["memoryEnforced"], g["computeEnforced"]
    a = Assignment.from_dict(d)
    assert a.cpu_milli == 0 and a.host_memory_mib == 0
    assert all(s.memory_mib == 0 for s in a.shares)


def test_enforcement_flags_in_input_are_ignored_not_trusted() -> None:
    d = json.loads(SAMPLES[2].to_json())
    d["gpus"][0]["memoryEnforced"] = True
    d["gpus"][0]["computeEnforced"] = True
    a = Assignment.from_dict(d)
    assert a.to_dict()["gpus"][0]["memoryEnforced"] is False


# ----- construction checks ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"gpu_index": -1}, "negative"),
        ({"compute_milli": 0}, "compute"),
        ({"compute_milli": 1001}, "compute"),
        ({"memory_mib": -1}, "memory"),
        ({"mechanism": Mechanism.MIG}, "MIG share needs its instance"),
        ({"mig": MigSlot("1g.10gb", 0)}, "only a MIG share"),
        ({"mechanism": Mechanism.MIG, "mig": MigSlot("1g.10gb", 0)}, "exclusive, mps or time-slicing"),
        ({"mechanism": Mechanism.MIG, "mig": MigSlot("1g.10gb", 0), "inner": Mechanism.MIG}, "exclusive, mps"),
        ({"inner": Mechanism.MPS}, "only a MIG share has an inner"),
    ],
)
def test_gpu_share_rejects_inconsistent_shares(kwargs: dict[str, Any], fragment: str) -> None:
    base: dict[str, Any] = {"gpu_index": 0, "gpu_uuid": "u", "mechanism": Mechanism.TIME_SLICING, "compute_milli": 10}
    with pytest.raises(InvalidAssignment, match=fragment):
        GpuShare(**{**base, **kwargs})


def test_assignment_rejects_inconsistent_assignments() -> None:
    with pytest.raises(InvalidAssignment, match="pod and a node"):
        Assignment("", "n", ())
    with pytest.raises(InvalidAssignment, match="pod and a node"):
        Assignment("p", "", ())
    with pytest.raises(InvalidAssignment, match="twice"):
        Assignment("p", "n", (TS, TS))
    with pytest.raises(InvalidAssignment, match="twice"):
        Assignment("p", "n", (MIG_MPS, dataclasses.replace(MIG_MPS, compute_milli=1)))
    with pytest.raises(InvalidAssignment, match="negative"):
        Assignment("p", "n", (), cpu_milli=-1)
    with pytest.raises(InvalidAssignment, match="negative"):
        Assignment("p", "n", (), host_memory_mib=-1)
    # two instances of one GPU are two units
    assert len(Assignment("p", "n", (MIG_EXCL, MIG_MPS)).shares) == 2


def test_values_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SAMPLES[0].pod = "x"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        TS.compute_milli = 1  # type: ignore[misc]


# ----- the parser rejects junk with InvalidAssignment -----------------------------------------------------------
def _mutate(path: list[str | int], value: Any = ..., delete: bool = False) -> str:
    d: Any = valid_dict()
    target = d
    for p in path[:-1]:
        target = target[p]
    if delete:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return json.dumps(d)


BAD_TEXTS = {
    "empty": "",
    "not json": "{not json",
    "truncated": json.dumps(valid_dict())[:-1],
    "json list": "[]",
    "json string": '"assignment"',
    "json null": "null",
    "json number": "1",
    "wrong version": _mutate(["version"], 2),
    "version as string": _mutate(["version"], "1"),
    "no version": _mutate(["version"], delete=True),
    "no pod": _mutate(["pod"], delete=True),
    "empty pod": _mutate(["pod"], ""),
    "no node": _mutate(["node"], delete=True),
    "no gpus": _mutate(["gpus"], delete=True),
    "gpus null": _mutate(["gpus"], None),
    "gpus number": _mutate(["gpus"], 3),
    "cpu as string": _mutate(["cpuMilli"], "100"),
    "cpu as float": _mutate(["cpuMilli"], 1.5),
    "cpu as integral float": _mutate(["cpuMilli"], 100.0),
    "cpu as bool": _mutate(["cpuMilli"], True),
    "cpu negative": _mutate(["cpuMilli"], -1),
    "memory as bool": _mutate(["hostMemoryMiB"], False),
    "memory null": _mutate(["hostMemoryMiB"], None),
    "gpu without index": _mutate(["gpus", 0, "index"], delete=True),
    "gpu without uuid": _mutate(["gpus", 0, "uuid"], delete=True),
    "gpu without mechanism": _mutate(["gpus", 0, "mechanism"], delete=True),
    "gpu without compute": _mutate(["gpus", 0, "computeMilli"], delete=True),
    "index as string": _mutate(["gpus", 0, "index"], "3"),
    "index as bool": _mutate(["gpus", 0, "index"], True),
    "index as float": _mutate(["gpus", 0, "index"], 3.0),
    "index negative": _mutate(["gpus", 0, "index"], -1),
    "compute as bool": _mutate(["gpus", 0, "computeMilli"], True),
    "compute zero": _mutate(["gpus", 0, "computeMilli"], 0),
    "compute above 1000": _mutate(["gpus", 0, "computeMilli"], 1001),
    "compute float": _mutate(["gpus", 0, "computeMilli"], 500.5),
    "gpu memory negative": _mutate(["gpus", 0, "memoryMiB"], -5),
    "gpu memory string": _mutate(["gpus", 0, "memoryMiB"], "10Gi"),
    "unknown mechanism": _mutate(["gpus", 0, "mechanism"], "vgpu"),
    "mechanism wrong case": _mutate(["gpus", 0, "mechanism"], "MIG"),
    "mechanism null": _mutate(["gpus", 0, "mechanism"], None),
    "mechanism list": _mutate(["gpus", 0, "mechanism"], ["mig"]),
    "mig share without slot": _mutate(["gpus", 0, "mig"], delete=True),
    "mig slot null": _mutate(["gpus", 0, "mig"], None),
    "mig slot string": _mutate(["gpus", 0, "mig"], "3g.40gb@4"),
    "mig slot list": _mutate(["gpus", 0, "mig"], ["3g.40gb", 4]),
    "mig slot without profile": _mutate(["gpus", 0, "mig", "profile"], delete=True),
    "mig slot without start": _mutate(["gpus", 0, "mig", "start"], delete=True),
    "mig start as string": _mutate(["gpus", 0, "mig", "start"], "4"),
    "mig start as bool": _mutate(["gpus", 0, "mig", "start"], True),
    "mig share without inner": _mutate(["gpus", 0, "inner"], delete=True),
    "unknown inner": _mutate(["gpus", 0, "inner"], "shared"),
    "inner mig": _mutate(["gpus", 0, "inner"], "mig"),
    "non-mig share with slot": _mutate(["gpus", 0, "mechanism"], "mps"),
    "same unit twice": _mutate(["gpus", 1, "mig", "start"], 4),
}


@pytest.mark.parametrize("text", list(BAD_TEXTS.values()), ids=list(BAD_TEXTS))
def test_from_json_rejects_malformed_input(text: str) -> None:
    with pytest.raises(InvalidAssignment) as e:
        Assignment.from_json(text)
    assert str(e.value)


def test_from_json_messages_say_what_is_wrong() -> None:
    with pytest.raises(InvalidAssignment, match="not valid JSON"):
        Assignment.from_json("{")
    with pytest.raises(InvalidAssignment, match="not a JSON object"):
        Assignment.from_json("[]")
    with pytest.raises(InvalidAssignment, match="version 2 is not 1"):
        Assignment.from_json(BAD_TEXTS["wrong version"])
    with pytest.raises(InvalidAssignment, match="expected an integer, got True"):
        Assignment.from_json(BAD_TEXTS["index as bool"])
    with pytest.raises(InvalidAssignment, match="'pod'"):
        Assignment.from_json(BAD_TEXTS["no pod"])
    with pytest.raises(InvalidAssignment, match="MIG share needs its instance"):
        Assignment.from_json(BAD_TEXTS["mig share without slot"])


def test_from_dict_rejects_non_dicts() -> None:
    for d in (None, [], "x", 1, 1.5, True):
        with pytest.raises(InvalidAssignment, match="not a JSON object"):
            Assignment.from_dict(d)


# ----- strict parsing: wrong types are rejected, never coerced ------------------------------------------------------
@pytest.mark.parametrize("gpus", ["ab", [1], [None], [[]], [valid_dict()["gpus"][0], "x"], {"a": 1}, {}])
def test_non_object_gpu_entries_raise_invalid_assignment(gpus: Any) -> None:
    text = json.dumps({"version": 1, "pod": "p", "node": "n", "gpus": gpus})
    with pytest.raises(InvalidAssignment):
        Assignment.from_json(text)


@pytest.mark.parametrize("version", [True, 1.0, "1", [1], None])
def test_version_must_be_the_integer_1(version: Any) -> None:
    text = json.dumps({"version": version, "pod": "p", "node": "n", "gpus": []})
    with pytest.raises(InvalidAssignment):
        Assignment.from_json(text)


@pytest.mark.parametrize(
    "path",
    [["pod"], ["node"], ["gpus", 0, "uuid"], ["gpus", 0, "mig", "profile"], ["gpus", 0, "inner"]],
    ids=["pod", "node", "uuid", "profile", "inner"],
)
@pytest.mark.parametrize("value", [None, 5, ["x"], {"x": 1}, True], ids=repr)
def test_strings_must_be_strings(path: list[str | int], value: Any) -> None:
    with pytest.raises(InvalidAssignment):
        Assignment.from_json(_mutate(path, value))


@pytest.mark.parametrize("text", ["[" * 100_000, '{"a":' * 100_000])
def test_deeply_nested_json_raises_invalid_assignment(text: str) -> None:
    # a pod can carry any annotation text, so the parser must not crash on it
    with pytest.raises(InvalidAssignment):
        Assignment.from_json(text)


# ----- properties ---------------------------------------------------------------------------------------------
names = st.text(min_size=1, max_size=12)
slots = st.builds(MigSlot, st.sampled_from(["1g.10gb", "3g.40gb", "7g.80gb", "x"]), st.integers(0, 7))


@st.composite
def shares(draw: st.DrawFn, index: int) -> GpuShare:
    mech = draw(st.sampled_from(Mechanism))
    return GpuShare(
        gpu_index=index,
        gpu_uuid=draw(st.text(max_size=12)),
        mechanism=mech,
        compute_milli=draw(st.integers(1, 1000)),
        memory_mib=draw(st.integers(0, 2**40)),
        mig=draw(slots) if mech is Mechanism.MIG else None,
        inner=draw(st.sampled_from([Mechanism.EXCLUSIVE, Mechanism.MPS, Mechanism.TIME_SLICING]))
        if mech is Mechanism.MIG
        else None,
    )


@st.composite
def assignments(draw: st.DrawFn) -> Assignment:
    indices = draw(st.lists(st.integers(0, 16), unique=True, max_size=4))
    return Assignment(
        pod=draw(names),
        node=draw(names),
        shares=tuple(draw(shares(i)) for i in indices),
        cpu_milli=draw(st.integers(0, 2**40)),
        host_memory_mib=draw(st.integers(0, 2**40)),
    )


@given(assignments())
def test_round_trip_property(a: Assignment) -> None:
    text = a.to_json()
    back = Assignment.from_json(text)
    assert back == a
    assert back.to_json() == text
    assert json.loads(text)["version"] == 1


json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
KEYS = ["version", "pod", "node", "gpus", "cpuMilli", "hostMemoryMiB"]
GPU_KEYS = ["index", "uuid", "mechanism", "computeMilli", "memoryMiB", "mig", "inner"]
plausible = {
    "version": st.just(1) | json_values,
    "pod": names | json_values,
    "node": names | json_values,
    "cpuMilli": st.integers(-2, 2000) | json_values,
    "hostMemoryMiB": st.integers(-2, 2000) | json_values,
    "index": st.integers(-1, 8) | json_values,
    "uuid": names | json_values,
    "mechanism": st.sampled_from([*Mechanism, "MPS"]) | json_values,
    "computeMilli": st.integers(-1, 1001) | json_values,
    "memoryMiB": st.integers(-1, 10**6) | json_values,
    "inner": st.sampled_from([*Mechanism]) | json_values,
    "mig": st.fixed_dictionaries(
        {}, optional={"profile": names | json_values, "start": st.integers(-1, 8) | json_values}
    )
    | json_values,
}


def _object(keys: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional={k: plausible[k] for k in keys})


gpu_objects = _object(GPU_KEYS)
top_objects = st.fixed_dictionaries(
    {},
    optional={**{k: plausible[k] for k in KEYS if k != "gpus"}, "gpus": st.lists(gpu_objects, max_size=3)},
)


def _parse_or_invalid(value: Any) -> None:
    text = value if isinstance(value, str) else json.dumps(value)
    try:
        a = Assignment.from_json(text)
    except InvalidAssignment:
        return
    # what parses is a real assignment that round-trips
    assert isinstance(a, Assignment)
    assert Assignment.from_json(a.to_json()) == a


@st.composite
def near_valid(draw: st.DrawFn) -> Any:
    """A valid assignment's JSON with one value replaced or deleted, anywhere in the tree."""
    d: Any = draw(assignments()).to_dict()
    target, path = d, []
    while True:
        keys = list(target) if isinstance(target, dict) else list(range(len(target)))
        if not keys:
            return d
        key = draw(st.sampled_from(keys))
        child = target[key]
        if isinstance(child, dict | list) and child and draw(st.booleans()):
            target, path = child, [*path, key]
            continue
        if isinstance(target, dict) and draw(st.booleans()):
            del target[key]
        elif path == ["gpus"]:
            target[key] = draw(gpu_objects | json_values)
        else:
            target[key] = draw(json_values)
        return d


@given(near_valid() | top_objects | json_values | st.text(max_size=30))
@example({"version": 1, "pod": "p", "node": "n", "gpus": [1]})
@example({"version": 1, "pod": "p", "node": "n", "gpus": "ab"})
def test_from_json_raises_only_invalid_assignment(value: Any) -> None:
    """Arbitrary JSON-ish input parses or raises InvalidAssignment, never another exception."""
    _parse_or_invalid(value)


@given(
    st.fixed_dictionaries(
        {"version": st.just(1), "gpus": st.lists(gpu_objects | json_values, max_size=3)},
        optional={k: plausible[k] for k in KEYS if k not in ("gpus", "version")},
    )
)
def test_from_json_raises_only_invalid_assignment_any_gpus(value: Any) -> None:
    """The same property with any JSON value as a 'gpus' entry."""
    _parse_or_invalid(value)
