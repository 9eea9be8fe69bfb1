"""The admission webhook (AdmissionReview v1) for pods that ask for sharegpu resources.

``/mutate`` (a MutatingWebhookConfiguration) and ``/validate`` (a ValidatingWebhookConfiguration, which sees the
pod after every mutating webhook) apply the same rules; only ``/mutate`` changes the pod:

- a request that can never be valid is rejected with the core's own message (:class:`GpuRequest` validation), and so
  is GPU memory below :data:`~sharegpu.k8s.pod_request.MIN_GPU_MEMORY_MIB` (a forgotten unit: ``"10"`` is 10
  bytes), a rule of the pod parser the extender applies too;
- an unknown ``sharegpu.io/`` annotation (a typo would silently leave the default in force) or container resource (no
  node offers it: the pod would stay Pending for ever) is refused with the closest known one, and so is a pod that
  asks for ``nvidia.com/`` GPUs besides sharegpu's, ``sharegpu.io/gpu: 0`` (a pod that asks for no GPU), and a
  ``sharegpu.io/movable`` other than ``"true"`` or ``"false"``;
- a pod whose fields do not have the Pod API's shapes (``containers`` as an object, an annotation that is not a
  string) is refused with the field named; every value a message quotes is cut to its first 80 characters;
- ``schedulerName`` is set to the sharegpu scheduler (mutate) or must be it (validate). Only ``default-scheduler``
  is replaced: the API server writes it into every pod that sets none before any webhook sees the pod, so it cannot
  be told from an explicit one; any other scheduler's name is refused (a third scheduler would never bind it);
- a container asking for GPU memory or compute without ``sharegpu.io/gpu`` gets ``sharegpu.io/gpu: 1`` (mutate),
  because the kubelet hands devices only to containers that ask for ``sharegpu.io/gpu``;
- nothing a pod sets itself may widen its limits: ``CUDA_MPS_*``, ``CUDA_VISIBLE_DEVICES`` and
  ``NVIDIA_VISIBLE_DEVICES`` in a container's env (value or valueFrom), any ``envFrom`` (the webhook cannot see what
  a ConfigMap or Secret holds), a ``sharegpu.io/assignment`` of its own, or a ``nodeName`` that skips the scheduler
  are refused, and so is a ``sharegpu.io/bind-fence`` of its own; on UPDATE only trusted users (the extender) may
  change the assignment or the fence, and nobody may change the request annotations (they decided the placement).

Pods that ask for nothing of sharegpu's pass untouched.
"""

from __future__ import annotations

import asyncio
import base64
import difflib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sharegpu.k8s.pod_request import asks_for_sharegpu, containers_missing_gpu_count, pod_request
from sharegpu.k8s.serving.body_limit import WEBHOOK_MAX_BODY, BodyLimit
from sharegpu.kube.echo import echo
from sharegpu.kube.schema import AdmissionResponse, AdmissionReview, AdmissionStatus, Container, Pod
from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog
from sharegpu.model.contract import (
    ANNOTATION_PREFIX,
    ASSIGNMENT_ANNOTATION,
    COMPUTE_RESOURCE,
    CUDA_VISIBLE_DEVICES_ENV,
    DEFAULT_SCHEDULER_NAME,
    FENCE_ANNOTATION,
    GPU_RESOURCE,
    MEMORY_RESOURCE,
    MOVABLE_ANNOTATION,
    MPS_ENV_PREFIX,
    NVIDIA_VISIBLE_DEVICES_ENV,
    POD_ANNOTATIONS,
    REQUEST_ANNOTATIONS,
    RESOURCES,
)
from sharegpu.model.request import InvalidRequest

log = logging.getLogger(__name__)

