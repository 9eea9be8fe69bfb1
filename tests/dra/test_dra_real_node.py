"""The DRA driver on the rig's real node: kubelet v1.36 + containerd 2.3 run busybox pods whose claims it prepared.

Each test starts ``sharegpu dra-driver --backend sim`` (two simulated H100-80GB) as its own process for the real node,
with the kubelet's root directory and containerd's CDI directory, and a state directory of its own. The real
kube-scheduler allocates the claims on the slices the driver publishes, the real kubelet calls NodePrepareResources
and containerd applies the CDI specs; each container prints ``env`` and the test reads the log back through the API.

Run by hand (one real node per machine; the ``real_node`` fixture holds the machine-wide lock):
    SHAREGPU_TEST_KUBECONFIG=/tmp/k8s-dev/kubeconfig SHAREGPU_TEST_K8S_REAL=/tmp/k8s-dev \
        uv run pytest tests/dra/test_dra_real_node.py -v
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from realnode import BUSYBOX, RealNode, env_lines, wait_until
from sharegpu.model.contract import DEVICE_PATH_LABEL, MIG_CLASS, SHARED_CLASS, WHOLE_CLASS
from sharegpu.model.tenant import tenant_dir
from sharegpu.node.backends.sim import SimBackend
from sharegpu.node.backends.sim_config import SimConfig, SimGpuGroup
from sharegpu.node.dra.classes import device_classes

DRIVER = "gpu.sharegpu.io"
GIB = 1024
GPU_MEMORY_MIB = 80 * GIB
GPU_CONFIG = {"apiVersion": "gpu.sharegpu.io/v1alpha1", "kind": "GpuConfig"}
# The simulated MPS daemon's marker file, read through the pipe directory's mount, says whose daemon it is (its unit
# and tenant); the mount's source (mountinfo's root field: the host directory bound there) says which directory it is.
PRINT_ENV = (
    'env | sort; echo "MPS_MARKER=$(cat /run/sharegpu/mps/sim-mps-daemon.json 2>/dev/null)"; '
    """awk '$5 == "/run/sharegpu/mps" {m = $4} END {print "MPS_MOUNT=" m}' /proc/self/mountinfo; """
    'echo "UID=$(id -u)"; echo "--- end"'
)


def mib(gib: int) -> str:
    return f"0={gib * GIB}M"


# ----- the driver process and the test's objects ---------------------------------------------------------------
@dataclass
class DriverProcess:
    node: RealNode
    root: Path
    interval: float = 10.0
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def log(self) -> Path:
        return self.root / "driver.log"

    @property
    def health_file(self) -> Path:
        return self.root / "health.yaml"

    def write_config(self) -> Path:
        path = self.root / "sim.yaml"
        path.write_text(
            "gpus: [{model: H100-80GB, count: 2}]\n"
            f"stateFile: {self.root / 'sim-state.json'}\nhealthFile: {self.health_file}\n"
        )
        return path

    def start(self) -> None:
        assert self.proc is None
        exe = Path(sys.executable).parent / "sharegpu"
        args = [str(exe), "dra-driver", "--node-name", self.node.name, "--kubeconfig", str(self.node.kubeconfig)]
        args += ["--backend", "sim", "--sim-config", str(self.write_config())]
        args += ["--kubelet-dir", str(self.node.kubelet_dir), "--cdi-dir", str(self.node.cdi_dir)]
        args += ["--interval", str(self.interval)]
        env = {**os.environ, "SHAREGPU_STATE_DIR": str(self.state_dir)}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.starts += 1

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def checkpoint(self) -> dict[str, Any]:
        """The driver's prepared claims as its checkpoint record holds them (read through the record's own loader,
        which checks its kind, version and checksum)."""
        from sharegpu.node.dra.checkpoint import KIND, VERSION
        from sharegpu.node.durable import load_record

        path = self.state_dir / "dra-checkpoint.json"
        data: dict[str, Any] = load_record(path, KIND, VERSION)["claims"] if path.exists() else {}
        return data

    def gpu_uuids(self) -> list[str]:
        # The simulated UUIDs derive from the node name (the driver's seed), as the driver's own backend does.
        return [d.uuid for d in SimBackend(SimConfig((SimGpuGroup("H100-80GB", 2),)), seed=self.node.name).devices()]

    def mig_instances(self) -> dict[str, tuple[int, str, int]]:
        """MIG UUID → (GPU index, profile, start) from the simulated GPUs' state file."""
        path = self.root / "sim-state.json"
        if not path.exists():
            return {}
        state = json.loads(path.read_text())
        return {i["uuid"]: (n, i["profile"], i["start"]) for n, g in enumerate(state["gpus"]) for i in g["instances"]}


