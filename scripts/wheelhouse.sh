#!/usr/bin/env bash
# The wheels a node without internet needs, fetched on a machine that reaches PyPI:
#   scripts/wheelhouse.sh build --out DIR [--python-version 3.12] [--have node-freeze.txt]
#                               [--without NAME,...] [--split-mb 60] [--torch cpu|cuNNN] [--glibc 2.28]
#   scripts/wheelhouse.sh build --engine vllm==0.26.0 --out DIR --python-version 3.12 --glibc 2.35 \
#                               --have deployments/nodes/h200-freeze.txt --split-mb 52 [--strip PKG:GLOB]
#                               a serving engine's own environment (devtools/engine_env.py), in parts and chunks
#   scripts/wheelhouse.sh install-engine CHUNK... --venv PATH --reuse-torch PY   (scripts/setup.sh --engine-venv)
#   scripts/wheelhouse.sh show DIR          what a wheelhouse holds (sizes, chunks, what the node supplies)
#   scripts/wheelhouse.sh freeze [--python PY]   name==version of a Python's packages (for --have)
# Install it on the node with `scripts/setup.sh --offline DIR ...` (docs/install.md: "A node without internet").
# Runs on the project's .venv Python when there is one, else python3 (any Python >= 3.11 with pip).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
exec "$PY" devtools/wheelhouse.py "$@"