FORBIDDEN_ENV = (CUDA_VISIBLE_DEVICES_ENV, NVIDIA_VISIBLE_DEVICES_ENV)
FORBIDDEN_ENV_PREFIX = MPS_ENV_PREFIX
# Written on a pod by the extender alone: the assignment, and the fence that moves a pod past a lost Binding's
# resourceVersion.
SYSTEM_ANNOTATIONS = (ASSIGNMENT_ANNOTATION, FENCE_ANNOTATION)
# The NVIDIA device plugin's resources: a pod that asks for them beside sharegpu.io/gpu needs a node that offers
# both, which a sharegpu node does not (its GPUs are offered as sharegpu.io/gpu), so it would stay Pending for ever.
NVIDIA_RESOURCE_PREFIX = "nvidia.com/"
# A key (annotation or resource name) longer than this is cut in messages too; the API server allows 316 characters.
ECHO_KEY_CHARS = 80
# The scheduler name the API server writes into every pod that sets none, before admission: it cannot be told from
# one a user wrote, so it alone is replaced.
KUBE_DEFAULT_SCHEDULER = "default-scheduler"


@dataclass(frozen=True)
class WebhookConfig:
    scheduler_name: str = DEFAULT_SCHEDULER_NAME
    trusted_users: tuple[str, ...] = ()  # may write sharegpu.io/assignment on UPDATE (the extender's account)
    catalog: Catalog = DEFAULT_CATALOG


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    message: str = ""
    patch: tuple[dict[str, Any], ...] = ()
    warnings: tuple[str, ...] = ()


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _env_offenders(pod: Pod, only: Sequence[Container] | None = None) -> list[str]:
    """What in the pod's containers (init and ephemeral ones too), or in ``only``, could set the variables
    sharegpu owns."""
    found = []
    containers = (
        (*pod.spec.init_containers, *pod.spec.containers, *pod.spec.ephemeral_containers) if only is None else only
    )
    for c in containers:
        for e in c.env:  # a value or a valueFrom: refused by name either way
            if e.name in FORBIDDEN_ENV or e.name.startswith(FORBIDDEN_ENV_PREFIX):
                found.append(
                    f"container {echo(c.name)} sets {e.name}: remove it — sharegpu sets the visible devices and the "
                    "MPS limits from the pod's assignment, and a pod may not set them itself"
                )
        if c.env_from:
            # The webhook cannot see what a ConfigMap or Secret holds (now or after an edit), so none is allowed.
            found.append(
                f"container {echo(c.name)} uses envFrom: set its variables with env instead — a ConfigMap or Secret "
                "could set CUDA_MPS_*, CUDA_VISIBLE_DEVICES or NVIDIA_VISIBLE_DEVICES, which sharegpu sets from the "
                "pod's assignment, and the webhook cannot see their contents"
            )
    return found


def _add_gpu_patches(pod: Pod, raw: dict[str, Any]) -> list[dict[str, Any]]:
    ops: list[dict[str, Any]] = []
    spec = raw.get("spec") or {}
    for field, i in containers_missing_gpu_count(pod):
        c = spec[field][i]
        base = f"/spec/{field}/{i}/resources"
        if "resources" not in c or not isinstance(c["resources"], dict):
            ops.append({"op": "add", "path": base, "value": {"limits": {GPU_RESOURCE: "1"}}})
        elif "limits" not in c["resources"] or not isinstance(c["resources"]["limits"], dict):
            ops.append({"op": "add", "path": f"{base}/limits", "value": {GPU_RESOURCE: "1"}})
        else:
            ops.append({"op": "add", "path": f"{base}/limits/{_escape(GPU_RESOURCE)}", "value": "1"})
        c.setdefault("resources", {}).setdefault("limits", {})[GPU_RESOURCE] = "1"
    return ops


