"""The root of every error the node's components raise on purpose, so that a command catches one class.

Each component keeps its own subclass (``BackendError``, ``MpsError``, ``MigError``, ``StateError``, ``CdiError``,
the DRA driver's ``ClaimError`` ...), whose message says what failed and what to change. Errors of the API server
and of the credentials for it are :class:`sharegpu.kube.errors.KubeError`, shared with the control plane and so not
a node error: :data:`COMMAND_ERRORS` is the one place where the two are caught together.
"""

from __future__ import annotations

from sharegpu.kube.errors import KubeError


class NodeError(Exception):
    """Something on this node stops a request or the agent (a flag, a file, the GPU backend, MIG, MPS, the kubelet's
    sockets); the message says what and, where it is known, what to change."""


# What a node command (node-agent, dra-driver) reports as one line and exits 2 on; anything else is a bug: traceback.
COMMAND_ERRORS: tuple[type[Exception], ...] = (NodeError, KubeError)
