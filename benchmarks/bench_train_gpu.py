"""Training throughput, MFU, peak memory and checkpoint stall of the NeMo AutoModel trainer, against a reference loop.

    python benchmarks/bench_train_gpu.py --model 134m --gpus 1            # one H200
    python benchmarks/bench_train_gpu.py --model 1.1b --gpus 2            # two H200 (torchrun; auto = FSDP2)
    python benchmarks/bench_train_gpu.py --model 134m --gpus 2            # two H200 (torchrun; auto = DDP)
    python benchmarks/bench_train_gpu.py --model tiny --cpu --seq 64 --steps 6 --warmup 1 --ckpt-every 3  # CPU check
    python benchmarks/bench_train_gpu.py --model moe-0.9b --gpus 1 --ckpt-every 100   # Mixtral-style MoE, side by side:
        # today's path (moe_impl hf: transformers' Mixtral, eager: it does not compile) and AutoModel's MoE layers
        # (moe_impl grouped, per-layer compile; and grouped-eager without compile), one trainer run each
    python benchmarks/bench_train_gpu.py --model tiny-moe --cpu --seq 64 --steps 6 --warmup 1 --ckpt-every 3

Each call runs, on the same synthetic Megatron dataset (uniform random tokens, Mixtral's
32000-token vocabulary, written with workloads/indexed_dataset.py):

  nemoflow   ``python -m workloads.train`` exactly as the pipeline runs it (under
             ``torch.distributed.run --nproc-per-node G``): NeMo AutoModel with ``--strategy``
             (default auto: DDP for the 134M model, FSDP2 for 1.1B; one GPU wraps nothing), bf16
             compute with fp32 master weights and AdamW state (precision=bf16-mixed), per-layer torch.compile,
             a checkpoint every ``--ckpt-every`` steps (consolidated safetensors + manifest, async);
  reference  a hand-written loop with the same model, batch and numerics (transformers Llama, fp32
             weights, bf16 autocast, SDPA, each decoder layer torch.compile'd, fused AdamW; DDP on
             several GPUs), no data loader and no checkpoints: the ceiling the engine is measured against.

MoE models (``moe-0.9b``, ``tiny-moe``: Mixtral-style, ``arch: mixtral``) run the trainer once per
``--moe-impl`` entry (default ``hf,grouped,grouped-eager``): ``hf`` = transformers' ``MixtralForCausalLM``
(its experts in a loop; never compiled: the trainer refuses compile with it), ``grouped`` = NeMo AutoModel's
MoE layers (``torch._grouped_mm`` experts, workloads/moe_model.py) with per-layer compile unless
``--no-compile``, ``grouped-eager`` = the same without compile. A variant that fails is reported with its
error and the others still run. There is no reference loop for MoE models (the comparison is the two paths).

Reported (JSON on stdout and in --out): tokens/s (median of the logged steps after ``--warmup``,
excluding the 2 steps that follow each checkpoint), MFU = tokens/s x FLOPs per token / (GPUs x 989 TFLOP/s,
the H100/H200 SXM dense bf16 peak), FLOPs per token = 6 x (ACTIVE parameters - input embedding)
+ 12 x layers x hidden x seq_length, where the active parameters of an MoE are those one token goes
through: embeddings, attention, norms, the router (hidden x experts) and top-k of the experts
(3 x hidden x ffn each), so the 0.93B-parameter ``moe-0.9b`` counts 0.31B (0.28B without the input
embedding); peak GPU memory (max over ranks, torch allocator), and the checkpoints:

  blocked_per_save_s   per save, the time the training loop waited for it: the save call itself
                       (checkpoint_save_s: the previous save's write if it is still running, and the start
                       of this one) plus the wait before the next optimizer step for the copy of the state
                       to host memory (checkpoint_wait_s); ``blocked_median_s`` over the saves of the run
  after_save           per save, the tokens/s of the 3 steps after it, as a share of the steady rate
  effective_tokens_per_s  tokens of the steps after ``--warmup`` over their training time plus the time
                       the loop blocked in saves among them: what a run with these saves achieves
  checkpoint_finalize_s  the wait for the last save's write at the end (after the last step)
  write_gbps_per_save  per save, the background writer's rate: the step directory's bytes (every rank's files)
                       over the time from the end of the first copy to host memory to the end of the last
                       write (metrics.jsonl checkpoint_write_s / checkpoint_gb / checkpoint_write_gbps);
                       ``write_gbps_median`` over the saves; compare with the disk's rate (gpu_node.sh facts)
  first_save_prestage  the staging buffers prepared in the background before the first save: GiB and seconds
  failed_saves         saves whose background write failed (the run went on; metrics checkpoint_failed)

With ``--compare-no-saves`` the nemoflow run is repeated without intermediate saves (one save at the
end) and ``effective_ratio`` = effective tokens/s with saves / without: the cost of the saves (the fraction
of the no-save rate; issue 34 asks >= 0.98 with a save every 200 steps of the 1.1B model, >= 0.90 with one
every 10). ``--ckpt-write-threads N`` sets TrainConfig.ckpt_write_threads (files written in parallel per rank).
A one-line summary of the checkpoint numbers goes to stderr at the end.
``--run-root`` puts the run directories (the checkpoints) elsewhere, e.g. /dev/shm, to separate the
trainer's share of a save from the disk's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Measured with it (2026-11-30, nvidia-h200-x2, torch 2.11, CUDA_VISIBLE_DEVICES=0 for one GPU; the README has the table):
#   1.1b 1 GPU  nemoflow 65.4k tok/s (47.8% MFU) vs reference 68.7k; 2 GPUs 115.4k (1.77x) vs DDP 115.8k
#   134m 1 GPU  nemoflow 336k tok/s (30.0%) vs reference 410k; 2 GPUs 314k (0.94x) vs DDP 665k   (strategy fsdp2)
# Later the same day, strategy auto (134m: DDP, 1.1b: FSDP2), one call, --steps 30 --ckpt-every 100:
#   134m 1 GPU  nemoflow 292k tok/s (26.1%) vs reference 400k; 2 GPUs DDP 607k (27.1%, 2.08x) vs DDP 748k (1.87x)
#   1.1b 2 GPUs FSDP2 103k (37.7%, --steps 20 --ckpt-every 100, another call of that session)

PEAK_BF16_TFLOPS = 989.0
VOCAB = 32000

# name: (hidden, layers, heads, kv_heads, ffn, micro_batch_size per GPU); ffn is per expert for an MoE
MODELS = {
    "tiny": (64, 2, 4, 2, 128, 2),
    "134m": (768, 12, 12, 12, 2048, 8),
    "1.1b": (2048, 16, 16, 8, 8192, 4),
    "tiny-moe": (64, 2, 4, 2, 128, 2),
    "moe-0.9b": (1024, 12, 16, 8, 2816, 4),  # the Mixtral: 0.93B parameters, 0.28B active (top-2 of 8)
    # Two layers of the seed's Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1: hidden 4096, 32 heads, 8 KV heads, FFN
    # 14336 per expert, 8 experts, top-2): 3.16B parameters, 1.05B active; one H200 holds it with its AdamW state
    # (the memory plan's check of the full model's per-GPU numbers, issue 35)
    "mixtral-8x7b-2l": (4096, 2, 32, 8, 14336, 2),
}
# MoE models (Mixtral-style, arch mixtral): name -> (experts, experts per token)
MOE = {"tiny-moe": (4, 2), "moe-0.9b": (8, 2), "mixtral-8x7b-2l": (8, 2)}
MOE_IMPLS = ("hf", "grouped", "grouped-eager")  # --moe-impl entries: TrainConfig.moe_impl, and whether to compile


def parameters(hidden: int, layers: int, heads: int, kv: int, ffn: int, moe: tuple[int, int] | None = None):
    """(all parameters, input-embedding parameters, active parameters) of the untied Llama / Mixtral.

    Active = what one token computes with: everything but the experts it is not routed to
    (an MoE layer: router hidden x experts, plus top-k experts of 3 x hidden x ffn)."""
    head = hidden // heads
    attn = hidden * hidden * 2 + 2 * hidden * kv * head
    norms = 2 * hidden
    experts, top_k = moe or (1, 1)
    router = hidden * experts if moe else 0
    total = 2 * VOCAB * hidden + layers * (attn + 3 * hidden * ffn * experts + router + norms) + hidden
    active = 2 * VOCAB * hidden + layers * (attn + 3 * hidden * ffn * top_k + router + norms) + hidden
    return total, VOCAB * hidden, active


def flops_per_token(model: str, seq: int) -> float:
    """6 x (active parameters - input embedding) + 12 x layers x hidden x seq (attention scores and values)."""
    hidden, layers, heads, kv, ffn, _ = MODELS[model]
    _, embedding, active = parameters(hidden, layers, heads, kv, ffn, MOE.get(model))
    return 6 * (active - embedding) + 12 * layers * hidden * seq


def moe_fields(model: str, impl: str | None, compile_: bool) -> dict:
    """The TrainConfig fields of an MoE model and --moe-impl entry (empty for a dense model)."""
    if model not in MOE:
        return {}
    experts, top_k = MOE[model]
    return {
        "arch": "mixtral",
        "num_moe_experts": experts,
        "moe_router_topk": top_k,
        "moe_impl": "hf" if impl == "hf" else "grouped",
        # transformers' Mixtral crashes under torch.compile (the trainer refuses the combination)
        "enable_compile": compile_ and impl == "grouped",
    }


def tokenizer_model() -> str:
    """Mixtral's sentencepiece model (any 32000-piece model would do: the tokens are random)."""
    if os.environ.get("BENCH_TOKENIZER_MODEL"):
        return os.environ["BENCH_TOKENIZER_MODEL"]
    import mistral_common

    return str(Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1")


def make_dataset(root: Path, tokens: int, seq: int) -> str:
    """Uniform random tokens as one Megatron indexed dataset of documents of ~2 sequences each."""
    import numpy as np

    from workloads.indexed_dataset import DType, IndexedDatasetWriter

    prefix = str(root / "random_text_document")
    if Path(prefix + ".idx").exists():
        return prefix
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    doc = 2 * seq + 1
    docs = max(8, tokens // doc)
    data = rng.integers(3, VOCAB, size=docs * doc, dtype=np.uint16)
    with IndexedDatasetWriter(prefix, DType.uint16) as writer:
        writer.add_documents(data, np.full(docs, doc, dtype=np.int32), np.ones(docs, dtype=np.int64))
    return prefix


def run_nemoflow(args, prefix: str, out: Path, moe_impl: str | None = None, ckpt_every: int | None = None) -> dict:
    hidden, layers, heads, kv, ffn, mbs = MODELS[args.model]
    mbs = args.micro_batch or mbs
    cuda = not args.cpu
    ckpt_every = ckpt_every or args.ckpt_every
    tag = f"{args.model}-{args.gpus}gpu" + (f"-{moe_impl}" if moe_impl else "") + f"-every{ckpt_every}"
    run_dir = Path(args.run_root or out) / f"run-{tag}"
    config = {
        "arch": "llama",
        "hidden_size": hidden,
        "num_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "ffn_hidden_size": ffn,
        "seq_length": args.seq,
        "global_batch_size": mbs * args.gpus,
        "micro_batch_size": mbs,
        "max_steps": args.steps,
        "lr": 3e-4,
        "min_lr": 3e-5,
        "warmup_steps": 2,
        "val_check_interval": 10_000,
        "limit_val_batches": 0,
        "ckpt_every_n_steps": ckpt_every,
        "save_top_k": 1,
        "log_every_n_steps": 1,
        "data_prefix": [prefix],
        "split": "100,0,0",
        "tokenizer_model": tokenizer_model(),
        "run_dir": str(run_dir),
        "gpus_per_node": args.gpus if cuda else 0,
        "nproc_per_node": args.gpus,
        "precision": args.precision,
        "enable_compile": cuda and not args.no_compile,
        "ckpt_async_save": not args.sync_save,
        # the saving run only: the no-save comparison (one save at the end) is today's path
        **({"ckpt_snapshots": True} if args.snapshots and ckpt_every < args.steps else {}),
        **({"ckpt_while_writing": "skip"} if args.skip_while_writing and ckpt_every < args.steps else {}),
        **({"ckpt_while_writing": "replace"} if args.replace_while_writing and ckpt_every < args.steps else {}),
        **({"ckpt_write_threads": args.ckpt_write_threads} if args.ckpt_write_threads else {}),
        "strategy": args.strategy,
        **moe_fields(args.model, moe_impl, cuda and not args.no_compile),
    }
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    (run_dir / "bench.json").write_text(json.dumps(config))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.gpus}"]
    command += ["-m", "workloads.train", "--config", str(run_dir / "bench.json")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    # torch.compile's caches where the pipeline puts them (tasks/train_engines/automodel.py compile_cache_env: the
    # work dir), here under --out: the second run of a shape (--compare-no-saves) shows what the cache saves
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(out / "cache" / "torch-compile"))
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    (out / f"nemoflow-{tag}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        # the trainer's own warnings and errors first (a failed save says why there), then the output's tail,
        # which torchrun's traceback fills
        said = [
            line
            for line in proc.stdout.splitlines()
            if line.split("] ", 1)[-1].startswith(("warning:", "error:", "out of memory"))  # after "[rank N] "
        ]
        tail = "\n".join(said[-10:]) + "\n...\n" + (proc.stdout + proc.stderr)[-2500:]
        raise SystemExit(
            f"nemoflow trainer failed (exit {proc.returncode}); its log: {out / f'nemoflow-{tag}.log'}\n{tail}"
        )
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    stats = checkpoint_stats(records, args.warmup, mbs * args.gpus * args.seq)
    tps = stats["steady_tokens_per_s"]
    from workloads import checkpoint as ckpt

    latest = ckpt.latest_checkpoint(run_dir)
    resolved = next((w.split("=", 1)[1] for w in proc.stdout.split() if w.startswith("strategy=")), None)
    return {
        "engine": "nemoflow (NeMo AutoModel)",
        **({"moe_impl": config["moe_impl"], "enable_compile": config["enable_compile"]} if moe_impl else {}),
        "strategy": resolved,
        "tokens_per_s": tps,
        "mfu": tps * flops_per_token(args.model, args.seq) / (args.gpus * PEAK_BF16_TFLOPS * 1e12) if cuda else None,
        "peak_mem_gib": max((r.get("peak_mem_gib", 0.0) for r in records if "loss" in r), default=None),
        "ckpt_every": ckpt_every,
        **({"snapshots": True} if config.get("ckpt_snapshots") else {}),
        **({"skip_while_writing": True} if config.get("ckpt_while_writing") == "skip" else {}),
        **({"replace_while_writing": True} if config.get("ckpt_while_writing") == "replace" else {}),
        **stats,
        "final_loss": [r for r in records if "loss" in r][-1]["loss"],
        # the trainer's own phase seconds (infra/phases.py: imports, build and compile, data, steps, saves)
        "phase_s": next((r["phase_s"] for r in reversed(records) if "phase_s" in r), None),
        "wall_s": wall,
        "latest_checkpoint": str(latest.path) if latest else None,
        "checkpoint_bytes": sum(
            v["size"] for v in json.loads((latest.path / ckpt.MANIFEST).read_text())["files"].values()
        )
        if latest
        else None,
    }


def checkpoint_stats(records: list[dict], warmup: int, tokens_per_step: int) -> dict:
    """The checkpoint numbers of one run's metrics.jsonl (every step logged; see the module docstring).

    >>> recs = [{"step": s, "loss": 1.0, "tokens_per_s": 100.0} for s in range(1, 9)]
    >>> recs += [{"step": 4, "checkpoint_save_s": 0.25}, {"step": 4, "checkpoint_wait_s": 0.25}]
    >>> stats = checkpoint_stats(recs, warmup=1, tokens_per_step=100)
    >>> stats["blocked_per_save_s"], stats["effective_tokens_per_s"]
    ([0.5], 93.33333333333333)
    """
    steps = {r["step"]: r for r in records if "loss" in r}
    blocked: dict[int, float] = {}
    for r in records:
        # a save's call and its wait for the previous write; with ckpt_snapshots, its copy into host memory (at
        # e5b86ee this sum left the copies out: the H200's snapshot run blocked 11.4 s a save and was reported
        # at 99.5 % of the no-save rate)
        for key in ("checkpoint_save_s", "checkpoint_wait_s", "snapshot_copy_s"):
            if key in r:
                blocked[r["step"]] = blocked.get(r["step"], 0.0) + r[key]
    last = max(steps)
    intermediate = {s: b for s, b in blocked.items() if s != last}  # the final save is followed by no step
    near_save = {s + k for s in blocked for k in (1, 2)}
    steady = [r["tokens_per_s"] for s, r in steps.items() if s > warmup and s not in near_save]
    steady_tps = statistics.median(steady) if steady else statistics.median(r["tokens_per_s"] for r in steps.values())
    counted = [s for s in steps if s > warmup]
    training = sum(tokens_per_step / steps[s]["tokens_per_s"] for s in counted)
    stalls = sum(b for s, b in intermediate.items() if s > warmup)
    return {
        "steady_tokens_per_s": steady_tps,
        "checkpoints": len(blocked),
        # ckpt_while_writing: skip — saves due while the previous one was still being written, not taken
        "skipped_saves": sum(1 for r in records if "checkpoint_skipped_while_writing" in r),
        # ckpt_while_writing: replace — saves taken while the previous one was being written, then replaced by a
        # newer one before their own write began (the others were written when that write ended)
        "replaced_saves": sum(1 for r in records if "checkpoint_replaced_by" in r),
        "delayed_writes": sum(1 for r in records if "checkpoint_write_delayed_s" in r),
        "blocked_per_save_s": [round(intermediate[s], 4) for s in sorted(intermediate)],
        "blocked_median_s": statistics.median(intermediate.values()) if intermediate else None,
        "final_save_s": blocked.get(last),
        "checkpoint_finalize_s": sum(r["checkpoint_finalize_s"] for r in records if "checkpoint_finalize_s" in r),
        "after_save": {
            s: [round(steps[s + k]["tokens_per_s"] / steady_tps, 3) for k in (1, 2, 3) if s + k in steps]
            for s in sorted(intermediate)
        },
        "effective_tokens_per_s": len(counted) * tokens_per_step / (training + stalls) if counted else None,
        "write_gbps_per_save": [round(r["checkpoint_write_gbps"], 3) for r in records if "checkpoint_write_gbps" in r],
        "write_s_per_save": [round(r["checkpoint_write_s"], 2) for r in records if "checkpoint_write_s" in r],
        "write_gbps_median": statistics.median(gbps) if (gbps := writes(records)) else None,
        "checkpoint_gb": max((r["checkpoint_gb"] for r in records if "checkpoint_gb" in r), default=None),
        "first_save_prestage": next(
            (
                {"gib": round(r["checkpoint_prestage_gib"], 2), "seconds": round(r["checkpoint_prestage_s"], 2)}
                for r in records
                if "checkpoint_prestage_gib" in r
            ),
            None,
        ),
        # the buffers the first save used: equal to first_save_prestage's GiB when they served it (no second copy)
        "first_save_staged_gib": next(
            (round(r["checkpoint_staged_gib"], 2) for r in records if "checkpoint_staged_gib" in r), None
        ),
        "failed_saves": [
            {"step": r["step"], "reason": r["checkpoint_failed"]} for r in records if "checkpoint_failed" in r
        ],
    }


def writes(records: list[dict]) -> list[float]:
    """The background writer's rate (GB/s) of each save of a run's metrics."""
    return [r["checkpoint_write_gbps"] for r in records if "checkpoint_write_gbps" in r]


def summary(result: dict) -> str:
    """One line of the checkpoint numbers the issue's targets are stated in (per-save blocked time, the writer's
    GB/s, the fraction of the no-save rate)."""
    run = result.get("nemoflow") or {}
    if not isinstance(run, dict) or "blocked_per_save_s" not in run:
        return "checkpoints: no single nemoflow run to summarise"
    ratio = result.get("effective_ratio")
    median = run.get("write_gbps_median")
    return (
        f"checkpoints every {run['ckpt_every']} steps: blocked per save {run['blocked_per_save_s']} s "
        f"(final save {run['final_save_s']} s, finalize {run['checkpoint_finalize_s']:.2f} s); writer "
        f"{run['write_gbps_per_save']} GB/s per save (median {median if median is None else round(median, 3)}, "
        f"{run['checkpoint_gb']} GB a save); first save's buffers {run['first_save_prestage']} (it used "
        f"{run['first_save_staged_gib']} GiB); "
        f"effective tokens/s {run['effective_tokens_per_s']:.0f}"
        + (f" = {ratio:.1%} of the no-save run" if ratio else "")
        + (f"; FAILED saves {run['failed_saves']}" if run["failed_saves"] else "")
    )


def reference_worker(args) -> None:
    """The reference loop, in one process per GPU (torchrun sets RANK/LOCAL_RANK/WORLD_SIZE)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv, ffn, mbs = MODELS[args.model]
    mbs = args.micro_batch or mbs
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    cuda = not args.cpu
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        use_cache=False,  # training: a KV cache would make every compiled layer recompile (and fall back to eager)
    )
    model = LlamaForCausalLM(config).to(device)
    if cuda and not args.no_compile:
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = torch.compile(layer)
    train_model = (
        torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if cuda else None) if world > 1 else model
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
    gen = torch.Generator(device=device).manual_seed(rank)
    tokens = torch.randint(3, VOCAB, (mbs, args.seq + 1), device=device, generator=gen)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    times = []
    for _ in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with autocast:
            logits = train_model(input_ids=tokens[:, :-1], use_cache=False).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    tps = world * mbs * args.seq / statistics.median(times[args.warmup :])
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    if rank == 0:
        print("REFERENCE " + json.dumps({"tokens_per_s": tps, "peak_mem_gib": peak, "final_loss": loss.item()}))
    if world > 1:
        dist.destroy_process_group()


def run_reference(args, out: Path) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.gpus}"]
    command += [str(Path(__file__).resolve()), "--reference-worker", "--model", args.model, "--gpus", str(args.gpus)]
    command += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--seq", str(args.seq)]
    command += ["--cpu"] if args.cpu else []
    command += ["--no-compile"] if args.no_compile else []
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    (out / f"reference-{args.model}-{args.gpus}gpu.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"reference loop failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    line = next(x for x in proc.stdout.splitlines() if "REFERENCE " in x)
    result = json.loads(line.split("REFERENCE ", 1)[1])
    tps = result["tokens_per_s"]
    flops = flops_per_token(args.model, args.seq)
    result["mfu"] = tps * flops / (args.gpus * PEAK_BF16_TFLOPS * 1e12) if not args.cpu else None
    result["engine"] = "reference loop (compiled layers, fused AdamW, SDPA" + (", DDP)" if args.gpus > 1 else ")")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="134m")
    parser.add_argument("--gpus", type=int, default=1, help="processes (GPUs); on --cpu, gloo processes")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the medians (compile, allocator)")
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, help="micro batch size per GPU (default: the model's, in MODELS)")
    parser.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "bf16", "32"])
    parser.add_argument("--strategy", default="auto", choices=["auto", "fsdp2", "ddp"], help="TrainConfig.strategy")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--sync-save", action="store_true", help="synchronous checkpoints (default: async)")
    parser.add_argument(
        "--snapshots",
        action="store_true",
        help="the saving run with ckpt_snapshots: each save a copy to host memory, persisted by a writer process",
    )
    parser.add_argument(
        "--skip-while-writing",
        action="store_true",
        help="the saving run with ckpt_while_writing: skip (a save due while the previous one is still being "
        "written is skipped, not waited for; the result counts them: skipped_saves)",
    )
    parser.add_argument(
        "--replace-while-writing",
        action="store_true",
        help="the saving run with ckpt_while_writing: replace (each save copied within the GPU first; one due "
        "during a write waits in that copy, written when the write ends or replaced by a newer one: the result "
        "counts them: replaced_saves, delayed_writes)",
    )
    parser.add_argument(
        "--ckpt-write-threads", type=int, help="files each rank writes in parallel per save (default: TrainConfig's)"
    )
    parser.add_argument(
        "--compare-no-saves",
        action="store_true",
        help="run the trainer again with one save at the end only, and report the ratio of effective tokens/s",
    )
    parser.add_argument("--run-root", help="where the run directories (checkpoints) go (default: --out)")
    parser.add_argument(
        "--moe-impl",
        default=",".join(MOE_IMPLS),
        help="MoE models: comma-separated trainer variants to run side by side, of " + ", ".join(MOE_IMPLS),
    )
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument("--skip-nemoflow", action="store_true")
    parser.add_argument("--cpu", action="store_true", help="no GPU: check the code path with --model tiny")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "train_gpu"))
    parser.add_argument("--reference-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if sum((args.snapshots, args.skip_while_writing, args.replace_while_writing)) > 1:
        parser.error("--snapshots, --skip-while-writing and --replace-while-writing are ways to save: give one")
    if args.reference_worker:
        reference_worker(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _, _, _, _, _, mbs = MODELS[args.model]
    mbs = args.micro_batch or mbs
    impls = [x.strip() for x in args.moe_impl.split(",") if x.strip()] if args.model in MOE else [None]
    if unknown := [x for x in impls if x is not None and x not in MOE_IMPLS]:
        parser.error(f"--moe-impl {','.join(unknown)}: choose from {', '.join(MOE_IMPLS)}")
    prefix = make_dataset(out / "data", tokens=(args.steps + 4) * mbs * args.gpus * (args.seq + 1) * 2, seq=args.seq)
    total, _, active = parameters(*MODELS[args.model][:5], MOE.get(args.model))
    result = {
        "model": args.model,
        "parameters": total,
        **({"active_parameters": active, "experts": MOE[args.model]} if args.model in MOE else {}),
        "gpus": args.gpus,
        "seq_length": args.seq,
        "micro_batch_size": mbs,
        "global_batch_size": mbs * args.gpus,
        "steps": args.steps,
        "flops_per_token": flops_per_token(args.model, args.seq),
        "device": _device(),
    }
    if not args.skip_nemoflow and args.model in MOE:
        result["nemoflow"] = {}
        for impl in impls:  # side by side; one variant failing does not lose the others
            try:
                result["nemoflow"][impl] = run_nemoflow(args, prefix, out, impl)
            except SystemExit as exc:
                result["nemoflow"][impl] = {"error": str(exc)[-2000:]}
            print(f"{impl}: {json.dumps(result['nemoflow'][impl])[:400]}", file=sys.stderr, flush=True)
    elif not args.skip_nemoflow:
        result["nemoflow"] = run_nemoflow(args, prefix, out)
        if args.compare_no_saves:
            result["nemoflow_no_saves"] = run_nemoflow(args, prefix, out, ckpt_every=10**6)
            with_saves = result["nemoflow"]["effective_tokens_per_s"]
            without = result["nemoflow_no_saves"]["effective_tokens_per_s"]
            result["effective_ratio"] = with_saves / without if with_saves and without else None
    if not args.skip_reference and args.model not in MOE:
        result["reference"] = run_reference(args, out)
    text = json.dumps(result, indent=1)
    (out / f"bench_train_gpu-{args.model}-{args.gpus}gpu.json").write_text(text)
    print(text, flush=True)
    if not args.skip_nemoflow and args.model not in MOE:
        print(summary(result), file=sys.stderr, flush=True)


def _device() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
        return f"cpu, torch {torch.__version__}"
    except ImportError:
        return "unknown"


if __name__ == "__main__":
    main()
