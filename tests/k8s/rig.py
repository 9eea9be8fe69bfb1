"""A harness over ../shared/k8s-rig: a real kube-apiserver and kube-scheduler, sharegpu's own processes around them.

What runs for real: the API server (validation, preconditions, watches, Binding's Status answer), a second
kube-scheduler process with the Helm chart's own KubeSchedulerConfiguration (profile ``sharegpu-scheduler``, the
extender for filter/prioritize/bind/preempt), ``sharegpu scheduler-extender`` and ``sharegpu node-agent``
(simulated GPU backend) as subprocesses. What the harness plays: the kubelet, which the rig has none of — for each
node, a device-plugin Registration server on ``kubelet.sock`` built from the real deviceplugin protos that, like the
kubelet, calls the registered plugin's ListAndWatch and publishes the healthy device count as the node's capacity.

Used by tests/k8s/test_k8s_rig_*.py (skipped unless SHAREGPU_TEST_KUBECONFIG is set) and bench/k8s_load.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import yaml
from tls_helpers import Pki, make_pki

from proc_helpers import free_port
from sharegpu.ledger import Ledger, LedgerError
from sharegpu.model.assignment import Assignment, InvalidAssignment
from sharegpu.model.catalog import DEFAULT_CATALOG
from sharegpu.model.contract import INVENTORY_ANNOTATION
from sharegpu.model.inventory import InvalidInventory, NodeSpec
from sharegpu.node.proto import deviceplugin_pb2 as pb
from sharegpu.node.proto import deviceplugin_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "sharegpu"
KUBECONFIG = os.environ.get("SHAREGPU_TEST_KUBECONFIG", "")
SKIP_REASON = (
    "no API server: set SHAREGPU_TEST_KUBECONFIG to the kubeconfig of ../shared/k8s-rig (and SHAREGPU_TEST_K8S_REAL "
    "to its folder if the kubeconfig is elsewhere) to run the integration suite; .ci/run starts the rig and sets both"
)
ASSIGNMENT = "sharegpu.io/assignment"
GPU_RESOURCE = "sharegpu.io/gpu"
SCHEDULER_NAME = "sharegpu-scheduler"


def rig_dir() -> Path:
    return Path(os.environ.get("SHAREGPU_TEST_K8S_REAL") or Path(KUBECONFIG).parent)


def sharegpu_argv(*args: str) -> list[str]:
    """The installed console script of this environment (what the image's entry point runs)."""
    return [str(Path(sys.executable).parent / "sharegpu"), *args]


class Proc:
    """A background process with its output in a log file (tests/proc_helpers.Proc reads a short-lived command's
    lines instead)."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.argv, self.log = name, argv, log
        self._log = log.open("ab")
        self.p = subprocess.Popen(
            _die_with_parent(argv), stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    @property
    def alive(self) -> bool:
        return self.p.poll() is None

    def kill(self) -> None:
        """SIGKILL: no cleanup, as an OOM kill or a lost node would do."""
        if self.alive:
            self.p.send_signal(signal.SIGKILL)
            self.p.wait(10)

    def stop(self) -> None:
        if self.alive:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()

    def text(self) -> str:
        if not self._log.closed:  # a stopped process's log was closed by stop(), and is still read by dump()
            self._log.flush()
        return self.log.read_text(errors="replace")


class ExtenderProc(Proc):
    def __init__(self, name: str, argv: list[str], log: Path, health: str, env: dict[str, str] | None = None) -> None:
        super().__init__(name, argv, log, env)
        self.health = health  # plain-HTTP base URL of /healthz and /readyz


def _die_with_parent(argv: list[str]) -> list[str]:
    """``argv`` under util-linux's setpriv, which has the child killed when the test process dies, however it dies:
    a crash leaves no orphan scheduler that would keep binding the next test's pods. (A preexec_fn would do the same
    but forks a process that runs gRPC's threads, which breaks the child.)"""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *argv] if setpriv else argv


def http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return 200 <= r.status < 300
    except Exception:
        return False


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 60.0, every: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(every)


# ----- the kubelet's side of the device plugin protocol --------------------------------------------------------------
class Kubelet(pb_grpc.RegistrationServicer):
    """Plays one node's kubelet: serves Registration on ``kubelet.sock``; for each plugin that registers, follows its
    ListAndWatch and publishes the healthy devices as the node's capacity and allocatable (as the kubelet does)."""

    def __init__(self, node: str, plugin_dir: Path, publish: Callable[[str, str, int], None]) -> None:
        self.node, self.plugin_dir, self.publish = node, plugin_dir, publish
        self.registered: list[pb.RegisterRequest] = []
        self.devices: dict[str, int] = {}
        self._server: grpc.aio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = grpc.aio.server()
        pb_grpc.add_RegistrationServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix://{self.plugin_dir / 'kubelet.sock'}")
        await self._server.start()

    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext) -> pb.Empty:  # type: ignore[override]
        assert request.version == "v1beta1", request.version
        self.registered.append(request)
        task = asyncio.ensure_future(self._follow(request))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return pb.Empty()

    async def _follow(self, request: pb.RegisterRequest) -> None:
        async with grpc.aio.insecure_channel(f"unix://{self.plugin_dir / request.endpoint}") as channel:
            stub = pb_grpc.DevicePluginStub(channel)
            with contextlib.suppress(grpc.aio.AioRpcError):  # the plugin stopped: it registers again when back
                async for resp in stub.ListAndWatch(pb.Empty()):
                    healthy = sum(d.health == "Healthy" for d in resp.devices)
                    self.devices[request.resource_name] = healthy
                    self.publish(self.node, request.resource_name, healthy)

    async def allocate(self, request: pb.RegisterRequest, device_ids: list[str]) -> pb.AllocateResponse:
        async with grpc.aio.insecure_channel(f"unix://{self.plugin_dir / request.endpoint}") as channel:
            stub = pb_grpc.DevicePluginStub(channel)
            req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=device_ids)])
            return await stub.Allocate(req)

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._server is not None:
            await self._server.stop(0)


