"""A daemon per (unit, tenant) on the device-plugin path (issue 32): who gets which MPS daemon, with which limits, for
how long, across restarts of the agent; and the opt-in multi-user mode.

The simulated backend plays the H200's MPS (one server per daemon, one Unix user per server, daemons side by side):
each container's client connects through the pipe directory its CDI spec mounts, as the user its pod runs as, so a
daemon that served two tenants' users would show a client waiting.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from node_fakes import FakeKube, KubeletRecord, agent_config, assignment, cdi_spec, pod, record_for, share
from node_fakes import start_container as start

from sharegpu.model.assignment import Assignment, Mechanism
from sharegpu.model.contract import ASSIGNMENT_ANNOTATION, INVENTORY_ANNOTATION
from sharegpu.model.inventory import NodeSpec
from sharegpu.model.tenant import MULTI_USER_TENANT, tenant_dir
from sharegpu.node.agent import NodeAgent
from sharegpu.node.backends.sim import SimBackend
from sharegpu.node.backends.sim_config import parse_sim_config
from sharegpu.node.kube import NodeInfo, PodInfo
from sharegpu.node.mps import TENANT_FILE, DaemonKey, MpsLimits, SimMpsDaemon

ONE_H100 = "gpus: [{model: H100-80GB, count: 1}]\n"
TWO_H100 = "gpus: [{model: H100-80GB, count: 2}]\n"
GIB = 1024


def _node(tmp: Path, sock: Path, yaml: str = ONE_H100, **kw: object) -> tuple[SimBackend, FakeKube, NodeAgent]:
    sim = SimBackend(parse_sim_config(yaml), seed="node-a")
    kube = FakeKube(NodeInfo("node-a", {}, {}, 32000, 256 * 1024))
    config = agent_config(tmp, sock, tokens_per_gpu=8, **kw)
    return sim, kube, NodeAgent(config, sim, kube, SimMpsDaemon(sim))


def _mount(agent: NodeAgent, ids: list[str]) -> Path:
    """The host-side source of the container's MPS pipe mount, from the CDI spec the runtime applies."""
    (m,) = cdi_spec(agent.config.cdi_dir, ids)["mounts"]
    assert m["containerPath"] == "/run/sharegpu/mps"
    return Path(m["hostPath"])


def _served(pipe: Path) -> str:
    """The tenant the daemon behind a pipe directory serves, as its directory records it."""
    return (pipe.parent / TENANT_FILE).read_text().strip()


FIVE = (("u1000-a", 1000), ("u1000-b", 1000), ("root", 0), ("anon-1", None), ("anon-2", None))


