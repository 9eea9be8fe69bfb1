"""Regenerate the ``*_pb2*.py`` modules from the .proto files here (needs the dev dependency grpcio-tools).

The generated modules are committed so that installing sharegpu needs no code generation; a test checks they
still match the .proto files.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO = Path(__file__).with_name("deviceplugin.proto")
# The device plugin API, the plugin-registration API, the DRA plugin API (both versions the kubelet speaks), the
# DRA health API and the pod-resources API.
PROTOS = (
    PROTO,
    PROTO.with_name("pluginregistration.proto"),
    PROTO.with_name("dra_v1.proto"),
    PROTO.with_name("dra_v1beta1.proto"),
    PROTO.with_name("dra_health_v1alpha1.proto"),
    PROTO.with_name("podresources_v1.proto"),
)


def generate(out_root: Path, protos: tuple[Path, ...] = PROTOS) -> None:
    """Write the modules under ``out_root/sharegpu/node/proto/``."""
    from grpc_tools import protoc  # a dev dependency: only needed when a .proto changes

    for proto in protos:
        src_root = proto.parents[3]
        rel = proto.relative_to(src_root)
        (out_root / rel.parent).mkdir(parents=True, exist_ok=True)
        code = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{src_root}",
                f"--python_out={out_root}",
                f"--pyi_out={out_root}",
                f"--grpc_python_out={out_root}",
                str(rel),
            ]
        )
        if code != 0:
            raise RuntimeError(f"protoc failed with exit code {code} on {proto}")


if __name__ == "__main__":
    generate(PROTO.parents[3])
    sys.exit(0)
