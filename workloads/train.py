"""Pretrain (or continue pretraining) a Llama / Mixtral with NVIDIA NeMo AutoModel, on every GPU of every node.

    python -m workloads.train --config run.json                        # one process (CPU demo, one GPU)
    python -m torch.distributed.run --nproc-per-node 8 -m workloads.train --config run.json
    srun python -m torch.distributed.run --nnodes $N --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint $HEAD:29500 -m workloads.train --config run.json   # one srun task per node

``run.json`` is a :class:`workloads.train_config.TrainConfig` (NeMo names; an unknown
key is an error naming it). :func:`recipe_config` maps it onto NeMo AutoModel's
pretraining recipe (``TrainFinetuneRecipeForNextTokenPrediction``): the model is a
Hugging Face ``LlamaForCausalLM`` / ``MixtralForCausalLM`` built from its config (or
loaded from ``init_from`` to continue pretraining), the data is AutoModel's Megatron-Core
dataset (``MegatronPretraining``) over the NeMo blend prepare-dataset writes (weights,
prefixes, split, seed), sharded over the data-parallel ranks by Megatron's sequential
sampler, and the model is replicated with DDP or sharded with FSDP2 (``strategy``; auto =
DDP for small dense models on one node, see ``resolve_strategy``; tensor / context parallel
where AutoModel supports them, with FSDP2). The training loop, optimizer, schedule, checkpointing and resume are
AutoModel's; this module adds what the pipeline needs around them:

* ``<run_dir>/metrics.jsonl`` (rank 0): one JSON object per logged step
  (step, loss, lr, tokens_per_s, grad_norm, consumed_samples; on GPUs mfu and peak_mem_gib),
  per validation (step, val_loss) and per save (step, checkpoint_save_s: how long it blocked);
* checkpoints every ``ckpt_every_n_steps`` as consolidated safetensors that
  transformers loads as they are, completed by rank 0 with tokenizer.model, meta.json
  and MANIFEST.json, and pruned to ``save_top_k`` (layout: workloads/checkpoint.py);
* resume: started again on the same ``run_dir`` (a retry, a Slurm requeue, a
  pre-empted job) AutoModel restores weights, optimizer, schedule, RNG and the data
  loader's position from the latest checkpoint, so the data order continues exactly;
* object storage: the blend, the tokenizer and ``init_from`` may be ``gs://`` URIs (staged
  to local disk once per node, workloads/staging.py), and so may ``run_dir`` (one node): the
  run then trains in a node-local copy, uploads every complete checkpoint (resume state
  included, MANIFEST.json last), metrics.jsonl and train_config.json, and a restarted job
  resumes from the newest uploaded checkpoint;
* SIGTERM / SIGUSR1: a checkpoint at the next step boundary, then exit 76;
* W&B through AutoModel when ``WANDB_API_KEY`` is set (``WANDB_PROJECT``, default nemoflow);
* every rank's output prefixed with ``[rank N]`` when there is more than one.

Numerics (``precision``): ``bf16-mixed`` (default, as NeMo recipes) keeps fp32 master
weights and fp32 AdamW state and computes in bf16 (FSDP2's mixed-precision policy on
several GPUs; bf16 autocast with DDP, which has no such policy, and on one GPU, where
AutoModel skips FSDP2 and so its policy); gradients are reduced in fp32 either way. On
CPU everything is fp32.

Exit codes: 0 done, 2 bad configuration / missing data / unwritable run_dir,
75 out of memory, 76 stopped by a signal after saving a checkpoint.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

# megatron-core / megatron-fsdp warn at import that Apex / Transformer Engine are absent; neither is used.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

from infra import storage  # noqa: E402 - after the warnings filter
from workloads import checkpoint as ckpt  # noqa: E402 - see above
from workloads import staging  # noqa: E402 - see above
from workloads.data_loader import (  # noqa: E402 - see above
    DatasetMissingError,
    SentencePieceInfo,
    check_prefixes,
    check_splits,
)
from workloads.moe import backend_config as moe_backend_config  # noqa: E402 - see above
from workloads.moe import resolve_moe_impl  # noqa: E402 - see above
from workloads.train_config import (  # noqa: E402 - see above
    EXIT_BAD_CONFIG,
    EXIT_OUT_OF_MEMORY,
    EXIT_PREEMPTED,
    ParallelismError,
    TrainConfig,
    check_parallelism,
    load_train_config,
    parse_blend,
    resolve_strategy,
)

# Test hooks (no effect unless set): raise OOM at a step, pause after a step, die inside a save, list samples.
OOM_AT_STEP_ENV = "NEMOFLOW_TRAIN_TEST_OOM_AT_STEP"
PAUSE_AFTER_STEP_ENV = "NEMOFLOW_TRAIN_TEST_PAUSE_AFTER_STEP"
CRASH_IN_SAVE_ENV = "NEMOFLOW_TRAIN_TEST_CRASH_IN_SAVE_AT_STEP"
LOG_SAMPLES_ENV = "NEMOFLOW_TRAIN_TEST_LOG_SAMPLES"  # each rank prints a hash of every sample it trains on

MIXED_PRECISION = "torch.distributed.fsdp.MixedPrecisionPolicy"


class LaunchError(ValueError):
    """The processes started do not match what the configuration asks for."""


def launch_world() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) as torchrun sets them; (0, 0, 1) for a plain ``python -m``."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


# ----------------------------------------------------------------------------------------------- config mapping
def hf_model_config(config: TrainConfig, vocab_size: int) -> dict:
    """The transformers config (as an AutoModel ``_target_`` node) of the model TrainConfig describes."""
    common = {
        "vocab_size": vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.kv_heads,
        "max_position_embeddings": config.seq_length,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if config.arch == "mixtral":
        return {
            "_target_": "transformers.MixtralConfig",
            # AutoModel picks its implementation by architecture name (workloads/moe_model.py registers it)
            "architectures": ["MixtralForCausalLM"],
            "num_local_experts": config.experts,
            "num_experts_per_tok": config.moe_router_topk,
            **common,
        }
    return {"_target_": "transformers.LlamaConfig", **common}


def _dtypes(config: TrainConfig, cuda: bool) -> tuple[str, str]:
    """(weights dtype, FSDP2 compute dtype) for ``precision`` on this device."""
    if not cuda or config.precision == "32":
        return "float32", "float32"
    if config.precision == "bf16":
        return "bfloat16", "bfloat16"
    return "float32", "bfloat16"  # bf16-mixed: fp32 master weights and optimizer state, bf16 compute


def recipe_config(config: TrainConfig, run_dir: Path, vocab_size: int, world_size: int, cuda: bool) -> dict:
    """TrainConfig as NeMo AutoModel's recipe config (the dict its YAML files hold).

    The mapping, NeMo name -> AutoModel key: global_batch_size / micro_batch_size ->
    step_scheduler.global_batch_size / local_batch_size; max_steps (or max_tokens) ->
    step_scheduler.max_steps; val_check_interval -> val_every_steps; ckpt_every_n_steps ->
    ckpt_every_steps; data_prefix / split / seed / seq_length -> MegatronPretraining paths /
    split / seed / seq_length (validation: the same blend's validation split, or
    valid_data_prefix, limit_val_batches global batches); lr / min_lr / warmup_steps /
    lr_schedule -> lr_scheduler (warmup from 0 like Megatron); weight_decay / adam_beta* ->
    AdamW; gradient_clip_val -> clip_grad_norm.max_norm; strategy -> distributed.strategy
    (``resolve_strategy``: auto is ddp or fsdp2); tensor / context parallel -> distributed.tp_size /
    cp_size (FSDP2 takes the rest of the world as data parallel); enable_compile -> FSDP2's
    enable_compile (with DDP, :func:`train` compiles the same decoder layers after setup).
    """
    weights_dtype, compute_dtype = _dtypes(config, cuda)
    strategy = resolve_strategy(config, world_size, vocab_size)
    total = config.total_steps
    gbs, mbs = config.global_batch_size, config.micro_batch_size
    if config.init_from:
        model = {
            "_target_": "nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained",
            "pretrained_model_name_or_path": str(config.init_from),
            "torch_dtype": weights_dtype,
        }
    else:
        model = {
            "_target_": "nemo_automodel.NeMoAutoModelForCausalLM.from_config",
            "config": hf_model_config(config, vocab_size),
            "torch_dtype": weights_dtype,
        }
    moe_impl = resolve_moe_impl(config.arch, config.moe_impl)
    if moe_impl == "hf":
        model["force_hf"] = True  # transformers' Mixtral (experts in a loop), sharded by FSDP2
    elif moe_impl == "grouped":
        # AutoModel's MoE layers (workloads/moe_model.py, registered as AutoModel's MixtralForCausalLM by train())
        model["backend"] = moe_backend_config(cuda)
        if config.moe_aux_loss_coeff:
            model["moe_overrides"] = {"aux_loss_coeff": config.moe_aux_loss_coeff}

    def paths(blend: list) -> list[str]:
        prefixes, weights = parse_blend(blend)
        return prefixes if weights is None else [x for w, p in zip(weights, prefixes) for x in (str(w), p)]

    def dataset(blend: list | dict, split_name: str, **extra) -> dict:
        return {
            "_target_": "nemo_automodel.components.datasets.llm.megatron_dataset.MegatronPretraining",
            "paths": {k: paths(v) for k, v in blend.items()} if isinstance(blend, dict) else paths(blend),
            "seq_length": config.seq_length,
            "seed": config.seed,
            "split": config.split,
            "splits_to_build": split_name,
            "index_mapping_dir": str(run_dir / "index-cache"),
            "tokenizer": {"_target_": "workloads.data_loader.SentencePieceInfo", "model_path": config.tokenizer_model},
            **extra,
        }

    cfg: dict = {
        "seed": config.seed,
        "dist_env": {"backend": "nccl" if cuda else "gloo", "timeout_minutes": 10},
        "model": model,
        "dataset": dataset(config.data_prefix, "train"),
        "dataloader": {"dataloader_type": "single"},
        "step_scheduler": {
            "global_batch_size": gbs,
            "local_batch_size": mbs,
            "max_steps": total,
            "num_epochs": 1,
            "ckpt_every_steps": config.ckpt_every_n_steps,
            "val_every_steps": config.val_check_interval,
            "log_remote_every_steps": config.log_every_n_steps,
            "preemption_signal": ["SIGTERM", "SIGUSR1"],
        },
        "checkpoint": {
            "enabled": True,
            "checkpoint_dir": str(ckpt.checkpoints_dir(run_dir)),
            "model_save_format": "safetensors",
            "save_consolidated": "every",
            # Background DCP writes and consolidation on GPUs; on CPU the save is small and synchronous.
            "is_async": bool(config.ckpt_async_save and cuda),
        },
        "distributed": _distributed(config, strategy, compute_dtype),
        "loss_fn": {"_target_": "nemo_automodel.components.loss.masked_ce.MaskedCrossEntropy"},
        "optimizer": {
            "_target_": "torch.optim.AdamW",
            "lr": config.lr,
            "betas": [config.adam_beta1, config.adam_beta2],
            "weight_decay": config.weight_decay,
            "eps": 1e-8,
            **({"fused": True} if cuda else {}),
        },
        "lr_scheduler": {
            "lr_decay_style": "constant" if config.lr_schedule == "constant" else "cosine",
            # AutoModel asserts warmup < decay steps; the last step of a run that is all warmup decays.
            "lr_warmup_steps": min(config.warmup_steps, total - 1),
            "lr_decay_steps": total,
            "init_lr": 0.0,
            "max_lr": config.lr,
            "min_lr": config.min_lr if config.lr_schedule == "cosine" else config.lr,
        },
        "clip_grad_norm": {"max_norm": config.gradient_clip_val},
    }
    if config.limit_val_batches > 0:
        num_val = config.limit_val_batches * gbs
        if config.valid_data_prefix:
            # A separate validation blend: Megatron's blend_per_split (the split string is then unused).
            cfg["validation_dataset"] = dataset(
                {"train": config.data_prefix, "validation": config.valid_data_prefix},
                "validation",
                num_val_samples=num_val,
            )
        else:
            cfg["validation_dataset"] = dataset(config.data_prefix, "validation", num_val_samples=num_val)
        cfg["validation_dataloader"] = {"dataloader_type": "single"}
    if os.environ.get("WANDB_API_KEY"):
        cfg["wandb"] = {
            "project": os.environ.get("WANDB_PROJECT", "nemoflow"),
            "name": run_dir.name,
            # the run's identity: its URI when it lives in object storage (the local copy differs by node)
            "id": hashlib.sha256(
                (config.run_dir if staging.is_remote(config.run_dir) else str(run_dir.resolve())).encode()
            ).hexdigest()[:12],
            "resume": "allow",
            "dir": str(run_dir),
        }
    return cfg


def _distributed(config: TrainConfig, strategy: str, compute_dtype: str) -> dict:
    """The recipe's ``distributed`` section for the resolved strategy (AutoModel refuses keys a strategy lacks)."""
    common = {
        "strategy": strategy,
        "dp_size": None,
        "tp_size": config.tensor_model_parallel_size,
        "cp_size": config.context_parallel_size,
        "activation_checkpointing": config.activation_checkpointing,
    }
    if strategy == "ddp":
        # No mixed-precision policy in DDP: fp32 (or bf16) weights as torch_dtype says, bf16 autocast around the
        # forward and loss (train, build_recipe), fp32 gradients all-reduced in buckets during the backward.
        # The HF Mixtral's experts that receive no token have no gradient in that step: DDP must look for them
        # (AutoModel's grouped experts are one tensor per layer, always used).
        return {**common, "find_unused_parameters": resolve_moe_impl(config.arch, config.moe_impl) == "hf"}
    if config.expert_model_parallel_size > 1:
        common["ep_size"] = config.expert_model_parallel_size  # experts sharded over ep ranks (AutoModel's MoE)
    return {
        **common,
        "sequence_parallel": False,
        "enable_compile": config.enable_compile,
        "mp_policy": {
            "_target_": MIXED_PRECISION,
            "param_dtype": compute_dtype,
            "reduce_dtype": "float32",
            "output_dtype": None,
            "cast_forward_inputs": False,
        },
    }


