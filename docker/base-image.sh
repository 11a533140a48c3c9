#!/usr/bin/env bash
# Builds the local base image from Debian's packages, for machines that cannot pull python:3.11-slim:
#   bash docker/base-image.sh [NAME]     (what `make base-image` runs; skips when NAME already exists)
# Needs root, debootstrap and a Docker engine. The image has Debian bookworm's python3 (3.11), venv and pip.
set -euo pipefail
NAME="${1:-maze-grpo/base:bookworm}"
SUITE=bookworm
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

if ! docker info >/dev/null 2>&1; then
  echo "error: no Docker engine reachable: start dockerd (or set DOCKER_HOST), then run make base-image again" >&2
  exit 1
fi
if docker image inspect "$NAME" >/dev/null 2>&1; then
  echo "base image $NAME exists: skipped (docker rmi $NAME to rebuild)"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "error: debootstrap needs root: run make base-image as root, or pass BASE_IMAGE=python:3.11-slim-bookworm to make images where you can pull" >&2
  exit 1
fi
if ! command -v debootstrap >/dev/null; then
  if command -v apt-get >/dev/null; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap
  else
    echo "error: debootstrap is missing and there is no apt-get: install debootstrap, then run make base-image again" >&2
    exit 1
  fi
fi

ROOTFS="$(mktemp -d /tmp/maze-grpo-rootfs.XXXXXX)"
# debootstrap mounts the target's /proc (and may mount more) while it runs; one that dies half-way leaves them
# mounted, and a plain rm -rf would walk into them: unmount whatever is under the rootfs, then stay on its file system.
cleanup() {
  grep -o " $ROOTFS/[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
  rm -rf --one-file-system "$ROOTFS"
}
trap cleanup EXIT
echo "debootstrap $SUITE into $ROOTFS (about 90 s)"
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
  "$SUITE" "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 || { tail -20 "$ROOTFS.log" >&2; rm -f "$ROOTFS.log"; exit 1; }
rm -f "$ROOTFS.log"
# The package caches and lists are build leftovers: they stay out of the image.
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/log/*.log
tar -C "$ROOTFS" -c . | docker import \
  --change 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["python3"]' \
  --message "debootstrap --variant=minbase $SUITE + python3, python3-venv, python3-pip, ca-certificates" \
  - "$NAME" >/dev/null
echo "built $NAME ($(docker image inspect "$NAME" --format '{{.Size}}' | awk '{printf "%.0f MB", $1/1e6}'))"
