#!/usr/bin/env bash
# Create .venv at the repo root and install nemoflow with pinned dependencies.
# Idempotent: re-runs only when pyproject.toml, constraints.txt or the torch build changed.
#
#   scripts/setup.sh [--test] [--torch auto|cpu|cuda|cuNNN]
#       --test    adds the test extras and Debian packages (what CI runs)
#       --torch   the torch build (also NEMOFLOW_TORCH). auto (default): a CUDA build matched to the
#                 driver when an NVIDIA GPU is found (nvidia-smi or /proc/driver/nvidia), else the CPU
#                 build; cuda: a CUDA build even with no GPU here; cu126, cu128, cu130: that build.
#                 Without --torch, an existing .venv keeps the build it was installed with.
#
#   scripts/setup.sh --offline DIR [--offline DIR2 ...] [--venv PATH] [--reuse-torch PYTHON]
#       No network: install from a wheelhouse made by `scripts/wheelhouse.sh build` (its chunks may
#       come one call at a time; the last one finishes). --reuse-torch: the venv uses that Python's
#       torch (and its other packages, after the venv's own). --venv: where (default .venv; also
#       NEMOFLOW_VENV). `--offline` with no DIR re-installs nemoflow from this checkout and re-checks.
#
#   scripts/setup.sh --offline DIR [--offline DIR2 ...] --engine-venv PATH --reuse-torch PYTHON [--no-check]
#       A serving engine's own environment (`scripts/wheelhouse.sh build --engine vllm==...`) at PATH, beside
#       nemoflow's venv: the node's torch reused through a .pth, the engine's own pins in front. The last
#       chunk checks it by importing the engine and its CUDA kernels (vllm._C...; --no-check skips that).
#       Point the serving engine at it: NEMOFLOW_VLLM_PYTHON=PATH/bin/python (or engine: {python: ...}).
#
#   scripts/setup.sh --dry-run [--torch ...]   print the torch build it would install, and how; change nothing
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { sed -n '2,/^set -euo/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; }
extras=""
torch_req=${NEMOFLOW_TORCH:-}
offline=0
wheels=()
venv=${NEMOFLOW_VENV:-.venv}
reuse=""
engine_venv=""
no_check=""
dry=0
while [ $# -gt 0 ]; do
  case "$1" in
    --test) extras="[test]" ;;
    --torch) torch_req=${2:?--torch needs auto, cpu, cuda or a CUDA tag such as cu126}; shift ;;
    --torch=*) torch_req=${1#*=} ;;
    --offline)
      offline=1
      if [ $# -gt 1 ] && [ "${2#-}" = "$2" ]; then wheels+=("$2"); shift; fi ;;
    --venv) venv=${2:?--venv needs a path}; shift ;;
    --reuse-torch) reuse=${2:?--reuse-torch needs a Python executable}; shift ;;
    --engine-venv) engine_venv=${2:?--engine-venv needs a path}; shift ;;
    --no-check) no_check=--no-check ;;
    --dry-run) dry=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "error: scripts/setup.sh: unknown argument '$1' (scripts/setup.sh --help)" >&2; exit 2 ;;
  esac
  shift
done
PY=${PYTHON:-python3}

if [ -n "$engine_venv" ]; then
  [ "$offline" = 1 ] || { echo "error: --engine-venv goes with --offline DIR (an engine wheelhouse's chunks)" >&2; exit 2; }
  [ -n "$reuse" ] || { echo "error: --engine-venv needs --reuse-torch PYTHON (the node's Python whose torch it uses)" >&2; exit 2; }
  exec "$reuse" devtools/wheelhouse.py install-engine --venv "$engine_venv" --reuse-torch "$reuse" $no_check \
    ${wheels[@]+"${wheels[@]}"}
fi
if [ "$offline" = 1 ]; then
  [ -z "$extras" ] || { echo "error: --test needs the network (its tools are not in a wheelhouse)" >&2; exit 2; }
  args=(install --venv "$venv" --repo "$PWD")
  if [ -n "$reuse" ]; then args+=(--reuse-torch "$reuse"); else args+=(--python "$PY"); fi
  # The wheelhouse's installer runs on the node's Python (the venv's own once it exists).
  runner=$PY
  [ -n "$reuse" ] && runner=$reuse
  exec "$runner" devtools/wheelhouse.py "${args[@]}" ${wheels[@]+"${wheels[@]}"}