class KubeletLoop:
    """The kubelets of every node, on one asyncio loop in a thread (the harness itself is synchronous)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.kubelets: dict[str, Kubelet] = {}

    def run(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def add(self, kubelet: Kubelet) -> None:
        self.kubelets[kubelet.node] = kubelet
        self.run(kubelet.start())

    def close(self) -> None:
        for k in self.kubelets.values():
            with contextlib.suppress(Exception):
                self.run(k.stop(), timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# ----- the rig ---------------------------------------------------------------------------------------------------------
@dataclass
class RigNode:
    name: str
    gpus: list[dict[str, Any]]  # the simulated backend's `gpus:` entries: model, count, mig
    plugin_dir: Path
    agent: Proc | None = None


@dataclass
class Rig:
    """One test's (or bench run's) objects and processes on the shared control plane; :meth:`close` removes them."""

    kubeconfig: Path
    k8s_real: Path
    work: Path
    prefix: str = field(default_factory=lambda: f"sg{uuid.uuid4().hex[:5]}")
    procs: list[Proc] = field(default_factory=list)
    nodes: dict[str, RigNode] = field(default_factory=dict)
    namespaces: list[str] = field(default_factory=list)
    real_nodes: set[str] = field(default_factory=set)  # served by a real kubelet: never deleted here
    real_state: dict[str, Path] = field(default_factory=dict)
    _kubelets: KubeletLoop | None = None
    _pki: Pki | None = None

    def __post_init__(self) -> None:
        from lightkube import Client, KubeConfig

        self.client = Client(config=KubeConfig.from_file(self.kubeconfig), field_manager="sharegpu-test-rig")

    @classmethod
    @contextlib.contextmanager
    def open(cls) -> Iterator[Rig]:
        work = Path(tempfile.mkdtemp(prefix="sharegpu-rig-"))
        rig = cls(Path(KUBECONFIG), rig_dir(), work)
        try:
            yield rig
        finally:
            rig.close()
            if not os.environ.get("SHAREGPU_RIG_KEEP"):  # set it to read the processes' logs afterwards
                shutil.rmtree(work, ignore_errors=True)

    # ----- objects ------------------------------------------------------------------------------------------------
    def namespace(self, name: str = "", labels: dict[str, str] | None = None) -> str:
        from lightkube.models.meta_v1 import ObjectMeta
        from lightkube.resources.core_v1 import Namespace

        ns = name or f"{self.prefix}-{len(self.namespaces)}"
        self.client.create(Namespace(metadata=ObjectMeta(name=ns, labels=labels)))
        self.namespaces.append(ns)
        return ns

    def add_node(
        self,
        suffix: str,
        gpus: list[dict[str, Any]],
        *,
        agent: bool = True,
        cpu: str = "64",
        memory: str = "256Gi",
        labels: dict[str, str] | None = None,
        inventory: NodeSpec | None = None,
    ) -> str:
        """A kubelet-less Node, Ready; with ``agent`` a real node agent on the simulated backend publishes its
        inventory and (through the harness's kubelet) its ``sharegpu.io/gpu`` capacity; otherwise ``inventory`` is
        written directly (what an agent would write) with the capacity the device plugin would advertise."""
        from lightkube.resources.core_v1 import Node
        from lightkube.types import PatchType

        name = f"{self.prefix}-{suffix}"
        meta_labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "sharegpu-test/rig": self.prefix}
        meta_labels |= labels or {}
        annotations = {INVENTORY_ANNOTATION: inventory.to_json()} if inventory is not None else {}
        self.client.create(
            Node.from_dict({"metadata": {"name": name, "labels": meta_labels, "annotations": annotations}, "spec": {}})
        )
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        resources = {"cpu": cpu, "memory": memory, "pods": "500"}
        if inventory is not None:
            resources[GPU_RESOURCE] = str(64 * len(inventory.gpus))
        status = {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "sharegpu test rig",
                 "lastHeartbeatTime": now, "lastTransitionTime": now},
            ],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": name}],
        }  # fmt: skip
        self._patch_node_status(name, status)
        # The API server taints a new Node not-ready; the node lifecycle controller (off on the rig: no kubelet
        # renews leases) would lift it once the node reports Ready.
        self.client.patch(Node, name, {"spec": {"taints": None}}, patch_type=PatchType.MERGE)
        plugin_dir = self.work / name
        plugin_dir.mkdir()
        node = RigNode(name, gpus, plugin_dir)
        self.nodes[name] = node
        if agent:
            self._start_agent(node)
        return name

    def _patch_node_status(self, name: str, status: dict[str, Any]) -> None:
        from lightkube.resources.core_v1 import Node
        from lightkube.types import PatchType

        self.client.patch(Node.Status, name, {"status": status}, patch_type=PatchType.MERGE)

    def _publish_capacity(self, node: str, resource: str, count: int) -> None:
        self._patch_node_status(node, {"capacity": {resource: str(count)}, "allocatable": {resource: str(count)}})

    @property
    def kubelets(self) -> KubeletLoop:
        if self._kubelets is None:
            self._kubelets = KubeletLoop()
        return self._kubelets

    def _start_agent(self, node: RigNode) -> None:
        self.kubelets.add(Kubelet(node.name, node.plugin_dir, self._publish_capacity))
        sim = self.work / f"{node.name}.yaml"
        sim.write_text(yaml.safe_dump({"gpus": node.gpus}))
        state = self.work / f"{node.name}.state"
        state.mkdir()
        argv = sharegpu_argv(
            "node-agent",
            "--node-name", node.name,
            "--kubeconfig", str(self.kubeconfig),
            "--backend", "sim",
            "--sim-config", str(sim),
            "--device-plugin-dir", str(node.plugin_dir),
            # A fake node's agent has no kubelet records to read and must never touch the host's CDI directory.
            "--pod-resources-socket", str(node.plugin_dir / "pod-resources.sock"),
            "--cdi-dir", str(self.work / f"{node.name}.cdi"),
            "--metrics-listen", "",
        )  # fmt: skip
        node.agent = self.spawn(f"agent-{node.name}", argv, env={"SHAREGPU_STATE_DIR": str(state)})

    def attach_real_node(self, real: Any, gpus: list[dict[str, Any]], env: dict[str, str] | None = None) -> str:
        """Serve the rig's real node (``realnode.RealNode``: a real kubelet and containerd) with a node agent on the
        simulated backend, exactly as the chart's DaemonSet would: the kubelet's device-plugin directory, its
        pod-resources socket and containerd's CDI directory. The Node object is the kubelet's: never deleted here.
        ``env``: more of the agent's environment (``PYTHONPATH`` at another version's ``src`` runs that version)."""
        node = RigNode(real.name, gpus, real.plugin_dir)
        self.nodes[real.name] = node
        self.real_nodes.add(real.name)
        sim = self.work / f"{real.name}.yaml"
        sim.write_text(yaml.safe_dump({"gpus": gpus, "stateFile": str(self.work / f"{real.name}.sim.json")}))
        state = self.work / f"{real.name}.state"
        state.mkdir()
        self.real_state[real.name] = state
        argv = sharegpu_argv(
            "node-agent",
            "--node-name", real.name,
            "--kubeconfig", str(self.kubeconfig),
            "--backend", "sim",
            "--sim-config", str(sim),
            "--device-plugin-dir", str(real.plugin_dir),
            "--pod-resources-socket", str(real.pod_resources_socket),
            "--cdi-dir", str(real.cdi_dir),
            "--metrics-listen", "",
        )  # fmt: skip
        node.agent = self.spawn(f"agent-{real.name}", argv, env={**(env or {}), "SHAREGPU_STATE_DIR": str(state)})
        return real.name

    def restart_real_agent(self, name: str, kill: bool = True, env: dict[str, str] | None = None) -> None:
        """Stop the real node's agent (SIGKILL, or SIGTERM) and start it again on the same state (``env``: more of
        its environment, as for :meth:`attach_real_node`)."""
        node = self.nodes[name]
        assert node.agent is not None
        if kill:
            node.agent.kill()
        else:
            node.agent.stop()
        node.agent = self.spawn(
            f"agent-{name}-{len(self.procs)}",
            node.agent.argv,
            env={**(env or {}), "SHAREGPU_STATE_DIR": str(self.real_state[name])},
        )

    def wait_nodes_published(self, timeout: float = 60.0) -> None:
        """Until every node with an agent shows its inventory and its ``sharegpu.io/gpu`` capacity."""

        def published() -> bool:
            for name, rn in self.nodes.items():
                if rn.agent is None:
                    continue
                node = self.node(name)
                if INVENTORY_ANNOTATION not in node["metadata"].get("annotations", {}):
                    return False
                if int(node["status"].get("allocatable", {}).get(GPU_RESOURCE, "0")) <= 0:
                    return False
            return True

        wait_for(published, "the node agents' inventories and device plugins", timeout)

    def node(self, name: str) -> dict[str, Any]:
        from lightkube.resources.core_v1 import Node

        return dict(self.client.get(Node, name).to_dict())

    # ----- processes ------------------------------------------------------------------------------------------------
    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        p = Proc(name, argv, self.work / f"{name}.log", env)
        self.procs.append(p)
        return p

    @property
    def pki(self) -> Pki:
        """The chart's PKI, made here: a CA, the extender's server pair (127.0.0.1), the scheduler's client pair."""
        if self._pki is None:
            self._pki = make_pki(self.work / "pki")
        return self._pki

    def start_extender(
        self,
        port: int = 0,
        *extra: str,
        name: str = "extender",
        ready: bool = True,
        env: dict[str, str] | None = None,
    ) -> tuple[ExtenderProc, str]:
        """``sharegpu scheduler-extender`` as the chart runs it: mutual TLS on ``port`` (only the scheduler's client
        certificate is served), the probes alone on a plain-HTTP port (``env``: more of its environment). Returns it
        and its HTTPS URL."""
        port = port or free_port()
        health = free_port()
        argv = sharegpu_argv(
            "scheduler-extender", "--kubeconfig", str(self.kubeconfig), "--listen", f"127.0.0.1:{port}",
            "--health-listen", f"127.0.0.1:{health}", "--tls-cert", str(self.pki.server_crt),
            "--tls-key", str(self.pki.server_key), "--client-ca", str(self.pki.ca), *extra,
        )  # fmt: skip
        p = ExtenderProc(name, argv, self.work / f"{name}.log", health=f"http://127.0.0.1:{health}", env=env)
        self.procs.append(p)
        url = f"https://127.0.0.1:{port}"
        if ready:
            wait_for(lambda: http_ok(p.health + "/readyz") or not p.alive, f"{name} to be ready", 60)
            assert p.alive, f"{name} exited:\n{p.text()[-3000:]}"
        return p, url

    def scheduler_config(
        self, extender_url: str, scheduler_name: str = SCHEDULER_NAME, values: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The chart's own KubeSchedulerConfiguration (rendered with ``values``), pointed at ``extender_url`` and at
        the rig's credentials."""
        cm = next(d for d in chart_docs(values) if d["kind"] == "ConfigMap" and "config.yaml" in d.get("data", {}))
        config: dict[str, Any] = yaml.safe_load(cm["data"]["config.yaml"])
        config["clientConnection"] = {"kubeconfig": str(self.k8s_real / "scheduler.kubeconfig")}
        config["leaderElection"] = {"leaderElect": False}
        config["profiles"][0]["schedulerName"] = scheduler_name
        for ext in config["extenders"]:
            # The chart's URL is the Service's; the path after its port (DRA steering's /dra) is kept.
            path = ext["urlPrefix"].split(".svc:", 1)[1].partition("/")[2]
            ext["urlPrefix"] = extender_url + (f"/{path}" if path else "")
            # The chart mounts these from its Secrets; here they are the harness's own pair.
            ext["tlsConfig"] = {"caFile": str(self.pki.ca), "certFile": str(self.pki.client_crt),
                                "keyFile": str(self.pki.client_key)}  # fmt: skip
        return config

    def start_scheduler(
        self,
        extender_url: str,
        scheduler_name: str = SCHEDULER_NAME,
        values: dict[str, Any] | None = None,
        config_obj: dict[str, Any] | None = None,
        verbosity: int = 2,
    ) -> Proc:
        """A second kube-scheduler (the rig's own keeps serving default-scheduler pods) running the chart's profile
        (or ``config_obj``, a KubeSchedulerConfiguration of the test's own); ``verbosity``: its klog ``--v`` (6 logs
        what its DRA claim tracker counts)."""
        config = self.work / "scheduler-config.yaml"
        config.write_text(yaml.safe_dump(config_obj or self.scheduler_config(extender_url, scheduler_name, values)))
        port = free_port()
        sk = str(self.k8s_real / "scheduler.kubeconfig")
        argv = [
            str(self.k8s_real / "bin" / "kube-scheduler"),
            f"--config={config}",
            f"--authentication-kubeconfig={sk}",
            f"--authorization-kubeconfig={sk}",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--v={verbosity}",
        ]
        gates = self.k8s_real / "feature-gates.txt"
        if gates.exists() and gates.read_text().strip():
            argv.append(f"--feature-gates={gates.read_text().strip()}")
        p = self.spawn("kube-scheduler", argv)
        wait_for(lambda: _https_ok(f"https://127.0.0.1:{port}/healthz") or not p.alive, "kube-scheduler", 60)
        assert p.alive, f"kube-scheduler exited:\n{p.text()[-3000:]}"
        return p

    # ----- pods -----------------------------------------------------------------------------------------------------
    def create_pods(self, ns: str, objs: Iterable[dict[str, Any]], parallel: int = 16) -> None:
        """Create pods at once (``parallel`` requests in flight), as a Job controller or kubectl apply would."""
        from lightkube.resources.core_v1 import Pod

        # Decoded here: lightkube's model classes are not safe to build from several threads at once.
        models = [Pod.from_dict(obj) for obj in objs]

        def create(pod: Pod) -> None:
            self.client.create(pod, namespace=ns)

        with ThreadPoolExecutor(parallel) as pool:
            list(pool.map(create, models))

    def pods(self, ns: str) -> list[dict[str, Any]]:
        from lightkube.resources.core_v1 import Pod

        return [p.to_dict() for p in self.client.list(Pod, namespace=ns)]

    def events(self, ns: str) -> list[dict[str, Any]]:
        from lightkube.resources.core_v1 import Event

        return [e.to_dict() for e in self.client.list(Event, namespace=ns)]

    def wait_settled(self, ns: str, quiet_s: float = 6.0, timeout: float = 300.0) -> list[dict[str, Any]]:
        """Until no pod of ``ns`` was bound for ``quiet_s`` (the rest are pending for want of room)."""
        deadline = time.monotonic() + timeout
        last, since = -1, time.monotonic()
        while True:
            pods = self.pods(ns)
            bound = sum(bool(p["spec"].get("nodeName")) for p in pods)
            if bound != last:
                last, since = bound, time.monotonic()
            if bound == len(pods) or time.monotonic() - since >= quiet_s:
                return pods
            if time.monotonic() > deadline:
                raise AssertionError(f"pods of {ns} still being bound after {timeout:g}s")
            time.sleep(0.5)

    # ----- cleanup --------------------------------------------------------------------------------------------------
    def dump(self, lines: int = 40) -> str:
        """The tail of every process's log (printed by the tests' fixture: pytest shows it when a test fails)."""
        out = []
        for p in self.procs:
            tail = p.text().splitlines()[-lines:]
            out.append(f"----- {p.name} ({'running' if p.alive else f'exit {p.p.returncode}'}) -----")
            out.extend(tail)
        return "\n".join(out)

    def close(self) -> None:
        from lightkube.resources.core_v1 import Namespace, Node, Pod
        from lightkube.types import PatchType

        for p in reversed(self.procs):
            with contextlib.suppress(Exception):
                p.stop()
        if self._kubelets is not None:
            self._kubelets.close()
        for ns in self.namespaces:
            # Bound pods wait for a kubelet to confirm they stopped; there is none.
            with contextlib.suppress(Exception):
                self.client.deletecollection(Pod, namespace=ns, grace_period=0)
            with contextlib.suppress(Exception):
                self.client.delete(Namespace, ns)
        for name in self.real_nodes:
            # The kubelet's Node stays; what the agent published on it goes, so that later tests see a plain node.
            with contextlib.suppress(Exception):
                node = self.node(name)
                labels = {k: None for k in node["metadata"].get("labels", {}) if k.startswith("sharegpu.io/")}
                annotations = {k: None for k in node["metadata"].get("annotations", {}) if k.startswith("sharegpu.io/")}
                self.client.patch(
                    Node, name, {"metadata": {"labels": labels, "annotations": annotations}}, patch_type=PatchType.MERGE
                )
        for name in self.nodes:
            if name in self.real_nodes:
                continue
            with contextlib.suppress(Exception):
                self.client.delete(Node, name)
        self.client.close()


def chart_docs(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The Helm chart rendered by the real Helm engine (release sg in gpu-system), as the tests of the chart do."""
    import helm_python as helm

    rendered = helm.Chart.load(str(CHART)).render(values or {}, name="sg", namespace="gpu-system", is_install=True)
    return [d for path, text in rendered.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def _tls_listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def chart_webhooks(rig: Rig, probe: Callable[[str], bool]) -> Iterator[str]:
    """``sharegpu webhook`` on this machine, registered with the API server as the chart registers it (its rules,
    matchConditions and policy) for one new namespace only, which is yielded. ``probe(namespace)`` says when the API
    server calls the webhooks: it loads webhook configurations through an informer, so a probe of dry runs (the
    chart's webhooks have no side effects) is waited on rather than a fixed pause."""
    import base64

    from lightkube.generic_resource import create_global_resource

    pki = rig.pki  # the webhook's serving pair for 127.0.0.1, and the CA the API server is given
    port = free_port()
    argv = sharegpu_argv("webhook", "--listen", f"127.0.0.1:{port}", "--tls-cert", str(pki.server_crt))
    hook = rig.spawn("webhook", [*argv, "--tls-key", str(pki.server_key)])
    wait_for(lambda: _tls_listening(port) or not hook.alive, "the webhook to listen", 30)
    ns = rig.namespace(labels={"sharegpu-test/webhook": rig.prefix})
    ca = base64.b64encode(pki.ca.read_bytes()).decode()
    made = []
    try:
        for doc in chart_docs():
            if doc["kind"] not in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
                continue
            doc["metadata"] = {"name": f"{rig.prefix}-{doc['kind'].lower()}"}
            for w in doc["webhooks"]:
                path = w["clientConfig"]["service"]["path"]
                w["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca}
                # Only this namespace, so that nothing else on the shared rig goes through this webhook.
                w["namespaceSelector"] = {"matchLabels": {"sharegpu-test/webhook": rig.prefix}}
            res = create_global_resource("admissionregistration.k8s.io", "v1", doc["kind"], doc["kind"].lower() + "s")
            rig.client.create(res.from_dict(doc))
            made.append((res, doc["metadata"]["name"]))
        wait_for(lambda: probe(ns), "the API server to call both webhooks", 30)
        yield ns
    finally:
        for res, name in made:
            rig.client.delete(res, name)


def _https_ok(url: str) -> bool:
    import ssl

    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, timeout=1, context=ctx) as r:
            return bool(r.status == 200)
    except Exception:
        return False


# ----- a Service in front of extender replicas -------------------------------------------------------------------
class ReadyProxy:
    """What a Service with a readiness probe gives the kube-scheduler: one address whose connections go to a replica
    whose ``/readyz`` answers 200 (checked every 0.25 s, as the endpoints controller would, only faster)."""

    def __init__(self, backends: list[tuple[str, str]]) -> None:
        self.backends = backends  # (plain-HTTP probe URL, "https://127.0.0.1:PORT" it sends connections to)
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"  # TLS passes through: the scheduler talks to the replica itself
        self.ready: str | None = None
        self.changes: list[tuple[float, str | None]] = []  # (monotonic time, the ready backend from then on)
        self.loop = asyncio.new_event_loop()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.prober = threading.Thread(target=self._probe, daemon=True)

    def __enter__(self) -> ReadyProxy:
        self.thread.start()
        self.prober.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.prober.join(5)

    def _probe(self) -> None:
        while not self._stop.is_set():
            # 1 s: the kubelet's default readiness-probe timeout (a replica busy with a backlog may answer late)
            ready = next((url for probe, url in self.backends if http_ok(probe + "/readyz", 1.0)), None)
            if ready != self.ready:
                self.changes.append((time.monotonic(), ready))
            self.ready = ready
            time.sleep(0.25)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._conn, "127.0.0.1", self.port))
        self.loop.run_forever()
        server.close()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        backend = self.ready
        if backend is None:  # no ready endpoint: the connection is refused, as a Service without endpoints does
            writer.close()
            return
        host, port = backend.removeprefix("https://").split(":")
        try:
            up_r, up_w = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            with contextlib.suppress(Exception):
                w.close()

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))


