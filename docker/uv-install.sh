#!/bin/sh
# One install into the image's venv (/opt/venv) with uv, for a build step: uv at UV_VERSION (the step's build arg)
# and its cache live in /tmp/uv and go with it. As pip did, uv searches every index for every package and compiles
# the bytecode (the images run with PYTHONDONTWRITEBYTECODE).
#   sh uv-install.sh [uv pip install arguments]
set -eu
pip install -q --target /tmp/uv "uv==${UV_VERSION}"
UV_CACHE_DIR=/tmp/uv/cache /tmp/uv/bin/uv pip install --python /opt/venv/bin/python --compile-bytecode \
  --index-strategy unsafe-best-match "$@"
rm -rf /tmp/uv
