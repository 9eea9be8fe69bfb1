"""The real node of ../shared/k8s-rig (kubelet v1.36 + containerd 2.3): what tests that run real pods need to know.

`.ci/run` starts it beside the rig's control plane (``install-node.sh``, ``kubelet-node.sh start``); by hand, see the
README ("Integration tests on a real control plane"). A test that uses it takes :data:`LOCK` for its whole run: the
kubelet's device-plugin directory is one per machine (``/var/lib/kubelet/device-plugins``), so two tests (or a test
run beside CI) that each started a node agent there would register over each other.

Pods print what they were given (``env``) and the test reads it back with the API's log endpoint.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

LOCK = Path("/tmp/sharegpu-real-node.lock")
DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
BUSYBOX = "k8s-rig/busybox:1.35"
REAL_NODE_LABEL = "k8s-rig/real-node"


@dataclass(frozen=True)
class RealNode:
    name: str
    k8s_real: Path
    kubeconfig: Path
    port_offset: int

    @property
    def kubelet_dir(self) -> Path:
        return self.k8s_real / "node" / "kubelet"

    @property
    def cdi_dir(self) -> Path:
        return self.k8s_real / "node" / "cdi"

    @property
    def plugin_dir(self) -> Path:
        return DEVICE_PLUGIN_DIR

    @property
    def pod_resources_socket(self) -> Path:
        return self.kubelet_dir / "pod-resources" / "kubelet.sock"

    @property
    def kubelet_log(self) -> Path:
        return self.k8s_real / "logs" / "kubelet.log"

    def script(self, *args: str, timeout: float = 120) -> str:
        """``$K8S_REAL/kubelet-node.sh ARGS`` with this rig's folder and port offset."""
        env = {**os.environ, "K8S_REAL": str(self.k8s_real), "K8S_RIG_PORT_OFFSET": str(self.port_offset)}
        out = subprocess.run(
            [str(self.k8s_real / "kubelet-node.sh"), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if out.returncode != 0:
            raise AssertionError(
                f"kubelet-node.sh {' '.join(args)} failed ({out.returncode}):\n{out.stdout}{out.stderr}"
            )
        return out.stdout

    def restart_kubelet(self, attempts: int = 3) -> int:
        """``kubelet-node.sh restart-kubelet``, again (up to ``attempts`` runs) when the rig's script fails.

        The script stops the kubelet, then starts it through steps that can fail on a loaded machine although nothing
        is wrong with the node: its ``ctr images ls -q | grep -qx`` under ``pipefail`` can fail on SIGPIPE ("importing
        registry.k8s.io/pause:3.10.2 failed", seen in CI-like runs), and its ``/readyz`` and Ready checks read the API
        server, which answers slowly or not ready while a burst of pods starts (a CI run failed inside this call with
        no other trace). Every run restarts the kubelet again, which is still what the callers ask for: a kubelet that
        restarted. What each failed run printed is kept for the report when none succeeds. Returns how many runs it
        took (each one restarted the kubelet).
        """
        failures: list[str] = []
        for attempt in range(attempts):
            try:
                self.script("restart-kubelet")
                return attempt + 1
            except (AssertionError, subprocess.TimeoutExpired) as e:
                failures.append(f"run {attempt + 1}: {e}")
                print(f"kubelet-node.sh restart-kubelet, run {attempt + 1} of {attempts}, failed: {e}", flush=True)
                if attempt + 1 < attempts:
                    time.sleep(2.0)
        raise AssertionError("\n".join(failures))

    def plugin_registration(self, resource: str, timeout: float = 60) -> tuple[float, datetime.datetime]:
        """How long the running kubelet waited for ``resource``'s device plugin, and when (UTC) it stopped waiting:
        from starting its registration server (``kubelet.sock``) to the plugin's device list reaching its device
        manager, after which it admits pods asking for the resource. Read from its log (the rig's script starts each
        kubelet with a fresh ``kubelet.log``; klog writes the machine's time, UTC on the rig's machines)."""

        def at(line: str) -> datetime.datetime:
            # klog's header: I1126 10:15:49.493080 (month, day, time of day; no year)
            stamp = " ".join(line.split()[:2])[1:]
            year = datetime.datetime.now(datetime.UTC).year
            return datetime.datetime.strptime(f"{year}{stamp}", "%Y%m%d %H:%M:%S.%f").replace(tzinfo=datetime.UTC)

        def lines() -> tuple[str, str] | None:
            text = self.kubelet_log.read_text(errors="replace").splitlines()
            started = next((ln for ln in text if '"Starting device plugin registration server"' in ln), None)
            pushed = next(
                (ln for ln in text if '"State pushed for device plugin"' in ln and f'resource="{resource}"' in ln), None
            )
            return (started, pushed) if started and pushed else None

        started, pushed = wait_until(lines, f"the kubelet's log to show {resource} registered", timeout)
        return (at(pushed) - at(started)).total_seconds(), at(pushed)

    def allocatable(self, resource: str) -> int:
        """How many devices of ``resource`` the kubelet would hand out now (pod-resources ``GetAllocatableResources``:
        its device manager's healthy devices, so 0 until a restarted kubelet has the plugin's device list again)."""
        import grpc

        from sharegpu.node.proto import podresources_v1_pb2 as pr

        try:
            with grpc.insecure_channel(f"unix://{self.pod_resources_socket}") as channel:
                call = channel.unary_unary(
                    "/v1.PodResourcesLister/GetAllocatableResources",
                    request_serializer=pr.AllocatableResourcesRequest.SerializeToString,
                    response_deserializer=pr.AllocatableResourcesResponse.FromString,
                )
                answer = call(pr.AllocatableResourcesRequest(), timeout=5)
        except grpc.RpcError:
            return 0  # the kubelet is not serving (yet)
        return sum(len(d.device_ids) for d in answer.devices if d.resource_name == resource)

    def wait_allocatable(self, resource: str, timeout: float = 60) -> int:
        """Until the kubelet has devices of ``resource`` to hand out (a plugin registered with it and listed them)."""
        return int(wait_until(lambda: self.allocatable(resource), f"the kubelet to have {resource} devices", timeout))

    def kubectl(self, *args: str, timeout: float = 60, check: bool = True) -> str:
        out = subprocess.run(
            ["kubectl", "--kubeconfig", str(self.kubeconfig), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and out.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {out.stderr}")
        return out.stdout


# Words that every "the rig is not there" skip reason holds (the modules' skipif markers, the real_node fixture).
RIG_MISSING_MARKS = ("SHAREGPU_TEST_KUBECONFIG", "no real node:", "no API server")


def rig_expected() -> bool:
    """True where the rig and its real node must be there: CI (env ``CI``), or a rig named by SHAREGPU_TEST_K8S_REAL
    (what ``.ci/run`` sets once it has started them)."""
    return bool(os.environ.get("CI") or os.environ.get("SHAREGPU_TEST_K8S_REAL"))


def rig_unavailable(reason: str) -> NoReturn:
    """Skip with ``reason`` on a developer's machine; fail where the rig must be there (:func:`rig_expected`)."""
    import pytest

    if rig_expected():
        pytest.fail(f"the rig should be there (CI or SHAREGPU_TEST_K8S_REAL is set) but is not: {reason}")
    pytest.skip(reason)


def _kubelet_alive(k8s_real: Path) -> bool:
    pid_file = k8s_real / "pids" / "kubelet.pid"
    try:
        pid = int(pid_file.read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return True


def _labelled_nodes(kubeconfig: Path) -> list[dict[str, Any]] | str:
    """The rig's Nodes that a kubelet of ``kubelet-node.sh`` registered (labelled :data:`REAL_NODE_LABEL`), or why
    they cannot be listed."""
    out = subprocess.run(
        ["kubectl", "--kubeconfig", str(kubeconfig), "get", "nodes", "-l", f"{REAL_NODE_LABEL}=true", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if out.returncode != 0:
        return f"cannot list the rig's nodes: {out.stderr.strip()}"
    items: list[dict[str, Any]] = json.loads(out.stdout)["items"]
    return items


def _ready(node: dict[str, Any]) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def find_real_node(kubeconfig: Path, k8s_real: Path) -> tuple[RealNode | None, str, bool | None]:
    """The rig's running real node, or None and why not (the skip reason); and whether the rig's API server has one
    registered at all (a kubelet of ``kubelet-node.sh`` started on this rig, whether it still runs or not; None: the
    API server could not be asked)."""
    listed = _labelled_nodes(kubeconfig)
    if isinstance(listed, str):
        return None, listed, None
    if not listed:
        return None, NONE_REGISTERED.format(kubeconfig=kubeconfig, k8s_real=k8s_real), False
    names = [n["metadata"]["name"] for n in listed]
    if len(names) != 1:
        return None, f"expected one node labelled {REAL_NODE_LABEL}=true, found {names}", True
    if not (k8s_real / "kubelet-node.sh").exists():
        return None, f"{k8s_real} has no kubelet-node.sh (run ../shared/k8s-rig/install-node.sh)", True
    if not _kubelet_alive(k8s_real):
        why = f"no real node runs in {k8s_real} (start it: K8S_REAL={k8s_real} {k8s_real}/kubelet-node.sh start)"
        return None, why, True
    if not _ready(listed[0]):
        return None, f"node {names[0]} is registered but not Ready (see {k8s_real}/logs/kubelet.log)", True
    config = (k8s_real / "node" / "kubelet-config.yaml").read_text()
    port = re.search(r"^port:\s*(\d+)", config, re.M)
    offset = int(port.group(1)) - 10250 if port else int(os.environ.get("K8S_RIG_PORT_OFFSET", "0"))
    return RealNode(names[0], k8s_real, kubeconfig, offset), "", True


# Why the real-node tests skip on a rig that never had a real node: no kubelet registered one with its API server.
# None of RIG_MISSING_MARKS is in it, so that it stays a skip where SHAREGPU_TEST_K8S_REAL alone is set (a rig without
# a real node, for the TLS test that needs only the rig's folder).
NONE_REGISTERED = (
    "the rig's API server ({kubeconfig}) has no kubelet node (no Node labelled "
    f"{REAL_NODE_LABEL}=true): these tests run real pods; start one with "
    "K8S_REAL={k8s_real} {k8s_real}/kubelet-node.sh start (after install-node.sh)"
)


def real_node_or_skip(kubeconfig: Path, k8s_real: Path) -> RealNode:
    """The rig's real node; a skip, saying why, where it has none; a failure where one must be there: under CI
    (``.ci/run`` starts one), or where one is registered but does not run (a kubelet that an earlier test broke would
    otherwise skip every later real-node test and leave the run green). SHAREGPU_TEST_K8S_REAL alone does not ask for
    one: it names the rig's folder, which the TLS test needs on a rig without a real node too."""
    import pytest

    node, why, registered = find_real_node(kubeconfig, k8s_real)
    if node is not None:
        return node
    if registered is False and not os.environ.get("CI"):
        pytest.skip(why)
    rig_unavailable(f"no real node: {why}")


@contextlib.contextmanager
def exclusive(timeout: float = 1800) -> Iterator[None]:
    """Hold the machine-wide real-node lock (one test at a time on the device-plugin directory)."""
    LOCK.touch(exist_ok=True)
    with LOCK.open("r+") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"another test held {LOCK} for {timeout:g}s") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def wait_until(cond: Callable[[], Any], what: str, timeout: float = 60.0, every: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(every)


def busybox(name: str, command: str, limits: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    """A container of the rig's shipped busybox image (nothing can be pulled on the real node)."""
    c: dict[str, Any] = {"name": name, "image": BUSYBOX, "imagePullPolicy": "Never", "command": ["sh", "-c", command]}
    if limits:
        c["resources"] = {"limits": limits}
    return c | extra


def env_lines(log: str, prefixes: tuple[str, ...] = ("NVIDIA_", "CUDA_", "SHAREGPU_")) -> dict[str, str]:
    """``env`` output → the variables with these prefixes."""
    out: dict[str, str] = {}
    for line in log.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.startswith(prefixes):
            out[key] = value
    return out