@dataclass
class Session:
    """One test on the real node: its namespace, its driver, and what it must undo."""

    node: RealNode
    ns: str
    driver: DriverProcess
    created_classes: list[str] = field(default_factory=list)
    labelled: bool = False

    def kubectl(self, *args: str, **kw: Any) -> str:
        return self.node.kubectl(*args, **kw)

    def apply(self, *objs: dict[str, Any]) -> None:
        path = self.driver.root / f"apply-{uuid.uuid4().hex[:8]}.json"
        path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)}))
        self.kubectl("apply", "-n", self.ns, "-f", str(path))

    def get(self, kind: str, name: str = "", ns: bool = True) -> Any:
        args = ["get", kind, *([name] if name else []), "-o", "json"]
        return json.loads(self.kubectl(*args, *(["-n", self.ns] if ns else [])))

    def slices(self) -> list[dict[str, Any]]:
        out = self.get("resourceslices", ns=False)["items"]
        return [s for s in out if s["spec"].get("driver") == DRIVER and s["spec"].get("nodeName") == self.node.name]

    def pod_phase(self, name: str) -> str:
        return str(self.get("pod", name)["status"].get("phase", ""))

    def pod_log(self, name: str, container: str = "main") -> str:
        return self.kubectl("logs", "-n", self.ns, name, "-c", container)

    def wait_pods(self, names: list[str], phases: tuple[str, ...], timeout: float = 90) -> None:
        def done() -> bool:
            pods = {p["metadata"]["name"]: p for p in self.get("pods")["items"]}
            for n in names:
                phase = pods.get(n, {}).get("status", {}).get("phase", "")
                if phase == "Failed" or _waiting_error(pods.get(n, {})):
                    raise AssertionError(
                        f"pod {n} failed: {json.dumps(pods[n].get('status'), indent=1)}\n{self.events()}"
                    )
                if phase not in phases:
                    return False
            return True

        try:
            wait_until(done, f"pods {names} {'/'.join(phases)}", timeout=timeout, every=0.5)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.events()}\ndriver log:\n{self.driver.log_text()[-4000:]}") from None

    def wait_printed(self, names: list[str], timeout: float = 90) -> None:
        self.wait_pods(names, ("Running",), timeout)
        for n in names:
            wait_until(lambda n=n: "--- end" in self.pod_log(n), f"{n} printed its env", timeout=30)  # type: ignore[misc]

    def unschedulable(self, name: str, why: str = "cannot allocate all claims", timeout: float = 60) -> str:
        """Wait until the kube-scheduler has tried pod ``name`` and found no device for its claims (PodScheduled:
        False, Unschedulable, with ``why`` in the message, as its DRA plugin says it); the message."""

        def judged() -> str:
            for cond in self.get("pod", name).get("status", {}).get("conditions") or []:
                if cond.get("type") == "PodScheduled" and cond.get("reason") == "Unschedulable":
                    message = str(cond.get("message", ""))
                    return message if why in message else ""
            return ""

        try:
            return str(wait_until(judged, f"the kube-scheduler to find no room for {name} ({why})", timeout=timeout))
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.events()}") from None

    def events(self) -> str:
        return self.kubectl("get", "events", "-n", self.ns, "--sort-by=.lastTimestamp", check=False)

    def claim_of(self, pod: str) -> dict[str, Any]:
        """The ResourceClaim the pod's claim "gpu" resolved to (its own, or one made from its template)."""
        p = self.get("pod", pod)
        [status] = [s for s in p["status"].get("resourceClaimStatuses", []) if s["name"] == "gpu"] or [
            {"resourceClaimName": c["resourceClaimName"]} for c in p["spec"]["resourceClaims"] if c["name"] == "gpu"
        ]
        claim: dict[str, Any] = self.get("resourceclaim", status["resourceClaimName"])
        return claim


def _waiting_error(pod: dict[str, Any]) -> bool:
    for s in pod.get("status", {}).get("containerStatuses", []) or []:
        reason = (s.get("state", {}).get("waiting") or {}).get("reason", "")
        if reason in ("CreateContainerError", "CreateContainerConfigError", "RunContainerError", "ErrImageNeverPull"):
            return True
    return False


