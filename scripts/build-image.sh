#!/usr/bin/env bash
# Build the nemoflow container image (CPU variant, from Debian packages; no registry needed).
#   scripts/build-image.sh [--tag REF ...] [--variant cpu|cuda] [--rebuild-base] [--no-cache]
# Needs root podman + runc + mmdebstrap (scripts/debian-packages.txt) and the .venv of
# scripts/setup.sh. Caches the Debian base and the wheelhouse in ~/.cache/nemoflow-image.
# Push afterwards with: podman push localhost/nemoflow:<version>-cpu REGISTRY/IMAGE:TAG
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || scripts/setup.sh
exec .venv/bin/python -m nemoflow image build "$@"
