"""The DeviceClasses of the DRA path (the chart's ``templates/dra-deviceclasses.yaml`` renders the same objects).

- ``gpu.sharegpu.io``: a share of a GPU. A claim asks for ``capacity.requests: {memory: 10Gi, compute: 30}``; what
  it leaves out it gets whole. Shared through MPS unless its config says ``sharing: TimeSlicing``.
- ``whole-gpu.sharegpu.io``: the same devices, for claims that ask for no capacity: the GPU to themselves.
- ``mig.sharegpu.io``: a MIG partition; select the profile with a CEL selector on the ``profile`` attribute.
"""

from __future__ import annotations

from typing import Any

from sharegpu.model.contract import (
    DRA_CONFIG_API_VERSION,
    DRA_CONFIG_KIND,
    DRIVER,
    MIG_CLASS,
    SHARED_CLASS,
    WHOLE_CLASS,
)
from sharegpu.node.dra.slices import RESOURCE_API


def selector(device_type: str) -> str:
    return f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "{device_type}"'


def device_classes() -> list[dict[str, Any]]:
    def cls(name: str, device_type: str, config: dict[str, Any] | None) -> dict[str, Any]:
        spec: dict[str, Any] = {"selectors": [{"cel": {"expression": selector(device_type)}}]}
        if config is not None:
            spec["config"] = [
                {
                    "opaque": {
                        "driver": DRIVER,
                        "parameters": {"apiVersion": DRA_CONFIG_API_VERSION, "kind": DRA_CONFIG_KIND, **config},
                    }
                }
            ]
        return {"apiVersion": RESOURCE_API, "kind": "DeviceClass", "metadata": {"name": name}, "spec": spec}

    return [
        cls(SHARED_CLASS, "gpu", {"sharing": "MPS"}),
        cls(WHOLE_CLASS, "gpu", None),
        cls(MIG_CLASS, "mig", None),
    ]
