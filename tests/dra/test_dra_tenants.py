"""MPS tenancy on the DRA path (issue 32): each claim is prepared into its tenant's daemon, a shared claim of several
tenants is refused with what to change, the containers that use a claim decide its tenant, multi-user mode, and the
checkpoint that keeps the tenant (an older one, with users, still loads)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from dra_fakes import Api, backend, driver

from sharegpu.kube.schema import ResourceClaim
from sharegpu.model.assignment import Mechanism
from sharegpu.model.contract import MPS_PIPE_DIRECTORY_ENV, MPS_THREAD_PERCENTAGE_ENV
from sharegpu.model.tenant import MULTI_USER_TENANT, own_tenant, user_tenant
from sharegpu.node.backends.base import DeviceInfo
from sharegpu.node.dra.checkpoint import KIND, Checkpoint, CheckpointError
from sharegpu.node.dra.claims import ClaimError, plan_claim
from sharegpu.node.dra.driver import DraDriver, DriverSetupError
from sharegpu.node.durable import save_record
from sharegpu.node.mps import DaemonKey, MpsLimits

A100 = DeviceInfo(0, "GPU-a100", "NVIDIA A100-SXM4-80GB", "A100-80GB", 81920, 108, False)


def cdi_edits(root: Path, claim_uid: str) -> dict[str, Any]:
    spec = json.loads((root / "cdi" / f"sharegpu.io-gpu_{claim_uid}.json").read_text())
    edits: dict[str, Any] = spec["devices"][0]["containerEdits"]
    return edits


def pipe_mount(root: Path, claim_uid: str) -> str:
    """The host path the claim's containers get as their MPS pipe directory."""
    edits = cdi_edits(root, claim_uid)
    env = dict(e.split("=", 1) for e in edits["env"])
    (mount,) = [m for m in edits["mounts"] if m["containerPath"] == env[MPS_PIPE_DIRECTORY_ENV]]
    return str(mount["hostPath"])


def env_of(root: Path, claim_uid: str) -> dict[str, str]:
    return dict(e.split("=", 1) for e in cdi_edits(root, claim_uid)["env"])


def test_claims_of_four_tenants_share_one_gpu_each_through_its_own_daemon(root: Path) -> None:
    sim = backend()
    gpu = sim.devices()[0].uuid
    api = Api()
    api.pod("p-a", "a", ("app", 1000, True))
    api.pod("p-b", "b", ("app", None, True), pod_user=1000)  # the pod's user: the same tenant as p-a
    api.pod("p-root", "root", ("app", 0, True))
    api.pod("p-anon", "anon", ("app", None, True))  # the image's user: a tenant of its own
    refs = [api.claim(n, [f"p-{n}"]) for n in ("a", "b", "root", "anon")]
    uid1000, uid0, anon = user_tenant("ns", 1000), user_tenant("ns", 0), own_tenant("uid-p-anon")

    async def main() -> None:
        d = driver(root, api, sim)
        got = await d.prepare(refs)
        assert {u: r.error for u, r in got.items()} == {r.uid: "" for r in refs}  # nobody waits for a unit
        assert {u: p.tenant for u, p in d.checkpoint.claims.items()} == {
            "c-a": uid1000,
            "c-b": uid1000,
            "c-root": uid0,
            "c-anon": anon,
        }
        mps = d._mps
        assert mps.running() == {DaemonKey(gpu, t) for t in (uid1000, uid0, anon)}
        # Each claim's containers mount their own tenant's pipe directory, and only that one.
        for ref, tenant in zip(refs, (uid1000, uid1000, uid0, anon), strict=True):
            assert pipe_mount(root, ref.uid) == str(mps.spec(gpu, tenant).pipe_dir)
        assert len({pipe_mount(root, r.uid) for r in refs}) == 3
        # Thread caps: a client's share against its own daemon's clients (20 of 40 for uid 1000's two), all threads
        # for a daemon's only client; every daemon holds its clients to 10 GiB.
        assert env_of(root, "c-b")[MPS_THREAD_PERCENTAGE_ENV] == "50"
        assert env_of(root, "c-root")[MPS_THREAD_PERCENTAGE_ENV] == "100"
        # Prepare only widens a daemon's limits (c-a was admitted at 100 %); the next pass sets them exactly.
        assert mps.limits(DaemonKey(gpu, uid1000)) == MpsLimits(100, 10240)
        await d.reconcile()
        assert mps.limits(DaemonKey(gpu, uid1000)) == MpsLimits(50, 10240)
        assert mps.limits(DaemonKey(gpu, uid0)) == MpsLimits(100, 10240)

        restarted = driver(root, api, sim)  # the tenants survive a restart (checkpoint), the daemons are adopted
        await restarted.recover()
        assert restarted.checkpoint.claims["c-b"].tenant == uid1000
        assert restarted._mps.running() == {DaemonKey(gpu, t) for t in (uid1000, uid0, anon)}
        await restarted.unprepare([refs[0]])  # uid 1000 keeps its daemon for p-b, now its only client
        assert DaemonKey(gpu, uid1000) in restarted._mps.running()
        assert restarted._mps.limits(DaemonKey(gpu, uid1000)) == MpsLimits(100, 10240)
        await restarted.unprepare([refs[1], refs[3]])  # a tenant's last claim gone: its daemon stops
        assert restarted._mps.running() == {DaemonKey(gpu, uid0)}
        assert not mps.spec(gpu, anon).pipe_dir.exists()

    asyncio.run(main())


