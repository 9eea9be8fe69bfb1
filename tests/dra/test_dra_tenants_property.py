"""No MPS daemon on the DRA path ever serves two tenants (issue 32, item 7): claims of pods of several users and of
pods that declare none are prepared, unprepared and reconciled in any order, across restarts of the driver."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from dra_fakes import Api, backend, driver
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_dra_tenants import pipe_mount

from sharegpu.model.tenant import own_tenant, user_tenant
from sharegpu.node.backends.sim import SimBackend
from sharegpu.node.dra.driver import ClaimRef, DraDriver
from sharegpu.node.mps import TENANT_FILE, DaemonKey

op = st.one_of(
    st.tuples(st.just("prepare"), st.sampled_from([None, 0, 1000, 2000])),  # None: the image's user
    st.tuples(st.just("unprepare"), st.integers(min_value=0, max_value=20)),
    st.tuples(st.just("restart")),
    st.tuples(st.just("reconcile")),
)


@dataclass
class _World:
    root: Path
    api: Api
    sim: SimBackend
    driver: DraDriver
    prepared: dict[str, tuple[ClaimRef, str]] = field(default_factory=dict)  # claim UID -> (ref, its tenant)


def _check(w: _World, gpu: str, settled: bool) -> None:
    """Every daemon serves one tenant, every prepared claim's containers mount its own tenant's pipe directory and no
    other tenant's claim mounts it; ``settled`` (after a reconcile): a daemon runs exactly per tenant with claims."""
    mps = w.driver._mps
    for key in mps.running():
        assert (mps.spec_of(key).pipe_dir.parent / TENANT_FILE).read_text().strip() == key.tenant
    tenants_of: dict[str, set[str]] = {}
    for uid, (_, tenant) in w.prepared.items():
        assert w.driver.checkpoint.claims[uid].tenant == tenant
        pipe = pipe_mount(w.root, uid)
        assert pipe == str(mps.spec(gpu, tenant).pipe_dir)
        assert (Path(pipe).parent / TENANT_FILE).read_text().strip() == tenant
        tenants_of.setdefault(pipe, set()).add(tenant)
    assert all(len(t) == 1 for t in tenants_of.values()), tenants_of
    if settled:
        assert mps.running() == {DaemonKey(gpu, t) for _, t in w.prepared.values()}


async def _step(w: _World, step: tuple[object, ...], n: int) -> bool:
    kind = step[0]
    if kind == "prepare":
        user = step[1]
        assert user is None or isinstance(user, int)
        name = f"p{n}"
        w.api.pod(name, f"c{n}", ("app", user, True))
        ref = w.api.claim(f"c{n}", [name], memory="2Gi", compute="5")
        got = await w.driver.prepare([ref])
        assert got[ref.uid].error == "", got[ref.uid].error
        tenant = user_tenant("ns", user) if user is not None else own_tenant(f"uid-{name}")
        w.prepared[ref.uid] = (ref, tenant)
        return False
    if kind == "unprepare":
        if not w.prepared:
            return False
        assert isinstance(step[1], int)
        uid = sorted(w.prepared)[step[1] % len(w.prepared)]
        ref, _ = w.prepared.pop(uid)
        await w.driver.unprepare([ref])
        return False
    if kind == "restart":
        # The driver process dies and starts again on the same root; the GPU and its daemons survive.
        w.driver = driver(w.root, w.api, w.sim)
        await w.driver.recover()
        return False
    await w.driver.reconcile()
    return True


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(op, min_size=1, max_size=14))
def test_no_daemon_ever_serves_two_tenants_across_prepares_unprepares_and_restarts(
    steps: list[tuple[object, ...]],
) -> None:
    root = Path(tempfile.mkdtemp(prefix="drap", dir="/tmp"))  # short: socket and pipe paths have length limits
    try:
        sim = backend()
        api = Api()
        w = _World(root, api, sim, driver(root, api, sim))
        gpu = sim.devices()[0].uuid

        async def main() -> None:
            for n, step in enumerate(steps):
                settled = await _step(w, step, n)
                _check(w, gpu, settled)

        asyncio.run(main())
    finally:
        shutil.rmtree(root, ignore_errors=True)
