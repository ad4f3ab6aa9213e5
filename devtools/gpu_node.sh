#!/usr/bin/env bash
# nemoflow on a GPU node that has Python with a CUDA build of torch but no network (the H200 machine this
# project is measured on): install from carried wheel chunks, run the whole end-to-end flow through Prefect
# on the node's GPUs (twice: the second run is all Cached), and the GPU measurements.
#
#   devtools/gpu_node.sh install DIR [DIR ...]   # wheel chunks from `scripts/wheelhouse.sh build` (one call each)
#   devtools/gpu_node.sh facts OUT               # the node: GPUs, driver, torch, disk and /dev/shm write speed
#   devtools/gpu_node.sh demo OUT                # `nemoflow demo` on every GPU, twice; stage times, summary, metrics
#   devtools/gpu_node.sh bench-checkpoints OUT [ARGS]  # 1.1B: a save every 10 steps against none (issues 21, 34);
#                                                # ARGS go to bench_train_gpu.py, e.g. --steps 410 --ckpt-every 200,
#                                                # --run-root /dev/shm/nemoflow-bench, --ckpt-write-threads 8
#   devtools/gpu_node.sh test-gpu OUT            # the tests marked `gpu` (resume on the GPU)
#   devtools/gpu_node.sh bench-moe OUT           # the Mixtral-shaped MoE, today's path against grouped GEMM
#   devtools/gpu_node.sh profile-saves OUT       # 1.1B, two saves: cProfile of what each save blocks on
#   devtools/gpu_node.sh profile-steps OUT ARGS  # torch.profiler over steps 8-10 of a bench_train_gpu.py run (ARGS)
#
# Everything lives under /tmp (the venv, NEMOFLOW_HOME, the work dir): on the lent machines files under /tmp
# survive between calls while the machine stays warm, and the repository copy does not. The node's Python is
# NODE_PYTHON (default: python3 on PATH, /opt/torch/.venv/bin/python3 there); its torch is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${NEMOFLOW_NODE_ROOT:-/tmp/nemoflow-node}
VENV=$ROOT/venv
NODE_PYTHON=${NODE_PYTHON:-$(command -v python3)}
export NEMOFLOW_HOME=$ROOT/home NEMOFLOW_WORK_DIR=$ROOT/work PREFECT_HOME=$ROOT/prefect
export PREFECT_SERVER_ANALYTICS_ENABLED=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
# This copy of the repository, whatever path the editable install recorded (the copy may move between calls).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# Multi-GPU hosts of this workplace: never NVLink multicast (it can take the host's GPUs down for others).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

cmd=${1:?usage: devtools/gpu_node.sh install|facts|demo|bench-checkpoints|test-gpu|bench-moe ...}
shift
mkdir -p "$ROOT"

