#!/usr/bin/env bash
# Create .venv at the repo root and install nemoflow with pinned dependencies.
# Idempotent: re-runs only when pyproject.toml or constraints.txt changed.
# Usage: scripts/setup.sh [--test]   (--test adds the test extras and Debian packages)
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  "$PY" -m venv .venv
fi
stamp=".venv/.nemoflow-installed${extras:+-test}"
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "==> installing nemoflow${extras} into .venv (pinned; torch CPU wheel)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -c constraints.txt -e ".${extras}"
  echo "$want" > "$stamp"
fi
# NeMo AutoModel compiles its Megatron dataset helper (C++, g++ + ninja) at first use: build it once
# here rather than inside the first training run (cached per user under /tmp; quick when cached).
if ! .venv/bin/python -c "from nemo_automodel.components.datasets.llm.megatron.megatron_utils import compile_helper; compile_helper()" >/tmp/nemoflow-compile-helper.log 2>&1; then
  echo "warning: AutoModel's dataset helper did not compile (training will try again): see /tmp/nemoflow-compile-helper.log" >&2
fi
if [ -n "$extras" ] && [ -f scripts/debian-packages.txt ]; then
  missing=$(grep -v '^#' scripts/debian-packages.txt | xargs -r -n1 sh -c 'dpkg -s "$0" >/dev/null 2>&1 || echo "$0"')
  if [ -n "$missing" ]; then
    if [ "$(id -u)" = 0 ]; then
      echo "==> installing Debian packages: $missing"
      apt-get update -qq >/dev/null
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
    else
      echo "warning: missing Debian packages (need root to install): $missing" >&2
    fi
  fi
fi