def admit_pod(
    raw: dict[str, Any], operation: str, old: dict[str, Any] | None, username: str, mutate: bool, cfg: WebhookConfig
) -> Verdict:
    """The rules above, for one pod as the API server sent it."""
    raw = json.loads(json.dumps(raw))  # a private copy: the patches are applied to it to validate the result
    try:
        pod = Pod.model_validate(raw)
    except ValidationError as e:
        return Verdict(False, _unreadable(e))
    if operation == "UPDATE":
        return _admit_update(pod, old, username, cfg)
    if problems := [
        *_annotation_problems(pod.metadata.annotations),
        *_annotation_value_problems(pod.metadata.annotations),
        *_resource_problems(pod),
    ]:
        return Verdict(False, "; ".join(problems))
    if not asks_for_sharegpu(pod):
        stray = sorted(k for k in pod.metadata.annotations if k in REQUEST_ANNOTATIONS)
        if stray:
            return Verdict(
                True,
                warnings=(f"{', '.join(stray)} has no effect: the pod asks for no {GPU_RESOURCE} resources",),
            )
        return Verdict(True)
    problems = _env_offenders(pod) + _nvidia_offenders(pod)
    if problems:
        return Verdict(False, "; ".join(problems))
    if pod.spec.scheduler_name not in ("", KUBE_DEFAULT_SCHEDULER, cfg.scheduler_name):
        return Verdict(
            False,
            f"spec.schedulerName is {_plain(pod.spec.scheduler_name)}: pods that ask for {GPU_RESOURCE} resources "
            f"are placed by the {cfg.scheduler_name} scheduler (no other scheduler can bind them); remove "
            f"spec.schedulerName or set it to {cfg.scheduler_name}",
        )
    if pod.spec.node_name:
        return Verdict(
            False,
            f"remove spec.nodeName ({_plain(pod.spec.node_name)}): pods that ask for {GPU_RESOURCE} resources are "
            f"placed by the {cfg.scheduler_name} scheduler",
        )
    ops: list[dict[str, Any]] = []
    if mutate:
        ops += _add_gpu_patches(pod, raw)
        if ops:
            pod = Pod.model_validate(raw)
    try:
        req = pod_request(pod, cfg.catalog)
    except InvalidRequest as e:
        return Verdict(False, str(e))
    if req is not None and not req.wants_gpu:
        return Verdict(False, _NO_GPU)
    if pod.spec.scheduler_name != cfg.scheduler_name:
        if not mutate:
            return Verdict(
                False,
                f"set spec.schedulerName to {cfg.scheduler_name} (it is {_plain(pod.spec.scheduler_name) or 'unset'}): "
                f"pods that ask for {GPU_RESOURCE} resources are placed by the sharegpu scheduler",
            )
        op = "replace" if "schedulerName" in (raw.get("spec") or {}) else "add"
        ops.append({"op": op, "path": "/spec/schedulerName", "value": cfg.scheduler_name})
    return Verdict(True, patch=tuple(ops))


def _admit_update(pod: Pod, old: dict[str, Any] | None, username: str, cfg: WebhookConfig) -> Verdict:
    if asks_for_sharegpu(pod):
        # Ephemeral containers are the only ones an UPDATE (pods/ephemeralcontainers) can add.
        before_pod = _pod_or_none(old)
        had = {c.name for c in before_pod.spec.ephemeral_containers} if before_pod else set()
        problems = _env_offenders(pod, [c for c in pod.spec.ephemeral_containers if c.name not in had])
        if problems:
            return Verdict(False, "; ".join(problems))
    raw_before = ((old or {}).get("metadata") or {}).get("annotations") or {}
    before: dict[str, Any] = raw_before if isinstance(raw_before, dict) else {}
    after = pod.metadata.annotations
    for key in SYSTEM_ANNOTATIONS:
        if before.get(key) != after.get(key) and username not in cfg.trusted_users:
            return Verdict(
                False, f"{key} is written by the sharegpu scheduler only; {username or 'you'} may not change it"
            )
    # Only the keys this UPDATE adds are judged: a pod admitted before this rule must stay editable.
    added = {k: v for k, v in after.items() if k not in before}
    changed_values = {k: v for k, v in after.items() if before.get(k) != v}
    if problems := [
        *_annotation_problems(added, system_ok=True),
        *_annotation_value_problems(changed_values),
    ]:
        return Verdict(False, "; ".join(problems))
    old_pod = _pod_or_none(old)
    if old_pod is not None and (asks_for_sharegpu(old_pod) or ASSIGNMENT_ANNOTATION in before):
        changed = [k for k in REQUEST_ANNOTATIONS if before.get(k) != after.get(k)]
        if changed:
            what = ", ".join(f"{k} ({_shown(before.get(k))} → {_shown(after.get(k))})" for k in changed)
            return Verdict(
                False,
                f"{what}: a pod's request annotations cannot change after it is created (they decided where and how "
                "it was placed, and the node agent enforces that placement); delete the pod and create it again "
                "with the new annotations",
            )
    return Verdict(True)


