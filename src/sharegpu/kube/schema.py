"""Pydantic models of the JSON that sharegpu's control plane reads and writes.

Kubernetes objects are modelled only as far as sharegpu reads them; every model keeps unknown fields
(``extra="allow"``) so that an object passed through (the ``Nodes`` of a non-node-cache extender call) goes back
exactly as it came. The extender types follow k8s.io/kube-scheduler/extender/v1, whose Go structs carry no JSON
tags: their keys are the Go field names (``Pod``, ``NodeNames``, ``FailedNodes``, ``Host``, ``Score``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

MAX_EXTENDER_PRIORITY = 10  # extenderv1.MaxExtenderPriority


class K8sModel(BaseModel):
    """A Kubernetes object part: camelCase keys as the API server writes them, unknown fields kept."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class OwnerReference(K8sModel):
    """Who owns an object; ``controller: true`` marks the one controller that recreates it when it goes."""

    api_version: str = Field(default="", alias="apiVersion")
    kind: str = ""
    name: str = ""
    uid: str = ""
    controller: bool | None = None  # a *bool in Go: unset or null is not the controller
    block_owner_deletion: bool | None = Field(default=None, alias="blockOwnerDeletion")


class ObjectMeta(K8sModel):
    name: str = ""
    namespace: str = ""
    uid: str = ""
    resource_version: str = Field(default="", alias="resourceVersion")
    annotations: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    deletion_timestamp: str | None = Field(default=None, alias="deletionTimestamp")
    generate_name: str = Field(default="", alias="generateName")
    # RFC 3339 in UTC with a Z ("2026-11-26T12:00:00Z"), as the API server writes it: string order is time order.
    creation_timestamp: str = Field(default="", alias="creationTimestamp")
    owner_references: list[OwnerReference] = Field(default_factory=list, alias="ownerReferences")


class ContainerClaim(K8sModel):
    """One entry of a container's ``resources.claims``: the pod's claim it uses (a ``spec.resourceClaims`` name) and
    which of its requests (empty: all)."""

    name: str = ""
    request: str = ""


class ResourceRequirements(K8sModel):
    limits: dict[str, str | int | float] = Field(default_factory=dict)
    requests: dict[str, str | int | float] = Field(default_factory=dict)
    claims: list[ContainerClaim] = Field(default_factory=list)  # DRA: the pod's claims this container uses

    def amount(self, name: str) -> str | int | float | None:
        """The quantity of resource ``name`` as written, None when neither list names it: its limit, else its
        request. The limit first because it is what the kubelet's device manager hands out for an extended resource
        (``sharegpu.io/gpu``), and the API server requires that limit and copies it into a missing request; the
        request where no limit is written, as the kube-scheduler counts it, for a pod read before the API server
        defaulted it (the webhook's admission request). One reader for the control plane and the node alike."""
        value = self.limits.get(name)
        return self.requests.get(name) if value is None else value


class EnvVar(K8sModel):
    name: str
    value: str | None = None


class EnvFromSource(K8sModel):
    """A ConfigMap or Secret whose every key becomes a variable (what it sets is known only at the pod's start)."""

    prefix: str = ""
    config_map_ref: dict[str, Any] | None = Field(default=None, alias="configMapRef")
    secret_ref: dict[str, Any] | None = Field(default=None, alias="secretRef")


class SecurityContext(K8sModel):
    """The part of a pod's or container's securityContext that sharegpu reads: who its processes run as."""

    run_as_user: int | None = Field(default=None, alias="runAsUser")


class Container(K8sModel):
    name: str = ""
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    env: list[EnvVar] = Field(default_factory=list)
    env_from: list[EnvFromSource] = Field(default_factory=list, alias="envFrom")
    security_context: SecurityContext | None = Field(default=None, alias="securityContext")
    # "Always" on an init container makes it a native sidecar: it runs beside the app containers.
    restart_policy: str = Field(default="", alias="restartPolicy")


class PodResourceClaim(K8sModel):
    """One entry of ``spec.resourceClaims``: a claim by name, or a template the claim controller makes one from."""

    name: str = ""
    resource_claim_name: str | None = Field(default=None, alias="resourceClaimName")
    resource_claim_template_name: str | None = Field(default=None, alias="resourceClaimTemplateName")