case "$cmd" in
  install)
    [ $# -ge 1 ] || { echo "install needs wheel directories" >&2; exit 2; }
    args=()
    for dir in "$@"; do args+=(--offline "$dir"); done
    scripts/setup.sh "${args[@]}" --venv "$VENV" --reuse-torch "$NODE_PYTHON"
    ;;
  facts)
    out=${1:?facts OUT}; mkdir -p "$out"
    {
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
      "$NODE_PYTHON" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
      nproc; free -g | sed -n 2p
      for target in "$ROOT/ddtest" /dev/shm/nemoflow-ddtest; do
        sync
        start=$(date +%s.%N)
        dd if=/dev/zero of="$target" bs=16M count=256 conv=fsync status=none
        end=$(date +%s.%N)
        echo "write 4 GiB with fsync to $(dirname "$target"): $(python3 -c "print(round(4/($end-$start), 2))") GiB/s"
        rm -f "$target"
      done
      df -h "$ROOT" /dev/shm | sed 1d
    } 2>&1 | tee "$out/facts.txt"
    "$NODE_PYTHON" -m pip list --format=freeze > "$out/node-freeze.txt" 2>/dev/null || true
    ;;
  demo)
    out=${1:?demo OUT}; mkdir -p "$out"
    export PATH="$VENV/bin:$PATH"
    for run in 1 2; do
      start=$(date +%s)
      nemoflow demo 2>&1 | tee "$out/demo-$run.log"
      echo "demo run $run: $(( $(date +%s) - start )) s" | tee -a "$out/demo-times.txt"
    done
    "$VENV/bin/python" -m devtools.gpu_report "$NEMOFLOW_WORK_DIR" "$out" || true
    cp "$(ls -d "$NEMOFLOW_WORK_DIR"/runs/llama-*/metrics.jsonl | head -1)" "$out/" 2>/dev/null || true
    nemoflow demo --down >/dev/null 2>&1 || true
    ;;
  bench-checkpoints)
    out=${1:?bench-checkpoints OUT}; shift; mkdir -p "$out"
    "$VENV/bin/python" benchmarks/bench_train_gpu.py --model 1.1b --gpus 1 --steps 40 --warmup 5 --ckpt-every 10 \
      --compare-no-saves --skip-reference --out "$ROOT/bench-ckpt" "$@" 2>&1 | tee "$out/bench-checkpoints.log" || true
    cp "$ROOT"/bench-ckpt/*.json "$ROOT"/bench-ckpt/*.log "$out/" 2>/dev/null || true
    # the numbers issue 34's targets are stated in: per-save blocked time, the writer's GB/s, the share of the
    # no-save rate (the facts case measures the disk and /dev/shm to compare the writer with)
    grep -E "^checkpoints every" "$out/bench-checkpoints.log" || echo "no checkpoint summary: see $out/bench-checkpoints.log"
    ;;
  test-gpu)
    out=${1:?test-gpu OUT}; mkdir -p "$out"
    "$VENV/bin/python" -m pytest tests/train/test_gpu_resume.py -m gpu -q -s -p no:cacheprovider 2>&1 | tee "$out/test-gpu.log"
    ;;
  bench-moe)
    out=${1:?bench-moe OUT}; shift; mkdir -p "$out"
    "$VENV/bin/python" benchmarks/bench_train_gpu.py --model moe-0.9b --gpus 1 --steps 30 --warmup 5 --ckpt-every 100 \
      --skip-reference --out "$ROOT/bench-moe" "$@" 2>&1 | tee "$out/bench-moe.log" || true
    cp "$ROOT"/bench-moe/*.json "$ROOT"/bench-moe/*.log "$out/" 2>/dev/null || true
    ;;
  profile-saves)
    out=${1:?profile-saves OUT}; shift; mkdir -p "$out"
    NEMOFLOW_PROFILE_SAVES=$out/prof "$VENV/bin/python" benchmarks/bench_train_gpu.py --model 1.1b --gpus 1 --steps 22 \
      --warmup 5 --ckpt-every 10 --skip-reference --out "$ROOT/bench-prof" "$@" > "$out/bench-prof.log" 2>&1 || true
    for f in "$out"/prof/*.prof; do
      "$VENV/bin/python" -c 'import pstats, sys; s = pstats.Stats(sys.argv[1]); s.sort_stats("cumulative").print_stats(40); s.sort_stats("tottime").print_stats(15)' "$f"
    done > "$out/profile.txt" 2>&1
    grep -E "checkpoint_(save|wait|finalize)_s" "$out/bench-prof.log" | head
    ;;
  profile-steps)
    out=${1:?profile-steps OUT}; shift; mkdir -p "$out"
    NEMOFLOW_PROFILE_STEPS=$out/prof:8:3 "$VENV/bin/python" benchmarks/bench_train_gpu.py --gpus 1 --steps 12 --warmup 5 \
      --ckpt-every 100 --skip-reference --out "$ROOT/bench-steps" "$@" > "$out/bench-steps.log" 2>&1 || true
    head -45 "$out"/prof/*.txt
    ;;
  *)
    echo "unknown command $cmd" >&2; exit 2 ;;
esac