def _shown(value: Any) -> str:
    return "unset" if value is None else echo(value)


def _pod_or_none(raw: dict[str, Any] | None) -> Pod | None:
    if raw is None:
        return None
    try:
        return Pod.model_validate(raw)
    except ValidationError:
        return None


def _annotation_problems(annotations: dict[str, str], system_ok: bool = False) -> list[str]:
    """The ``sharegpu.io/`` annotations a pod may not carry: the scheduler's own (unless ``system_ok``: checked as
    changes instead), and unknown ones, each named with the closest known one (a typo such as
    ``sharegpu.io/isolaton`` would otherwise leave the default isolation in force without a word)."""
    out = []
    for key in sorted(annotations):
        if not key.startswith(ANNOTATION_PREFIX):
            continue
        if key in SYSTEM_ANNOTATIONS:
            if not system_ok:
                out.append(f"remove the {key} annotation: only the sharegpu scheduler sets it")
        elif key in RESOURCES:
            out.append(
                f"{key} is a container resource, not an annotation: set it in the container's resources.limits "
                f"(e.g. {key}: {_EXAMPLES[key]}) and remove the annotation"
            )
        elif key not in POD_ANNOTATIONS:
            close = difflib.get_close_matches(key, [*POD_ANNOTATIONS, *RESOURCES], n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}? " if close else ""
            out.append(
                f"unknown annotation {_plain(key)}: {hint}the annotations a pod may set are "
                f"{', '.join(POD_ANNOTATIONS)}"
            )
    return out


def _plain(key: str) -> str:
    """A name (annotation, resource, scheduler, node) a user wrote, as a message shows it: as written, unless long."""
    return key if len(key) <= ECHO_KEY_CHARS else echo(key)


# The values a boolean annotation may have: what the consolidation reads as yes, and its explicit no.
MOVABLE_VALUES = ("true", "false")


def _annotation_value_problems(annotations: dict[str, str]) -> list[str]:
    """Values of the ``sharegpu.io/`` annotations that no reader understands, beyond those the request parser judges
    (a value it cannot read refuses the pod there): ``sharegpu.io/movable`` is ``"true"`` or ``"false"``, and anything
    else would leave the pod unmovable without a word."""
    value = annotations.get(MOVABLE_ANNOTATION)
    if value is None or value in MOVABLE_VALUES:
        return []
    return [
        f'{MOVABLE_ANNOTATION} is {echo(value)}: write "true" (consolidation may evict the pod so that its controller '
        f'recreates it elsewhere) or "false" (the default), quoted in YAML'
    ]


def _resource_problems(pod: Pod) -> list[str]:
    """Container resources named ``sharegpu.io/…`` that are not sharegpu's: no node offers them, so the pod would be
    Pending for ever (``sharegpu.io/gpu-mem`` for ``sharegpu.io/gpu-memory``)."""
    out = []
    for c in (*pod.spec.init_containers, *pod.spec.containers, *pod.spec.ephemeral_containers):
        for kind, names in (("limits", c.resources.limits), ("requests", c.resources.requests)):
            for name in sorted(names):
                if not name.startswith(ANNOTATION_PREFIX) or name in RESOURCES:
                    continue
                close = difflib.get_close_matches(name, RESOURCES, n=1, cutoff=0.6)
                hint = f"did you mean {close[0]}? " if close else ""
                out.append(
                    f"container {echo(c.name)} asks for unknown resource {_plain(name)} in its {kind}: {hint}the "
                    f"sharegpu resources are {', '.join(RESOURCES)} (no node offers any other, so the pod would stay "
                    "Pending for ever)"
                )
    return out


_NO_GPU = (
    f"the pod asks for {GPU_RESOURCE}: 0, that is for no GPU: ask for {GPU_RESOURCE}: 1 or more, or drop the "
    f"{ANNOTATION_PREFIX} resources from its containers if it needs no GPU"
)


