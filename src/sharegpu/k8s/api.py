"""The control plane's view of the Kubernetes API, behind a small interface.

:class:`LightkubeClusterApi` talks to a real API server through ``lightkube.AsyncClient`` (as the node agent's
:mod:`sharegpu.node.kube` does); :class:`sharegpu.k8s.memory.MemoryClusterApi` is the in-memory stand-in that
tests and the benchmark use. Objects cross the interface as the pydantic models of :mod:`sharegpu.k8s.schema`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from sharegpu.k8s.kubeconfig import load_credentials, request_server
from sharegpu.k8s.schema import Node, Pod

if TYPE_CHECKING:
    from sharegpu.k8s.leader import LeaseRecord

ADDED, MODIFIED, DELETED = "ADDED", "MODIFIED", "DELETED"
BINDS_IN_FLIGHT = 8
LIST_CHUNK = 500  # objects per list page: a 10,000-node relist in 20 requests, none of them huge


class ApiError(Exception):
    """The API server refused a request or could not be reached; the message says which and why."""


class Unavailable(ApiError):
    """No usable answer from the API server (connection refused or reset, timeout, 5xx, an answer that cannot be
    read, credentials not loadable). For a write, the outcome is unknown: the server may have applied it."""


class Conflict(ApiError):
    """A precondition (resourceVersion, UID) failed: the object changed since it was read."""


class NotFound(ApiError):
    pass


class ClusterApi(Protocol):
    async def list_nodes(self) -> tuple[list[Node], str]:
        """All nodes and the list's resourceVersion (to watch from)."""
        ...

    async def list_pods(self, scheduler_name: str | None = None) -> tuple[list[Pod], str]:
        """All pods (only those of ``scheduler_name``, when given: a field selector the server applies)."""
        ...

    def watch_nodes(self, resource_version: str, timeout_s: int | None = None) -> AsyncIterator[tuple[str, Node]]:
        """(ADDED | MODIFIED | DELETED, node) after ``resource_version``; raises :class:`ApiError` when it breaks.

        ``timeout_s``: the server-side timeout of the watch (``timeoutSeconds``); the server ends the watch then
        (the stream may end, or the client may resume it by itself)."""
        ...

    def watch_pods(
        self, resource_version: str, timeout_s: int | None = None, scheduler_name: str | None = None
    ) -> AsyncIterator[tuple[str, Pod]]: ...

    async def get_pod(self, namespace: str, name: str) -> Pod: ...

    async def patch_pod_annotations(
        self, namespace: str, name: str, annotations: Mapping[str, str | None], resource_version: str | None
    ) -> Pod:
        """Merge-patch annotations (None removes one); with ``resource_version`` the patch fails with
        :class:`Conflict` unless the pod is still at that version."""
        ...

    async def bind_pod(
        self,
        namespace: str,
        name: str,
        uid: str,
        node: str,
        annotations: Mapping[str, str] | None = None,
        resource_version: str | None = None,
    ) -> None:
        """Create the pod's Binding: one atomic write that sets ``spec.nodeName`` and adds ``annotations``.

        Fails with :class:`Conflict` if the pod is bound, its UID differs or (with ``resource_version``) it changed
        since that version; with :class:`Unavailable` when the outcome is unknown."""
        ...

    async def close(self) -> None: ...


