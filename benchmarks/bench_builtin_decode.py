"""The built-in engine's decode: milliseconds a token along the answer, and where a token's time goes.

    .venv/bin/python benchmarks/bench_builtin_decode.py [--checkpoint DIR] [--tokens 400] [--device auto]
        [--profile-steps 20] [--out benchmarks/out/bench_builtin_decode.json]

Why: on the H200 at cbcee70 the GPU demo's smoke request (its 0.25B Llama in bf16, about 800 tokens) took
80.8 s with the built-in engine, about 10 tokens a second: no faster than this 2-core VM's CPU decodes the same
shape in fp32 (65-77 ms a token). A GPU should not be that slow on a model this size, so something other than
the arithmetic holds each step, and this shows what, in one short call on the node.

It loads ``--checkpoint`` (on the node: the GPU demo's export,
``$NEMOFLOW_WORK_DIR/runs/llama-*/checkpoints/*/model/consolidated``) or, without one, a random Llama of the
GPU demo's shape (flows/end_to_end.py, ``demo_gpu_train_config``) with Mixtral's tokenizer, in the trainer's
layout, through the engine itself (``workloads.serve_engines.builtin.model.Engine``, as ``workloads.serve``
loads it), then generates ``--tokens`` greedy tokens for the seed's prompt with ``Engine.generate``, timing every
forward pass from one call to the next (the step's whole time: the pass, the pick, the decode). Then
``--profile-steps`` more steps under torch.profiler: the ops with the most self time on the CPU and, on a GPU,
on the device, and how many CUDA runtime calls synchronised (cudaStreamSynchronize, cudaDeviceSynchronize,
cudaMemcpy*). Then the same lengths again, and SDPA left to choose its attention backend (cuDNN's on the H200;
the engine excludes it) over new lengths and again: a per-shape cost shows as a first pass slower than its
repeat. Not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPT = "In the beginning God created"  # the seed's smoke request
SYNCING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def demo_gpu_checkpoint(dest: Path) -> Path:
    """A random Llama of the GPU demo's shape, saved as the trainer's export lays it out."""
    import mistral_common

    from flows.end_to_end import demo_gpu_train_config
    from tests.support.tiny_models import tiny_llama
    from workloads.train.recipe import hf_model_config

    # the GPU demo's model as the trainer builds it (with Mixtral's 32000-token vocabulary)
    values = hf_model_config(demo_gpu_train_config(1), vocab_size=32000)
    assert values.pop("_target_") == "transformers.LlamaConfig"
    return tiny_llama(dest, Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1", seed=0, **values)


def split_times(engine, prompt_ids: list[int], tokens: int) -> dict[str, list[float]]:
    """Each step in three: enqueue (the forward call: Python and launches), wait (.float().cpu() until _pick has
    the row: the GPU finishing), host (pick, decode, the next input, up to the next forward)."""
    from workloads.serve_engines.builtin.model import SamplingParams

    t: list[float] = []

    def mark(*_) -> None:
        t.append(time.perf_counter())

    hooks = [engine.model.register_forward_pre_hook(mark), engine.model.register_forward_hook(mark)]
    pick = engine._pick
    engine._pick = lambda *a: (mark(), pick(*a))[1]  # shadows the staticmethod until deleted
    try:
        engine.generate(prompt_ids, SamplingParams(max_tokens=tokens, temperature=0.0))
    finally:
        del engine._pick
        for hook in hooks:
            hook.remove()
    steps = [t[i : i + 4] for i in range(0, len(t) - 3, 3)]  # start, enqueued, synced, next start
    return {name: [s[k + 1] - s[k] for s in steps] for k, name in enumerate(("enqueue", "wait", "host"))}


def node_facts(engine) -> dict:
    """Outside the engine: where the weights are, threads, CPUs, load, environment; the GPU's launch and sync costs."""
    import os
    import subprocess

    import torch

    m, dev = engine.model, engine.device
    facts = {
        "placement": sorted({f"{t.device}/{t.dtype}" for t in [*m.parameters(), *m.buffers()]}),
        "attn": m.config._attn_implementation,
        "threads": torch.get_num_threads(),
        "loadavg": os.getloadavg(),
        "cpus": [os.cpu_count(), len(os.sched_getaffinity(0))],
        "env": {k: v for k, v in os.environ.items() if k.startswith(("CUDA_", "PYTORCH_", "TORCH_", "OMP_"))},
    }
    if dev.type == "cuda":
        query = "--query-gpu=pstate,clocks.sm,clocks.max.sm,compute_mode,mig.mode.current"
        for args in ([query, "--format=csv"], ["--query-compute-apps=pid,name,used_memory", "--format=csv"]):
            run = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, check=False)
            facts[args[0]] = (run.stdout + run.stderr).strip()
        x = torch.zeros(1, device=dev)
        for name, n, fn in (
            ("us_per_launch", 2000, lambda: x.add_(1)),
            ("us_per_d2h_sync", 300, x.cpu),
            ("us_per_h2d_scalar", 300, lambda: torch.tensor([[1]], device=dev)),
        ):
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
            facts[name] = round((time.perf_counter() - started) / n * 1e6, 2)  # healthy: ~5, ~10-30, ~10-30
    return facts


