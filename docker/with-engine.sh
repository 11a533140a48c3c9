#!/usr/bin/env bash
# Runs a command with a Docker engine answering (what `make test` wraps its test runs in).
# Where none answers and this is root with apt: installs Debian's docker.io if needed, starts dockerd for the
# command's duration and stops it again afterwards. Otherwise the command runs anyway, and the container tests
# skip with one line saying why.
set -uo pipefail
dockerd_pid=""
stop_dockerd() {
  if [ -n "$dockerd_pid" ]; then
    kill "$dockerd_pid" 2>/dev/null && wait "$dockerd_pid" 2>/dev/null || true
  fi
}
trap stop_dockerd EXIT
if ! docker info >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    if ! command -v dockerd >/dev/null || ! command -v docker >/dev/null; then
      apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends docker.io
    fi
    dockerd >/tmp/maze-grpo-dockerd.log 2>&1 &
    dockerd_pid=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || echo "note: dockerd did not start (log: /tmp/maze-grpo-dockerd.log): the container tests will be skipped"
  else
    echo "note: no Docker engine and not root with apt: the container tests will be skipped"
  fi
fi
"$@"
