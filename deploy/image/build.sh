#!/usr/bin/env bash
# Build the sharegpu OCI image for real with no container registry, and run its entry point.
#
# 1. the wheel (uv build) and the locked dependencies (uv export of uv.lock, with hashes), downloaded as wheels;
# 2. a Debian root file system with Python from Debian's own packages (mmdebstrap, minbase), the wheels installed
#    offline into /opt/sharegpu with their hashes checked, a non-root user 65532;
# 3. packed as an OCI image layout by umoci, with the entry point, user, environment and OCI labels of the
#    Containerfile (ENTRYPOINT sharegpu, CMD --help, USER 65532);
# 4. the image unpacked again and its entry point run as the image's config says (user 65532): with an OCI runtime
#    (crun or runc) where one can run here, else with chroot; then every subcommand's --help the same way.
#
# Usage: deploy/image/build.sh [OUT_DIR]   (default deploy/image/out; needs root, mmdebstrap, umoci, uv;
#        an OCI runtime (crun or runc) optional: apt-get install mmdebstrap umoci runc)
# Env:   TAG (default: the project version), DEBIAN_SUITE (bookworm), DEBIAN_MIRROR (default: this host's apt source)
# Push:  skopeo copy oci:OUT_DIR/oci:TAG docker://ghcr.io/you/sharegpu:TAG
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="$(mkdir -p "${1:-$ROOT/deploy/image/out}" && cd "${1:-$ROOT/deploy/image/out}" && pwd)"
SUITE="${DEBIAN_SUITE:-bookworm}"
VERSION="$(cd "$ROOT" && python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')"
TAG="${TAG:-$VERSION}"
REVISION="$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
WORK="$OUT/work"
LAYOUT="$OUT/oci"
say() { printf '\n== %s\n' "$*"; }

for tool in mmdebstrap umoci uv; do
  command -v "$tool" >/dev/null || { echo "build.sh: $tool is missing (apt-get install mmdebstrap umoci; pip install uv)" >&2; exit 2; }
done
[ "$(id -u)" = 0 ] || { echo "build.sh: run as root (mmdebstrap and umoci unpack keep file ownership)" >&2; exit 2; }

rm -rf "$WORK" "$LAYOUT"
mkdir -p "$WORK/wheels" "$WORK/dist"

say "wheel and locked dependencies"
(cd "$ROOT" && uv build --wheel --out-dir "$WORK/dist" --quiet)
(cd "$ROOT" && uv export --frozen --no-dev --no-emit-project --format requirements-txt --output-file "$WORK/requirements.txt" --quiet)
# Wheels for Debian's Python 3.11 on this architecture: every manylinux tag that bookworm's glibc 2.36 runs (pip
# does not widen a --platform by itself).
arch="$(uname -m)"
platforms=(--platform "manylinux2014_$arch" --platform any)
for minor in $(seq 17 36); do platforms+=(--platform "manylinux_2_${minor}_$arch"); done
python3 -m pip download --quiet --dest "$WORK/wheels" --require-hashes -r "$WORK/requirements.txt" \
  --only-binary=:all: --implementation cp --python-version 3.11 --abi cp311 --abi abi3 --abi none "${platforms[@]}"

say "Debian $SUITE root file system with Python (mmdebstrap)"
umoci init --layout "$LAYOUT"
umoci new --image "$LAYOUT:$TAG"
umoci unpack --image "$LAYOUT:$TAG" "$WORK/bundle" >/dev/null
mirror=()
[ -n "${DEBIAN_MIRROR:-}" ] && mirror=("$DEBIAN_MIRROR")
mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  --customize-hook='mkdir -p "$1/tmp/sharegpu"' \
  --customize-hook="copy-in $WORK/wheels $WORK/dist $WORK/requirements.txt /tmp/sharegpu" \
  --customize-hook='chroot "$1" python3 -m venv /opt/sharegpu' \
  --customize-hook='chroot "$1" /opt/sharegpu/bin/pip --isolated install --quiet --no-index --find-links /tmp/sharegpu/wheels --require-hashes -r /tmp/sharegpu/requirements.txt' \
  --customize-hook='chroot "$1" sh -c "/opt/sharegpu/bin/pip --isolated install --quiet --no-index --no-deps /tmp/sharegpu/dist/*.whl"' \
  --customize-hook='chroot "$1" /opt/sharegpu/bin/pip --isolated uninstall --quiet --yes pip' \
  --customize-hook='chroot "$1" groupadd --gid 65532 nonroot' \
  --customize-hook='chroot "$1" useradd --key UID_MAX=65535 --uid 65532 --gid 65532 --no-create-home --shell /usr/sbin/nologin nonroot' \
  --customize-hook='rm -rf "$1/tmp/sharegpu" "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/* "$1"/usr/share/doc/* "$1"/usr/share/man/*' \
  "$SUITE" "$WORK/bundle/rootfs" "${mirror[@]}"

