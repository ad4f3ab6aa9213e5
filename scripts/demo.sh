#!/usr/bin/env bash
# The main job: set up .venv and run the pipeline on the embedded default
# (local work pool, local files, a small model on CPU). Extra arguments go to
# `nemoflow demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
exec .venv/bin/nemoflow demo "$@"