# ----------------------------------------------------------------------------------------------- output
class RankPrefixed:
    """A text stream that starts every line with ``[rank N] `` (all ranks' output reaches one log).

    Whole lines go out in one write each, so the lines of ranks sharing a pipe never interleave mid-line.
    """

    def __init__(self, stream, rank: int):
        self.stream, self.prefix, self.pending = stream, f"[rank {rank}] ", ""
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        with self.lock:
            lines = (self.pending + text).split("\n")
            self.pending = lines.pop()
            if lines:
                self.stream.write("".join(f"{self.prefix}{line}\n" for line in lines))
        return len(text)

    def flush(self) -> None:
        with self.lock:
            if self.pending:
                self.stream.write(self.prefix + self.pending)
                self.pending = ""
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


class MetricsLog:
    """metrics.jsonl (one JSON object per line) and a short stdout line per record; rank 0 only."""

    def __init__(self, run_dir: Path, resume_step: int):
        self.path = run_dir / "metrics.jsonl"
        if self.path.exists():
            # A killed run may have logged steps past its last checkpoint; they are redone now.
            kept = [line for line in self.path.read_text().splitlines() if _step_of(line) <= resume_step]
            ckpt.write_text_atomic(self.path, "".join(line + "\n" for line in kept))
        self.fh = open(self.path, "a", encoding="utf-8")

    def log(self, record: dict) -> None:
        self.fh.write(json.dumps(record) + "\n")
        self.fh.flush()
        print(" ".join(f"{k}={_fmt(v)}" for k, v in record.items()), flush=True)

    def close(self) -> None:
        self.fh.close()


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except ValueError:
        return 0


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def _scalar(value):
    item = getattr(value, "item", None)
    return float(item()) if callable(item) else value