fi

if [ -n "$reuse" ] || [ "$venv" != .venv ]; then
  echo "error: --reuse-torch and --venv go with --offline (a wheelhouse install)" >&2; exit 2
fi
if [ ! -x .venv/bin/python ] && [ "$dry" = 0 ]; then
  echo "==> creating .venv"
  "$PY" -m venv .venv
fi
# The torch build: asked for, kept from the last install, or chosen for this machine's GPU.
variant_file=.venv/.nemoflow-torch
kept=0
if [ -z "$torch_req" ] && [ -s "$variant_file" ]; then
  torch_req=$(cat "$variant_file")
  kept=1
fi
torch_version=$(sed -n 's/^torch==//p' constraints.txt)
choice=$("$PY" devtools/torch_build.py choose --torch "${torch_req:-auto}" --torch-version "$torch_version") || exit 2
eval "$choice"
[ "$kept" = 1 ] && TORCH_REASON="kept from the last install (--torch auto chooses again)"
echo "==> torch $torch_version, $TORCH_VARIANT build: $TORCH_REASON"
if [ "$dry" = 1 ]; then
  echo "would run: pip install --no-deps --no-index $TORCH_REQUIREMENT (a wheel already on disk)," \
    "else pip install --no-deps ${TORCH_INDEX:+--index-url $TORCH_INDEX }$TORCH_REQUIREMENT"
  exit 0
fi

stamp=".venv/.nemoflow-installed${extras:+-test}"
want="$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16) torch=$TORCH_VARIANT"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "==> installing nemoflow${extras} into .venv (pinned; torch $TORCH_VARIANT build)"
  .venv/bin/python -m pip install -q --upgrade pip
  constraints=constraints.txt
  if [ "$TORCH_VARIANT" != cpu ]; then
    # A CUDA build of torch pins its own triton (2.13.0: triton==3.7.1); constraints.txt pins the
    # one the CPU build runs with.
    grep -v '^triton==' constraints.txt > .venv/constraints-cuda.txt
    constraints=.venv/constraints-cuda.txt
  fi
  # torch first, alone: a wheel already on disk (pip's find-links) if there is one, else its index.
  # `===` never takes another build of the same version (torch===2.13.0 refuses 2.13.0+cpu).
  if ! .venv/bin/python -m pip install -q --no-deps --no-index "$TORCH_REQUIREMENT" >/dev/null 2>&1; then
    .venv/bin/python -m pip install -q --no-deps ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "$TORCH_REQUIREMENT"
  fi
  .venv/bin/python -m pip install -q -c "$constraints" -e ".${extras}"
  echo "$TORCH_VARIANT" > "$variant_file"
  echo "$want" > "$stamp"
fi
if [ "$TORCH_VARIANT" != cpu ]; then
  # Before any job: can this torch use this machine's GPU? One line naming the mismatch and the fix if not.
  .venv/bin/python devtools/torch_build.py check || exit 1
fi
# NeMo AutoModel compiles its Megatron dataset helper (C++, g++ + ninja) at first use: build it once
# here rather than inside the first training run (cached per user under /tmp; quick when cached), with
# the venv's ninja as training does (a system ninja's build log made the first training rebuild it).
if ! .venv/bin/python -c "from workloads.automodel_shim import build_dataset_helper; build_dataset_helper()" >/tmp/nemoflow-compile-helper.log 2>&1; then
  echo "warning: AutoModel's dataset helper did not compile (training will try again): see /tmp/nemoflow-compile-helper.log" >&2
fi
# Prefect migrates a new database when its server first starts (~7 s of the first `nemoflow demo`): do it here
# for the database the demo's server will open (the default SQLite file), once, when it does not exist yet.
prefect_db="${PREFECT_HOME:-$HOME/.prefect}/prefect.db"
if [ -z "${PREFECT_API_URL:-}${PREFECT_SERVER_DATABASE_CONNECTION_URL:-}${PREFECT_API_DATABASE_CONNECTION_URL:-}" ] \
  && [ ! -e "$prefect_db" ]; then
  if ! PREFECT_SERVER_ANALYTICS_ENABLED=false .venv/bin/prefect server database upgrade -y >/tmp/nemoflow-prefect-db.log 2>&1; then
    echo "warning: could not create Prefect's database $prefect_db (the server will): see /tmp/nemoflow-prefect-db.log" >&2
  fi
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