def test_the_containers_that_use_the_claim_decide_its_tenant(root: Path) -> None:
    sim = backend()
    api = Api()
    # A sidecar that runs as root and uses no claim does not decide: the claim's user is the app's.
    api.pod("side", "c1", ("app", 1000, True), ("log", 0, False), sidecars=(("proxy", 0, False),))
    # A container that uses the claim as the image's user makes the pod a tenant of its own, whatever the other
    # (declared) one says.
    api.pod("mixed", "c2", ("app", 1000, True), ("tool", None, True))
    # Two users among the claim's containers: refused, with the containers named.
    api.pod("two", "c3", ("app", 1000, True), ("tool", 0, True))
    # hostUsers: false maps the declared UID elsewhere on the host: a tenant of its own.
    api.pod("userns", "c4", ("app", 1000, True), host_users=False)
    refs = [api.claim("c1", ["side"]), api.claim("c2", ["mixed"]), api.claim("c3", ["two"])]
    refs.append(api.claim("c4", ["userns"]))

    async def main() -> None:
        d = driver(root, api, sim)
        got = await d.prepare(refs)
        assert got["c-c1"].error == "" and d.checkpoint.claims["c-c1"].tenant == user_tenant("ns", 1000)
        assert got["c-c2"].error == "" and d.checkpoint.claims["c-c2"].tenant == own_tenant("uid-mixed")
        assert "c-c3" not in d.checkpoint.claims
        assert "pod two" in got["c-c3"].error and "app: 1000, tool: 0" in got["c-c3"].error
        assert "runAsUser" in got["c-c3"].error
        assert d.checkpoint.claims["c-c4"].tenant == own_tenant("uid-userns")

    asyncio.run(main())


def test_a_claim_shared_by_pods_of_two_tenants_is_refused_and_one_of_one_tenant_works(root: Path) -> None:
    sim = backend()
    gpu = sim.devices()[0].uuid
    api = Api()
    for name, user in (("w1", 1000), ("w2", 1000), ("x1", 1000), ("x2", None), ("y1", None), ("y2", None)):
        api.pod(name, name[0], ("app", user, True))
    # A pod the claim is still reserved for, but gone: another pod took its name (its UID differs); it decides nothing.
    api.pod("gone", "w", ("app", 0, True))
    same = api.claim("w", ["w1", "w2", "gone"])
    api.pods["gone"]["metadata"]["uid"] = "uid-new-gone"
    mixed, anon = api.claim("x", ["x1", "x2"]), api.claim("y", ["y1", "y2"])

    async def main() -> None:
        d = driver(root, api, sim)
        got = await d.prepare([same, mixed, anon])
        assert got[same.uid].error == "" and d.checkpoint.claims[same.uid].tenant == user_tenant("ns", 1000)
        assert mps_keys(d) == {DaemonKey(gpu, user_tenant("ns", 1000))}
        for ref in (mixed, anon):
            error = got[ref.uid].error
            assert f"claim ns/{ref.name} is used by pods of different MPS tenants" in error
            for what in ("runAsUser", "ResourceClaimTemplate", "--mps-multi-user"):
                assert what in error
        assert "pod x1: uid 1000 in ns" in got[mixed.uid].error
        assert "pod y1: pod uid-y1 alone" in got[anon.uid].error and "pod y2: pod uid-y2 alone" in got[anon.uid].error
        assert set(d.checkpoint.claims) == {same.uid}  # nothing made for the refused ones is left
        assert not (root / "cdi" / f"sharegpu.io-gpu_{mixed.uid}.json").exists()

    asyncio.run(main())


