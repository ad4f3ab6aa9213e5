#!/usr/bin/env bash
# Start the local services the tests use that must outlive a pytest session:
# the one-machine Slurm cluster and a private PostgreSQL for Prefect servers
# (devtools/postgres.py). Idempotent and quick when already up.
# Called by scripts/test.sh before pytest. Without root (or apt) it only warns:
# tests marked `slurm` then skip with the reason.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
  echo "services-up: not root; the local Slurm cluster and PostgreSQL need root (their tests will skip)" >&2
  exit 0
fi
if ! .venv/bin/python -m devtools.slurm_cluster up >/tmp/nemoflow-services-up.log 2>&1; then
  echo "services-up: local Slurm did not start (slurm tests will skip):" >&2
  tail -n 20 /tmp/nemoflow-services-up.log >&2
fi
if ! .venv/bin/python -m devtools.postgres up >/tmp/nemoflow-postgres-up.log 2>&1; then
  echo "services-up: local PostgreSQL did not start (PostgreSQL-backed Prefect tests will skip):" >&2
  tail -n 20 /tmp/nemoflow-postgres-up.log >&2
fi
