#!/usr/bin/env bash
# Build trainbench's container image from the package registries alone, and the files each runtime takes.
#
#   containers/image.sh cpu           # Debian root file system (mmdebstrap) + wheels from PyPI -> $IMAGE (podman)
#   containers/image.sh gpu BASE      # BASE: an image with CUDA PyTorch (e.g. docker.io/pytorch/pytorch:...)
#   containers/image.sh sqsh [OUT]    # $IMAGE as an enroot squashfs, for pyxis (--container-image=OUT)
#   containers/image.sh oci [OUT]     # $IMAGE as an OCI archive, for `apptainer build x.sif oci-archive://OUT`
#
# IMAGE defaults to localhost/trainbench:<version>; PODMAN to podman. Everything is written under build/.
set -euo pipefail
cd "$(dirname "$0")/.."
PODMAN=${PODMAN:-podman}
PYTHON=${PYTHON:-python3}
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE=${IMAGE:-localhost/trainbench:$VERSION}
DEBIAN_BASE=localhost/trainbench-base:bookworm
mkdir -p build

need() {
  for tool in "$@"; do
    command -v "$tool" >/dev/null || { echo "error: $tool is not installed (Debian: apt-get install $tool)" >&2; exit 2; }
  done
}

debian_base() {  # Debian bookworm's python3 (3.11, the Python the wheels are built for) as an image
  if "$PODMAN" image exists "$DEBIAN_BASE"; then return; fi
  need mmdebstrap
  echo "root file system from Debian's packages (mmdebstrap) -> $DEBIAN_BASE"
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates bookworm build/rootfs.tar
  "$PODMAN" import --quiet build/rootfs.tar "$DEBIAN_BASE" >/dev/null
  rm -f build/rootfs.tar
}

wheels() {  # $1 = all: trainbench and every dependency; own: trainbench only (the rest from the index in the build)
  rm -rf build/wheels && mkdir -p build/wheels
  if [ "$1" = all ]; then
    "$PYTHON" -m pip wheel --quiet --wheel-dir build/wheels .
  else
    "$PYTHON" -m pip wheel --quiet --no-deps --wheel-dir build/wheels .
  fi
}

build() {  # $1 BASE, $2 OFFLINE, $3 EXTRAS
  digest=$(cd build/wheels && sha256sum -- * | sha256sum | cut -c1-16)
  "$PODMAN" build --quiet --build-arg BASE="$1" --build-arg OFFLINE="$2" --build-arg EXTRAS="$3" \
    --build-arg WHEELS_DIGEST="$digest" -t "$IMAGE" -f Containerfile . >/dev/null
  echo "$IMAGE built ($("$PODMAN" image inspect --format "{{.Size}}" "$IMAGE" | awk "{printf \"%.0f MB\", \$1/1e6}"))"
}

rootfs_env() {  # the image's environment as enroot reads it (/etc/environment of the squashfs)
  "$PODMAN" image inspect --format '{{range .Config.Env}}{{println .}}{{end}}' "$IMAGE" | sed '/^$/d'
}

case "${1:-}" in
  cpu)
    need "$PODMAN"
    debian_base
    wheels all
    build "$DEBIAN_BASE" 1 ""
    ;;
  gpu)
    need "$PODMAN"
    [ -n "${2:-}" ] || { echo "error: give the CUDA PyTorch image: containers/image.sh gpu BASE" >&2; exit 2; }
    wheels own
    build "$2" 0 cudnn
    ;;
  sqsh)
    need "$PODMAN" mksquashfs
    out=${2:-build/trainbench.sqsh}
    rm -rf build/sqsh-root "$out" && mkdir -p build/sqsh-root
    id=$("$PODMAN" create "$IMAGE" true)
    "$PODMAN" export "$id" | tar -x -C build/sqsh-root --exclude='dev/*'
    "$PODMAN" rm "$id" >/dev/null
    rootfs_env > build/sqsh-root/etc/environment
    mksquashfs build/sqsh-root "$out" -all-root -noappend -quiet -comp lz4 >/dev/null
    rm -rf build/sqsh-root
    echo "$out ($(du -h "$out" | cut -f1)): srun --container-image=$out"
    ;;
  oci)
    need "$PODMAN"
    out=${2:-build/trainbench.oci.tar}
    rm -f "$out"
    "$PODMAN" image save --quiet --format oci-archive -o "$out" "$IMAGE"
    echo "$out ($(du -h "$out" | cut -f1)): apptainer build trainbench.sif oci-archive://$out"
    ;;
  *)
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