def mps_keys(d: DraDriver) -> set[DaemonKey]:
    return set(d._mps.running())


def test_multi_user_mode_serves_every_tenant_through_one_daemon_per_unit(root: Path) -> None:
    sim = backend()
    gpu = sim.devices()[0].uuid
    api = Api()
    for name, user in (("a", 1000), ("b", None), ("s1", 0), ("s2", None)):
        api.pod(name, name if len(name) == 1 else "s", ("app", user, True))
    refs = [api.claim("a", ["a"]), api.claim("b", ["b"]), api.claim("s", ["s1", "s2"])]

    async def main() -> None:
        d = driver(root, api, sim, multi_user=True)
        got = await d.prepare(refs)
        assert {u: r.error for u, r in got.items()} == {r.uid: "" for r in refs}  # the shared claim too
        assert {p.tenant for p in d.checkpoint.claims.values()} == {MULTI_USER_TENANT}
        spec = d._mps.spec(gpu, MULTI_USER_TENANT)
        assert mps_keys(d) == {DaemonKey(gpu, MULTI_USER_TENANT)} and spec.multi_user
        assert {pipe_mount(root, r.uid) for r in refs} == {str(spec.pipe_dir)}
        # One daemon's clients: each cap is its share against all three (20 of 60).
        assert env_of(root, "c-s")[MPS_THREAD_PERCENTAGE_ENV] == "33"
        # The driver refuses to start in the other mode while these claims are prepared ...
        with pytest.raises(
            DriverSetupError, match=r"prepared in multi-user mode remain on this node \(ns/a, ns/b, ns/s\)"
        ):
            await driver(root, api, sim).recover()
        await d.unprepare(refs)
        await driver(root, api, sim).recover()  # ... and starts once they are gone

    asyncio.run(main())


def test_a_version_2_checkpoint_with_users_loads_with_tenants(root: Path) -> None:
    device = {
        "request": "gpu",
        "device": "gpu-0",
        "pool": "n1",
        "share_id": "s",
        "gpu_index": 0,
        "gpu_uuid": "GPU-x",
        "mechanism": "mps",
        "compute_percent": 20,
        "memory_mib": 10240,
        "mig_profile": None,
        "mig_start": None,
        "time_slice": "Default",
    }
    exclusive = device | {"mechanism": "exclusive", "compute_percent": 100}
    claims = {
        "u1": {"namespace": "ns", "name": "a", "devices": [device], "units": ["GPU-x"], "user": 1000},
        "u2": {"namespace": "ns", "name": "b", "devices": [device], "units": ["GPU-x"]},
        "u3": {"namespace": "ns", "name": "c", "devices": [exclusive], "units": ["GPU-x"]},
    }
    save_record(root / "cp.json", KIND, 2, {"claims": claims})
    cp = Checkpoint(root / "cp.json")
    assert {u: p.tenant for u, p in cp.claims.items()} == {
        "u1": user_tenant("ns", 1000),
        "u2": own_tenant("u2"),
        "u3": "",
    }
    assert cp.claims["u1"].devices[0].mechanism is Mechanism.MPS
    cp.drop("u3")  # written back as the current version, and read again
    assert Checkpoint(root / "cp.json").claims["u1"].tenant == user_tenant("ns", 1000)
    claims["u1"]["user"] = "root"
    save_record(root / "bad.json", KIND, 2, {"claims": claims})
    with pytest.raises(CheckpointError, match="is not a UID"):
        Checkpoint(root / "bad.json")