# ----- checks recomputed from the API server alone -------------------------------------------------------------------
@dataclass
class Audit:
    bound: int
    pending: int
    findings: list[str]
    per_gpu: dict[str, set[str]]  # gpu uuid -> the pods that hold a share of it


def audit(nodes: list[dict[str, Any]], pods: list[dict[str, Any]]) -> Audit:
    """Recompute every GPU's use from the nodes' inventories and the bound pods' ``sharegpu.io/assignment``
    annotations (nothing of the extender's state) into a fresh :class:`Ledger`, which refuses any over-allocation or
    MIG overlap; each refusal, and each bound sharegpu pod without a valid assignment for its node, is a finding."""
    specs = {}
    findings: list[str] = []
    for n in nodes:
        text = n["metadata"].get("annotations", {}).get(INVENTORY_ANNOTATION)
        if text:
            try:
                specs[n["metadata"]["name"]] = NodeSpec.from_json(text, DEFAULT_CATALOG)
            except InvalidInventory as e:
                findings.append(f"node {n['metadata']['name']}: {e}")
    led = Ledger(specs.values(), DEFAULT_CATALOG)
    bound = pending = 0
    for p in sorted(pods, key=lambda p: p["metadata"]["name"]):
        key = f"{p['metadata']['namespace']}/{p['metadata']['name']}"
        node = p["spec"].get("nodeName")
        if not node:
            pending += 1
            continue
        bound += 1
        text = p["metadata"].get("annotations", {}).get(ASSIGNMENT)
        if text is None:
            findings.append(f"{key}: bound to {node} without an assignment")
            continue
        try:
            a = Assignment.from_json(text)
        except InvalidAssignment as e:
            findings.append(f"{key}: {e}")
            continue
        if a.node != node or a.pod != key:
            findings.append(f"{key}: bound to {node} but its assignment is {a.pod} on {a.node}")
            continue
        try:
            led.place(a, check_health=False)
        except LedgerError as e:
            findings.append(f"{key}: over-allocation: {e}")
    led.check_invariants()
    per_gpu: dict[str, set[str]] = {}
    for key, a in led.assignments.items():
        for s in a.shares:
            per_gpu.setdefault(s.gpu_uuid, set()).add(key)
    return Audit(bound, pending, findings, per_gpu)


