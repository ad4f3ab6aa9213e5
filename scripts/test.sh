#!/usr/bin/env bash
# The test command: set up .venv, install test tools and the local services the
# tests need, start them, run pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
export PATH="$PWD/.venv/bin:$PATH"
export PREFECT_SERVER_ANALYTICS_ENABLED=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ -x scripts/services-up.sh ]; then scripts/services-up.sh; fi
exec .venv/bin/python -m pytest "$@"