class PodSpec(K8sModel):
    containers: list[Container] = Field(default_factory=list)
    init_containers: list[Container] = Field(default_factory=list, alias="initContainers")
    # An EphemeralContainer has a Container's fields (and a targetContainerName, kept as an unknown field).
    ephemeral_containers: list[Container] = Field(default_factory=list, alias="ephemeralContainers")
    node_name: str = Field(default="", alias="nodeName")
    scheduler_name: str = Field(default="", alias="schedulerName")
    security_context: SecurityContext | None = Field(default=None, alias="securityContext")
    # false: the pod runs in a user namespace of its own, so the UID it declares is not its UID on the host.
    host_users: bool | None = Field(default=None, alias="hostUsers")
    # Set by the Priority admission plugin from the pod's PriorityClass; unset counts as 0, as the scheduler reads it.
    priority: int = 0
    # "PreemptLowerPriority" (the API server's default) or "Never".
    preemption_policy: str = Field(default="PreemptLowerPriority", alias="preemptionPolicy")
    resource_claims: list[PodResourceClaim] = Field(default_factory=list, alias="resourceClaims")
    # Pod-level requests and limits (PodLevelResources) and the RuntimeClass's overhead: both count towards the
    # pod's CPU and memory as the kube-scheduler sums them.
    resources: ResourceRequirements | None = None
    overhead: dict[str, str | int | float] = Field(default_factory=dict)


class PodCondition(K8sModel):
    type: str = ""
    status: str = ""  # "True", "False" or "Unknown"
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = Field(default=None, alias="lastTransitionTime")
    last_probe_time: str | None = Field(default=None, alias="lastProbeTime")


class PodResourceClaimStatus(K8sModel):
    """The claim the resource claim controller made for a ``spec.resourceClaims`` entry from its template."""

    name: str = ""
    resource_claim_name: str | None = Field(default=None, alias="resourceClaimName")


class PodStatus(K8sModel):
    phase: str = ""
    reason: str = ""  # set when the kubelet rejected or evicted the pod ("OutOfcpu", "Evicted")
    nominated_node_name: str = Field(default="", alias="nominatedNodeName")
    conditions: list[PodCondition] = Field(default_factory=list)
    start_time: str | None = Field(default=None, alias="startTime")
    resource_claim_statuses: list[PodResourceClaimStatus] = Field(default_factory=list, alias="resourceClaimStatuses")