def test_five_pods_of_two_users_and_none_run_at_once_on_one_gpu_with_four_daemons(
    tmp_path: Path, sock_dir: Path
) -> None:
    """The issue's case: five MPS pods of 10Gi/15 % (two of uid 1000, one of uid 0, two undeclared) on one GPU: four
    daemons, each container mounted only its tenant's pipe, every client running at once; a tenant's daemon stops
    with its last pod, the others run on."""

    async def main() -> None:
        sim, kube, agent = _node(tmp_path, sock_dir)
        g = sim.devices()[0].uuid
        record = record_for(agent.config)
        await record.start()
        try:
            pods = {
                name: kube.add(pod(name, assignment(name, share(0, g, Mechanism.MPS, 150, 10 * GIB)), user=user))
                for name, user in FIVE
            }
            pipes, envs = {}, {}
            for i, name in enumerate(pods):
                grant = await start(agent, record, pods[name], "c0", [f"t{i}"])
                pipes[name], envs[name] = _mount(agent, [f"t{i}"]), grant.envs
            assert len(agent.mps.running()) == 4 == len(set(pipes.values()))
            assert pipes["u1000-a"] == pipes["u1000-b"]  # one tenant: uid 1000 in one namespace
            for name, p in pods.items():
                assert _served(pipes[name]) == p.tenant  # each container reaches its own tenant's daemon only
                assert pipes[name] == agent.mps.spec(g, p.tenant).pipe_dir
            # Caps: uid 1000's two clients share their daemon's turn (15 against 30: half each); the others are alone.
            assert {n: e["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] for n, e in envs.items()} == {
                "u1000-a": "50",
                "u1000-b": "50",
                "root": "100",
                "anon-1": "100",
                "anon-2": "100",
            }
            assert {e["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] for e in envs.values()} == {"0=10240M"}
            await agent.reconcile_once()
            assert {agent.mps.limits(k) for k in agent.mps.running()} == {MpsLimits(50, 10240), MpsLimits(100, 10240)}
            assert agent.mps.limits(DaemonKey(g, pods["u1000-a"].tenant)) == MpsLimits(50, 10240)
            # Every client connects through its mount as its pod's user (the undeclared ones as root, say): all five
            # run at once, four servers side by side.
            for pid, (name, user) in enumerate(FIVE, start=100):
                assert sim.add_process(pid, g, 1000, pods[name].uid, mps=True, daemon=pipes[name], user=user or 0)
            assert sim.mps_waiting() == () and len(sim.processes(0)) == 5 + 4
            await agent.reconcile_once()
            assert agent.snapshot.findings == ()
            # u1000-a ends: its tenant's daemon stays for u1000-b, with the exact limits of what is left.
            sim.remove_process(100)
            kube.set_phase(pods["u1000-a"].uid, "Succeeded")
            await agent.reconcile_once()
            assert len(agent.mps.running()) == 4
            assert agent.mps.limits(DaemonKey(g, pods["u1000-a"].tenant)) == MpsLimits(100, 10240)
            # u1000-b ends too: that daemon stops; root's and the anonymous pods' daemons (and clients) run on.
            sim.remove_process(101)
            kube.pods.pop(pods["u1000-b"].uid)
            await agent.reconcile_once()
            assert {k.tenant for k in agent.mps.running()} == {pods[n].tenant for n in ("root", "anon-1", "anon-2")}
            assert not pipes["u1000-a"].exists()
            assert {p.pid for p in sim.mps_processes(0) or ()} == {102, 103, 104}
        finally:
            await record.stop()

    asyncio.run(main())


def test_multi_user_mode_serves_every_tenant_from_one_daemon_and_says_so_in_the_inventory(
    tmp_path: Path, sock_dir: Path
) -> None:
    async def main() -> None:
        sim, kube, agent = _node(tmp_path, sock_dir, mps_multi_user=True)
        g = sim.devices()[0].uuid
        record = record_for(agent.config)
        await record.start()
        try:
            pods = {
                name: kube.add(pod(name, assignment(name, share(0, g, Mechanism.MPS, 150, 10 * GIB)), user=user))
                for name, user in FIVE
            }
            grants = {name: await start(agent, record, p, "c0", [f"t{i}"]) for i, (name, p) in enumerate(pods.items())}
            pipes = {_mount(agent, [f"t{i}"]) for i in range(5)}
            assert agent.mps.running() == {DaemonKey(g, MULTI_USER_TENANT)} and len(pipes) == 1
            (pipe,) = pipes
            assert _served(pipe) == MULTI_USER_TENANT
            assert json.loads((pipe / SimMpsDaemon.MARKER).read_text())["multiUser"] is True
            # One server runs everyone together: each cap is held against all five shares (15 of 75).
            assert {g_.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] for g_ in grants.values()} == {"20"}
            for pid, (name, user) in enumerate(FIVE, start=100):
                assert sim.add_process(pid, g, 1000, pods[name].uid, mps=True, daemon=pipe, user=user or 0)
            assert sim.mps_waiting() == () and len(sim.processes(0)) == 5 + 1
            await agent.reconcile_once()
            spec = NodeSpec.from_json(kube.nodes["node-a"].annotations[INVENTORY_ANNOTATION])
            assert spec.mps_multi_user
        finally:
            await record.stop()

    asyncio.run(main())


def test_a_node_without_multi_user_mode_publishes_none(tmp_path: Path, sock_dir: Path) -> None:
    async def main() -> None:
        _, kube, agent = _node(tmp_path, sock_dir)
        await agent.reconcile_once()
        assert not NodeSpec.from_json(kube.nodes["node-a"].annotations[INVENTORY_ANNOTATION]).mps_multi_user
        assert "mpsMultiUser" not in kube.nodes["node-a"].annotations[INVENTORY_ANNOTATION]

    asyncio.run(main())


def test_a_pod_that_runs_in_a_user_namespace_of_its_own_is_a_tenant_of_its_own(tmp_path: Path, sock_dir: Path) -> None:
    """hostUsers: false maps its declared UID to another on the host: it shares no daemon with its namespace's
    uid-1000 pods."""

    async def main() -> None:
        sim, kube, agent = _node(tmp_path, sock_dir)
        g = sim.devices()[0].uuid
        record = record_for(agent.config)
        await record.start()
        try:
            a = kube.add(pod("a", assignment("a", share(0, g, Mechanism.MPS, 150, GIB)), user=1000))
            b = kube.add(pod("b", assignment("b", share(0, g, Mechanism.MPS, 150, GIB)), user=1000, host_users=False))
            await start(agent, record, a, "c0", ["ta"])
            await start(agent, record, b, "c0", ["tb"])
            assert _mount(agent, ["ta"]) != _mount(agent, ["tb"])
            assert _served(_mount(agent, ["tb"])) == f"pod/{b.uid}"
        finally:
            await record.stop()

    asyncio.run(main())


# ----- the property: no daemon ever serves two tenants ------------------------------------------------------------------
USERS = (None, 0, 1000)  # None: the pod declares none (its image runs as some user: see IMAGE_USER)
IMAGE_USER = {0: 0, 1: 1000, 2: 4242}  # what an undeclared pod's image runs as, by the pod's number mod 3


@dataclass
class _Pod:
    info: PodInfo
    ids: list[str]
    pid: int | None = None  # its client on the simulated GPU (None: not started)


@dataclass
class _World:
    sim: SimBackend
    kube: FakeKube
    agent: NodeAgent
    record: KubeletRecord
    pods: dict[str, _Pod] = field(default_factory=dict)
    restarts: int = 0


op = st.one_of(
    st.tuples(st.just("start"), st.sampled_from(USERS), st.sampled_from(("team-a", "team-b")), st.integers(0, 1)),
    st.tuples(st.just("finish"), st.integers(0, 50)),
    st.tuples(st.just("restart")),
    st.tuples(st.just("reconcile")),
)


def _check(w: _World) -> None:
    """What must hold after every step: every daemon serves one tenant, every live container reaches its own
    tenant's daemon, and no client ever waits for another user's clients."""
    root = w.agent.mps.root
    for key in w.agent.mps.running():
        base = w.agent.mps.spec_of(key).pipe_dir.parent
        assert base.name == tenant_dir(key.tenant) and (base / TENANT_FILE).read_text().strip() == key.tenant
    tenants_of_dir: dict[Path, set[str]] = {}
    for p in w.pods.values():
        if p.pid is None or p.info.finished:
            continue
        pipe = _mount(w.agent, p.ids)
        assert pipe.is_relative_to(root) and _served(pipe) == p.info.tenant
        tenants_of_dir.setdefault(pipe, set()).add(p.info.tenant)
    assert all(len(t) == 1 for t in tenants_of_dir.values()), tenants_of_dir
    assert w.sim.mps_waiting() == ()


async def _step(w: _World, step: tuple[object, ...], n: int, tmp: Path, sock: Path) -> None:
    kind = step[0]
    if kind == "start":
        _, user, ns, gpu = step
        assert isinstance(ns, str) and isinstance(gpu, int) and (user is None or isinstance(user, int))
        name = f"p{n}"
        g = w.sim.devices()[gpu].uuid
        a = assignment(name, share(gpu, g, Mechanism.MPS, 100, GIB), namespace=ns)
        info = w.kube.add(pod(name, a, namespace=ns, user=user))
        p = w.pods[name] = _Pod(info, [f"t{n}"])
        await start(w.agent, w.record, info, "c0", p.ids)
        w.kube.set_phase(info.uid, "Running")
        as_user = user if user is not None else IMAGE_USER[n % 3]
        pid = 1000 + n
        assert w.sim.add_process(pid, g, 100, info.uid, mps=True, daemon=_mount(w.agent, p.ids), user=as_user)
        p.pid = pid
    elif kind == "finish":
        live = sorted(k for k, p in w.pods.items() if not p.info.finished and p.pid is not None)
        if not live:
            return
        assert isinstance(step[1], int)
        p = w.pods[live[step[1] % len(live)]]
        assert p.pid is not None
        w.sim.remove_process(p.pid)
        w.kube.set_phase(p.info.uid, "Succeeded")
        p.info = w.kube.pods[p.info.uid]
        w.record.release(p.info.uid)
    elif kind == "restart":
        # The agent process dies and starts again on the same state directory; the GPU and its daemons survive.
        w.restarts += 1
        config = agent_config(tmp, sock, tokens_per_gpu=8, grant_grace_s=0.0)
        w.agent = NodeAgent(config, w.sim, w.kube, SimMpsDaemon(w.sim))
        await w.agent.reconcile_once()
    else:
        await w.agent.reconcile_once()
        # After a reconcile, a daemon runs exactly where a live pod of its tenant holds an MPS share of its unit.
        wanted = {
            DaemonKey(s.gpu_uuid, p.info.tenant)
            for p in w.pods.values()
            if not p.info.finished
            for s in assignment_of(p.info).shares
        }
        assert w.agent.mps.running() == wanted


def assignment_of(p: PodInfo) -> Assignment:
    return Assignment.from_json(p.annotations[ASSIGNMENT_ANNOTATION])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(op, min_size=1, max_size=14))
def test_no_daemon_ever_serves_two_tenants_across_grants_finishes_and_restarts(steps: list[tuple[object, ...]]) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="sg-"))
    try:
        sim = SimBackend(parse_sim_config(TWO_H100), seed="node-a")
        kube = FakeKube(NodeInfo("node-a", {}, {}, 32000, 256 * 1024))
        config = agent_config(tmp, tmp, tokens_per_gpu=8, grant_grace_s=0.0)

        async def main() -> None:
            record = record_for(config)
            await record.start()
            w = _World(sim, kube, NodeAgent(config, sim, kube, SimMpsDaemon(sim)), record)
            try:
                for n, step in enumerate(steps):
                    await _step(w, step, n, tmp, tmp)
                    _check(w)
            finally:
                await record.stop()

        asyncio.run(main())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_sim_would_show_a_daemon_serving_two_users() -> None:
    """The property's last check has teeth: two users' clients on one daemon are seen waiting."""
    sim = SimBackend(parse_sim_config(ONE_H100), seed="node-a")
    g = sim.devices()[0].uuid
    assert sim.add_process(1, g, 100, "a", mps=True, daemon="/x/pipe", user=1000)
    assert not sim.add_process(2, g, 100, "b", mps=True, daemon="/x/pipe", user=0)
    assert sim.mps_waiting() == (2,)