class LightkubeClusterApi:
    """:class:`ClusterApi` over ``lightkube.AsyncClient`` (in-cluster config, or a kubeconfig file)."""

    def __init__(self, kubeconfig: Path | None = None, field_manager: str = "sharegpu-scheduler-extender") -> None:
        """Raises :class:`~sharegpu.k8s.kubeconfig.KubeconfigError` for credentials that cannot be loaded."""
        creds = load_credentials(kubeconfig)
        self.server, self.credentials_source = creds.server, creds.source
        self._client = creds.client(field_manager)
        # Bindings in flight at once. Beyond the connection pool's keep-alive limit (20) each extra one opened a
        # TLS connection, a full handshake on both sides, that was closed after its one request.
        self._binds = asyncio.Semaphore(BINDS_IN_FLIGHT)

    async def list_nodes(self) -> tuple[list[Node], str]:
        from lightkube.resources.core_v1 import Node as KNode

        try:
            items, version = await self._list(KNode)
            return [Node.model_validate(n) for n in items], version
        except Exception as e:
            raise _translate(e, "list nodes") from None

    async def list_pods(self, scheduler_name: str | None = None) -> tuple[list[Pod], str]:
        from lightkube.resources.core_v1 import Pod as KPod

        try:
            items, version = await self._list(KPod, namespace="*", fields=_of_scheduler(scheduler_name))
            return [Pod.model_validate(p) for p in items], version
        except Exception as e:
            raise _translate(e, "list pods") from None

    # Lists and watches are requested through lightkube but read as plain JSON: its typed models cost more to
    # decode (and to turn back into dicts) than the rest of the extender's work per watch event.
    async def _list(
        self, res: Any, namespace: str | None = None, fields: dict[str, Any] | None = None
    ) -> tuple[list[dict[str, Any]], str]:
        """Every item of a (paginated) list, as JSON objects, and the list's resourceVersion."""
        generic = self._client._client
        params: dict[str, Any] = {"limit": LIST_CHUNK, "fieldSelector": _fields(fields)}
        items: list[dict[str, Any]] = []
        while True:
            br = generic.prepare_request("list", res=res, namespace=namespace, params=params)
            response = await generic.send(generic.build_adapter_request(br))  # type: ignore[no-untyped-call]
            if response.status_code >= 400:
                generic.handle_response("list", response, br)  # raises lightkube's ApiError with the Status
            body = response.json()
            items.extend(body.get("items") or [])
            meta = body.get("metadata") or {}
            if not meta.get("continue"):
                return items, str(meta.get("resourceVersion") or "")
            params["continue"] = meta["continue"]

    async def _watch(
        self,
        res: Any,
        resource_version: str,
        timeout_s: int | None,
        namespace: str | None = None,
        fields: dict[str, Any] | None = None,
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """(type, object) of each watch event after ``resource_version``; a watch the server ends by itself is
        resumed from the last version seen (as lightkube's own watch does); an ERROR event raises."""
        from lightkube.core.exceptions import ApiError as LkApiError
        from lightkube.models.meta_v1 import Status

        generic = self._client._client
        params = {"timeoutSeconds": timeout_s, "fieldSelector": _fields(fields)}
        br = generic.prepare_request("list", res=res, namespace=namespace, watch=True, params=params)
        version = resource_version or None
        while True:
            query = {k: v for k, v in br.params.items() if k != "resourceVersion"}
            if version:
                query["resourceVersion"] = version
            request = generic._client.build_request(br.method, br.url, params=query, timeout=generic._watch_timeout)
            response = await generic.send(request, stream=True)  # type: ignore[no-untyped-call]
            try:
                if response.status_code >= 400:
                    await response.aread()
                    generic.handle_response("list", response, br)
                async for line in response.aiter_lines():
                    event = json.loads(line)
                    obj = event.get("object") or {}
                    if event.get("type") == "ERROR":
                        raise LkApiError(status=cast(Status, Status.from_dict(obj)))
                    version = (obj.get("metadata") or {}).get("resourceVersion") or version
                    yield event["type"], obj
            finally:
                await response.aclose()

    async def watch_nodes(self, resource_version: str, timeout_s: int | None = None) -> AsyncIterator[tuple[str, Node]]:
        from lightkube.resources.core_v1 import Node as KNode

        try:
            async for kind, obj in self._watch(KNode, resource_version, timeout_s):
                yield kind, Node.model_validate(obj)
        except Exception as e:
            raise _translate(e, "watch nodes") from None

    async def watch_pods(
        self, resource_version: str, timeout_s: int | None = None, scheduler_name: str | None = None
    ) -> AsyncIterator[tuple[str, Pod]]:
        from lightkube.resources.core_v1 import Pod as KPod

        try:
            async for kind, obj in self._watch(
                KPod, resource_version, timeout_s, namespace="*", fields=_of_scheduler(scheduler_name)
            ):
                yield kind, Pod.model_validate(obj)
        except Exception as e:
            raise _translate(e, "watch pods") from None

    async def get_pod(self, namespace: str, name: str) -> Pod:
        from lightkube.resources.core_v1 import Pod as KPod

        try:
            pod = await self._client.get(KPod, name, namespace=namespace)
        except Exception as e:
            raise _translate(e, f"read pod {namespace}/{name}") from None
        return Pod.model_validate(pod.to_dict())

    async def patch_pod_annotations(
        self, namespace: str, name: str, annotations: Mapping[str, str | None], resource_version: str | None
    ) -> Pod:
        from lightkube.resources.core_v1 import Pod as KPod
        from lightkube.types import PatchType

        meta: dict[str, Any] = {"annotations": dict(annotations)}
        if resource_version:
            # A merge patch that carries metadata.resourceVersion is applied only at that version (else 409).
            meta["resourceVersion"] = resource_version
        try:
            pod = await self._client.patch(
                KPod, name, {"metadata": meta}, namespace=namespace, patch_type=PatchType.MERGE
            )
        except Exception as e:
            raise _translate(e, f"annotate pod {namespace}/{name}") from None
        return Pod.model_validate(pod.to_dict())

    async def bind_pod(
        self,
        namespace: str,
        name: str,
        uid: str,
        node: str,
        annotations: Mapping[str, str] | None = None,
        resource_version: str | None = None,
    ) -> None:
        from lightkube.models.core_v1 import ObjectReference
        from lightkube.models.meta_v1 import ObjectMeta
        from lightkube.resources.core_v1 import Pod as KPod

        binding = KPod.Binding(
            metadata=ObjectMeta(
                name=name,
                namespace=namespace,
                uid=uid or None,
                resourceVersion=resource_version or None,
                annotations=dict(annotations) if annotations else None,
            ),
            target=ObjectReference(apiVersion="v1", kind="Node", name=node),
        )
        # The API server answers a Binding with a Status (201), not a Binding: lightkube's create() would fail to
        # decode that and report a bind that happened as failed. So the request is sent with no decoding.
        generic = self._client._client
        try:
            request = generic.prepare_request("post", obj=binding, name=name, namespace=namespace)
            request.response_type = None
            async with self._binds:
                response = await generic.send(generic.build_adapter_request(request))  # type: ignore[no-untyped-call]
            generic.handle_response("post", response, request)
        except Exception as e:
            raise _translate(e, f"bind pod {namespace}/{name} to {node}") from None

    # ----- leases (leader election) ----------------------------------------------------------------------------
    async def get_lease(self, namespace: str, name: str) -> LeaseRecord:
        from lightkube.resources.coordination_v1 import Lease

        try:
            lease = await self._client.get(Lease, name, namespace=namespace)
        except Exception as e:
            raise _translate(e, f"read lease {namespace}/{name}") from None
        return _lease_record(lease.to_dict())

    async def create_lease(self, namespace: str, name: str, record: LeaseRecord) -> LeaseRecord:
        from lightkube.resources.coordination_v1 import Lease

        try:
            lease = await self._client.create(cast(Lease, Lease.from_dict(_lease_dict(namespace, name, record))))
        except Exception as e:
            raise _translate(e, f"create lease {namespace}/{name}") from None
        return _lease_record(lease.to_dict())

    async def update_lease(self, namespace: str, name: str, record: LeaseRecord) -> LeaseRecord:
        from lightkube.resources.coordination_v1 import Lease

        try:
            lease = await self._client.replace(cast(Lease, Lease.from_dict(_lease_dict(namespace, name, record))))
        except Exception as e:
            raise _translate(e, f"update lease {namespace}/{name}") from None
        return _lease_record(lease.to_dict())

    async def close(self) -> None:
        await self._client.close()


def _micro_time(t: datetime | None) -> str | None:
    return None if t is None else t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_time(v: Any) -> datetime | None:
    if v is None or isinstance(v, datetime):
        return v
    return datetime.fromisoformat(str(v).replace("Z", "+00:00"))


def _lease_dict(namespace: str, name: str, r: LeaseRecord) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if r.resource_version:
        meta["resourceVersion"] = r.resource_version
    spec = {
        "holderIdentity": r.holder,
        "leaseDurationSeconds": r.lease_s,
        "acquireTime": _micro_time(r.acquired),
        "renewTime": _micro_time(r.renewed),
        "leaseTransitions": r.transitions,
    }
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}


