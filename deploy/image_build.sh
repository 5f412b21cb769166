#!/usr/bin/env bash
# `make image`: the router's image from deploy/Containerfile, built with buildah on a Debian
# base that mmdebstrap makes from Debian's own mirror (no container registry needed).
#
# The base rootfs is cached at $NARWHAL_IMAGE_CACHE/rootfs-bookworm-KEY.tar (default
# ~/.cache/narwhal-image; KEY: a hash of mmdebstrap's arguments) and imported as $BASE
# (default localhost/debian-py:bookworm); buildah's layer cache (--layers) keeps the stages
# between builds. Every RUN step runs with --isolation chroot: machines where crun may
# not set RLIMIT_NOFILE (podman run fails there) still build.
#
#   deploy/image_build.sh [IMAGE]       default IMAGE: localhost/narwhal:<pyproject version>
#   NARWHAL_IMAGE_NO_CACHE=1 ...        no layer cache (the base rootfs is still reused)
# Prints the time of each part and the image's size.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=$(python3 -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['version'])")
IMAGE=${1:-localhost/narwhal:$VERSION}
BASE=${BASE:-localhost/debian-py:bookworm}
CACHE=${NARWHAL_IMAGE_CACHE:-$HOME/.cache/narwhal-image}
# the source label: the git remote when it is a URL (a clone of a local path is not)
origin=$(git remote get-url origin 2>/dev/null || true)
case "$origin" in https://*) ;; *) origin=https://example.com/narwhal ;; esac
SOURCE=${SOURCE:-$origin}
REVISION=$(git rev-parse HEAD 2>/dev/null || echo unknown)

for tool in buildah podman mmdebstrap; do
    command -v "$tool" >/dev/null || {
        echo "image: $tool is missing (apt-get install podman buildah mmdebstrap)" >&2
        exit 1
    }
done

# the base: Debian bookworm's minbase with python3 (3.11), the Python the router runs on,
# without documentation, manual pages and translations (as Debian's slim images); the dpkg
# options stay in the base, so the build stage's apt-get honours them too
MMDEBSTRAP=(--variant=minbase --include=python3
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias'
    bookworm)
# the cache's name and the base's label follow these arguments: change them, get a new base
KEY=$(printf '%s\n' "${MMDEBSTRAP[@]}" | sha256sum | cut -c1-12)
ROOTFS=$CACHE/rootfs-bookworm-$KEY.tar

started=$(date +%s)
if [ "$(podman image inspect --format '{{index .Labels "narwhal.rootfs"}}' "$BASE" 2>/dev/null)" != "$KEY" ]; then
    if [ ! -s "$ROOTFS" ]; then
        mkdir -p "$CACHE"
        echo "image: building the base rootfs with mmdebstrap ($ROOTFS)"
        t0=$(date +%s)
        # to a temporary name first: an interrupted run leaves no half-written cache
        mmdebstrap --quiet --format=tar "${MMDEBSTRAP[@]}" "$ROOTFS.partial"
        mv "$ROOTFS.partial" "$ROOTFS"
        echo "image: base rootfs built in $(($(date +%s) - t0)) s ($(du -h "$ROOTFS" | cut -f1))"
    else
        echo "image: base rootfs from the cache ($ROOTFS)"
    fi
    podman import --quiet --change "LABEL narwhal.rootfs=$KEY" "$ROOTFS" "$BASE" >/dev/null
    echo "image: imported as $BASE"
else
    echo "image: base $BASE present (rootfs $KEY)"
fi
base_done=$(date +%s)

# pip in the build trusts what this machine trusts (a TLS-intercepting proxy's CA): a build
# secret, in no layer
CA=${NARWHAL_IMAGE_CA:-/etc/ssl/certs/ca-certificates.crt}
secret=()
[ -s "$CA" ] && secret=(--secret "id=pip-ca,src=$CA")

layers=(--layers)
[ "${NARWHAL_IMAGE_NO_CACHE:-0}" = 1 ] && layers=(--layers --no-cache)
# docker format: the OCI image format has no HEALTHCHECK
buildah bud --isolation chroot --format docker --force-rm "${layers[@]}" "${secret[@]}" \
    -f deploy/Containerfile --ignorefile deploy/Containerfile.dockerignore \
    --build-arg BASE="$BASE" \
    --build-arg VERSION="$VERSION" \
    --build-arg SOURCE="$SOURCE" \
    --build-arg REVISION="$REVISION" \
    -t "$IMAGE" .
done_at=$(date +%s)

size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
echo "image: $IMAGE built: base $((base_done - started)) s, build $((done_at - base_done)) s," \
    "total $((done_at - started)) s; size $((size / 1000000)) MB ($size bytes)"
