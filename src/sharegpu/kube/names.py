"""Names that become part of an API server URL, checked before any request is built from them.

The client builds paths such as ``/api/v1/namespaces/<namespace>/pods/<name>/binding`` from names it is given, and
some come from outside the process (the kube-scheduler's bind call, a pod's own fields): ``../../nodes/x`` as a pod
name would address another object. Kubernetes itself allows only DNS-1123 names there (apimachinery's
``IsDNS1123Subdomain`` for pods, nodes, leases and most objects, ``IsDNS1123Label`` for namespaces), so a name of
any other shape names no object and is refused here, before a request exists, by :class:`~sharegpu.kube.client.
KubeClient` for every request and by the callers that answer someone (the extender's bind) for a clear answer.
"""

from __future__ import annotations

import re
from typing import Final, Literal

from sharegpu.kube.echo import echo
from sharegpu.kube.errors import KubeError

# apimachinery/pkg/util/validation: dns1123LabelFmt and dns1123SubdomainFmt, with their maximum lengths.
_LABEL: Final = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_LABEL_RE: Final = re.compile(_LABEL)
_SUBDOMAIN_RE: Final = re.compile(rf"{_LABEL}(\.{_LABEL})*")
LABEL_MAX: Final = 63
SUBDOMAIN_MAX: Final = 253

NameKind = Literal["pod", "node", "namespace", "object"]


class InvalidName(KubeError):
    """A name that Kubernetes would not accept for its kind, so it names no object; no request was sent."""


def name_problem(kind: NameKind, name: str) -> str:
    """Why ``name`` cannot be the name of a ``kind`` ("" when it can): namespaces are DNS-1123 labels, pods, nodes
    and other objects DNS-1123 subdomains."""
    if kind == "namespace":
        shape, limit, ok = "a DNS-1123 label", LABEL_MAX, _LABEL_RE.fullmatch(name) is not None
        example = "my-team"
    else:
        shape, limit, ok = "a DNS-1123 subdomain", SUBDOMAIN_MAX, _SUBDOMAIN_RE.fullmatch(name) is not None
        example = "gpu-node-1" if kind == "node" else "train-0"
    if ok and len(name) <= limit:
        return ""
    why = f"is not {shape}" if not ok else f"is {len(name)} characters long"
    chars = "lower-case letters, digits and '-'" if kind == "namespace" else "lower-case letters, digits, '-' and '.'"
    what = "name" if kind == "object" else f"{kind} name"
    return (
        f"{what} {echo(name)} {why}: a {what} is {shape} of at most {limit} characters ({chars}, "
        f"starting and ending with a letter or digit, e.g. {example})"
    )


def check_name(kind: NameKind, name: str) -> None:
    """Raise :class:`InvalidName` unless ``name`` can be the name of a ``kind``."""
    if problem := name_problem(kind, name):
        raise InvalidName(problem)


def check_path(what: str, name: str | None = None, namespace: str | None = None, any_namespace: bool = False) -> None:
    """Raise :class:`InvalidName` (its message starting "cannot ``what``") unless ``name`` and ``namespace``, when
    given, can name an object; ``any_namespace``: ``*`` (every namespace, for lists and watches) is allowed too."""
    problems = []
    if namespace is not None and not (any_namespace and namespace == "*"):
        problems.append(name_problem("namespace", namespace))
    if name is not None:
        problems.append(name_problem("object", name))
    if found := [p for p in problems if p]:
        raise InvalidName(f"cannot {what}: " + "; ".join(found))