def _lease_record(d: Mapping[str, Any]) -> LeaseRecord:
    from sharegpu.k8s.leader import LeaseRecord  # leader.py builds on this module's errors

    spec = d.get("spec") or {}
    return LeaseRecord(
        holder=spec.get("holderIdentity") or "",
        lease_s=int(spec.get("leaseDurationSeconds") or 0),
        acquired=_parse_time(spec.get("acquireTime")),
        renewed=_parse_time(spec.get("renewTime")),
        transitions=int(spec.get("leaseTransitions") or 0),
        resource_version=str((d.get("metadata") or {}).get("resourceVersion") or ""),
    )


def _fields(fields: dict[str, Any] | None) -> str | None:
    from lightkube.core.selector import build_selector

    return build_selector(fields, for_fields=True) if fields else None


def _of_scheduler(name: str | None) -> dict[str, Any] | None:
    # spec.schedulerName is immutable, so a pod never enters or leaves the selection while it exists.
    return {"spec.schedulerName": name} if name else None


def _translate(e: Exception, what: str) -> ApiError:
    from lightkube.core.exceptions import ApiError as LkApiError

    if isinstance(e, ApiError):
        return e
    if isinstance(e, LkApiError):
        code = e.status.code
        message = e.status.message or str(e)
        if code == 409:
            return Conflict(f"cannot {what}: {message}")
        if code == 404:
            return NotFound(f"cannot {what}: {message}")
        if code is not None and (code >= 500 or code == 429):
            return Unavailable(f"cannot {what}: HTTP {code}: {message}")
        return ApiError(f"cannot {what}: HTTP {code}: {message}")
    if (answered := _non_json_answer(e, what)) is not None:
        return answered
    from sharegpu.k8s.transport import CertificateRejected

    server = request_server(e)
    if isinstance(e, CertificateRejected):
        return Unavailable(f"cannot {what}: {server}: {e}")
    # Anything else is the connection (httpx errors, timeouts, a closed stream): name the server that did not answer.
    why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return Unavailable(
        f"cannot {what}: the API server at {server} did not answer: {why}" if server else f"cannot {what}: {why}"
    )