def _unreadable(e: ValidationError) -> str:
    """Why the pod cannot be read, at the field where it departs from the Pod API (the first such field)."""
    err = e.errors()[0]
    where = ".".join(str(x) for x in err["loc"]) or "the pod"
    return (
        f"sharegpu cannot read this pod: {where}: {err['msg']} (it is {echo(err.get('input'))}); write it as the Pod "
        "API defines it"
    )


_EXAMPLES = {GPU_RESOURCE: "1", MEMORY_RESOURCE: "10Gi", COMPUTE_RESOURCE: "30"}


def _nvidia_offenders(pod: Pod) -> list[str]:
    found = []
    for c in (*pod.spec.init_containers, *pod.spec.containers):
        names = sorted(
            {r for r in (*c.resources.limits, *c.resources.requests) if r.startswith(NVIDIA_RESOURCE_PREFIX)}
        )
        if names:
            found.append(
                f"container {echo(c.name)} asks for {', '.join(_plain(n) for n in names)} in a pod that asks for "
                f"{GPU_RESOURCE}: sharegpu nodes offer their GPUs as {GPU_RESOURCE} only, so no node could host the "
                f"pod; ask for {GPU_RESOURCE} alone (with {MEMORY_RESOURCE} or {COMPUTE_RESOURCE} for a share)"
            )
    return found


def review(body: AdmissionReview, mutate: bool, cfg: WebhookConfig) -> AdmissionReview:
    req = body.request
    if req is None:
        raise ValueError("the AdmissionReview has no request")
    kind = req.kind.get("kind", "")
    if kind != "Pod" or req.object is None or req.operation not in ("CREATE", "UPDATE"):
        verdict = Verdict(True)
    else:
        verdict = admit_pod(req.object, req.operation, req.old_object, req.user_info.username, mutate, cfg)
    resp = AdmissionResponse(uid=req.uid, allowed=verdict.allowed)
    if not verdict.allowed:
        resp.status = AdmissionStatus(code=403, reason="Forbidden", message=f"sharegpu: {verdict.message}")
        log.info("denied %s %s/%s: %s", req.operation, req.namespace, req.name or "(generated)", verdict.message)
    if verdict.patch:
        resp.patch_type = "JSONPatch"
        resp.patch = base64.b64encode(json.dumps(list(verdict.patch)).encode()).decode()
    if verdict.warnings:
        resp.warnings = list(verdict.warnings)
    return AdmissionReview(apiVersion=body.api_version, kind="AdmissionReview", response=resp)


def make_app(cfg: WebhookConfig) -> Starlette:
    def route(path: str, mutate: bool) -> Route:
        async def endpoint(request: Request) -> Response:
            try:
                body = AdmissionReview.model_validate_json(await request.body())
                out = review(body, mutate, cfg)
            except (ValidationError, ValueError) as e:
                return JSONResponse({"error": f"malformed AdmissionReview: {_short(e)}"}, status_code=400)
            return Response(out.model_dump_json(by_alias=True, exclude_none=True), media_type="application/json")

        return Route(path, endpoint, methods=["POST"])

    async def healthz(request: Request) -> Response:
        return Response("ok\n", media_type="text/plain")

    return Starlette(
        routes=[route("/mutate", True), route("/validate", False), Route("/healthz", healthz)],
        middleware=[Middleware(BodyLimit, max_bytes=WEBHOOK_MAX_BODY, what="AdmissionReview")],
    )


def _short(e: Exception) -> str:
    if isinstance(e, ValidationError):
        return "; ".join(f"{'.'.join(str(x) for x in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()[:5])
    return str(e)


def serve_webhook(host: str, port: int, cert: str, key: str, cfg: WebhookConfig) -> None:
    """Serve until SIGTERM/SIGINT; raises :class:`~sharegpu.k8s.serving.tls.TlsError` for unusable certificate files and
    OSError when the port cannot be bound."""
    from sharegpu.k8s.serving.server import Listener, Site, serve
    from sharegpu.k8s.serving.tls import ServerTls

    tls = ServerTls(Path(cert), Path(key))
    tls.context()
    asyncio.run(serve([Site(make_app(cfg), Listener(host, port, tls), "admission webhook")]))


def trusted(users: Sequence[str]) -> tuple[str, ...]:
    return tuple(u.strip() for u in users if u.strip())
