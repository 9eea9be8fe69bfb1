"""Fakes shared by the DRA driver's tests: the API server's claims, pods and Events, and a driver on a simulated node."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sharegpu.kube.api import PodEvent
from sharegpu.kube.errors import KubeError
from sharegpu.kube.schema import Pod, ResourceClaim
from sharegpu.node.backends.sim import SimBackend
from sharegpu.node.backends.sim_config import SimConfig, SimGpuGroup
from sharegpu.node.cdi import CdiWriter
from sharegpu.node.dra.checkpoint import Checkpoint
from sharegpu.node.dra.driver import ClaimRef, DraDriver, SimTimeSlicer
from sharegpu.node.mig import MigManager
from sharegpu.node.mps import MpsManager, SimMpsDaemon
from sharegpu.node.state import AgentState


class Notifier:
    """Records what the watch tells on pods, and as whom."""

    def __init__(self) -> None:
        self.events: list[PodEvent] = []
        self.components: list[str] = []
        self.evicted: list[str] = []

    async def create_event(self, event: PodEvent, component: str) -> None:
        self.events.append(event)
        self.components.append(component)

    async def evict_pod(self, namespace: str, name: str, uid: str = "") -> None:
        self.evicted.append(f"{namespace}/{name}")

    async def close(self) -> None:
        pass

    def told(self) -> list[tuple[str, str]]:
        return [(e.pod, e.reason) for e in self.events]


class Api:
    """Claims and pods by name, as the driver reads them; the Events it posts on its Node."""

    def __init__(self) -> None:
        self.claims: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        self.node_events: list[tuple[str, str, str, str]] = []  # (node, reason, message, component)
        self.fail_events = 0  # how many Node Events to refuse next

    async def create_node_event(self, node: str, reason: str, message: str, component: str) -> None:
        if self.fail_events:
            self.fail_events -= 1
            raise KubeError("events is forbidden")
        self.node_events.append((node, reason, message, component))

    async def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        return ResourceClaim.model_validate(self.claims[name])

    async def get_pod(self, namespace: str, name: str) -> Pod:
        return Pod.model_validate(self.pods[name])

    async def pods_on_node(self, node: str) -> list[Pod]:
        return [Pod.model_validate(p) for p in self.pods.values()]

    def claim(
        self,
        name: str,
        pods: list[str],
        *,
        device: str = "gpu-0",
        memory: str = "10Gi",
        compute: str = "20",
        config: list[dict[str, Any]] | None = None,
    ) -> ClaimRef:
        """An allocated claim reserved for ``pods`` (UID ``c-<name>``); a MIG device takes no capacity."""
        result: dict[str, Any] = {"request": "gpu", "driver": "gpu.sharegpu.io", "pool": "n1", "device": device}
        if "mig" not in device:
            result |= {"consumedCapacity": {"memory": memory, "compute": compute}, "shareID": f"s-{name}"}
        self.claims[name] = {
            "metadata": {"namespace": "ns", "name": name, "uid": f"c-{name}"},
            "status": {
                "allocation": {"devices": {"results": [result], "config": config or []}},
                "reservedFor": [{"resource": "pods", "name": p, "uid": self.pods[p]["metadata"]["uid"]} for p in pods],
            },
        }
        return ClaimRef("ns", f"c-{name}", name)

    def pod(
        self,
        name: str,
        claim: str,
        *containers: tuple[str, int | None, bool],
        pod_user: int | None = None,
        host_users: bool | None = None,
        sidecars: tuple[tuple[str, int | None, bool], ...] = (),
    ) -> None:
        """A pod whose spec.resourceClaims entry ``gpu`` names ``claim``; each container is (name, runAsUser, uses
        the claim); ``sidecars`` are init containers with restartPolicy Always."""

        def container(c: tuple[str, int | None, bool], sidecar: bool = False) -> dict[str, Any]:
            out: dict[str, Any] = {"name": c[0]}
            if c[1] is not None:
                out["securityContext"] = {"runAsUser": c[1]}
            if c[2]:
                out["resources"] = {"claims": [{"name": "gpu"}]}
            if sidecar:
                out["restartPolicy"] = "Always"
            return out

        spec: dict[str, Any] = {
            "containers": [container(c) for c in containers],
            "initContainers": [container(c, True) for c in sidecars],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
        }
        if pod_user is not None:
            spec["securityContext"] = {"runAsUser": pod_user}
        if host_users is not None:
            spec["hostUsers"] = host_users
        self.pods[name] = {"metadata": {"namespace": "ns", "name": name, "uid": f"uid-{name}"}, "spec": spec}


def backend() -> SimBackend:
    return SimBackend(SimConfig((SimGpuGroup("A100-80GB", 1),)), seed="n1")


def driver(
    root: Path, api: Api, sim: SimBackend, *, multi_user: bool = False, daemon: SimMpsDaemon | None = None
) -> DraDriver:
    """A driver on ``sim``; its MPS daemons are ``daemon``'s (``SimMpsDaemon(sim)``: the simulated node's, whose
    clients connect and whose servers run), by default stand-ins the backend does not know."""
    return DraDriver(
        "n1",
        sim,
        api,
        MigManager(sim, AgentState(root / "mig.json")),
        MpsManager(root / "mps", daemon or SimMpsDaemon(), multi_user=multi_user),
        Checkpoint(root / "checkpoint.json"),
        CdiWriter(root / "cdi"),
        SimTimeSlicer(),
    )