class Pod(K8sModel):
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: PodSpec = Field(default_factory=PodSpec)
    status: PodStatus = Field(default_factory=PodStatus)

    @property
    def key(self) -> str:
        return f"{self.metadata.namespace}/{self.metadata.name}"

    def run_as_user(self, container: Container) -> int | None:
        """The UID ``container`` runs as where the pod declares it (its own securityContext, else the pod's); None
        when only the image knows (its USER)."""
        own = container.security_context.run_as_user if container.security_context else None
        if own is not None:
            return own
        return self.spec.security_context.run_as_user if self.spec.security_context else None

    @property
    def finished(self) -> bool:
        return self.status.phase in ("Succeeded", "Failed")

    @property
    def unschedulable(self) -> bool:
        """Whether the scheduler tried the pod and found no node (``PodScheduled=False``, reason ``Unschedulable``)."""
        for c in self.status.conditions:
            if c.type == "PodScheduled":
                return c.status == "False" and c.reason == "Unschedulable"
        return False

    @property
    def started_at(self) -> float | None:
        """``status.startTime`` as a POSIX timestamp; None when the kubelet has not started the pod (or wrote a time
        that cannot be read)."""
        if not self.status.start_time:
            return None
        try:
            return datetime.fromisoformat(self.status.start_time.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None

    def claim_name(self, claim: PodResourceClaim) -> str | None:
        """The ResourceClaim a ``spec.resourceClaims`` entry stands for: the one it names, else the one the claim
        controller made from its template and recorded in ``status.resourceClaimStatuses``; None while none is."""
        if claim.resource_claim_name:
            return claim.resource_claim_name
        made = (s.resource_claim_name for s in self.status.resource_claim_statuses if s.name == claim.name)
        return next((n for n in made if n), None)

    def claim_containers(self, claim_name: str) -> list[Container]:
        """The containers (init, sidecar and app) that use the ResourceClaim named ``claim_name`` through one of the
        pod's ``spec.resourceClaims`` entries; a container that names no such entry does not use it."""
        entries = {pc.name for pc in self.spec.resource_claims if self.claim_name(pc) == claim_name}
        return [
            c
            for c in (*self.spec.init_containers, *self.spec.containers)
            if any(cc.name in entries for cc in c.resources.claims)
        ]


class NodeStatus(K8sModel):
    allocatable: dict[str, str | int | float] = Field(default_factory=dict)


class Node(K8sModel):
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    status: NodeStatus = Field(default_factory=NodeStatus)


class NodeList(K8sModel):
    items: list[Node] = Field(default_factory=list)


class PassedNodeList(K8sModel):
    """The ``Nodes`` of a non-node-cache extender call: read only for the names, passed back as it came, so its
    items stay plain JSON (modelling a thousand Node objects per call would cost more than the whole decision)."""

    items: list[dict[str, Any]] = Field(default_factory=list)

    def names(self) -> list[str]:
        return [str((n.get("metadata") or {}).get("name", "")) for n in self.items]


# ----- k8s.io/kube-scheduler/extender/v1 ------------------------------------------------------------------------
class GoModel(BaseModel):
    """An extender struct: Go field names as keys; unknown keys are ignored (a newer scheduler may add some)."""

    model_config = ConfigDict(extra="ignore")


class ExtenderArgs(GoModel):
    Pod: Pod
    Nodes: PassedNodeList | None = None  # nodeCacheCapable: false
    NodeNames: list[str] | None = None  # nodeCacheCapable: true


class ExtenderFilterResult(GoModel):
    Nodes: dict[str, Any] | None = None  # the NodeList JSON, passed through as it came
    NodeNames: list[str] | None = None
    FailedNodes: dict[str, str] = Field(default_factory=dict)
    FailedAndUnresolvableNodes: dict[str, str] = Field(default_factory=dict)
    Error: str = ""


class ExtenderBindingArgs(GoModel):
    PodName: str
    PodNamespace: str
    PodUID: str
    Node: str


class ExtenderBindingResult(GoModel):
    Error: str = ""


class MetaPod(GoModel):
    UID: str


class MetaVictims(GoModel):
    Pods: list[MetaPod] = Field(default_factory=list)
    NumPDBViolations: int = 0


class Victims(GoModel):
    Pods: list[Pod] = Field(default_factory=list)
    NumPDBViolations: int = 0


class ExtenderPreemptionArgs(GoModel):
    Pod: Pod
    NodeNameToVictims: dict[str, Victims] | None = None
    NodeNameToMetaVictims: dict[str, MetaVictims] | None = None


class ExtenderPreemptionResult(GoModel):
    NodeNameToMetaVictims: dict[str, MetaVictims] = Field(default_factory=dict)


# ----- admission.k8s.io/v1 AdmissionReview ----------------------------------------------------------------------
class UserInfo(K8sModel):
    username: str = ""


class AdmissionRequest(K8sModel):
    uid: str
    kind: dict[str, str] = Field(default_factory=dict)
    operation: str = ""
    namespace: str = ""
    name: str = ""
    object: dict[str, Any] | None = None
    old_object: dict[str, Any] | None = Field(default=None, alias="oldObject")
    user_info: UserInfo = Field(default_factory=UserInfo, alias="userInfo")
    dry_run: bool = Field(default=False, alias="dryRun")


class AdmissionStatus(K8sModel):
    code: int = 403
    message: str = ""
    reason: str = ""


class AdmissionResponse(K8sModel):
    uid: str
    allowed: bool
    status: AdmissionStatus | None = None
    patch_type: str | None = Field(default=None, alias="patchType")
    patch: str | None = None  # base64 of a JSONPatch
    warnings: list[str] | None = None


class AdmissionReview(K8sModel):
    api_version: str = Field("admission.k8s.io/v1", alias="apiVersion")
    kind: str = "AdmissionReview"
    request: AdmissionRequest | None = None
    response: AdmissionResponse | None = None


# ----- resource.k8s.io/v1 (DRA) -----------------------------------------------------------------------------------
# As far as sharegpu reads them: the driver's ResourceSlices (its devices, their attributes and capacities) and the
# ResourceClaims (what they ask, what they were allocated, which pods they are reserved for).
class DeviceAttribute(K8sModel):
    """One typed value of a device attribute: exactly one of the four is set."""

    string: str | None = None
    int_: int | None = Field(default=None, alias="int")
    bool_: bool | None = Field(default=None, alias="bool")
    version: str | None = None


class DeviceCapacity(K8sModel):
    value: str | int | float = 0


class Device(K8sModel):
    name: str = ""
    attributes: dict[str, DeviceAttribute] = Field(default_factory=dict)
    capacity: dict[str, DeviceCapacity] = Field(default_factory=dict)


class ResourcePool(K8sModel):
    name: str = ""
    generation: int = 0
    resource_slice_count: int = Field(default=1, alias="resourceSliceCount")


class ResourceSliceSpec(K8sModel):
    driver: str = ""
    node_name: str = Field(default="", alias="nodeName")
    pool: ResourcePool = Field(default_factory=ResourcePool)
    devices: list[Device] = Field(default_factory=list)


class ResourceSlice(K8sModel):
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: ResourceSliceSpec = Field(default_factory=ResourceSliceSpec)

    @property
    def node(self) -> str:
        """The node whose devices the slice lists (a node-local pool is named after its node)."""
        return self.spec.node_name or self.spec.pool.name


class CelSelector(K8sModel):
    expression: str = ""


class DeviceSelector(K8sModel):
    cel: CelSelector | None = None


class CapacityRequirements(K8sModel):
    requests: dict[str, str | int | float] = Field(default_factory=dict)


class ExactDeviceRequest(K8sModel):
    device_class_name: str = Field(default="", alias="deviceClassName")
    selectors: list[DeviceSelector] = Field(default_factory=list)
    allocation_mode: str = Field(default="ExactCount", alias="allocationMode")
    count: int = 1
    capacity: CapacityRequirements | None = None


class DeviceRequest(K8sModel):
    name: str = ""
    exactly: ExactDeviceRequest | None = None
    first_available: list[dict[str, Any]] | None = Field(default=None, alias="firstAvailable")


class DeviceClaim(K8sModel):
    requests: list[DeviceRequest] = Field(default_factory=list)


class ResourceClaimSpec(K8sModel):
    devices: DeviceClaim = Field(default_factory=DeviceClaim)


class DeviceRequestAllocationResult(K8sModel):
    request: str = ""
    driver: str = ""
    pool: str = ""
    device: str = ""
    consumed_capacity: dict[str, str | int | float] = Field(default_factory=dict, alias="consumedCapacity")
    share_id: str | None = Field(default=None, alias="shareID")  # set for a device allocated as one of its shares


class DeviceAllocationResult(K8sModel):
    results: list[DeviceRequestAllocationResult] = Field(default_factory=list)
    # The DeviceClass's and the claim's opaque configs, copied in at allocation; each driver reads its own entries
    # (sharegpu.node.dra.config validates ours), so they stay JSON here.
    config: list[dict[str, Any]] = Field(default_factory=list)


class AllocationResult(K8sModel):
    devices: DeviceAllocationResult = Field(default_factory=DeviceAllocationResult)


class ResourceClaimConsumerReference(K8sModel):
    resource: str = ""
    name: str = ""
    uid: str = ""


class ResourceClaimStatus(K8sModel):
    allocation: AllocationResult | None = None
    reserved_for: list[ResourceClaimConsumerReference] = Field(default_factory=list, alias="reservedFor")


class ResourceClaim(K8sModel):
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: ResourceClaimSpec = Field(default_factory=ResourceClaimSpec)
    status: ResourceClaimStatus = Field(default_factory=ResourceClaimStatus)

    @property
    def key(self) -> str:
        return f"{self.metadata.namespace}/{self.metadata.name}"
