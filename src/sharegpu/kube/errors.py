"""Every failure of a request to the API server, or of the credentials for one, as one exception hierarchy.

lightkube raises its ``ApiError`` (an answer with a Kubernetes Status), httpx's errors (the connection) and, for an
answer that is not a Kubernetes Status, httpx's ``HTTPStatusError`` or a ``KeyError`` raised while reading it.
:func:`translate` turns each into a :class:`KubeError` whose class says what the caller can do (retry, relist, give
up) and whose message says what failed and, where the cause is known, what to change::

    KubeError                     anything below; what a command prints and exits on
    ├── ConfigError               credentials that cannot be loaded (kubeconfig, service account, exec spec)
    ├── Unavailable               no usable answer: refused, reset, timed out, 5xx; a write may have been applied
    │   ├── TooManyRequests       429: the server sheds load; try again later
    │   └── ExecPluginError       (sharegpu.kube.exec_auth) the exec plugin gave no token
    ├── NotFound                  404
    ├── Conflict                  409: a precondition (resourceVersion, UID) failed, or the object exists
    ├── EvictionBlocked           429 on an Eviction: a PodDisruptionBudget allows no disruption now
    ├── Gone                      410: the resourceVersion asked for is too old; list again
    ├── Unauthorized              401: the credentials were refused
    └── Forbidden                 403: the credentials lack the permission (RBAC)
"""

from __future__ import annotations


class KubeError(Exception):
    """A request to the API server failed, or the credentials for one cannot be loaded; the message says which and
    why. ``code`` is the HTTP status of the server's answer, when there was one."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class ConfigError(KubeError):
    """Credentials that cannot be loaded or used; the message names the file (or source) and what is wrong."""


class Unavailable(KubeError):
    """No usable answer from the API server (connection refused or reset, timeout, 5xx, an answer that cannot be
    read, credentials not obtainable now). For a write, the outcome is unknown: the server may have applied it."""


class TooManyRequests(Unavailable):
    """429: the API server (or its priority and fairness) sheds load; the request was not applied."""


class NotFound(KubeError):
    """404: the object (or the API group, on a server that does not serve it) does not exist."""


class Conflict(KubeError):
    """409: a precondition (resourceVersion, UID) failed since the object was read, or it exists already."""


class EvictionBlocked(KubeError):
    """429 to an Eviction: the pod's PodDisruptionBudget allows no disruption now (or the pod matches several
    budgets); the pod was not evicted. Retry once the budget allows one, or choose another pod."""


class Gone(KubeError):
    """410 (reason Expired): the resourceVersion a watch or list asked for is older than the server keeps; only a
    fresh list can go on from here."""


class Unauthorized(KubeError):
    """401: the API server does not accept the credentials (expired or revoked token, unknown certificate)."""


class Forbidden(KubeError):
    """403: the credentials are accepted but lack the permission (RBAC) for this request."""


# What a Go HTTPS server answers a plain-HTTP request with (net/http, no Content-Type): the API server's own port.
_HTTP_TO_HTTPS = "Client sent an HTTP request to an HTTPS server"

_ADVICE = {
    401: "the API server refused the credentials; renew the token or certificate the kubeconfig's user gives "
    "(or the pod's service account token)",
    403: "the credentials lack the permission; grant it to the user or service account (the Helm chart's "
    "ClusterRoles hold what sharegpu needs)",
}


def of_status(code: int | None, message: str) -> KubeError:
    """The error for an answer with HTTP status ``code``; ``message`` is the whole text shown."""
    kind: type[KubeError]
    if code == 404:
        kind = NotFound
    elif code == 409:
        kind = Conflict
    elif code == 410:
        kind = Gone
    elif code == 401:
        kind = Unauthorized
    elif code == 403:
        kind = Forbidden
    elif code == 429:
        kind = TooManyRequests
    elif code is not None and code >= 500:
        kind = Unavailable
    else:
        kind = KubeError
    return kind(message, code)


def translate(e: BaseException, what: str) -> KubeError:
    """The :class:`KubeError` for ``e``, raised while trying to ``what`` ("bind pod ns/p to node-1")."""
    from lightkube.core.exceptions import ApiError as LkApiError

    if isinstance(e, KubeError):
        return e
    if isinstance(e, LkApiError):
        code = e.status.code
        message = e.status.message or str(e)
        if code in (404, 409):  # the Status message names the object and the precondition
            return of_status(code, f"cannot {what}: {message}")
        advice = f"; {_ADVICE[code]}" if code in _ADVICE else ""
        return of_status(code, f"cannot {what}: HTTP {code}: {message}{advice}")
    if (answered := _non_json_answer(e, what)) is not None:
        return answered
    from sharegpu.kube.transport import CertificateRejected

    server = request_server(e)
    if isinstance(e, CertificateRejected):
        return Unavailable(f"cannot {what}: {server}: {e}")
    # Anything else is the connection (httpx errors, timeouts, a closed stream): name the server that did not answer.
    why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return Unavailable(
        f"cannot {what}: the API server at {server} did not answer: {why}" if server else f"cannot {what}: {why}"
    )


def _non_json_answer(e: BaseException, what: str) -> KubeError | None:
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
        return KubeError(
            f"cannot {what}: the API server at http://{url.netloc.decode()} serves HTTPS only; write {https} as the "
            "cluster's server in the kubeconfig (plain http:// works only with a plain-HTTP endpoint such as kubectl "
            "proxy)",
            code,
        )
    where = f" from {url.scheme}://{url.netloc.decode()}" if url is not None else ""
    kind = Unavailable if code >= 500 or code == 429 else KubeError
    return kind(f"cannot {what}: HTTP {code}{where}, not a Kubernetes API answer: {text or '(no body)'}", code)


def request_server(e: BaseException) -> str:
    """scheme://host:port of the API server a connection error (httpx's RequestError, which lightkube raises) was
    trying to reach; "" for anything else, such as an answer with an error status (it carries a response)."""
    if getattr(e, "response", None) is not None:
        return ""
    try:
        url = e.request.url  # type: ignore[attr-defined]  # httpx's RequestError; raises when no request is set
    except (AttributeError, RuntimeError):
        return ""
    return f"{url.scheme}://{url.netloc.decode()}"
