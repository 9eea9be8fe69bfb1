"""Who may share one MPS server: the tenant, computed once from the pod and used by every side.

An MPS server serves one Unix user at a time (measured on an H200: a client of another UID waits in CUDA
initialisation until every client of the running server has exited), and its clients share one fault domain. Two
MPS control daemons on one GPU, each with its own pipe directory, serve two users at once and take turns on the GPU.
So sharegpu runs a daemon per (unit, tenant), where a tenant is the set of pods that may share one server:

- the pods of one namespace whose GPU containers all declare the same ``runAsUser`` and run in the host's user
  namespace (``hostUsers`` unset or true): their processes run as that UID on the host;
- any other pod (a container leaves its user to the image, or ``hostUsers: false`` maps it to another host UID) is
  a tenant of its own: nobody can know whom it would share a server with.

On a node in multi-user mode (``nvidia-cuda-mps-control -M``, an administrator's opt-in) one root-owned server serves
every user: all its MPS clients are one tenant, :data:`MULTI_USER_TENANT`.

The ledger counts daemons per unit by tenant, placement prefers the unit that already runs a share's tenant, the
node starts one daemon per tenant and mounts a container only its tenant's pipe directory; each reads the key made
here and nowhere else.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MULTI_USER_TENANT = "*multi-user"  # every client of a node in multi-user mode (one -M daemon per unit)
# A request or assignment without a tenant joins any MPS unit: the simulator's "no rule" (a trace says nothing of
# users), and assignments written before tenants existed are read with their own tenant instead (Assignment).
NO_TENANT = ""

_DIR_SAFE = re.compile(r"[^A-Za-z0-9._-]")


class TenantConflict(ValueError):
    """The GPU containers of one pod declare different Unix users; the message says what to change."""


def user_tenant(namespace: str, uid: int) -> str:
    """The tenant of the pods of ``namespace`` that run as ``uid`` on the host."""
    return f"{namespace}/uid-{uid}"


def own_tenant(pod_id: str) -> str:
    """The tenant of a pod that shares its server with nobody (``pod_id``: its UID, or its name where it has none)."""
    return f"pod/{pod_id}"


def tenant_of(
    namespace: str, pod_id: str, users: Iterable[tuple[str, int | None]], host_users: bool | None = None
) -> str:
    """The tenant of a pod whose GPU-using containers run as ``users`` ((container name, declared UID or None)).

    Raises :class:`TenantConflict` when they declare different UIDs: one MPS share is one client at a time, and
    clients of two users on one server wait on each other.
    """
    named = list(users)
    declared = {uid for _, uid in named if uid is not None}
    if len(declared) > 1:
        listed = ", ".join(f"{name}: {uid if uid is not None else 'image user'}" for name, uid in named)
        raise TenantConflict(
            f"the containers that use GPUs run as different Unix users ({listed}); an MPS server serves one user at a "
            "time, so they would wait on each other: run them as one user (securityContext.runAsUser), or split them "
            "into separate pods"
        )
    if host_users is False or not named or any(uid is None for _, uid in named):
        return own_tenant(pod_id)
    return user_tenant(namespace, declared.pop())


def tenant_dir(tenant: str) -> str:
    """A file name for ``tenant`` (its daemon's directory on the node): distinct tenants get distinct names."""
    if tenant == NO_TENANT:
        return "common"
    if tenant == MULTI_USER_TENANT:
        return "multi-user"
    # Namespaces and pod UIDs hold none of "_" or "~", so the escapes below cannot collide with a real name.
    return _DIR_SAFE.sub("~", tenant.replace("/", "_"))


def describe(tenant: str) -> str:
    """A tenant in words, for messages and ``sharegpu status``."""
    if tenant == NO_TENANT:
        return "any user"
    if tenant == MULTI_USER_TENANT:
        return "every user (multi-user daemon)"
    if tenant.startswith("pod/"):
        return f"pod {tenant[4:]} alone"
    ns, _, uid = tenant.partition("/uid-")
    return f"uid {uid} in {ns}"