# What a Go HTTPS server answers a plain-HTTP request with (net/http, no Content-Type): the API server's own port.
_HTTP_TO_HTTPS = "Client sent an HTTP request to an HTTPS server"


def _non_json_answer(e: Exception, what: str) -> ApiError | None:
    """An error status whose body is not a Kubernetes Status (no JSON Content-Type): lightkube passes on httpx's
    HTTPStatusError, or fails on the missing header with a KeyError raised while handling it. Said as the answer it
    is, with what to change where the cause is known (http:// written for the API server's HTTPS port)."""
    cause: BaseException | None = e
    while cause is not None and getattr(cause, "response", None) is None:
        cause = cause.__context__
    response = getattr(cause, "response", None)
    code = getattr(response, "status_code", None)
    if not isinstance(code, int):
        return None
    try:
        text = " ".join(str(response.text).split())[:200]  # type: ignore[union-attr]
    except Exception:  # an answer whose body cannot be read: only its status is known
        text = ""
    url = getattr(getattr(cause, "request", None), "url", None)
    if _HTTP_TO_HTTPS in text and url is not None and url.scheme == "http":
        https = f"https://{url.netloc.decode()}"
        return ApiError(
            f"cannot {what}: the API server at http://{url.netloc.decode()} serves HTTPS only; write {https} as the "
            "cluster's server in the kubeconfig (plain http:// works only with a plain-HTTP endpoint such as kubectl "
            "proxy)"
        )
    where = f" from {url.scheme}://{url.netloc.decode()}" if url is not None else ""
    kind = Unavailable if code >= 500 or code == 429 else ApiError
    return kind(f"cannot {what}: HTTP {code}{where}, not a Kubernetes API answer: {text or '(no body)'}")