def mig_claim(config: dict[str, Any]) -> ResourceClaim:
    return ResourceClaim.model_validate(
        {
            "metadata": {"namespace": "ns", "name": "c", "uid": "u1"},
            "status": {
                "allocation": {
                    "devices": {
                        "results": [
                            {
                                "request": "gpu",
                                "driver": "gpu.sharegpu.io",
                                "pool": "n1",
                                "device": "gpu-0-mig-1g10gb-0",
                            }
                        ],
                        "config": [
                            {
                                "source": "FromClaim",
                                "opaque": {
                                    "driver": "gpu.sharegpu.io",
                                    "parameters": {"apiVersion": "gpu.sharegpu.io/v1alpha1", "kind": "GpuConfig"}
                                    | config,
                                },
                            }
                        ],
                    }
                }
            },
        }
    )


@pytest.mark.parametrize("isolation", ["fault", "hardware"])
def test_fault_isolation_never_becomes_mps_inside_a_mig_instance(isolation: str) -> None:
    with pytest.raises(ClaimError, match=f"isolation: {isolation} cannot be met by MPS inside the instance"):
        plan_claim(mig_claim({"sharing": "MPS", "isolation": isolation}), "u1", "n1", (A100,))
    # Without MPS the instance is the claim's, its pods each with their own context: that isolation holds.
    alone = plan_claim(mig_claim({"isolation": isolation}), "u1", "n1", (A100,)).devices[0]
    assert alone.mechanism is Mechanism.MIG
    shared = plan_claim(mig_claim({"sharing": "MPS", "isolation": "memory"}), "u1", "n1", (A100,)).devices[0]
    assert shared.mechanism is Mechanism.MPS


def test_a_multi_user_driver_says_so_on_every_device_it_publishes() -> None:
    from sharegpu.node.dra.slices import build_slices

    def devices(multi: bool) -> list[dict[str, Any]]:
        return [d for s in build_slices("n1", (A100,), mps_multi_user=multi) for d in s.spec.get("devices", [])]

    assert len(devices(True)) > 1  # the GPU and its MIG placements
    assert all(d["attributes"]["mpsMultiUser"] == {"bool": True} for d in devices(True))
    assert not any("mpsMultiUser" in d["attributes"] for d in devices(False))  # a daemon per tenant: unchanged


def test_the_command_takes_multi_user_mode_and_refuses_it_on_a_gpu_older_than_volta(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from sharegpu.cli import app
    from sharegpu.node.cli import BackendKind, build_dra_service

    monkeypatch.setenv("SHAREGPU_STATE_DIR", str(root / "state"))
    (root / "a100.yaml").write_text("gpus: [{model: A100-80GB, count: 1}]\n")
    (root / "mixed.yaml").write_text("gpus: [{model: A100-80GB, count: 1}, {model: P100, count: 1}]\n")

    def build(config: str, **flags: bool) -> Any:
        return build_dra_service(
            "n1", None, BackendKind.SIM, root / config, root / "kl", None, None, root / "cdi", kube=Api(), **flags
        )

    service = build("a100.yaml", mps_multi_user=True, evict_on_audit=True)
    assert service.driver.mps.multi_user and service.watch is not None and service.watch.watch.evict
    assert not build("a100.yaml").driver.mps.multi_user
    assert build("mixed.yaml").watch is not None  # a daemon per tenant: fine beside a P100 (its MPS is refused)
    args = ["dra-driver", "--node-name", "n1", "--backend", "sim", "--sim-config", str(root / "mixed.yaml")]
    args += ["--kubelet-dir", str(root / "kl"), "--cdi-dir", str(root / "cdi"), "--mps-multi-user"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "--mps-multi-user needs Volta or later" in result.output and "GPU 1 (" in result.output
