"""GpuRequest: validation on construction, with messages that say what to change."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sharegpu.model.catalog import DEFAULT_CATALOG, GIB, Catalog, GpuModel, MigProfile
from sharegpu.model.request import FULL_MILLI, GpuRequest, InvalidRequest, Isolation, Sharing

LARGEST = 141 * GIB  # H200-141GB


# ----- valid requests -----------------------------------------------------------------------------------------
def test_defaults_are_one_whole_gpu() -> None:
    r = GpuRequest("job")
    assert r.gpu_count == 1
    assert r.compute_milli is None  # not said: a whole GPU
    assert r.milli == FULL_MILLI == 1000
    assert r.memory_mib is None
    assert r.isolation is Isolation.NONE
    assert r.sharing is Sharing.AUTO
    assert r.allowed_models == frozenset()
    assert r.is_whole
    assert r.wants_gpu
    assert r.total_milli == 1000


def test_enum_strings_are_parsed() -> None:
    r = GpuRequest("job", isolation="memory", sharing="mps", compute_milli=300)  # type: ignore[arg-type]
    assert r.isolation is Isolation.MEMORY
    assert r.sharing is Sharing.MPS
    r = GpuRequest("job", sharing="time-slicing", compute_milli=300)  # type: ignore[arg-type]
    assert r.sharing is Sharing.TIME_SLICING
    r = GpuRequest("job", isolation="hardware", sharing="mig", mig_profile="3g.40gb")  # type: ignore[arg-type]
    assert r.isolation is Isolation.HARDWARE and r.sharing is Sharing.MIG


def test_allowed_models_are_canonicalised() -> None:
    r = GpuRequest("job", allowed_models=frozenset({"V100M16", "h100", "H100-80GB"}))
    assert r.allowed_models == frozenset({"V100-16GB", "H100-80GB"})
    assert r.allows_model("H100-80GB")
    assert not r.allows_model("A100-80GB")
    assert sorted(m.name for m in r.candidate_models()) == ["H100-80GB", "V100-16GB"]
    assert GpuRequest("any").allows_model("whatever")
    assert len(GpuRequest("any").candidate_models()) == len(DEFAULT_CATALOG.models)


def test_unknown_allowed_model_resolves_to_a_generic_candidate() -> None:
    r = GpuRequest("trace-task", compute_milli=500, allowed_models=frozenset({"G2"}))
    assert r.allowed_models == frozenset({"G2"})
    (m,) = r.candidate_models()
    assert m.generic and m.name == "G2"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"compute_milli": 1},
        {"compute_milli": 1000},
        {"memory_mib": 1},
        {"memory_mib": LARGEST},
        {"memory_mib": 16 * GIB, "allowed_models": frozenset({"T4"})},
        {"gpu_count": 0},
        {"gpu_count": 64},
        {"cpu_milli": 0, "host_memory_mib": 0},
        {"isolation": Isolation.HARDWARE},
        {"isolation": Isolation.HARDWARE, "sharing": Sharing.EXCLUSIVE},
        {"isolation": Isolation.HARDWARE, "sharing": Sharing.MIG},
        {"isolation": Isolation.MEMORY, "sharing": Sharing.MPS, "compute_milli": 200},
        {"isolation": Isolation.MEMORY, "sharing": Sharing.MIG},
        {"isolation": Isolation.NONE, "sharing": Sharing.TIME_SLICING, "compute_milli": 100},
        {"sharing": Sharing.MIG, "mig_profile": "1g.5gb", "allowed_models": frozenset({"A100-40GB"})},
        {"mig_profile": "1g.6gb"},  # exists on A30-24GB
        {"sharing": Sharing.MPS, "mig_profile": "3g.40gb", "compute_milli": 500},  # MPS inside a MIG instance
        {"sharing": Sharing.MIG, "allowed_models": frozenset({"T4", "A30"})},  # one of them has MIG
        {"sharing": Sharing.TIME_SLICING, "allowed_models": frozenset({"P100"}), "compute_milli": 250},
        {"sharing": Sharing.MPS, "allowed_models": frozenset({"P100", "T4"})},  # T4 supports MPS
        {"memory_mib": 10**9, "allowed_models": frozenset({"G2"})},  # generic: memory unknown, cannot be judged
    ],
)
def test_valid_requests_construct(kwargs: dict[str, object]) -> None:
    r = GpuRequest("job", **kwargs)  # type: ignore[arg-type]
    for k, v in kwargs.items():
        if k != "allowed_models":
            assert getattr(r, k) == v


# ----- invalid requests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        ({"cpu_milli": -1}, ["CPU", "-1m", "negative"]),
        ({"host_memory_mib": -5}, ["host memory", "-5Mi", "negative"]),
        ({"compute_milli": 0}, ["compute", "0%", "1–100%"]),
        ({"compute_milli": -100}, ["compute", "-10%"]),
        ({"compute_milli": 1001}, ["compute", "100.1%", "1–100%"]),
        ({"compute_milli": 1500}, ["compute", "150%", "more GPUs"]),
        ({"memory_mib": 0}, ["memory", "0Mi", "positive"]),
        ({"memory_mib": -1}, ["memory", "positive"]),
        ({"memory_mib": LARGEST + 1}, ["memory", f"{LARGEST + 1}Mi", f"largest allowed GPU ({LARGEST}Mi)"]),
        ({"memory_mib": 16 * GIB + 1, "allowed_models": frozenset({"T4"})}, ["memory", f"({16 * GIB}Mi)"]),
        ({"memory_mib": 32 * GIB, "allowed_models": frozenset({"V100M16", "T4"})}, ["largest allowed GPU"]),
        ({"gpu_count": -1}, ["GPU count", "-1", "0 to 64"]),
        ({"gpu_count": 65}, ["GPU count", "65"]),
        ({"gpu_count": 1.5}, ["GPU count", "integer"]),
        ({"gpu_count": 0, "memory_mib": 1024}, ["0 GPUs"]),
        ({"gpu_count": 0, "compute_milli": 500}, ["0 GPUs"]),
        ({"gpu_count": 0, "compute_milli": 1000}, ["0 GPUs"]),
        ({"gpu_count": 0, "mig_profile": "1g.10gb"}, ["0 GPUs"]),
        ({"isolation": "strong"}, ["isolation", "'strong'", "none | memory | fault | hardware"]),
        ({"sharing": "vgpu"}, ["sharing", "'vgpu'", "auto | exclusive | time-slicing | mps | mig"]),
        ({"sharing": "MPS"}, ["sharing", "'MPS'"]),
        ({"sharing": Sharing.MIG, "allowed_models": frozenset({"T4"})}, ["MIG", "T4", "supports MIG"]),
        ({"mig_profile": "1g.10gb", "allowed_models": frozenset({"V100M16"})}, ["MIG", "V100-16GB"]),
        ({"sharing": Sharing.MIG, "allowed_models": frozenset({"G2"})}, ["MIG", "G2"]),
        ({"mig_profile": "5g.50gb"}, ["MIG profile", "'5g.50gb'", "exists on no allowed model"]),
        ({"mig_profile": "1g.5gb", "allowed_models": frozenset({"H100-80GB"})}, ["'1g.5gb'", "1g.10gb"]),
        ({"mig_profile": "4g.24gb", "allowed_models": frozenset({"A100-80GB", "H100"})}, ["'4g.24gb'"]),
        ({"isolation": Isolation.HARDWARE, "sharing": Sharing.MPS}, ["hardware", "mps"]),
        ({"isolation": Isolation.HARDWARE, "sharing": Sharing.TIME_SLICING}, ["hardware", "time-slicing"]),
        ({"isolation": Isolation.MEMORY, "sharing": Sharing.TIME_SLICING}, ["memory", "time-slicing"]),
        ({"sharing": Sharing.MPS, "allowed_models": frozenset({"P100"})}, ["MPS"]),
        ({"sharing": Sharing.MPS, "allowed_models": frozenset({"G2"})}, ["MPS"]),
        ({"isolation": Isolation.FAULT, "sharing": Sharing.MPS}, ["fault", "MPS", "time-slicing"]),
        ({"sharing": Sharing.MPS, "gpu_count": 2, "memory_mib": 1024}, ["MPS share on 2 GPUs", "1 GPU per MPS share"]),
        (
            {"isolation": Isolation.MEMORY, "gpu_count": 2, "compute_milli": 300, "allowed_models": frozenset({"T4"})},
            ["memory", "2 GPUs", "MIG"],
        ),
    ],
)
def test_invalid_requests_name_the_problem(kwargs: dict[str, object], fragments: list[str]) -> None:
    with pytest.raises(InvalidRequest) as e:
        GpuRequest("job-1", **kwargs)  # type: ignore[arg-type]
    msg = str(e.value)
    if not msg.startswith(("isolation ", "sharing ")):  # enum parse errors do not carry the request's name
        assert msg.startswith("request 'job-1': ")
    for f in fragments:
        assert f in msg, (f, msg)


def test_invalid_request_is_a_value_error_and_unnamed_requests_have_no_prefix() -> None:
    assert issubclass(InvalidRequest, ValueError)
    with pytest.raises(InvalidRequest) as e:
        GpuRequest("", cpu_milli=-1)
    assert str(e.value).startswith("CPU -1m")


def test_memory_check_uses_a_custom_catalog() -> None:
    cat = Catalog((GpuModel("Small", 8 * GIB, 10),))
    assert GpuRequest("a", memory_mib=8 * GIB, catalog=cat).memory_mib == 8 * GIB
    with pytest.raises(InvalidRequest, match="largest allowed GPU"):
        GpuRequest("a", memory_mib=8 * GIB + 1, catalog=cat)
    with pytest.raises(InvalidRequest, match="MIG"):
        GpuRequest("a", sharing=Sharing.MIG, catalog=cat)


# ----- is_whole and derived values ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "whole"),
    [
        ({}, True),
        ({"gpu_count": 4}, True),
        ({"sharing": Sharing.EXCLUSIVE}, True),
        ({"isolation": Isolation.HARDWARE}, True),
        ({"compute_milli": 999}, False),
        ({"memory_mib": 10 * GIB}, False),
        ({"mig_profile": "7g.80gb"}, False),
        ({"sharing": Sharing.MIG}, False),
        ({"sharing": Sharing.MPS}, False),
        ({"sharing": Sharing.TIME_SLICING}, False),
        ({"gpu_count": 0}, False),
        ({"sharing": Sharing.EXCLUSIVE, "memory_mib": 10 * GIB}, True),  # exclusive takes the whole GPU anyway
        ({"sharing": Sharing.EXCLUSIVE, "compute_milli": 300}, True),
    ],
)
def test_is_whole(kwargs: dict[str, object], whole: bool) -> None:
    assert GpuRequest("job", **kwargs).is_whole is whole  # type: ignore[arg-type]


def test_total_milli_and_wants_gpu() -> None:
    assert GpuRequest("a", gpu_count=3, compute_milli=250).total_milli == 750
    assert GpuRequest("a", gpu_count=2).total_milli == 2000
    assert GpuRequest("a", gpu_count=0).total_milli == 0
    assert not GpuRequest("a", gpu_count=0).wants_gpu
    assert GpuRequest("a").wants_gpu


def test_milli_and_compute_on() -> None:
    h100 = DEFAULT_CATALOG.strict("H100-80GB")
    t4 = DEFAULT_CATALOG.strict("T4")
    g2 = DEFAULT_CATALOG.get("G2")
    whole = GpuRequest("a")
    assert whole.milli == 1000 and whole.compute_on(h100) == 1000
    asked = GpuRequest("a", compute_milli=300, memory_mib=40 * GIB)
    assert asked.milli == 300 and asked.compute_on(h100) == 300 and asked.compute_on(g2) == 300
    # memory only: compute follows the memory's fraction of the GPU, rounded up
    mem = GpuRequest("a", memory_mib=20 * GIB)
    assert mem.milli == 1
    assert mem.compute_on(h100) == 250
    assert GpuRequest("a", memory_mib=8 * GIB).compute_on(t4) == 500
    assert GpuRequest("a", memory_mib=1).compute_on(h100) == 1  # at least 1 milli
    assert GpuRequest("a", memory_mib=10 * GIB + 1).compute_on(h100) == 126  # 125.0001 -> 126
    assert GpuRequest("a", memory_mib=80 * GIB).compute_on(t4) == 1000  # never above a whole GPU
    assert mem.compute_on(g2) == 1  # a generic model's memory is unknown


def test_shape_key_ignores_the_name_only() -> None:
    a = GpuRequest("a", compute_milli=300, memory_mib=1024, cpu_milli=500)
    b = GpuRequest("b", compute_milli=300, memory_mib=1024, cpu_milli=500)
    c = GpuRequest("c", compute_milli=300, memory_mib=1024, cpu_milli=600)
    assert a.shape_key() == b.shape_key()
    assert a.shape_key() != c.shape_key()
    assert a != b  # the name is part of equality
    assert a == GpuRequest("a", compute_milli=300, memory_mib=1024, cpu_milli=500)


def test_requests_are_frozen() -> None:
    r = GpuRequest("a")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.compute_milli = 5  # type: ignore[misc]


# ----- property: a request either is valid or raises InvalidRequest -------------------------------------------
MODEL_NAMES = [m.name for m in DEFAULT_CATALOG] + ["G2", "V100M16", "h100"]
PROFILES = [*sorted({p.name for m in DEFAULT_CATALOG for p in m.mig_profiles}), "9g.1gb"]


@given(
    gpu_count=st.integers(-2, 70),
    compute=st.none() | st.integers(-10, 1100),
    memory=st.none() | st.integers(-10, 150 * GIB),
    isolation=st.sampled_from([*Isolation, "bogus"]),
    sharing=st.sampled_from([*Sharing, "bogus"]),
    allowed=st.frozensets(st.sampled_from(MODEL_NAMES), max_size=3),
    mig=st.none() | st.sampled_from(PROFILES),
    cpu=st.integers(-5, 10_000),
)
def test_requests_are_valid_or_invalid_request(
    gpu_count: int,
    compute: int | None,
    memory: int | None,
    isolation: str,
    sharing: str,
    allowed: frozenset[str],
    mig: str | None,
    cpu: int,
) -> None:
    try:
        r = GpuRequest(
            "p",
            gpu_count=gpu_count,
            compute_milli=compute,
            memory_mib=memory,
            isolation=isolation,  # type: ignore[arg-type]
            sharing=sharing,  # type: ignore[arg-type]
            allowed_models=allowed,
            mig_profile=mig,
            cpu_milli=cpu,
        )
    except InvalidRequest as e:
        msg = str(e)
        assert msg.startswith(("request 'p': ", "isolation 'bogus'", "sharing 'bogus'")), msg
        return
    # whatever constructed satisfies every documented rule
    assert 0 <= r.gpu_count <= 64
    assert r.compute_milli is None or 1 <= r.compute_milli <= 1000
    assert 1 <= r.milli <= 1000
    assert r.cpu_milli >= 0
    assert isinstance(r.isolation, Isolation) and isinstance(r.sharing, Sharing)
    candidates = r.candidate_models()
    if r.gpu_count == 0:
        assert r.memory_mib is None and r.compute_milli is None and r.mig_profile is None
        assert r.total_milli == 0
        return
    if r.memory_mib is not None:
        assert r.memory_mib > 0
        sized = [m.memory_mib for m in candidates if not m.generic]
        assert not sized or r.memory_mib <= max(sized)
    if r.isolation is Isolation.HARDWARE:
        assert r.sharing not in (Sharing.MPS, Sharing.TIME_SLICING)
    if r.isolation is Isolation.MEMORY:
        assert r.sharing is not Sharing.TIME_SLICING
    if r.sharing is Sharing.MIG or r.mig_profile:
        assert any(m.mig_capable for m in candidates)
    if r.mig_profile:
        assert any(r.mig_profile in {p.name for p in m.mig_profiles} for m in candidates)
        if r.memory_mib is not None:  # the instance is all the memory the share gets
            assert any(
                p.name == r.mig_profile and r.memory_mib <= p.memory_mib for m in candidates for p in m.mig_profiles
            )
    if r.sharing is Sharing.MPS:
        assert any(m.mps_capable for m in candidates)


# ----- issue 33: memory above the named MIG profile's instance is refused, not bound short ---------------------
PROFILED = [(m, p) for m in DEFAULT_CATALOG for p in m.mig_profiles]


@pytest.mark.parametrize(("model", "profile"), PROFILED, ids=[f"{m.name}-{p.name}" for m, p in PROFILED])
def test_memory_above_the_named_mig_profile_is_refused_on_every_model(model: GpuModel, profile: MigProfile) -> None:
    only = frozenset({model.name})
    fits = GpuRequest("job", memory_mib=profile.memory_mib, mig_profile=profile.name, allowed_models=only)
    assert fits.memory_mib == profile.memory_mib
    with pytest.raises(InvalidRequest) as e:
        GpuRequest("job", memory_mib=profile.memory_mib + 1, mig_profile=profile.name, allowed_models=only)
    msg = str(e.value)
    if profile.memory_mib >= model.memory_mib:  # the whole GPU's profile: the GPU's own memory check says it first
        assert "above the largest allowed GPU" in msg, msg
        return
    assert f"MIG profile {profile.name!r} holds ({profile.memory_mib}Mi on {model.name})" in msg, msg
    assert f"at most {profile.memory_mib}Mi" in msg, msg
    larger = [p for p in model.mig_profiles if p.memory_mib > profile.memory_mib]
    if larger:  # names a profile that holds it, the smallest one
        smallest = min(larger, key=lambda p: (p.compute_slices, p.memory_mib))
        assert f"e.g. {smallest.name}" in msg, msg


def test_issue33_thirty_gib_on_a_1g_10gb_instance_is_refused_with_what_to_change() -> None:
    with pytest.raises(InvalidRequest) as e:
        GpuRequest("default/p", memory_mib=30 * GIB, mig_profile="1g.10gb")
    msg = str(e.value)
    assert "GPU memory 30720Mi is more than MIG profile '1g.10gb' holds (10240Mi" in msg, msg
    assert "e.g. 3g.40gb" in msg and "at most 10240Mi" in msg, msg
    # through MPS inside the instance too (isolation memory, sharing mig): the instance is all there is
    with pytest.raises(InvalidRequest, match="more than MIG profile"):
        GpuRequest("p", memory_mib=11 * GIB, mig_profile="1g.10gb", sharing=Sharing.MIG, isolation=Isolation.MEMORY)
    # no profile large enough on the allowed model: says to ask for less
    with pytest.raises(InvalidRequest, match=r"no MIG profile of A100-40GB holds that much; ask for at most 5120Mi"):
        GpuRequest("p", memory_mib=40 * GIB + 1, mig_profile="1g.5gb", allowed_models=frozenset({"A100-40GB", "H200"}))
    # one allowed model's profile of that name holds it: valid
    GpuRequest("p", memory_mib=10 * GIB, mig_profile="1g.10gb")


def test_issue33_pod_asking_more_memory_than_its_mig_profile_is_refused_at_creation() -> None:
    from sharegpu.k8s.pod_request import pod_request
    from sharegpu.kube.schema import Pod

    def pod(memory: str) -> Pod:
        limits = {"sharegpu.io/gpu": "1", "sharegpu.io/gpu-memory": memory}
        return Pod.model_validate(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": "p",
                    "namespace": "default",
                    "annotations": {"sharegpu.io/mig-profile": "1g.10gb"},
                },
                "spec": {"containers": [{"name": "main", "image": "x", "resources": {"limits": limits}}]},
            }
        )

    with pytest.raises(InvalidRequest) as e:
        pod_request(pod("30Gi"))
    assert str(e.value).startswith("request 'default/p': GPU memory 30720Mi is more than MIG profile '1g.10gb'")
    req = pod_request(pod("10Gi"))
    assert req is not None and req.mig_profile == "1g.10gb" and req.memory_mib == 10 * GIB
