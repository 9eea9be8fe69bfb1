"""The GPU catalog: models, aliases, generic entries and MIG geometry (DESIGN §4)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sharegpu.model.catalog import (
    DEFAULT_CATALOG,
    GIB,
    Catalog,
    CatalogError,
    GpuModel,
    MigProfile,
    UnknownGpuModel,
    UnknownMigProfile,
)

# The MIG tables of DESIGN §4, written out by hand: profile -> (compute slices, memory slots, memory GiB, starts).
EIGHT_SLOT_STARTS = {
    "1g_small": (1, 1, (0, 1, 2, 3, 4, 5, 6)),
    "1g_large": (1, 2, (0, 2, 4, 6)),
    "2g": (2, 2, (0, 2, 4)),
    "3g": (3, 4, (0, 4)),
    "4g": (4, 4, (0,)),
    "7g": (7, 8, (0,)),
}
EIGHT_SLOT_NAMES = {
    "A100-40GB": ("1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
    "A100-80GB": ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "H100-80GB": ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "H200-141GB": ("1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
}
EIGHT_SLOT_MEMORY_GIB = {
    "A100-40GB": (5, 10, 10, 20, 20, 40),
    "A100-80GB": (10, 20, 20, 40, 40, 80),
    "H100-80GB": (10, 20, 20, 40, 40, 80),
    "H200-141GB": (18, 35, 35, 71, 71, 141),
}


def _expected_geometry() -> dict[str, dict[str, tuple[int, int, int, tuple[int, ...]]]]:
    out: dict[str, dict[str, tuple[int, int, int, tuple[int, ...]]]] = {}
    for model, names in EIGHT_SLOT_NAMES.items():
        out[model] = {
            name: (slices, slots, gib, starts)
            for name, gib, (slices, slots, starts) in zip(
                names, EIGHT_SLOT_MEMORY_GIB[model], EIGHT_SLOT_STARTS.values(), strict=True
            )
        }
    out["A30-24GB"] = {
        "1g.6gb": (1, 1, 6, (0, 1, 2, 3)),
        "2g.12gb": (2, 2, 12, (0, 2)),
        "4g.24gb": (4, 4, 24, (0,)),
    }
    return out


EXPECTED_MIG = _expected_geometry()

# model -> (memory GiB, SMs, memory slots, compute slices, SMs per slice)
EXPECTED_MIG_MODELS = {
    "A100-40GB": (40, 108, 8, 7, 14),
    "A100-80GB": (80, 108, 8, 7, 14),
    "H100-80GB": (80, 132, 8, 7, 16),
    "H200-141GB": (141, 132, 8, 7, 16),
    "A30-24GB": (24, 56, 4, 4, 14),
}
NON_MIG_MODELS = ["T4", "V100-16GB", "V100-32GB", "A10", "L4", "L40S", "RTX-4090", "P100"]


@pytest.mark.parametrize("name", sorted(EXPECTED_MIG))
def test_mig_profiles_match_design_table(name: str) -> None:
    model = DEFAULT_CATALOG.strict(name)
    got = {p.name: (p.compute_slices, p.memory_slots, p.memory_mib, p.starts) for p in model.mig_profiles}
    want = {n: (slices, slots, gib * GIB, starts) for n, (slices, slots, gib, starts) in EXPECTED_MIG[name].items()}
    assert got == want
    # profile order: smallest first, as in the table
    assert [p.name for p in model.mig_profiles] == list(EXPECTED_MIG[name])


@pytest.mark.parametrize("name", sorted(EXPECTED_MIG_MODELS))
def test_mig_model_facts(name: str) -> None:
    gib, sms, slots, slices, per_slice = EXPECTED_MIG_MODELS[name]
    model = DEFAULT_CATALOG.strict(name)
    assert model.name == name
    assert model.memory_mib == gib * GIB
    assert model.sms == sms
    assert model.memory_slots == slots
    assert model.compute_slices == slices
    assert model.sms_per_slice == per_slice
    assert model.mig_capable
    assert model.mps_capable
    assert not model.generic


@pytest.mark.parametrize("name", sorted(EXPECTED_MIG))
def test_every_placement_fits_the_memory_axis_and_is_aligned(name: str) -> None:
    model = DEFAULT_CATALOG.strict(name)
    for p in model.mig_profiles:
        placements = list(p.placements())
        assert placements == [(s, p.memory_slots) for s in p.starts]
        assert p.max_instances == len(p.starts)
        for start, size in placements:
            assert start >= 0
            assert start + size <= model.memory_slots
        # the name says the compute slices: "3g.40gb" takes 3 of the GPU's compute slices
        assert p.name.startswith(f"{p.compute_slices}g.")
        assert p.name.endswith(f".{p.memory_mib // GIB}gb")
        assert p.compute_slices <= model.compute_slices
        # all instances of one profile side by side never need more slices or slots than the GPU has
        assert p.max_instances * p.compute_slices <= model.compute_slices
        assert p.max_instances * p.memory_slots <= model.memory_slots


def test_max_instances_per_profile() -> None:
    h100 = DEFAULT_CATALOG.strict("H100-80GB")
    assert [p.max_instances for p in h100.mig_profiles] == [7, 4, 3, 2, 1, 1]
    a30 = DEFAULT_CATALOG.strict("A30-24GB")
    assert [p.max_instances for p in a30.mig_profiles] == [4, 2, 1]


def test_profile_sms() -> None:
    a100 = DEFAULT_CATALOG.strict("A100-40GB")
    h100 = DEFAULT_CATALOG.strict("H100-80GB")
    assert a100.profile_sms(a100.profile("7g.40gb")) == 98
    assert a100.profile_sms(a100.profile("1g.5gb")) == 14
    assert h100.profile_sms(h100.profile("1g.10gb")) == 16
    # Hopper's table is not slices × 16: 3g has 60 SMs, 4g 64 and 7g the whole 132
    assert h100.profile_sms(h100.profile("2g.20gb")) == 32
    assert h100.profile_sms(h100.profile("3g.40gb")) == 60
    assert h100.profile_sms(h100.profile("4g.40gb")) == 64
    assert h100.profile_sms(h100.profile("7g.80gb")) == 132


def test_profile_lookup_and_unknown_profile_message() -> None:
    h100 = DEFAULT_CATALOG.strict("H100-80GB")
    assert h100.profile("3g.40gb").compute_slices == 3
    with pytest.raises(UnknownMigProfile) as e:
        h100.profile("1g.5gb")
    msg = str(e.value)
    assert "'1g.5gb'" in msg and "H100-80GB" in msg and "1g.10gb" in msg and "7g.80gb" in msg
    with pytest.raises(UnknownMigProfile, match="no MIG"):
        DEFAULT_CATALOG.strict("T4").profile("1g.5gb")
    assert issubclass(UnknownMigProfile, CatalogError)
    assert issubclass(CatalogError, ValueError)


@pytest.mark.parametrize("name", NON_MIG_MODELS)
def test_non_mig_models(name: str) -> None:
    model = DEFAULT_CATALOG.strict(name)
    assert not model.mig_capable
    assert model.mig_profiles == ()
    assert model.memory_slots == 0 and model.compute_slices == 0
    assert model.memory_mib > 0 and model.sms > 0
    assert not model.generic


def test_p100_has_no_mps_everything_else_known_does() -> None:
    assert not DEFAULT_CATALOG.strict("P100").mps_capable
    for m in DEFAULT_CATALOG:
        if m.name != "P100":
            assert m.mps_capable, m.name


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("V100M16", "V100-16GB"),
        ("V100M32", "V100-32GB"),
        ("v100m16", "V100-16GB"),
        ("V100-SXM2-16GB", "V100-16GB"),
        ("A100-SXM4-40GB", "A100-40GB"),
        ("a100-pcie-80gb", "A100-80GB"),
        ("H100", "H100-80GB"),
        ("H100-80GB-HBM3", "H100-80GB"),
        ("h100_sxm5_80gb", "H100-80GB"),
        ("  H200 ", "H200-141GB"),
        ("A30", "A30-24GB"),
        ("Tesla T4", "T4"),
        ("tesla_t4", "T4"),
        ("P100-16GB", "P100"),
        ("GeForce RTX 4090", "RTX-4090"),
    ],
)
def test_alias_resolution(alias: str, canonical: str) -> None:
    assert DEFAULT_CATALOG.known(alias)
    assert DEFAULT_CATALOG.get(alias).name == canonical
    assert DEFAULT_CATALOG.strict(alias) is DEFAULT_CATALOG.strict(canonical)


def test_every_name_and_alias_resolves_to_its_model() -> None:
    for m in DEFAULT_CATALOG:
        for n in (m.name, *m.aliases):
            assert DEFAULT_CATALOG.get(n) is m
            assert DEFAULT_CATALOG.get(n.lower()) is m
            assert DEFAULT_CATALOG.strict(f" {n} ") is m


def test_unknown_name_gets_a_generic_non_mig_entry() -> None:
    g2 = DEFAULT_CATALOG.get("G2")
    assert g2.name == "G2"
    assert g2.generic
    assert not g2.mig_capable
    assert g2.mig_profiles == ()
    assert not g2.mps_capable
    assert g2.memory_mib == 0
    assert not DEFAULT_CATALOG.known("G2")
    assert DEFAULT_CATALOG.get("  G2 ").name == "G2"
    with pytest.raises(UnknownMigProfile):
        g2.profile("1g.10gb")


@pytest.mark.parametrize("name", ["", "   ", "\t"])
def test_get_rejects_an_empty_name(name: str) -> None:
    with pytest.raises(UnknownGpuModel, match="empty"):
        DEFAULT_CATALOG.get(name)


def test_strict_rejects_unknown_names_helpfully() -> None:
    with pytest.raises(UnknownGpuModel) as e:
        DEFAULT_CATALOG.strict("G2")
    msg = str(e.value)
    assert "'G2'" in msg
    assert "unknown GPU model" in msg
    for known in ("H100-80GB", "A100-40GB", "A30-24GB", "T4", "P100"):
        assert known in msg
    with pytest.raises(UnknownGpuModel):
        DEFAULT_CATALOG.strict("")
    assert issubclass(UnknownGpuModel, CatalogError)


def test_canonical() -> None:
    assert DEFAULT_CATALOG.canonical(["V100M16", "V100-16GB", "h100"]) == frozenset({"V100-16GB", "H100-80GB"})
    assert DEFAULT_CATALOG.canonical(["G2", "g3"]) == frozenset({"G2", "g3"})
    assert DEFAULT_CATALOG.canonical([]) == frozenset()


def test_largest_memory() -> None:
    assert DEFAULT_CATALOG.largest_memory_mib == 141 * GIB
    small = Catalog((GpuModel("X", 10, 1), GpuModel("Y", 30, 1)))
    assert small.largest_memory_mib == 30


def test_custom_catalog_and_duplicate_names() -> None:
    x = GpuModel("X-1", 10, 1, aliases=("x_1",))  # an alias equal to the name, after normalisation, is fine
    cat = Catalog((x,))
    assert cat.strict("X 1") is x
    assert [m.name for m in cat] == ["X-1"]
    assert not cat.known("H100-80GB")
    with pytest.raises(CatalogError, match="defined twice"):
        Catalog((GpuModel("X", 10, 1), GpuModel("x", 20, 1)))
    with pytest.raises(CatalogError, match="defined twice"):
        Catalog((GpuModel("A", 10, 1, aliases=("Z",)), GpuModel("B", 20, 1, aliases=("z",))))


def test_catalog_values_are_frozen() -> None:
    m = DEFAULT_CATALOG.strict("H100-80GB")
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.memory_mib = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.mig_profiles[0].starts = ()  # type: ignore[misc]
    assert isinstance(m.mig_profiles, tuple)
    assert isinstance(m.mig_profiles[0], MigProfile)


def test_default_catalog_names_are_unique() -> None:
    names = [m.name for m in DEFAULT_CATALOG]
    assert len(names) == len(set(names))
    for name in ("A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB", "A30-24GB", *NON_MIG_MODELS):
        assert name in names


@given(st.text(min_size=1, max_size=20))
def test_get_and_strict_agree_on_any_name(name: str) -> None:
    if not name.strip():
        with pytest.raises(UnknownGpuModel):
            DEFAULT_CATALOG.get(name)
        return
    model = DEFAULT_CATALOG.get(name)
    if DEFAULT_CATALOG.known(name):
        assert DEFAULT_CATALOG.strict(name) is model
        assert not model.generic
    else:
        with pytest.raises(UnknownGpuModel):
            DEFAULT_CATALOG.strict(name)
        assert model.generic
        assert model.name == name.strip()
        assert not model.mig_capable
        assert not model.mps_capable


@given(st.sampled_from([n for m in DEFAULT_CATALOG for n in (m.name, *m.aliases)]), st.data())
def test_names_resolve_whatever_the_case_or_separator(name: str, data: st.DataObject) -> None:
    variant = "".join(
        data.draw(st.sampled_from([c, c.lower(), c.upper()] + (["_", " "] if c == "-" else []))) for c in name
    )
    assert DEFAULT_CATALOG.get(variant) is DEFAULT_CATALOG.get(name)