def status_json(rig: Rig) -> dict[str, Any]:
    out = subprocess.run(
        sharegpu_argv("status", "--kubeconfig", str(rig.kubeconfig), "--json"),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return dict(json.loads(out.stdout))


# ----- the mixed load of issue 8 -----------------------------------------------------------------------------------
# Five nodes of different models, some GPUs in MIG mode: room for well under 300 mixed pods, so the cluster saturates.
LOAD_NODES: dict[str, list[dict[str, Any]]] = {
    "h100": [{"model": "H100-80GB", "count": 2}, {"model": "H100-80GB", "count": 1, "mig": True}],
    "a100-80": [{"model": "A100-80GB", "count": 1}, {"model": "A100-80GB", "count": 1, "mig": True}],
    "a100-40": [{"model": "A100-40GB", "count": 1, "mig": True}, {"model": "A30-24GB", "count": 1}],
    "a30": [{"model": "A30-24GB", "count": 2, "mig": True}],
    "t4": [{"model": "T4", "count": 2}],
}


# Room for every pod of mixed_pods(150) (issue 32: pods that declare no user pack as densely as before the one-user
# rule, so a cluster that held all 150 before it holds them again): eleven nodes of 16 GPUs, every model of the
# mixed load's pins with room to spare. In-process, with the sharegpu policy, 150 of 150 bind in creation order and
# in 30 shuffled orders; with at most one MPS daemon per GPU (--mps-daemons-per-gpu 1) 146 to 150.
ROOMY_NODES: dict[str, list[dict[str, Any]]] = {
    "h100-0": [{"model": "H100-80GB", "count": 15}, {"model": "H100-80GB", "count": 1, "mig": True}],
    "h100-1": [{"model": "H100-80GB", "count": 16}],
    "h100-2": [{"model": "H100-80GB", "count": 16}],
    "a100-0": [{"model": "A100-80GB", "count": 14}, {"model": "A100-80GB", "count": 2, "mig": True}],
    "a100-1": [{"model": "A100-80GB", "count": 16}],
    "a100-40": [{"model": "A100-40GB", "count": 14}, {"model": "A100-40GB", "count": 2, "mig": True}],
    "t4-0": [{"model": "T4", "count": 16}],
    "t4-1": [{"model": "T4", "count": 16}],
    "t4-2": [{"model": "T4", "count": 16}],
    "t4-3": [{"model": "T4", "count": 16}],
    "a30": [{"model": "A30-24GB", "count": 14}, {"model": "A30-24GB", "count": 2, "mig": True}],
}


def mixed_pods(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` pods of every kind sharegpu places: MPS shares with memory and compute limits (isolation memory),
    time-sliced shares, hardware-isolated MIG instances, whole GPUs and 2-GPU pods, some pinned to GPU models. Like
    most pods they declare no user (no securityContext): each MPS client is a tenant of its own."""
    import random

    rng = random.Random(seed)
    pods = []
    for i in range(n):
        kind = ("mps", "mps", "ts", "mig", "whole", "multi")[i % 6]
        limits: dict[str, str] = {}
        ann: dict[str, str] = {}
        if kind == "mps":
            limits = {"sharegpu.io/gpu": "1", "sharegpu.io/gpu-memory": f"{rng.choice([2, 4, 8, 12, 20])}Gi",
                      "sharegpu.io/gpu-compute": str(rng.choice([10, 20, 30, 50]))}  # fmt: skip
            ann["sharegpu.io/isolation"] = "memory"
        elif kind == "ts":
            limits = {"sharegpu.io/gpu": "1", "sharegpu.io/gpu-memory": f"{rng.choice([1, 2, 4])}Gi"}
            ann["sharegpu.io/sharing"] = "time-slicing"
        elif kind == "mig":
            limits = {"sharegpu.io/gpu": "1", "sharegpu.io/gpu-memory": f"{rng.choice([5, 10, 20])}Gi"}
            ann["sharegpu.io/isolation"] = "hardware"
        elif kind == "whole":
            limits = {"sharegpu.io/gpu": "1"}
        else:
            limits = {"sharegpu.io/gpu": "2"}
        if i % 7 == 0:
            ann["sharegpu.io/gpu-model"] = rng.choice(["H100-80GB", "A100-80GB,A100-40GB", "T4", "A30-24GB"])
        pods.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"{kind}-{i:04d}", "annotations": ann},
                "spec": {
                    "schedulerName": SCHEDULER_NAME,
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "main",
                            "image": "registry.example/app:1",
                            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": limits},
                        },
                    ],
                },
            }
        )
    return pods


def unreported_binds(rig: Rig, pods: list[dict[str, Any]]) -> list[str]:
    """Pods the API server shows bound for which no extender process reported that bind as a success (its log line
    ``bound NS/NAME to NODE``): a bind that succeeded but was reported failed shows up here (a retry of such a pod
    finds it bound and reports that as an error, never as a success)."""
    import re

    reported: dict[str, str] = {}
    for p in rig.procs:
        if p.name.startswith("extender"):
            for m in re.finditer(r" bound (\S+) to (\S+):", p.text()):
                reported[m.group(1)] = m.group(2)
    return [
        f"{key} on {node}"
        for pod in pods
        if (node := pod["spec"].get("nodeName"))
        and reported.get(key := f"{pod['metadata']['namespace']}/{pod['metadata']['name']}") != node
    ]


def status_agrees(report: dict[str, Any], result: Audit, node_names: Iterable[str]) -> list[str]:
    """Where ``sharegpu status --json`` disagrees with the audit recomputed from the API server."""
    names = set(node_names)
    seen: dict[str, set[str]] = {}
    for node in report["nodes"]:
        if node["name"] in names:
            for g in node["gpus"]:
                pods = set(g["pods"]) | {p for inst in g["mig"] for p in inst["pods"]}
                if pods:
                    seen[g["uuid"]] = pods
    return [
        f"{gpu}: status shows {sorted(seen.get(gpu, ()))}, the API server's pods give {sorted(result.per_gpu.get(gpu, ()))}"
        for gpu in sorted(set(seen) | set(result.per_gpu))
        if seen.get(gpu) != result.per_gpu.get(gpu)
    ]
