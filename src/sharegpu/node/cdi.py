"""CDI specs: what the container runtime adds to a container that uses a sharegpu GPU, on both ways in.

The kubelet passes fully qualified CDI device IDs (``sharegpu.io/gpu=<name>``) to the runtime, which applies their
edits: the environment (the visible unit and, for MPS, the daemon's pipe and the share's limits), the device nodes
and the MPS pipe directory's mount. A runtime stats every device node, so a spec names only nodes that exist on the
host (the backend says which). Files are written atomically, so a runtime never reads half a spec.

- DRA: one file per prepared claim (``sharegpu.io-gpu_<claim UID>.json``), one CDI device per allocated device of the
  claim (named by :func:`~sharegpu.model.contract.cdi_claim_device_name`).
- Device plugin: one file per container allocation (``sharegpu.io-dp_<name>.json``), named after the device IDs
  the kubelet allocated (:func:`~sharegpu.model.contract.cdi_allocation_name`); written at PreStartContainer, once
  the kubelet has said whose container it is.

The names and the fully qualified IDs (:func:`~sharegpu.model.contract.cdi_device_id`) live in the contract.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sharegpu.model.contract import CDI_ALLOCATION_PREFIX, CDI_KIND
from sharegpu.node.durable import write_atomic
from sharegpu.node.errors import NodeError

CDI_VERSION = "0.6.0"
DEFAULT_CDI_DIR = Path("/var/run/cdi")
_FILE_PREFIX = "sharegpu.io-gpu_"  # DRA claims
_DP_FILE_PREFIX = "sharegpu.io-dp_"  # device-plugin allocations


class CdiError(NodeError):
    """A CDI spec cannot be written or removed; the message names the file."""


@dataclass(frozen=True, slots=True)
class CdiMount:
    container_path: str
    host_path: str
    read_only: bool = False


@dataclass(frozen=True, slots=True)
class CdiDevice:
    name: str
    env: tuple[tuple[str, str], ...] = ()
    device_nodes: tuple[str, ...] = ()
    mounts: tuple[CdiMount, ...] = field(default_factory=tuple)


class CdiWriter:
    def __init__(self, directory: Path = DEFAULT_CDI_DIR) -> None:
        self.directory = directory

    def check(self) -> None:
        """Fail now, not at the first Prepare, when the directory cannot hold specs (made if missing)."""
        probe = self.directory / f".{_FILE_PREFIX}probe-{os.getpid()}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise CdiError(f"cannot write CDI specs in {self.directory}: {e.strerror or e}") from None

    def path(self, claim_uid: str) -> Path:
        if not re.fullmatch(r"[A-Za-z0-9-]+", claim_uid):
            raise CdiError(f"{claim_uid!r} is not a claim UID")
        return self.directory / f"{_FILE_PREFIX}{claim_uid}.json"

    def write(self, claim_uid: str, devices: tuple[CdiDevice, ...]) -> Path:
        return self._write(self.path(claim_uid), devices)

    def allocation_path(self, name: str) -> Path:
        if not re.fullmatch(rf"{CDI_ALLOCATION_PREFIX}[0-9a-f]+", name):
            raise CdiError(f"{name!r} is not a device-plugin allocation name")
        return self.directory / f"{_DP_FILE_PREFIX}{name}.json"

    def write_allocation(self, device: CdiDevice) -> Path:
        """The spec of one device-plugin allocation (``device.name`` from :func:`~sharegpu.model.contract.cdi_allocation_name`)."""
        return self._write(self.allocation_path(device.name), (device,))

    def remove_allocation(self, name: str) -> None:
        self._remove(self.allocation_path(name))

    def allocation_names(self) -> set[str]:
        if not self.directory.is_dir():
            return set()
        return {p.name[len(_DP_FILE_PREFIX) : -len(".json")] for p in self.directory.glob(f"{_DP_FILE_PREFIX}*.json")}

    def _write(self, path: Path, devices: tuple[CdiDevice, ...]) -> Path:
        spec: dict[str, Any] = {
            "cdiVersion": CDI_VERSION,
            "kind": CDI_KIND,
            "devices": [
                {
                    "name": d.name,
                    "containerEdits": {
                        "env": [f"{k}={v}" for k, v in d.env],
                        "deviceNodes": [{"path": p} for p in d.device_nodes],
                        "mounts": [
                            {
                                "hostPath": m.host_path,
                                "containerPath": m.container_path,
                                "options": ["ro" if m.read_only else "rw", "nosuid", "nodev", "bind"],
                            }
                            for m in d.mounts
                        ],
                    },
                }
                for d in devices
            ],
        }
        try:
            write_atomic(path, json.dumps(spec, indent=2))
        except OSError as e:
            raise CdiError(f"cannot write the CDI spec {path}: {e.strerror or e}; check --cdi-dir") from None
        return path

    def remove(self, claim_uid: str) -> None:
        self._remove(self.path(claim_uid))

    def _remove(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            raise CdiError(f"cannot remove the CDI spec {path}: {e.strerror or e}") from None

    def claim_uids(self) -> set[str]:
        """The claims that have a spec here (to remove the orphans of claims no checkpoint knows)."""
        if not self.directory.is_dir():
            return set()
        return {p.name[len(_FILE_PREFIX) : -len(".json")] for p in self.directory.glob(f"{_FILE_PREFIX}*.json")}