@pytest.fixture
def session(real_node: RealNode) -> Iterator[Session]:
    root = Path(tempfile.mkdtemp(prefix="dra-real", dir="/tmp"))
    ns = f"dra-real-{uuid.uuid4().hex[:6]}"
    s = Session(real_node, ns, DriverProcess(real_node, root))
    node = s.get("node", real_node.name, ns=False)
    s.labelled = DEVICE_PATH_LABEL not in node["metadata"].get("labels", {})
    if s.slices():
        pytest.fail(f"node {real_node.name} already has {DRIVER} ResourceSlices: another driver runs there")
    existing = {c["metadata"]["name"] for c in s.get("deviceclasses", ns=False)["items"]}
    for cls in device_classes():
        if cls["metadata"]["name"] not in existing:
            s.created_classes.append(cls["metadata"]["name"])
            path = root / f"class-{cls['metadata']['name']}.json"
            path.write_text(json.dumps(cls))
            s.kubectl("create", "-f", str(path))
    s.kubectl("create", "namespace", ns)
    try:
        yield s
    finally:
        try:
            _cleanup(s)
        finally:
            shutil.rmtree(root, ignore_errors=True)


def _cleanup(s: Session) -> None:
    # Pods first, with the driver still running, so that the kubelet unprepares their claims through it.
    s.kubectl("delete", "namespace", s.ns, "--wait=false", check=False)
    if not s.driver.alive():
        s.driver.start()  # a test that failed with the driver down: unprepare needs it
    try:
        wait_until(
            lambda: not s.kubectl("get", "pods", "-n", s.ns, "-o", "name", check=False).strip(),
            "the test's pods deleted",
            timeout=90,
        )
        wait_until(
            lambda: (
                "NotFound"
                in subprocess.run(
                    ["kubectl", "--kubeconfig", str(s.node.kubeconfig), "get", "namespace", s.ns],
                    capture_output=True,
                    text=True,
                    check=False,
                ).stderr
            ),
            "the test's namespace deleted",
            timeout=90,
        )
    finally:
        # Each step on its own: one that fails (the API server gone) must not leave the others undone.
        s.driver.stop()
        for spec in s.node.cdi_dir.glob("sharegpu.io-gpu_*.json"):
            spec.unlink(missing_ok=True)  # a claim the kubelet never unprepared (a failed test): not ours to keep
        try:
            names = [sl["metadata"]["name"] for sl in s.slices()]
        except AssertionError:
            names = []
        for name in names:  # the driver leaves its slices for the next driver; the test removes them
            s.kubectl("delete", "resourceslice", name, "--ignore-not-found", check=False)
        for name in s.created_classes:
            s.kubectl("delete", "deviceclass", name, "--ignore-not-found", check=False)
        if s.labelled:
            s.kubectl("label", "node", s.node.name, f"{DEVICE_PATH_LABEL}-", check=False)


# ----- manifests ------------------------------------------------------------------------------------------------
def claim_spec(
    cls: str,
    capacity: dict[str, str] | None = None,
    cel: str | None = None,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": cls}
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    if cel:
        exactly["selectors"] = [{"cel": {"expression": cel}}]
    spec: dict[str, Any] = {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}
    if config:
        spec["devices"]["config"] = [
            {"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": GPU_CONFIG | config}}
        ]
    return spec


def claim_obj(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name}, "spec": spec}


def template_obj(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": spec},
    }


def pod_obj(
    name: str,
    node: str,
    claim: str | None = None,
    template: str | None = None,
    sleep: bool = False,
    mps: bool = False,
    user: int | None = 0,
) -> dict[str, Any]:
    ref: dict[str, str] = {"name": "gpu"}
    ref |= {"resourceClaimName": claim} if claim else {"resourceClaimTemplateName": str(template)}
    command = PRINT_ENV + ("; exec sleep 3600" if sleep else "")
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {"kubernetes.io/hostname": node},
            # No hostIPC: an MPS client reaches its daemon through the pipe directory (measured on an H200). One user
            # for all (unless ``user`` says otherwise): the pods of one namespace and one declared UID are one MPS
            # tenant, served by one daemon per GPU; a pod that declares none is a tenant of its own.
            **({"securityContext": {"runAsUser": user}} if user is not None else {}),
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "main",
                    "image": BUSYBOX,
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", command],
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
            "resourceClaims": [ref],
        },
    }


def index_is(i: int) -> str:
    return f'device.attributes["{DRIVER}"].index == {i}'


def profile_is(p: str) -> str:
    return f'device.attributes["{DRIVER}"].profile == "{p}"'