# ----------------------------------------------------------------------------------------------- the recipe
def build_recipe(
    config: TrainConfig,
    run_dir: Path,
    cfg: dict,
    autocast_bf16: bool,
    recorded: TrainConfig | None = None,
    mirror: staging.RunMirror | None = None,
):
    """AutoModel's pretraining recipe with nemoflow's metrics, checkpoint completion and test hooks.

    ``config`` has its inputs on local disk (:func:`localize`); ``recorded`` is the configuration as
    given (gs:// URIs), which the checkpoints' meta.json records; ``mirror`` uploads the checkpoints of
    a remote run directory.
    """
    recorded = recorded or config
    import torch
    from nemo_automodel.components.checkpoint.utils import is_checkpoint_incomplete
    from nemo_automodel.components.config.loader import ConfigNode
    from nemo_automodel.recipes.llm.train_ft import TrainFinetuneRecipeForNextTokenPrediction

    oom_at = int(os.environ.get(OOM_AT_STEP_ENV, "-1"))
    pause_after = int(os.environ.get(PAUSE_AFTER_STEP_ENV, "-1"))
    crash_at = int(os.environ.get(CRASH_IN_SAVE_ENV, "-1"))
    log_samples = bool(os.environ.get(LOG_SAMPLES_ENV))
    tokens_per_step = config.global_batch_size * config.seq_length

    class NemoflowPretraining(TrainFinetuneRecipeForNextTokenPrediction):
        metrics: MetricsLog | None = None
        last_val_loss: float | None = None

        def _make_progress_bar(self, *args, **kwargs):
            return None  # one log line per logged step instead of a redrawn bar in the job log

        def _forward_backward_step(self, *args, **kwargs):
            # One GPU (AutoModel skips FSDP2 and with it the bf16 compute policy) and DDP (which has none):
            # autocast computes in bf16 over the fp32 master weights instead.
            if autocast_bf16:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    return super()._forward_backward_step(*args, **kwargs)
            return super()._forward_backward_step(*args, **kwargs)

        def _run_train_optim_step(self, batches, max_grad_norm=None):
            done = self.step_scheduler.step + 1
            if done == oom_at:
                raise torch.OutOfMemoryError("simulated by " + OOM_AT_STEP_ENV)
            if log_samples:
                rows = [
                    hashlib.sha256(row.numpy().tobytes()).hexdigest()[:12] for b in batches for row in b["input_ids"]
                ]
                print(f"samples step={done} rank={self.dist_env.rank} {','.join(rows)}", flush=True)
            self.step_lr = self.optimizer[0].param_groups[0]["lr"]  # the lr this step trains with
            return super()._run_train_optim_step(batches, max_grad_norm)

        # -------------------------------------------------- metrics
        def start_metrics(self) -> None:
            self.window_start, self.window_steps = time.perf_counter(), 0
            self.max_steps = self.step_scheduler.max_steps
            # W&B gets what metrics.jsonl gets: log_train_metrics below passes only nemoflow's log steps
            # (done % log_every_n_steps, done = step + 1) to AutoModel, whose own filter (step % n, 0-based)
            # would then drop every one of them; so AutoModel logs remotely whenever it is called.
            self.step_scheduler.log_remote_every_steps = 1
            if self.dist_env.is_main:
                self.metrics = MetricsLog(run_dir, self.step_scheduler.step)

        def log_train_metrics(self, log_data):
            done = log_data.step + 1
            self.window_steps += 1
            if done % config.log_every_n_steps and done != self.max_steps:
                return
            now = time.perf_counter()
            m = log_data.metrics
            record = {
                "step": done,
                "loss": _scalar(m["loss"]),
                "lr": self.step_lr,
                "tokens_per_s": self.window_steps * tokens_per_step / max(now - self.window_start, 1e-9),
                "grad_norm": _scalar(m["grad_norm"]),
                "consumed_samples": done * config.global_batch_size,
            }
            if torch.cuda.is_available():
                if m.get("mfu") is not None:
                    record["mfu"] = _scalar(m["mfu"])
                record["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            self.window_start, self.window_steps = now, 0
            if self.metrics is not None:
                self.metrics.log(record)
            super().log_train_metrics(log_data)  # W&B, AutoModel's own log; resets the peak-memory window
            if done == pause_after:
                handler = self.step_scheduler.sig_handler
                deadline = time.monotonic() + 120
                while not handler._signal_received and time.monotonic() < deadline:
                    time.sleep(0.05)

        def log_val_metrics(self, val_name, log_data, metric_logger=None):
            self.last_val_loss = _scalar(log_data.metrics["val_loss"])
            if self.metrics is not None and val_name == "default":
                self.metrics.log({"step": log_data.step + 1, "val_loss": self.last_val_loss})
            super().log_val_metrics(val_name, log_data, metric_logger)

        def _finalize_and_close_checkpointer(self):
            started = time.perf_counter()
            super()._finalize_and_close_checkpointer()  # waits for the last async save and publishes it
            if self.metrics is not None:
                done = self.step_scheduler.step
                self.metrics.log({"step": done, "checkpoint_finalize_s": time.perf_counter() - started})

        # -------------------------------------------------- checkpoints
        def save_checkpoint(self, epoch, step, train_loss, val_loss=None, best_metric_key="default"):
            done = step + 1
            path = Path(self.checkpointer.config.checkpoint_dir) / f"epoch_{epoch}_step_{step}"
            if done == crash_at:
                # Die inside AutoModel's save: weights written, optimizer not, checkpoint never published.
                def die(*args, **kwargs):
                    os.kill(os.getpid(), signal.SIGKILL)

                self.checkpointer.save_optimizer = die
            started = time.perf_counter()
            super().save_checkpoint(epoch, step, train_loss, val_loss, best_metric_key)
            if self.metrics is not None:
                # Time the training loop waited for this save (with async saves: staging, and the previous save).
                self.metrics.log({"step": done, "checkpoint_save_s": time.perf_counter() - started})
            self.window_start += time.perf_counter() - started  # tokens_per_s measures training steps only
            if self.dist_env.is_main:
                val = (val_loss or {}).get("default")
                meta = checkpoint_meta(recorded, done, None if val is None else _scalar(val), _scalar(train_loss))
                meta["world_size"] = self.dist_env.world_size
                ckpt.write_meta(ckpt.consolidated_dir(path), meta, config.tokenizer_model)
                self.finisher.pending.append(path)
                self.finisher.finish_published()

    recipe = NemoflowPretraining(ConfigNode(cfg))
    recipe.finisher = CheckpointFinisher(run_dir, config.save_top_k, is_checkpoint_incomplete, mirror)
    return recipe


def checkpoint_meta(config: TrainConfig, step: int, val_loss: float | None, train_loss: float | None) -> dict:
    consumed = step * config.global_batch_size
    return {
        "step": step,
        "val_loss": val_loss,
        "train_loss": train_loss,
        "consumed_samples": consumed,
        "tokens_seen": consumed * config.seq_length,
        "arch": config.arch,
        "data_prefix": config.data_prefix,
        "valid_data_prefix": config.valid_data_prefix,
        "split": config.split,
        "seq_length": config.seq_length,
        "micro_batch_size": config.micro_batch_size,
        "limit_val_batches": config.limit_val_batches,
        "seed": config.seed,
        "init_from": config.init_from,
        "precision": config.precision,
        "engine": "nemo-automodel",
    }


class CheckpointFinisher:
    """Rank 0: once AutoModel has published a checkpoint, write its manifest and prune, in the background.

    Hashing a multi-GB consolidated export takes seconds; a single worker thread does it
    while training goes on (joined before the process exits), in publication order.
    """

    def __init__(self, run_dir: Path, save_top_k: int, is_incomplete, mirror: staging.RunMirror | None = None):
        self.run_dir, self.save_top_k, self.is_incomplete = run_dir, save_top_k, is_incomplete
        self.mirror = mirror
        self.pending: list[Path] = []
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def finish_published(self) -> None:
        published = [p for p in self.pending if p.is_dir() and not self.is_incomplete(p)]
        if not published:
            return
        self.pending = [p for p in self.pending if p not in published]
        self.join()
        self.thread = threading.Thread(target=self._finish, args=(published,), name="nemoflow-manifest", daemon=True)
        self.thread.start()

    def _finish(self, paths: list[Path]) -> None:
        try:
            for path in paths:
                consolidated = ckpt.consolidated_dir(path)
                ckpt.name_architecture(consolidated)
                ckpt.write_manifest(consolidated)
                meta = ckpt.read_meta(consolidated)
                print(f"saved checkpoint {consolidated} (step {meta.get('step')}, val_loss {meta.get('val_loss')})")
                if self.mirror is not None:
                    uri = self.mirror.push_checkpoint(path)
                    self.mirror.push_file("metrics.jsonl")
                    print(f"uploaded checkpoint {uri}")
            latest = ckpt.latest_checkpoint(self.run_dir)
            protect = {latest.step_dir} if latest else set()
            for gone in ckpt.prune_checkpoints(self.run_dir, self.save_top_k, protect=protect):
                print(f"pruned checkpoint {gone} (save_top_k={self.save_top_k})")
            if self.mirror is not None:
                names = {latest.step_dir.name} if latest else set()
                for gone in self.mirror.prune(self.save_top_k, protect=names):
                    print(f"pruned checkpoint {gone} (save_top_k={self.save_top_k})")
            sys.stdout.flush()
        except BaseException as exc:  # noqa: BLE001 - reported by join() in the training thread
            self.error = exc

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def complete_interrupted(
    run_dir: Path, config: TrainConfig, tokenizer_model: str | None = None, mirror: staging.RunMirror | None = None
) -> None:
    """Rank 0 at start-up: manifest (and upload) every checkpoint AutoModel published before a crash cut the
    finishing short. ``tokenizer_model``: the local copy of ``config.tokenizer_model``."""
    from nemo_automodel.components.checkpoint.utils import is_checkpoint_incomplete

    for step_dir in ckpt.step_dirs(run_dir):
        consolidated = ckpt.consolidated_dir(step_dir)
        if is_checkpoint_incomplete(step_dir) or (consolidated / ckpt.MANIFEST).exists():
            continue
        if not (consolidated / "config.json").exists():
            continue
        ckpt.name_architecture(consolidated)
        if not (consolidated / ckpt.META).exists():
            step = int(ckpt.STEP_DIR_RE.match(step_dir.name).group(2)) + 1
            losses = step_dir / "losses.json"
            loss = json.loads(losses.read_text()) if losses.exists() else {}
            ckpt.write_meta(
                consolidated,
                checkpoint_meta(config, step, loss.get("val_loss"), loss.get("train_loss")),
                tokenizer_model or config.tokenizer_model,
            )
        ckpt.write_manifest(consolidated)
        print(f"completed checkpoint {consolidated} (published before the last run stopped)", flush=True)
        if mirror is not None:
            print(f"uploaded checkpoint {mirror.push_checkpoint(step_dir)}", flush=True)


def run_mirror(config: TrainConfig) -> staging.RunMirror | None:
    """The node-local copy of a run directory in object storage (None for a path)."""
    if not config.run_dir:
        raise ValueError("run_dir is not set: where should checkpoints and metrics go?")
    if not staging.is_remote(config.run_dir):
        return None
    if config.num_nodes > 1:
        raise ValueError(
            f"run_dir {config.run_dir} is in object storage, which needs the run on one node (each node writes "
            f"only its own ranks' checkpoint shards); with num_nodes={config.num_nodes} use a run_dir on a file "
            "system every node mounts (a PVC, Lustre, NFS)"
        )
    return staging.RunMirror(config.run_dir)


def localize(config: TrainConfig) -> TrainConfig:
    """The configuration with its inputs on this node's disk: gs:// blends, tokenizer and init_from staged in."""
    update: dict = {
        "data_prefix": staging.local_blend(config.data_prefix),
        "valid_data_prefix": staging.local_blend(config.valid_data_prefix),
    }
    if config.tokenizer_model:
        update["tokenizer_model"] = staging.stage_in(config.tokenizer_model)
    if staging.is_remote(config.init_from):
        if config.reset_optimizer:
            update["init_from"] = staging.local_checkpoint(config.init_from)
        else:  # the optimizer state too: the whole AutoModel step directory
            step_dir = staging.stage_tree(storage.parent(storage.parent(config.init_from)))
            update["init_from"] = str(ckpt.consolidated_dir(step_dir))
    return config.model_copy(update=update)


def prepare_run_dir(config: TrainConfig, mirror: staging.RunMirror | None = None) -> Path:
    """The local run directory (for a remote run_dir: the node's copy, the newest remote checkpoint pulled in)."""
    if mirror is not None:
        run_dir = mirror.pull()
    else:
        if not config.run_dir:
            raise ValueError("run_dir is not set: where should checkpoints and metrics go?")
        run_dir = Path(config.run_dir.removeprefix("file://"))
    probe = ckpt.checkpoints_dir(run_dir) / f".tmp-probe-{os.getpid()}"
    try:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise PermissionError(
            f"checkpoint directory {probe.parent} is not writable ({exc.strerror or exc}); "
            "set run_dir to a writable path"
        ) from None
    return run_dir


def check_launch(config: TrainConfig, world_size: int, cuda: bool, device_count: int) -> None:
    """The processes torchrun started must be the ones the configuration describes."""
    wanted = config.world_size
    if world_size != wanted:
        how = (
            f"num_nodes={config.num_nodes} x {config.procs_per_node} per node "
            f"({'gpus_per_node' if config.gpus_per_node and not config.nproc_per_node else 'nproc_per_node'})"
        )
        raise LaunchError(
            f"the configuration asks for {wanted} training processes ({how}) but {world_size} were started; "
            f"launch with python -m torch.distributed.run --nnodes {config.num_nodes} "
            f"--nproc-per-node {config.procs_per_node} -m workloads.train --config ..."
        )
    if config.gpus_per_node and not cuda:
        raise LaunchError(f"gpus_per_node={config.gpus_per_node} but this node has no CUDA device")
    if cuda and config.gpus_per_node and device_count < config.procs_per_node:
        raise LaunchError(
            f"{config.procs_per_node} processes per node need as many GPUs; this node has {device_count} "
            "(CUDA_VISIBLE_DEVICES?)"
        )


def check_data_splits(config: TrainConfig) -> None:
    """Before AutoModel builds the datasets: every split it builds (train; validation when
    limit_val_batches > 0) has documents of every prefix, or its index builder never returns."""
    splits = ("train", "validation") if config.limit_val_batches > 0 else ("train",)
    check_splits(config.data_prefix, config.split, splits, config.valid_data_prefix)


def train(config: TrainConfig) -> int:
    rank, _, world_size = launch_world()
    if not config.data_prefix or not config.tokenizer_model:
        raise ValueError("data_prefix and tokenizer_model must be set (the prepared dataset's blend and tokenizer)")

    import torch

    cuda = torch.cuda.is_available() and config.gpus_per_node > 0
    check_launch(config, world_size, cuda, torch.cuda.device_count())
    plan = check_parallelism(config, on_cpu=not cuda, world_size=world_size)
    if cuda:
        from workloads.memory_plan import check_memory

        check_memory(config, world_size=world_size)  # against gpu_memory_gib when the config states it
    mirror = run_mirror(config)
    run_dir = prepare_run_dir(config, mirror)
    recorded, config = config, localize(config)  # meta.json records the URIs given; AutoModel reads local files
    if config.init_from and not (Path(config.init_from) / "config.json").is_file():
        raise FileNotFoundError(f"init_from {recorded.init_from} has no config.json: not a checkpoint directory")
    if config.init_from and resolve_moe_impl(config.arch, config.moe_impl) == "grouped":
        config = config.model_copy(update={"init_from": grouped_init_from(config, recorded)})
    check_prefixes(config.data_prefix)
    if config.valid_data_prefix:
        check_prefixes(config.valid_data_prefix)
    check_data_splits(config)
    tokenizer = SentencePieceInfo(config.tokenizer_model)
    vocab_size = config.vocab_size or tokenizer.vocab_size
    if rank == 0:
        ckpt.write_text_atomic(run_dir / "train_config.json", recorded.model_dump_json(indent=1))
        if mirror is not None:
            mirror.push_file("train_config.json")
        complete_interrupted(run_dir, recorded, config.tokenizer_model, mirror)

    if not cuda:
        from workloads import automodel_shim

        automodel_shim.apply()
    if resolve_moe_impl(config.arch, config.moe_impl) == "grouped":
        from workloads import moe_model

        if not moe_model.grouped_mm_available():
            raise ValueError(
                f"moe_impl={config.moe_impl!r} runs the experts with torch._grouped_mm, which torch "
                f"{torch.__version__} lacks (torch >= 2.8 has it); set moe_impl 'hf' or upgrade torch"
            )
        moe_model.register()  # AutoModel builds its MoE-layer Mixtral for MixtralForCausalLM configs
        if not cuda and not config.enable_compile:
            # AutoModel's MoE helpers (SwiGLU, ...) are @torch.compile'd: on CPU inductor's C++ build of them takes
            # ~25 s for milliseconds of work. Run them eagerly there (the same numbers) unless compile is asked for.
            torch.compiler.set_stance("force_eager")
    os.environ.setdefault("LOGGING_LEVEL", str(30))  # AutoModel's INFO lines (dataset indexes...) flood the log
    if config.init_from:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory: never ask the Hugging Face hub
    cfg = recipe_config(config, run_dir, vocab_size, world_size, cuda)
    strategy = cfg["distributed"]["strategy"]
    autocast_bf16 = cuda and config.precision == "bf16-mixed" and (world_size == 1 or strategy == "ddp")
    recipe = build_recipe(config, run_dir, cfg, autocast_bf16, recorded, mirror)
    recipe.setup()
    if strategy == "ddp" and config.enable_compile:
        compile_decoder_layers(recipe.model_parts)
    if config.init_from and not config.reset_optimizer:
        source = Path(config.init_from).parent.parent
        recipe.checkpointer.load_optimizer(recipe.optimizer, recipe.model_parts, str(source))
    resumed = recipe.step_scheduler.step
    recipe.start_metrics()
    if rank == 0:
        from workloads.wandb_run import record_active_run

        record_active_run(run_dir)  # the W&B run's link or offline path, for the stage's artifact
        params = sum(p.numel() for p in recipe.model_parts[0].parameters())
        moe_impl = resolve_moe_impl(config.arch, config.moe_impl)
        moe_note = f"moe_impl={moe_impl} expert_parallel={config.expert_model_parallel_size}, " if moe_impl else ""
        device = f"cuda x {world_size}" if cuda else f"cpu (gloo) x {world_size}"
        print(
            f"NeMo AutoModel {config.arch}: {params / 1e6:.2f}M parameters (per rank), {device}, "
            f"{moe_note}steps={plan.total_steps}, global_batch_size={config.global_batch_size} "
            f"micro_batch_size={config.micro_batch_size} data_parallel={plan.data_parallel_size} "
            f"accumulation={plan.gradient_accumulation_steps} seq_length={config.seq_length} strategy={strategy} "
            f"({type(recipe.model_parts[0]).__name__}) "
            f"precision={config.precision if cuda else '32 (cpu)'}",
            flush=True,
        )
        if resumed:
            latest = ckpt.latest_checkpoint(run_dir)
            print(f"resuming from {latest} at step {resumed} (consumed_samples={resumed * config.global_batch_size})")
        elif config.init_from:
            print(f"initialised weights from {config.init_from} (reset_optimizer={config.reset_optimizer})")
        sys.stdout.flush()
    try:
        recipe.run_train_validation_loop()
        recipe.finisher.finish_published()
        recipe.finisher.join()
    except (torch.OutOfMemoryError, MemoryError):
        print(
            f"out of memory at step {recipe.step_scheduler.step + 1} with micro_batch_size={config.micro_batch_size}, "
            f"seq_length={config.seq_length}: lower micro_batch_size (or set activation_checkpointing)",
            flush=True,
        )
        return EXIT_OUT_OF_MEMORY
    finally:
        if recipe.metrics is not None:
            recipe.metrics.close()
            if mirror is not None:
                mirror.push_file("metrics.jsonl")
        _finish_wandb()
    done = recipe.step_scheduler.step
    if recipe.step_scheduler.sigterm_flag and done < plan.total_steps:
        if rank == 0:
            print(f"received a stop signal: checkpoint saved at step {done}, exiting", flush=True)
        return EXIT_PREEMPTED
    if rank == 0:
        best = ckpt.best_checkpoint(run_dir)
        print(f"done: {done} steps, best checkpoint {best.path if best else None}", flush=True)
    return 0


def grouped_init_from(config: TrainConfig, recorded: TrainConfig) -> str:
    """``init_from`` for the grouped Mixtral: as it is, or (a checkpoint transformers' Mixtral wrote, moe_impl 'hf')
    a node-local copy in Mixtral's per-expert layout, which AutoModel's MoE model loads (workloads/moe_model.py)."""
    from workloads import moe_model

    if not moe_model.uses_fused_expert_layout(config.init_from):
        return config.init_from
    if not config.reset_optimizer:
        raise ValueError(
            f"init_from {recorded.init_from} was written by transformers' MixtralForCausalLM (moe_impl 'hf'): its "
            "optimizer state cannot continue with moe_impl 'grouped' (other parameters); set reset_optimizer true, "
            "or moe_impl 'hf'"
        )
    return moe_model.mixtral_layout_checkpoint(config.init_from, staging.stage_dir() / "mixtral-layout")


def compile_decoder_layers(model_parts: list) -> None:
    """torch.compile each decoder layer in place, as AutoModel's FSDP2 path does for ``enable_compile``.

    AutoModel 0.7 compiles per layer only under FSDP2 (its DDP path offers whole-model compile alone), so with
    DDP nemoflow calls the same AutoModel function on the wrapped module after setup. ``nn.Module.compile``
    compiles in place: DDP's gradient hooks stay on the same parameters and the state-dict keys (hence the
    checkpoints) do not change.
    """
    from nemo_automodel.components.distributed.parallelizer import _apply_per_layer_compile

    for part in model_parts:
        _apply_per_layer_compile(getattr(part, "module", part))


def _read_config(path: str) -> str:
    """The --config file: a path, or a URI in object storage (a run directory there keeps it)."""
    if staging.is_remote(path):
        return storage.read_text(path)
    return Path(path).read_text()


def _finish_wandb() -> None:
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()


def _config_fields_help() -> str:
    lines = ["config fields (JSON keys, NeMo names):"]
    for name, field in TrainConfig.model_fields.items():
        default = "required" if field.is_required() else f"default {field.default!r}"
        note = f": {field.description}" if field.description else ""
        lines.append(f"  {name} ({default}){note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workloads.train",
        description=__doc__,
        epilog=_config_fields_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="TrainConfig as a JSON file")
    parser.add_argument("--check", action="store_true", help="only check the configuration and the data, then exit")
    args = parser.parse_args(argv)
    rank, _, world_size = launch_world()
    if world_size > 1:
        sys.stdout = RankPrefixed(sys.stdout, rank)
        sys.stderr = RankPrefixed(sys.stderr, rank)
    try:
        config = load_train_config(_read_config(args.config))
        if args.check:
            plan = check_parallelism(config)
            check_prefixes(config.data_prefix)
            check_data_splits(config)
            print(json.dumps(plan.__dict__))
            return 0
        return train(config)
    except (ParallelismError, DatasetMissingError, PermissionError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_CONFIG
    except BaseException as exc:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        if not _disk_full(exc):
            raise
        # One line after the traceback: what happened and what to do (the incomplete save is never a checkpoint).
        print(
            f"error: no space left on the device holding the run directory ({exc.__class__.__name__} while "
            "writing); the last complete checkpoint is kept: free space (or move run_dir) and run again to resume",
            file=sys.stderr,
            flush=True,
        )
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _disk_full(exc: BaseException) -> bool:
    """ENOSPC anywhere in the exception's chain, or in torch.distributed.checkpoint's per-rank failures."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if "[Errno 28]" in str(e):  # DCP wraps the ranks' exceptions, keeping their text
            return True
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
        for failure in (getattr(e, "failures", None) or {}).values():  # DCP's CheckpointException: rank -> error
            inner = failure[0] if isinstance(failure, tuple) else getattr(failure, "exception", failure)
            if isinstance(inner, BaseException):
                todo.append(inner)
            elif "[Errno 28]" in str(failure):
                return True
    return False


if __name__ == "__main__":
    sys.exit(main())