say "OCI image $LAYOUT:$TAG (umoci)"
umoci repack --image "$LAYOUT:$TAG" "$WORK/bundle"
umoci config --image "$LAYOUT:$TAG" \
  --os linux --architecture "$(dpkg --print-architecture)" \
  --config.entrypoint /opt/sharegpu/bin/sharegpu --config.cmd --help \
  --config.user 65532:65532 --config.workingdir / \
  --config.env PATH=/opt/sharegpu/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --config.env PYTHONDONTWRITEBYTECODE=1 --config.env PYTHONUNBUFFERED=1 \
  --config.label org.opencontainers.image.title=sharegpu \
  --config.label "org.opencontainers.image.version=$VERSION" \
  --config.label org.opencontainers.image.source=https://github.com/sharegpu/sharegpu \
  --config.label "org.opencontainers.image.revision=$REVISION" \
  --config.label org.opencontainers.image.licenses=Apache-2.0
umoci gc --layout "$LAYOUT"
rm -rf "$WORK/bundle"

say "check: the image's entry point"
umoci unpack --image "$LAYOUT:$TAG" "$WORK/check" >/dev/null
# The process the image's config asks for (entry point + cmd, as umoci's runtime config writes it).
mapfile -t args < <(python3 -c 'import json,sys; print("\n".join(json.load(open(sys.argv[1]))["process"]["args"]))' "$WORK/check/config.json")
echo "entry point + cmd: ${args[*]}"
run_in_image() {  # run a command in the unpacked image: with $RUNTIME (an OCI runtime) or chroot as 65532
  if [ "$RUNTIME" != chroot ]; then
    python3 - "$WORK/check/config.json" "$@" <<'PY'
import json, sys
path, argv = sys.argv[1], sys.argv[2:]
cfg = json.load(open(path))
cfg["process"]["args"], cfg["process"]["terminal"] = argv, False
json.dump(cfg, open(path, "w"))
PY
    "$RUNTIME" run --bundle "$WORK/check" "sharegpu-image-check-$$-$RANDOM"
  else
    chroot --userspec=65532:65532 "$WORK/check/rootfs" /usr/bin/env -i \
      PATH=/opt/sharegpu/bin:/usr/bin:/bin HOME=/ "$@"
  fi
}
# The first OCI runtime that can run a container here (crun needs cgroup v2 or v1 alone; runc also runs on hybrid
# cgroups), else chroot.
out=""
for RUNTIME in crun runc chroot; do
  [ "$RUNTIME" = chroot ] || command -v "$RUNTIME" >/dev/null || continue
  if out="$(run_in_image "${args[@]}" 2>"$WORK/runtime.err")"; then
    break
  fi
  echo "$RUNTIME cannot run the image here: $(tail -1 "$WORK/runtime.err")"
  [ "$RUNTIME" = chroot ] && { echo "build.sh: the image's entry point failed" >&2; exit 1; }
done
echo "$out" | head -5
echo "$out" | grep -q "Usage: sharegpu" || { echo "build.sh: the entry point did not print sharegpu's usage" >&2; exit 1; }
cmds="$(run_in_image /opt/sharegpu/bin/python -c 'import typer, sharegpu.cli as c; print(" ".join(sorted(typer.main.get_command(c.app).commands)))')"
for cmd in $cmds; do
  run_in_image /opt/sharegpu/bin/sharegpu "$cmd" --help >/dev/null || { echo "build.sh: sharegpu $cmd --help failed in the image" >&2; exit 1; }
done
echo "sharegpu --help and the --help of: $cmds — ran in the image with $RUNTIME as user 65532"
size="$(du -sh "$LAYOUT" | cut -f1)"
rm -rf "$WORK"
say "done: $LAYOUT:$TAG ($size). Push: skopeo copy oci:$LAYOUT:$TAG docker://ghcr.io/you/sharegpu:$TAG"
