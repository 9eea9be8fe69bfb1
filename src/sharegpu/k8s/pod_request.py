"""A pod's sharegpu resources and annotations → a :class:`~sharegpu.model.request.GpuRequest`.

The one parser of the user-facing contract (DESIGN §2), used by the admission webhook, the scheduler extender and
the cluster view alike. It reads syntax (Kubernetes quantities, the comma list of models); every rule about what a
valid request is lives in :class:`GpuRequest`, whose :class:`InvalidRequest` message is passed on unchanged, except
the one rule that needs the text as written: GPU memory below :data:`MIN_GPU_MEMORY_MIB` is a forgotten unit, refused
here with the unit to write, so that the webhook and the extender (for pods in namespaces the webhook skips) refuse it
alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from sharegpu.kube.echo import ECHO_CHARS, echo
from sharegpu.kube.quantity import asked_mib, asked_milli, parse_quantity
from sharegpu.kube.schema import Container, Pod
from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog, CatalogError
from sharegpu.model.contract import (
    COMPUTE_RESOURCE,
    GPU_RESOURCE,
    ISOLATION_ANNOTATION,
    MEMORY_RESOURCE,
    MIG_PROFILE_ANNOTATION,
    MODEL_ANNOTATION,
    RESOURCES,
    SHARING_ANNOTATION,
)
from sharegpu.model.demand import ContainerDemand, pod_demand
from sharegpu.model.request import FULL_MILLI, GpuRequest, InvalidRequest
from sharegpu.model.tenant import TenantConflict, tenant_of
from sharegpu.placement.reasons import fmt_mib

__all__ = [
    "MIN_GPU_MEMORY_MIB",
    "InvalidPodRequest",
    "asks_for_sharegpu",
    "containers_missing_gpu_count",
    "cpu_and_memory",
    "gpu_tenant",
    "pod_request",
    "same_request",
]

PERCENT_MILLI = FULL_MILLI // 100  # compute_milli per percent of a GPU
# GPU memory below this is a forgotten unit ("10" is 10 bytes, bound as 1Mi), not a request: a CUDA context alone
# takes about 300-500 MiB of GPU memory.
MIN_GPU_MEMORY_MIB = 256


class InvalidPodRequest(InvalidRequest):
    """A pod whose sharegpu resources or annotations cannot be read; the message says what to change."""


@dataclass(frozen=True, slots=True)
class _ContainerAsk:
    name: str
    gpus: int | None  # None: not given
    memory_mib: int | None
    compute_milli: int | None

    @property
    def any(self) -> bool:
        return self.gpus is not None or self.memory_mib is not None or self.compute_milli is not None


def resource_text(c: Container, name: str) -> str | None:
    """The quantity a container asks for of one resource, as written (None when it names none)."""
    value = c.resources.amount(name)
    return None if value is None else str(value)


def _quantity(text: str, what: str) -> Decimal:
    value = parse_quantity(text)
    if value is None:
        raise InvalidPodRequest(_not_a_quantity(text, what))
    return value


def _not_a_quantity(text: str, what: str) -> str:
    """Why ``text`` cannot be read as a quantity, with what to write instead."""
    try:
        number: Decimal | None = Decimal(text.strip())
    except (InvalidOperation, ValueError):
        number = None
    if number is not None and not number.is_finite():
        why = "is not a number"
    elif number is not None:
        # Kubernetes holds quantities up to about 9.2e18 (an int64), and no GPU comes near that.
        why = "is far beyond any GPU"
    else:
        why = "is not a Kubernetes quantity"
    return f"{what} {echo(text)} {why}; write a quantity such as 1 (GPUs), 30 (percent of a GPU) or 10Gi (memory)"


def _container_ask(c: Container) -> _ContainerAsk:
    where = f"container {echo(c.name)}: " if c.name else ""
    gpus = memory = compute = None
    if (text := resource_text(c, GPU_RESOURCE)) is not None:
        q = _quantity(text, f"{where}{GPU_RESOURCE}")
        if q != q.to_integral_value():
            raise InvalidPodRequest(f"{where}{GPU_RESOURCE} {echo(text)} must be a whole number of GPUs, e.g. 1")
        if q < 0:
            raise InvalidPodRequest(f"{where}{GPU_RESOURCE} {echo(text)} is negative; ask for a number of GPUs, e.g. 1")
        gpus = int(q)
    if (text := resource_text(c, MEMORY_RESOURCE)) is not None:
        q = _quantity(text, f"{where}{MEMORY_RESOURCE}")
        # An ask: rounded up ("10G" is 9537Mi, not 9536Mi); a value ≤ 0 stays ≤ 0, for GpuRequest to refuse.
        memory = asked_mib(q)
    if (text := resource_text(c, COMPUTE_RESOURCE)) is not None:
        q = _quantity(text, f"{where}{COMPUTE_RESOURCE}")
        if q != q.to_integral_value():
            raise InvalidPodRequest(
                f"{where}{COMPUTE_RESOURCE} {echo(text)} must be a whole percent of one GPU from 1 to 100, e.g. 30"
            )
        compute = int(q) * PERCENT_MILLI
    return _ContainerAsk(c.name, gpus, memory, compute)


def _gpu_containers(pod: Pod) -> list[Container]:
    # The order the kubelet allocates in and the node agent slices the assignment's shares in.
    return [*pod.spec.init_containers, *pod.spec.containers]


def asks_for_sharegpu(pod: Pod) -> bool:
    """True when any container names a sharegpu.io resource (the pods the webhook and extender handle)."""
    return any(resource_text(c, r) is not None for c in _gpu_containers(pod) for r in RESOURCES)


def containers_missing_gpu_count(pod: Pod) -> list[tuple[str, int]]:
    """(list name, index) of containers asking for GPU memory or compute without a sharegpu.io/gpu count.

    Such a container means one GPU; the webhook writes ``sharegpu.io/gpu: 1`` into it, because the kubelet hands
    GPUs only to containers that ask for ``sharegpu.io/gpu``.
    """
    out = []
    for field, cs in (("initContainers", pod.spec.init_containers), ("containers", pod.spec.containers)):
        for i, c in enumerate(cs):
            if resource_text(c, GPU_RESOURCE) is None and (
                resource_text(c, MEMORY_RESOURCE) is not None or resource_text(c, COMPUTE_RESOURCE) is not None
            ):
                out.append((field, i))
    return out


def _demands(pod: Pod, amount: Callable[[Container], int]) -> list[ContainerDemand]:
    return [
        *(
            ContainerDemand(c.name, amount(c), init=True, sidecar=c.restart_policy == "Always")
            for c in pod.spec.init_containers
        ),
        *(ContainerDemand(c.name, amount(c)) for c in pod.spec.containers),
    ]


def _cpu_memory_of(res: Mapping[str, str | int | float], where: str) -> tuple[int | None, int | None]:
    """CPU (milli) and memory (MiB) of a resource list, rounded up (None: not named)."""
    cpu = mem = None
    if "cpu" in res:
        cpu = max(asked_milli(_quantity(str(res["cpu"]), f"{where}cpu")), 0)
    if "memory" in res:
        mem = max(asked_mib(_quantity(str(res["memory"]), f"{where}memory")), 0)
    return cpu, mem


def cpu_and_memory(pod: Pod) -> tuple[int, int]:
    """The pod's CPU (milli) and memory (MiB) requests as the kube-scheduler counts them (:func:`pod_demand`):
    its containers' peak (native sidecars beside the app containers, each init container beside the sidecars started
    before it), or its pod-level ``spec.resources`` request where it sets one, plus its ``spec.overhead``."""

    def one(c: Container) -> tuple[int, int]:
        cpu, mem = _cpu_memory_of({**c.resources.limits, **c.resources.requests}, f"container {echo(c.name)}: ")
        return cpu or 0, mem or 0  # requests default to limits

    pod_res = pod.spec.resources
    level_cpu, level_mem = (
        _cpu_memory_of({**pod_res.limits, **pod_res.requests}, "spec.resources: ") if pod_res else (None, None)
    )
    over_cpu, over_mem = _cpu_memory_of(pod.spec.overhead, "spec.overhead: ")
    return (
        pod_demand(_demands(pod, lambda c: one(c)[0]), over_cpu or 0, level_cpu),
        pod_demand(_demands(pod, lambda c: one(c)[1]), over_mem or 0, level_mem),
    )


def _effective_gpus(pod: Pod) -> int:
    """The pod's GPU count, as the kube-scheduler and the kubelet's device manager count it (model.demand)."""
    return pod_demand(_demands(pod, lambda c: _container_ask(c).gpus or 0))


def _models(text: str, catalog: Catalog) -> frozenset[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise InvalidPodRequest(f"{MODEL_ANNOTATION} is empty; list allowed models, e.g. H100-80GB,A100-80GB")
    if long := [n for n in names if len(n) > ECHO_CHARS]:
        raise InvalidPodRequest(
            f"{MODEL_ANNOTATION}: {echo(long[0])} is no GPU model (names are short, e.g. H100-80GB); list allowed "
            "models, e.g. H100-80GB,A100-80GB"
        )
    try:
        # A model a user names must exist: a typo would otherwise leave the pod pending for ever.
        return frozenset(catalog.strict(n).name for n in names)
    except CatalogError as e:
        raise InvalidPodRequest(f"{MODEL_ANNOTATION}: {e}") from None


def gpu_tenant(pod: Pod) -> str:
    """Who may share an MPS server with the pod (sharegpu.model.tenant), from the users its GPU containers run as.

    Raises :class:`InvalidPodRequest` when they declare different UIDs: the clients of one MPS share would wait on
    each other (one MPS server serves one UID at a time).
    """
    # The containers that hold a GPU (the node reads the same ones: node.kube.PodInfo.tenant); a sidecar without
    # one runs no MPS client and decides nothing.
    users = [(echo(c.name), pod.run_as_user(c)) for c in _gpu_containers(pod) if _container_ask(c).gpus]
    try:
        return tenant_of(pod.metadata.namespace, pod.metadata.uid or pod.key, users, pod.spec.host_users)
    except TenantConflict as e:
        raise InvalidPodRequest(str(e)) from None


_READ_ANNOTATIONS = (ISOLATION_ANNOTATION, SHARING_ANNOTATION, MIG_PROFILE_ANNOTATION, MODEL_ANNOTATION)


def same_request(a: Pod, b: Pod) -> bool:
    """Whether :func:`pod_request` reads the same from both copies of a pod, so that one's request serves the other.

    A pod's request is read by its watch events, filter and bind alike (five times per pod); this lets the cluster
    view keep one. The fields compared are all that :func:`pod_request` reads: one it comes to read must be added.
    """
    if a is b:
        return True
    ma, mb = a.metadata, b.metadata
    if ma.uid != mb.uid or ma.name != mb.name or ma.namespace != mb.namespace:
        return False
    if ma.resource_version and ma.resource_version == mb.resource_version:
        return True  # one version of one object: the API server's copies are equal
    sa, sb = a.spec, b.spec
    return (
        all(ma.annotations.get(k) == mb.annotations.get(k) for k in _READ_ANNOTATIONS)
        and sa.host_users == sb.host_users
        and sa.security_context == sb.security_context
        and sa.overhead == sb.overhead
        and sa.resources == sb.resources
        and sa.containers == sb.containers  # resized in place, their requests change
        and sa.init_containers == sb.init_containers
    )


def _too_little_memory(pod: Pod, memory_mib: int | None) -> str:
    """Why the pod's GPU memory is too small to be meant ("" when it is not): a plain number is bytes, and so is a
    number with a decimal suffix (``500m`` is milli: half a byte)."""
    if memory_mib is None or memory_mib >= MIN_GPU_MEMORY_MIB:
        return ""
    texts = [t for c in _gpu_containers(pod) if (t := resource_text(c, MEMORY_RESOURCE))]
    text = (texts[0] if texts else f"{memory_mib}Mi").strip()
    value = parse_quantity(text)
    number = text.rstrip("kMGTPEm")
    if text.isdigit():
        size, note, meant = f"only {text} bytes", "", f"{text}Gi"
    elif text.endswith("m") and value is not None:
        size = f"{value.normalize():f} bytes"
        note = "the suffix m is milli (a thousandth), not mebi: "
        meant = f"{number}Mi"
    else:
        size, note, meant = fmt_mib(memory_mib), "", "10Gi"
    return (
        f"{MEMORY_RESOURCE} {echo(text)} is {size}, less than the {MIN_GPU_MEMORY_MIB}Mi a GPU workload needs at the "
        f"least (a CUDA context alone takes about 300 MiB): {note}a number without a unit is bytes; write the unit, "
        f"e.g. {MEMORY_RESOURCE}: {meant}"
    )


def pod_request(pod: Pod, catalog: Catalog = DEFAULT_CATALOG) -> GpuRequest | None:
    """The pod's GPU request, or None when it asks for nothing of sharegpu's.

    Raises :class:`InvalidRequest` (or its subclass :class:`InvalidPodRequest`) with a message that says what to
    change.
    """
    if not asks_for_sharegpu(pod):
        return None
    init_asks = [a for a in (_container_ask(c) for c in pod.spec.init_containers) if a.any]
    app_asks = [a for a in (_container_ask(c) for c in pod.spec.containers) if a.any]
    asks = [*init_asks, *app_asks]
    for a in asks:
        if a.gpus is None:
            raise InvalidPodRequest(
                f"container {echo(a.name)} asks for GPU memory or compute but not for {GPU_RESOURCE}; "
                f"add {GPU_RESOURCE}: 1 to its limits"
            )
    sharing = [a for a in asks if a.gpus]
    shapes = {(a.memory_mib, a.compute_milli) for a in sharing}
    if len(shapes) > 1:
        listed = ", ".join(
            f"{echo(a.name)}: {a.memory_mib if a.memory_mib is not None else '-'}Mi/"
            f"{a.compute_milli // PERCENT_MILLI if a.compute_milli is not None else '-'}%"
            for a in sharing
        )
        raise InvalidPodRequest(
            "all containers of a pod that use GPUs must ask for the same sharegpu.io/gpu-memory and "
            f"sharegpu.io/gpu-compute per GPU ({listed}); split them into separate pods"
        )
    for a in asks:
        if a.gpus == 0 and (a.memory_mib is not None or a.compute_milli is not None):
            raise InvalidPodRequest(
                f"container {echo(a.name)} asks for GPU memory or compute with {GPU_RESOURCE}: 0; ask for ≥ 1 GPU"
            )
    memory, compute = next(iter(shapes)) if shapes else (None, None)
    ann: Mapping[str, str] = pod.metadata.annotations
    for key in (ISOLATION_ANNOTATION, SHARING_ANNOTATION, MIG_PROFILE_ANNOTATION):
        # Their values are short words: a long one is refused here, quoted in part, before a message quotes it whole.
        if len(ann.get(key, "")) > ECHO_CHARS:
            raise InvalidPodRequest(f"{key} {echo(ann[key])} is not a value it takes; see docs/kubernetes.md")
    models = _models(ann[MODEL_ANNOTATION], catalog) if MODEL_ANNOTATION in ann else frozenset()
    cpu, host_mem = cpu_and_memory(pod)
    mig = ann.get(MIG_PROFILE_ANNOTATION)
    req = GpuRequest(
        name=pod.key,
        gpu_count=_effective_gpus(pod),
        compute_milli=compute,
        memory_mib=memory,
        isolation=ann.get(ISOLATION_ANNOTATION, "none").strip(),  # type: ignore[arg-type]  # parsed by GpuRequest
        sharing=ann.get(SHARING_ANNOTATION, "auto").strip(),  # type: ignore[arg-type]
        allowed_models=models,
        mig_profile=mig.strip() if mig is not None and mig.strip() else None,
        cpu_milli=cpu,
        host_memory_mib=host_mem,
        tenant=gpu_tenant(pod),
        catalog=catalog,
    )
    if small := _too_little_memory(pod, req.memory_mib):
        raise InvalidPodRequest(small)
    return req