# ----- what a container must have seen -------------------------------------------------------------------------
def expected_env(s: Session, claim: dict[str, Any]) -> dict[str, str]:
    """The exact NVIDIA_/CUDA_/SHAREGPU_ variables this claim's containers get, from its allocation."""
    [result] = claim["status"]["allocation"]["devices"]["results"]
    device, pool = result["device"], result["pool"]
    assert pool == s.node.name
    uid = claim["metadata"]["uid"]
    prepared = s.driver.checkpoint()[uid]
    [unit] = prepared["units"]
    [dev] = prepared["devices"]
    assert dev["device"] == device  # what was prepared is what the scheduler allocated
    gpus = s.driver.gpu_uuids()
    if "-mig-" in device:
        gpu, profile, start = s.driver.mig_instances()[unit]  # the instance exists, at the allocated placement
        assert device == f"gpu-{gpu}-mig-{profile.replace('.', '')}-{start}"
    else:
        assert unit == gpus[int(device.split("-")[1])]
    env = {"NVIDIA_VISIBLE_DEVICES": unit, "SHAREGPU_MECHANISM": dev["mechanism"]}
    if dev["mechanism"] == "mps":
        # The thread cap is the share against the other clients its tenant's daemon had at Prepare (the first one
        # prepared there is alone: 100 %), so it depends on the order of Prepares: read from the claim's CDI spec,
        # and held to what that rule allows.
        spec = json.loads((s.node.cdi_dir / f"sharegpu.io-gpu_{uid}.json").read_text())
        written = dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])
        pct = written["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]
        assert dev["compute_percent"] <= int(pct) <= 100, (pct, dev)
        env |= {
            "CUDA_MPS_PIPE_DIRECTORY": "/run/sharegpu/mps",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": pct,
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={dev['memory_mib']}M",
        }
    return env


def daemon_pipe(s: Session, claim: dict[str, Any]) -> Path:
    """The host pipe directory of the MPS daemon the claim was prepared into: its tenant's on its unit."""
    prepared = s.driver.checkpoint()[claim["metadata"]["uid"]]
    [unit] = prepared["units"]
    return s.driver.state_dir / "mps" / unit / tenant_dir(prepared["tenant"]) / "pipe"


def check_container(s: Session, pod: str, want: dict[str, str]) -> str:
    log = s.pod_log(pod)
    assert "--- end" in log, log
    seen = env_lines(log)
    assert seen == want, f"pod {pod} saw {seen}, expected exactly {want}"
    if want.get("SHAREGPU_MECHANISM") == "mps":
        # The pipe directory mounted is the daemon's of exactly this unit.
        assert mps_marker(log)["unit"] == want["NVIDIA_VISIBLE_DEVICES"], log
    else:
        assert "MPS_MARKER=\n" in log and "MPS_MOUNT=\n" in log, log  # no MPS pipe directory mounted
    return log


def mps_marker(log: str) -> dict[str, Any]:
    """The simulated daemon's marker, read in the container through its pipe directory's mount."""
    [line] = [x for x in log.splitlines() if x.startswith("MPS_MARKER=")]
    marker: dict[str, Any] = json.loads(line.removeprefix("MPS_MARKER="))
    return marker


def printed(log: str, key: str) -> str:
    [line] = [x for x in log.splitlines() if x.startswith(f"{key}=")]
    return line.removeprefix(f"{key}=")


def wait_driver_ready(s: Session, timeout: float = 30) -> None:
    def ready() -> bool:
        if not s.driver.alive():
            raise AssertionError(f"the driver exited:\n{s.driver.log_text()[-3000:]}")
        return len(s.slices()) == 4 and "the kubelet registered DRA driver" in s.driver.log_text()

    wait_until(ready, "the driver's 4 slices published and the plugin registered", timeout=timeout)


# ----- 1. the docs' examples as real pods ----------------------------------------------------------------------
def test_docs_examples_run_as_real_pods_and_each_container_sees_only_its_claim(session: Session) -> None:
    s, node = session, session.node.name
    s.driver.start()
    wait_driver_ready(s)

    # Phase A: the 80/20 MPS split and the time-sliced notebook (two GPUs hold all three).
    shared = SHARED_CLASS
    s.apply(
        claim_obj("heavy-inference", claim_spec(shared, {"memory": "64Gi", "compute": "80"})),
        claim_obj("light-inference", claim_spec(shared, {"memory": "16Gi", "compute": "20"})),
        template_obj(
            "notebook",
            claim_spec(
                shared,
                {"memory": "8Gi", "compute": "25"},
                config={"sharing": "TimeSlicing", "timeSliceInterval": "Short"},
            ),
        ),
        pod_obj("heavy", node, claim="heavy-inference", sleep=True, mps=True),
        pod_obj("light", node, claim="light-inference", sleep=True, mps=True),
        pod_obj("notebook", node, template="notebook", sleep=True),
    )
    # Running, not Succeeded: a finished pod's claim from a template is deleted at once (read it while it runs).
    s.wait_printed(["heavy", "light", "notebook"])
    heavy, light, notebook = (s.claim_of(p) for p in ("heavy", "light", "notebook"))
    caps: dict[str, str | None] = {}
    for pod, claim, mech, mem in (
        ("heavy", heavy, "mps", mib(64)),
        ("light", light, "mps", mib(16)),
        ("notebook", notebook, "time-slicing", None),
    ):
        want = expected_env(s, claim)
        assert want["SHAREGPU_MECHANISM"] == mech and want.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") == mem
        caps[pod] = want.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
        check_container(s, pod, want)
    # Both pods run as uid 0 in one namespace: one tenant, one daemon on the GPU they share. The first prepared was
    # its only client (all threads); the second got its share against both (80 of 100, or 20).
    assert caps in (
        {"heavy": "100", "light": "20", "notebook": None},
        {"heavy": "80", "light": "100", "notebook": None},
    )
    assert daemon_pipe(s, heavy) == daemon_pipe(s, light)
    # The CDI specs name no device node (the simulated GPUs have none), so containerd started the containers.
    for claim in (heavy, light, notebook):
        spec = json.loads((s.node.cdi_dir / f"sharegpu.io-gpu_{claim['metadata']['uid']}.json").read_text())
        assert all(d["containerEdits"]["deviceNodes"] == [] for d in spec["devices"])
    s.kubectl("delete", "pod", "-n", s.ns, "heavy", "light", "notebook", "--wait=true", timeout=120)
    s.kubectl("delete", "resourceclaim", "-n", s.ns, "heavy-inference", "light-inference", "--wait=true")
    wait_until(lambda: not s.driver.checkpoint(), "phase A's claims unprepared", timeout=60)
    assert not list(s.node.cdi_dir.glob("sharegpu.io-gpu_*.json"))  # Unprepare removed every spec

    # Phase B: a 3g MIG partition and a dedicated GPU (one GPU each).
    s.apply(
        template_obj("mig-3g", claim_spec(MIG_CLASS, cel=profile_is("3g.40gb"))),
        template_obj("dedicated", claim_spec(WHOLE_CLASS)),
        pod_obj("mig", node, template="mig-3g", sleep=True),
        pod_obj("dedicated", node, template="dedicated", sleep=True),
    )
    s.wait_printed(["mig", "dedicated"])
    mig_claim, dedicated = s.claim_of("mig"), s.claim_of("dedicated")
    want_mig = expected_env(s, mig_claim)
    assert want_mig["SHAREGPU_MECHANISM"] == "mig" and want_mig["NVIDIA_VISIBLE_DEVICES"].startswith("MIG-")
    check_container(s, "mig", want_mig)
    want_dedicated = expected_env(s, dedicated)
    assert want_dedicated["SHAREGPU_MECHANISM"] == "exclusive"
    check_container(s, "dedicated", want_dedicated)
    assert want_dedicated["NVIDIA_VISIBLE_DEVICES"] != want_mig["NVIDIA_VISIBLE_DEVICES"]
    s.kubectl("delete", "pod", "-n", s.ns, "mig", "dedicated", "--wait=true", timeout=120)
    wait_until(lambda: not s.driver.checkpoint(), "phase B's claims unprepared", timeout=60)
    wait_until(lambda: not s.driver.mig_instances(), "the 3g instance released", timeout=30)

    # Phase C: MPS inside a MIG instance: one 1g claim (sharing: MPS) used by two pods at once.
    s.apply(
        claim_obj("mig-mps", claim_spec(MIG_CLASS, cel=profile_is("1g.10gb"), config={"sharing": "MPS"})),
        pod_obj("mig-mps-a", node, claim="mig-mps", sleep=True, mps=True),
        pod_obj("mig-mps-b", node, claim="mig-mps", sleep=True, mps=True),
    )
    s.wait_printed(["mig-mps-a", "mig-mps-b"])
    shared_mig = s.claim_of("mig-mps-a")
    want = expected_env(s, shared_mig)
    assert want["NVIDIA_VISIBLE_DEVICES"].startswith("MIG-") and want["SHAREGPU_MECHANISM"] == "mps"
    assert want["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
    assert want["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"  # the 1g.10gb instance's memory
    check_container(s, "mig-mps-a", want)
    check_container(s, "mig-mps-b", want)
    assert len(shared_mig["status"]["reservedFor"]) == 2  # one claim, two pods: prepared once
    assert s.driver.log_text().count(f"prepared claim {s.ns}/mig-mps ") == 1


# ----- 2. health: an unhealthy simulated GPU shows in the pod's status -----------------------------------------
def resource_health(s: Session, pod: str) -> dict[str, str]:
    """resourceID → health from status.containerStatuses[].allocatedResourcesStatus."""
    out: dict[str, str] = {}
    for c in s.get("pod", pod)["status"].get("containerStatuses", []) or []:
        for entry in c.get("allocatedResourcesStatus", []) or []:
            assert entry["name"] == "claim:gpu", entry  # "claim:<the pod's claim name>" (kubelet v1.36)
            for r in entry.get("resources", []) or []:
                out[r["resourceID"]] = r.get("health", "")
    return out


def test_an_unhealthy_simulated_gpu_appears_in_the_pods_status(session: Session) -> None:
    s, node = session, session.node.name
    s.driver.interval = 2
    s.driver.start()
    wait_driver_ready(s)
    s.apply(
        claim_obj("on-gpu-0", claim_spec(WHOLE_CLASS, cel=index_is(0))),
        claim_obj("on-gpu-1", claim_spec(WHOLE_CLASS, cel=index_is(1))),
        pod_obj("p0", node, claim="on-gpu-0", sleep=True),
        pod_obj("p1", node, claim="on-gpu-1", sleep=True),
    )
    s.wait_pods(["p0", "p1"], ("Running",))
    # The kubelet v1.36 names each resource by the CDI device ID the driver answered at Prepare.
    id0, id1 = (f"sharegpu.io/gpu={s.claim_of(p)['metadata']['uid']}-gpu-gpu-{i}" for i, p in enumerate(("p0", "p1")))
    wait_until(lambda: resource_health(s, "p1") == {id1: "Healthy"}, "p1's GPU reported Healthy", timeout=60)
    assert resource_health(s, "p0") == {id0: "Healthy"}

    s.driver.health_file.write_text("unhealthy: [1]\n")
    t0 = time.monotonic()
    wait_until(lambda: resource_health(s, "p1") == {id1: "Unhealthy"}, "p1's GPU reported Unhealthy", timeout=60)
    took = time.monotonic() - t0
    assert resource_health(s, "p0") == {id0: "Healthy"}  # the other GPU's pod is not touched
    # The unhealthy GPU is withdrawn from the pool: its device slice is gone, the pool's generation went up.
    wait_until(lambda: len(s.slices()) == 2, "gpu-1's slices withdrawn", timeout=30)
    assert "gpu-1" not in {d["name"] for sl in s.slices() for d in sl["spec"].get("devices", [])}
    assert s.pod_phase("p1") == "Running"  # a running pod keeps its GPU; nothing new lands there

    s.driver.health_file.write_text("unhealthy: []\n")
    wait_until(lambda: resource_health(s, "p1") == {id1: "Healthy"}, "p1's GPU Healthy again", timeout=60)
    wait_until(lambda: len(s.slices()) == 4, "gpu-1 published again", timeout=30)
    print(f"unhealthy GPU seen in the pod's status {took:.1f}s after the health file changed")


# ----- 3. a kubelet restart: slices back at once ---------------------------------------------------------------
def test_slices_are_back_within_seconds_of_a_kubelet_restart(session: Session) -> None:
    s = session
    s.driver.interval = 120  # the timer cannot be what brings them back
    s.driver.start()
    wait_driver_ready(s)
    before = {sl["metadata"]["name"]: sl["metadata"]["uid"] for sl in s.slices()}
    registrations = s.driver.log_text().count("the kubelet registered DRA driver")
    s.node.restart_kubelet()
    back = time.monotonic()

    def republished() -> bool:
        now = {sl["metadata"]["name"]: sl["metadata"]["uid"] for sl in s.slices()}
        return set(now) == set(before) and all(now[n] != before[n] for n in now)

    wait_until(
        republished, "the kubelet to delete the slices and the driver to publish them again", timeout=20, every=0.1
    )
    took = time.monotonic() - back
    assert s.driver.log_text().count("the kubelet registered DRA driver") > registrations
    assert took < 3.0, f"slices back {took:.1f}s after the kubelet restarted"
    print(f"slices recreated {took:.2f}s after kubelet-node.sh restart-kubelet returned")
    # And they stay: the kubelet's wipe at start does not remove them again later.
    time.sleep(5)
    assert {sl["metadata"]["name"] for sl in s.slices()} == set(before)


# ----- 4. restarts in the middle of a burst --------------------------------------------------------------------
def test_kubelet_and_driver_restarts_mid_burst_keep_shares_and_hand_nothing_out_twice(session: Session) -> None:
    s, node = session, session.node.name
    s.driver.interval = 2
    s.driver.start()
    wait_driver_ready(s)
    share = claim_spec(SHARED_CLASS, {"memory": "10Gi", "compute": "25"})
    names = [f"burst-{i}" for i in range(9)]  # 8 fill both GPUs (4 x 25 % each); the ninth cannot fit
    s.apply(*(claim_obj(n, share) for n in names))

    first = names[:3]
    s.apply(*(pod_obj(n, node, claim=n, sleep=True, mps=True) for n in first))
    s.wait_pods(first, ("Running",))
    running = {n: s.get("pod", n)["status"]["containerStatuses"][0]["containerID"] for n in first}
    specs = {n: s.node.cdi_dir / f"sharegpu.io-gpu_{s.claim_of(n)['metadata']['uid']}.json" for n in first}
    assert all(p.exists() for p in specs.values())

    # The burst: pods arrive while the kubelet restarts and the driver is killed and started again.
    s.apply(*(pod_obj(n, node, claim=n, sleep=True, mps=True) for n in names[3:5]))
    s.node.restart_kubelet()
    s.apply(*(pod_obj(n, node, claim=n, sleep=True, mps=True) for n in names[5:7]))
    time.sleep(0.5)
    s.driver.stop(signal.SIGKILL)
    assert all(p.exists() for p in specs.values())  # a killed driver leaves the running pods' specs
    s.apply(*(pod_obj(n, node, claim=n, sleep=True, mps=True) for n in names[7:]))
    s.driver.start()
    t0 = time.monotonic()
    s.wait_pods(names[:8], ("Running",), timeout=150)
    print(f"all 8 pods running {time.monotonic() - t0:.1f}s after the driver started again")
    # The ninth stays pending because the scheduler's allocator found no room for it (not because it was not tried
    # yet): had anything been handed out twice, it would have been allocated rather than judged so.
    s.unschedulable(names[8])
    assert s.pod_phase(names[8]) == "Pending"
    assert not s.get("resourceclaim", names[8]).get("status", {}).get("allocation")

    # Running pods kept their container (no restart) and their CDI spec.
    for n in first:
        st = s.get("pod", n)["status"]["containerStatuses"][0]
        assert st["containerID"] == running[n] and st["restartCount"] == 0
        assert specs[n].exists()
    # Every pod saw exactly its own claim's share.
    claims = {n: s.claim_of(n) for n in names[:8]}
    caps: dict[str, list[int]] = {}
    for n in names[:8]:
        wait_until(lambda n=n: "--- end" in s.pod_log(n), f"{n} printed its env")  # type: ignore[misc]
        want = expected_env(s, claims[n])
        assert want["SHAREGPU_MECHANISM"] == "mps" and want["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == mib(10)
        caps.setdefault(want["NVIDIA_VISIBLE_DEVICES"], []).append(int(want["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]))
        check_container(s, n, want)
    # One tenant (uid 0): per GPU one daemon, whose k-th client prepared got 25 % against k clients' 25 % each.
    assert {gpu: sorted(c) for gpu, c in caps.items()} == {gpu: [25, 33, 50, 100] for gpu in s.driver.gpu_uuids()}
    # Nothing handed out twice: per GPU, the allocations and the driver's checkpoint stay within its capacity.
    used: dict[str, list[int]] = {}
    share_ids = set()
    for c in claims.values():
        [r] = c["status"]["allocation"]["devices"]["results"]
        share_ids.add(r["shareID"])
        used.setdefault(r["device"], []).append(int(r["consumedCapacity"]["compute"]))
    assert len(share_ids) == 8
    assert sorted(used) == ["gpu-0", "gpu-1"] and all(sum(v) <= 100 for v in used.values()), used
    prepared = s.driver.checkpoint()
    assert set(prepared) == {c["metadata"]["uid"] for c in claims.values()}
    per_unit: dict[str, tuple[int, int]] = {}
    for p in prepared.values():
        [d] = p["devices"]
        compute, memory = per_unit.get(d["gpu_uuid"], (0, 0))
        per_unit[d["gpu_uuid"]] = (compute + d["compute_percent"], memory + d["memory_mib"])
    assert all(c <= 100 and m <= GPU_MEMORY_MIB for c, m in per_unit.values()), per_unit
    assert s.driver.starts == 2 and "the kubelet registered DRA driver" in s.driver.log_text()


# ----- 5. MPS tenants: claims of two tenants on one GPU at once, each through its own daemon ----------------------
def pod_events(s: Session, pod: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = s.get("events")["items"]
    return [e for e in items if e.get("involvedObject", {}).get("name") == pod]


def test_mps_claims_of_two_tenants_share_a_gpu_each_through_its_own_daemon(session: Session) -> None:
    s, node = session, session.node.name
    s.driver.interval = 2  # the audit's pass: a late pod is told within seconds
    s.driver.start()
    wait_driver_ready(s)
    share = claim_spec(SHARED_CLASS, {"memory": "10Gi", "compute": "30"}, cel=index_is(0))

    # Phase A: a uid-1000 pod and a pod that declares no user (the image's: root), each with an MPS claim on GPU 0.
    s.apply(
        claim_obj("c-1000", share),
        claim_obj("c-anon", share),
        pod_obj("u1000", node, claim="c-1000", sleep=True, mps=True, user=1000),
        pod_obj("anon", node, claim="c-anon", sleep=True, mps=True, user=None),
    )
    s.wait_printed(["u1000", "anon"])
    assert {s.pod_phase("u1000"), s.pod_phase("anon")} == {"Running"}  # at the same time, on one GPU
    gpu = s.driver.gpu_uuids()[0]
    anon_uid = s.get("pod", "anon")["metadata"]["uid"]
    tenants = {"u1000": f"{s.ns}/uid-1000", "anon": f"pod/{anon_uid}"}
    pipes: dict[str, str] = {}
    for pod in ("u1000", "anon"):
        claim = s.claim_of(pod)
        want = expected_env(s, claim)
        assert want["NVIDIA_VISIBLE_DEVICES"] == gpu and want["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
        log = check_container(s, pod, want)
        assert s.driver.checkpoint()[claim["metadata"]["uid"]]["tenant"] == tenants[pod]
        # The daemon it reaches is its own tenant's: the marker read through its mount says so, and the mount's
        # host-side source is that daemon's pipe directory.
        assert mps_marker(log)["tenant"] == tenants[pod], log
        mount = printed(log, "MPS_MOUNT")
        host = daemon_pipe(s, claim)
        assert host == s.driver.state_dir / "mps" / gpu / tenant_dir(tenants[pod]) / "pipe"
        assert mount and str(host).endswith(mount), (mount, host)
        pipes[pod] = mount
        print(f"{pod} (UID {printed(log, 'UID')}): pipe mount {mount}")
    assert pipes["u1000"] != pipes["anon"]
    daemons = sorted(p.name for p in (s.driver.state_dir / "mps" / gpu).iterdir())
    assert daemons == sorted(tenant_dir(t) for t in tenants.values())

    # Phase B: a pod of a third tenant joins c-1000 after its Prepare; the kubelet gives it the claim's devices
    # without asking the driver, and the driver's audit tells it why that is wrong.
    s.apply(pod_obj("joiner", node, claim="c-1000", sleep=True, mps=True, user=None))
    s.wait_printed(["joiner"])
    assert mps_marker(s.pod_log("joiner"))["tenant"] == tenants["u1000"]

    def told() -> str:
        return " ".join(e["message"] for e in pod_events(s, "joiner") if e["reason"] == "GpuAuditMpsOtherTenant")

    message = wait_until(told, "the audit's Event on the pod that joined another tenant's claim", timeout=30)
    assert f"claim {s.ns}/c-1000" in message and "ResourceClaimTemplate" in message, message
    s.kubectl("delete", "pod", "-n", s.ns, "u1000", "anon", "joiner", "--wait=true", timeout=120)
    wait_until(lambda: not s.driver.checkpoint(), "phase A's claims unprepared", timeout=60)
    wait_until(lambda: not (s.driver.state_dir / "mps" / gpu).exists(), "the tenants' daemons stopped", timeout=30)

    # Phase C: one claim shared by pods of two tenants, both reserved before the kubelet can prepare it (the driver
    # is down meanwhile): refused, the pods' events say why and what to change.
    s.driver.stop()
    s.apply(
        claim_obj("c-mixed", share),
        pod_obj("m1000", node, claim="c-mixed", sleep=True, mps=True, user=1000),
        pod_obj("manon", node, claim="c-mixed", sleep=True, mps=True, user=None),
    )
    wait_until(
        lambda: len(s.get("resourceclaim", "c-mixed").get("status", {}).get("reservedFor") or []) == 2,
        "c-mixed reserved for both pods",
        timeout=60,
    )
    s.driver.start()
    wait_driver_ready(s)

    def refused() -> str:
        for pod in ("m1000", "manon"):
            for e in pod_events(s, pod):
                if "used by pods of different MPS tenants" in e.get("message", ""):
                    return str(e["message"])
        return ""

    t0 = time.monotonic()
    message = wait_until(refused, "the kubelet's retry of c-mixed refused with the reason", timeout=150, every=1)
    for what in ("runAsUser", "ResourceClaimTemplate", "--mps-multi-user", "uid 1000 in", "alone"):
        assert what in message, message
    assert {s.pod_phase("m1000"), s.pod_phase("manon")} == {"Pending"}
    assert not s.driver.checkpoint()
    print(f"shared claim of two tenants refused {time.monotonic() - t0:.0f}s after the driver came back: {message}")