def default_attention_times(engine, prompt_ids: list[int], tokens: int) -> list[float] | str:
    """Median ms a token with SDPA choosing its backend (the engine excludes cuDNN's attention): first over
    lengths this process has not run yet, then over the same lengths again. None fits the context: a note."""
    from workloads.serve_engines.builtin import model as engine_module

    longer = (prompt_ids * (tokens // len(prompt_ids) + 2))[: len(prompt_ids) + tokens + 8]
    if len(longer) + tokens > engine.context_length:
        return f"not run: {len(longer)} + {tokens} tokens exceed the context ({engine.context_length})"
    own = engine_module._attention_without_cudnn
    engine_module._attention_without_cudnn = contextlib.nullcontext
    try:
        runs = [step_times(engine, longer, tokens) for _ in range(2)]
    finally:
        engine_module._attention_without_cudnn = own
    return [round(statistics.median(t) * 1000, 2) for t in runs]


def step_times(engine, prompt_ids: list[int], tokens: int) -> list[float]:
    """Seconds from each forward pass to the next, over one greedy generation of ``tokens`` tokens."""
    from workloads.serve_engines.builtin.model import SamplingParams

    starts: list[float] = []
    hook = engine.model.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter()))
    try:
        engine.generate(prompt_ids, SamplingParams(max_tokens=tokens, temperature=0.0))
    finally:
        hook.remove()
    return [b - a for a, b in zip(starts, starts[1:])]


def profile(engine, prompt_ids: list[int], steps: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from workloads.serve_engines.builtin.model import SamplingParams

    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        engine.generate(prompt_ids, SamplingParams(max_tokens=steps, temperature=0.0))
    events = prof.key_averages()
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"

    def top(key: str) -> list[dict]:
        rows = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:15]
        return [{"op": e.key, "calls": e.count, "self_ms": round(getattr(e, key, 0) / 1000, 3)} for e in rows]

    return {
        "steps": steps,
        "table": events.table(sort_by=sort, row_limit=20),
        "top_cpu": top("self_cpu_time_total"),
        "top_device": top("self_device_time_total") if cuda else [],
        "syncing_calls": {e.key: e.count for e in events if e.key.startswith(SYNCING)},
        "device_ms_per_step": round(sum(e.self_device_time_total for e in events) / steps / 1000, 3) if cuda else None,
        "launches": {
            e.key: [round(e.count / steps, 1), round(e.self_cpu_time_total / e.count, 2)]  # a step; us each
            for e in events
            if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel"))
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, help="an exported checkpoint (default: a random GPU-demo Llama)")
    parser.add_argument("--tokens", type=int, default=400, help="greedy tokens to time (default 400)")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--profile-steps", type=int, default=20, help="steps under torch.profiler (0: none)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "bench_builtin_decode.json")
    args = parser.parse_args(argv)

    from workloads.serve_engines.builtin.model import Engine

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint or demo_gpu_checkpoint(Path(tmp) / "demo-gpu-llama")
        engine = Engine(checkpoint, device=args.device)
        started = time.perf_counter()
        engine.load()
        load_s = time.perf_counter() - started
        prompt_ids = engine.encode_prompt(PROMPT)
        step_times(engine, prompt_ids, 8)  # warm-up: the first passes allocate and pick kernels
        times = step_times(engine, prompt_ids, args.tokens)
        repeat = step_times(engine, prompt_ids, args.tokens)  # the same lengths again
        split = split_times(engine, prompt_ids, args.tokens)
        sdpa_default = default_attention_times(engine, prompt_ids, args.tokens)
        params = sum(p.numel() for p in engine.model.parameters())
        thirds = [times[i * len(times) // 3 : (i + 1) * len(times) // 3] for i in range(3)]
        result = {
            "checkpoint": str(args.checkpoint) if args.checkpoint else "random, the GPU demo's shape",
            "parameters": params,
            "device": str(engine.device),
            "dtype": str(next(engine.model.parameters()).dtype).removeprefix("torch."),
            "load_s": round(load_s, 2),
            "tokens": len(times) + 1,
            "tokens_per_s": round(len(times) / sum(times), 1),
            "ms_per_token_by_third": [round(statistics.median(t) * 1000, 2) for t in thirds if t],
            "repeat_ms_per_token": round(statistics.median(repeat) * 1000, 2),
            "sdpa_default_ms_per_token": sdpa_default,
            "split_ms_by_third": {
                k: [round(statistics.median(v[i * len(v) // 3 : (i + 1) * len(v) // 3]) * 1000, 2) for i in range(3)]
                for k, v in split.items()
            },
            "facts": node_facts(engine),
            "profile": profile(engine, prompt_ids, args.profile_steps) if args.profile_steps else None,
        }
    print(
        f"{result['parameters'] / 1e6:.1f}M parameters on {result['device']} ({result['dtype']}): "
        f"{result['tokens_per_s']} tokens/s over {result['tokens']} greedy tokens; ms a token (median of each "
        f"third): {result['ms_per_token_by_third']}"
    )
    print(
        f"the same lengths again: {result['repeat_ms_per_token']} ms a token; SDPA's own backend choice (cuDNN's "
        f"attention on an H200), new lengths then the same again: {result['sdpa_default_ms_per_token']}"
    )
    if result["profile"]:
        print(result["profile"]["table"])
        print("synchronising CUDA calls:", result["profile"]["syncing_calls"] or "none")
        print("device ms a step:", result["profile"]["device_ms_per_step"], "launches:", result["profile"]["launches"])
    print("ms enqueue / wait / host, by third:", result["split_ms_by_third"], "\nfacts:", json.dumps(result["facts"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
