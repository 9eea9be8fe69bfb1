"""The requests sharegpu makes of the API server, over one lightkube client, with every error translated once.

Objects come back as plain JSON (``dict``), as the API server wrote them: lightkube's typed models cost more to decode
(and to turn back into dicts) than the rest of the extender's work per watch event, and they drop the fields they do
not know. Requests are built by lightkube (URLs, selectors, authentication), except the one write
of every pod, its Binding, whose body is encoded once by its caller (:meth:`KubeClient.post_encoded`), and carried
by :mod:`sharegpu.kube.transport`. Every method takes ``what`` — what the caller was doing, said for a person ("read
node n1") — and raises :class:`~sharegpu.kube.errors.KubeError` (a subclass that says what to do) on any failure.
Every name and namespace that goes into a URL is checked first (:func:`sharegpu.kube.names.check_path`): one that
Kubernetes would not accept raises :class:`~sharegpu.kube.names.InvalidName` before any request is built.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from sharegpu.kube.errors import translate
from sharegpu.kube.kubeconfig import load_credentials
from sharegpu.kube.names import check_path

if TYPE_CHECKING:
    from lightkube import AsyncClient

LIST_CHUNK = 500  # objects per list page: a 10,000-node relist in 20 requests, none of them huge
JsonObject = dict[str, Any]


class KubeClient:
    """One API server, with the credentials of a kubeconfig file or of the in-cluster service account."""

    def __init__(self, kubeconfig: Path | None, field_manager: str) -> None:
        """Raises :class:`~sharegpu.kube.errors.ConfigError` for credentials that cannot be loaded."""
        creds = load_credentials(kubeconfig)
        self.server, self.source = creds.server, creds.source
        self.lightkube: AsyncClient = creds.client(field_manager)
        self._create_params = {"fieldManager": field_manager} if field_manager else {}  # as lightkube's creates

    async def get(self, res: Any, name: str, what: str, namespace: str | None = None) -> JsonObject:
        check_path(what, name, namespace)
        try:
            return await self._send("get", res, name=name, namespace=namespace)
        except Exception as e:
            raise translate(e, what) from None

    async def list(
        self, res: Any, what: str, namespace: str | None = None, fields: Mapping[str, Any] | None = None
    ) -> tuple[list[JsonObject], str]:
        """Every item of a (paginated) list and the list's resourceVersion (to watch from)."""
        check_path(what, namespace=namespace, any_namespace=True)
        generic = self.lightkube._client
        params: dict[str, Any] = {"limit": LIST_CHUNK, "fieldSelector": _fields(fields)}
        items: list[JsonObject] = []
        try:
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
        except Exception as e:
            raise translate(e, what) from None

    async def watch(
        self,
        res: Any,
        resource_version: str,
        what: str,
        timeout_s: int | None = None,
        namespace: str | None = None,
        fields: Mapping[str, Any] | None = None,
    ) -> AsyncIterator[tuple[str, JsonObject]]:
        """(type, object) of each watch event after ``resource_version``; a watch the server ends by itself is
        resumed from the last version seen (as lightkube's own watch does); an ERROR event (410 Gone: the version is
        too old) raises. ``timeout_s``: the server-side timeout of each watch request (``timeoutSeconds``)."""
        check_path(what, namespace=namespace, any_namespace=True)
        try:
            async for event in self._watch(res, resource_version, timeout_s, namespace, fields):
                yield event
        except Exception as e:
            raise translate(e, what) from None

    async def _watch(
        self,
        res: Any,
        resource_version: str,
        timeout_s: int | None,
        namespace: str | None,
        fields: Mapping[str, Any] | None,
    ) -> AsyncIterator[tuple[str, JsonObject]]:
        from lightkube.core.exceptions import ApiError as LkApiError
        from lightkube.models.meta_v1 import Status

        generic = self.lightkube._client
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

    async def merge_patch(
        self, res: Any, name: str, body: Mapping[str, Any], what: str, namespace: str | None = None
    ) -> JsonObject:
        """A JSON merge patch (a None value removes a key); the object as it is after it."""
        from lightkube.types import PatchType

        check_path(what, name, namespace)
        try:
            return await self._send(
                "patch", res, name=name, namespace=namespace, obj=dict(body), headers_type=PatchType.MERGE
            )
        except Exception as e:
            raise translate(e, what) from None

    async def create(self, obj: Any, what: str) -> JsonObject:
        """Create ``obj`` (a lightkube resource object); the object as created."""
        try:
            out: JsonObject = (await self.lightkube.create(obj)).to_dict()
        except Exception as e:
            raise translate(e, what) from None
        return out

    async def replace(self, obj: Any, what: str) -> JsonObject:
        """Replace ``obj`` (a lightkube resource object; its resourceVersion, when set, is the precondition)."""
        meta = getattr(obj, "metadata", None)
        check_path(what, getattr(meta, "name", None), getattr(meta, "namespace", None))
        try:
            out: JsonObject = (await self.lightkube.replace(obj)).to_dict()
        except Exception as e:
            raise translate(e, what) from None
        return out

    async def apply(self, obj: Any, what: str) -> None:
        """Server-side apply of a lightkube resource object, taking over fields another manager holds (our fields
        only are sent)."""
        try:
            await self.lightkube.apply(obj, force=True)
        except Exception as e:
            raise translate(e, what) from None

    async def delete(self, res: Any, name: str, what: str, namespace: str | None = None) -> None:
        check_path(what, name, namespace)
        try:
            await self.lightkube.delete(res, name, namespace=namespace)
        except Exception as e:
            raise translate(e, what) from None

    async def post_undecoded(self, obj: Any, name: str, namespace: str | None, what: str) -> None:
        """Create ``obj`` (a lightkube object) and read nothing of the answer but its status: the API server answers
        some creations (a Binding) with a Status, which lightkube's create() would fail to decode as the object."""
        check_path(what, name, namespace)
        generic = self.lightkube._client
        try:
            request = generic.prepare_request("post", obj=obj, name=name, namespace=namespace)
            request.response_type = None
            response = await generic.send(generic.build_adapter_request(request))  # type: ignore[no-untyped-call]
            generic.handle_response("post", response, request)
        except Exception as e:
            raise translate(e, what) from None

    async def post_encoded(self, path: str, body: bytes, name: str, namespace: str, what: str) -> None:
        """POST ``body`` (an object already encoded as JSON) to the API ``path`` of object ``name`` and read nothing of
        the answer but its status, as :meth:`post_undecoded` does, without lightkube's object model and request
        building: for the one write of every pod (its Binding), where they cost about 79 µs of the bind's 0.5 ms
        (issue 34). ``path`` is relative to the server's URL, which the kubeconfig may give a path of its own."""
        check_path(what, name, namespace)
        generic = self.lightkube._client
        try:
            request = generic._client.build_request(
                "POST", path, params=self._create_params, content=body, headers=_JSON_BODY
            )
            response = await generic.send(request)  # type: ignore[no-untyped-call]
            generic.raise_for_status(response)  # type: ignore[no-untyped-call]
        except Exception as e:
            raise translate(e, what) from None

    async def _send(
        self,
        method: str,
        res: Any,
        name: str | None = None,
        namespace: str | None = None,
        obj: Any = None,
        headers_type: Any = None,
    ) -> JsonObject:
        """One request whose answer is an object, read as JSON (errors as lightkube raises them)."""
        generic = self.lightkube._client
        br = generic.prepare_request(
            method, res=res, obj=obj, name=name, namespace=namespace, headers=_patch_headers(headers_type)
        )
        response = await generic.send(generic.build_adapter_request(br))  # type: ignore[no-untyped-call]
        if response.status_code >= 400:
            generic.handle_response(method, response, br)
        out: JsonObject = response.json()
        return out

    async def close(self) -> None:
        await self.lightkube.close()


_JSON_BODY = {"Content-Type": "application/json"}


def _patch_headers(patch_type: Any) -> dict[str, str] | None:
    return None if patch_type is None else {"Content-Type": patch_type.value}


def _fields(fields: Mapping[str, Any] | None) -> str | None:
    from lightkube.core.selector import build_selector

    return build_selector(dict(fields), for_fields=True) if fields else None
