#!/usr/bin/env bash
# Create (or update) the Slurm work pool, then start a worker on a machine with sbatch:
#   deployments/slurm/create-pool.sh [POOL]        (default POOL: gpu-cluster)
#   prefect worker start --pool gpu-cluster --type slurm
# Per-deployment job variables (partition, time, gpus_per_node, setup_lines, ...) go in prefect.yaml.
set -euo pipefail
pool="${1:-gpu-cluster}"
prefect --no-prompt work-pool create "$pool" --type slurm --overwrite \
  --base-job-template "$(dirname "$0")/base-job-template.json"
