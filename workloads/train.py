"""Pretrain (or continue pretraining) a Llama / Mixtral with NVIDIA NeMo AutoModel, on every GPU of every node.

    python -m workloads.train --config run.json                        # one process (CPU demo, one GPU)
    python -m torch.distributed.run --nproc-per-node 8 -m workloads.train --config run.json
    srun python -m torch.distributed.run --nnodes $N --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint $HEAD:29500 -m workloads.train --config run.json   # one srun task per node

``run.json`` is a :class:`infra.configs.train.TrainConfig` (NeMo names; an unknown
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
* checkpoints every ``ckpt_every_n_steps``: AutoModel's sharded, resumable checkpoint, written in
  the background from pinned host memory (the loop waits only while the state leaves the GPU;
  the staging buffers are kept for the whole run), with nemoflow's meta.json, pruned to
  ``save_top_k``; when training ends, a separate process (workloads/consolidate.py) exports the
  best and the last as Hugging Face safetensors that transformers loads as they are, with
  tokenizer.model, meta.json and, last, MANIFEST.json (layout: workloads/checkpoint.py);
* resume: started again on the same ``run_dir`` (a retry, a Slurm requeue, a
  pre-empted job) AutoModel restores weights, optimizer, schedule, RNG and the data
  loader's position from the latest checkpoint, so the data order continues exactly;
* object storage: the blend, the tokenizer and ``init_from`` may be ``gs://`` URIs (staged
  to local disk once per node, workloads/staging.py), and so may ``run_dir`` (one node): the
  run then trains in a node-local copy, uploads every complete checkpoint (resume state
  included, MANIFEST.json last), metrics.jsonl and train_config.json, and a restarted job
  resumes from the newest uploaded checkpoint;
* a background save that fails (a storage error, a full disk, the writer process killed) is reported (a
  "warning: the checkpoint of step N was not saved" line, a ``checkpoint_failed`` record in metrics.jsonl) and
  training continues: the failed save is removed (it was never published), the previous checkpoint stays the
  newest, a dead writer process is replaced; ``ckpt_max_failed_saves`` failures in a row, or a failed last
  save, stop the run (exit 1, one line that says why);
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
import concurrent.futures
import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

# megatron-core / megatron-fsdp warn at import that Apex / Transformer Engine are absent; neither is used.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

from infra import failpoints, phases, storage  # noqa: E402 - after the warnings filter
from infra.configs.moe import backend_config as moe_backend_config  # noqa: E402 - see above
from infra.configs.moe import resolve_moe_impl  # noqa: E402 - see above
from infra.configs.train import (  # noqa: E402 - see above
    EXIT_BAD_CONFIG,
    EXIT_OUT_OF_MEMORY,
    EXIT_PREEMPTED,
    ParallelismError,
    TrainConfig,
    check_parallelism,
    estimate_parameters,
    load_train_config,
    parse_blend,
    resolve_strategy,
)
from workloads import checkpoint as ckpt  # noqa: E402 - see above
from workloads import staging  # noqa: E402 - see above
from workloads.data_loader import (  # noqa: E402 - see above
    DatasetMissingError,
    SentencePieceInfo,
    check_prefixes,
    check_splits,
)

MIXED_PRECISION = "torch.distributed.fsdp.MixedPrecisionPolicy"


class LaunchError(ValueError):
    """The processes started do not match what the configuration asks for."""


class ExportError(RuntimeError):
    """The Hugging Face export after training failed; the saved checkpoints are intact."""


class CheckpointSaveError(RuntimeError):
    """Saves failed ``ckpt_max_failed_saves`` times in a row, or the run's last save failed: the run stops (the
    newest complete checkpoint is kept; its ``__cause__`` is the last write's error). ``disk_full``: the last
    failure came with the run directory's disk full (its space is back once the failed save is removed)."""

    def __init__(self, message: str, disk_full: bool = False):
        super().__init__(message)
        self.disk_full = disk_full


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


def recipe_config(
    config: TrainConfig, run_dir: Path, vocab_size: int, world_size: int, cuda: bool, async_save: bool | None = None
) -> dict:
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
    enable_compile (with DDP, :func:`train` compiles the same decoder layers after setup);
    ckpt_async_save -> checkpoint.is_async (``async_save`` overrides it: :func:`async_save_fits` falls back to
    synchronous saves where the node lacks the host memory to stage them). Checkpoints are never consolidated
    inside the loop (``save_consolidated: false``): workloads/consolidate.py exports them after training.
    """
    weights_dtype, compute_dtype = _dtypes(config, cuda)
    strategy = resolve_strategy(config, world_size, vocab_size)
    total = config.total_steps
    gbs = config.global_batch_size
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
        "step_scheduler": step_scheduler(config, total, num_epochs=1, ckpt_every_steps=config.ckpt_every_n_steps),
        # Sharded DCP only during training; the Hugging Face export is made after it (workloads/consolidate.py).
        # Background DCP writes on GPUs and CPUs alike (automodel_shim.keep_staging_buffers).
        "checkpoint": checkpoint_section(
            run_dir, consolidated="false", is_async=config.ckpt_async_save if async_save is None else async_save
        ),
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
        "lr_scheduler": lr_scheduler(config, total),
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
        "mp_policy": mixed_precision_policy(compute_dtype),
    }


def step_scheduler(config, total: int, *, num_epochs: int, ckpt_every_steps: int | None) -> dict:
    """The recipe's ``step_scheduler`` from NeMo's batch sizes, val_check_interval and log_every_n_steps (a
    TrainConfig's or an SftConfig's): ``total`` steps; SIGTERM and SIGUSR1 save a checkpoint and stop."""
    return {
        "global_batch_size": config.global_batch_size,
        "local_batch_size": config.micro_batch_size,
        "max_steps": total,
        "num_epochs": num_epochs,
        "ckpt_every_steps": ckpt_every_steps,
        "val_every_steps": config.val_check_interval,
        "log_remote_every_steps": config.log_every_n_steps,
        "preemption_signal": ["SIGTERM", "SIGUSR1"],
    }


def checkpoint_section(run_dir: Path, *, consolidated: str, is_async: bool) -> dict:
    """The recipe's ``checkpoint``: safetensors under ``<run_dir>/checkpoints``; ``consolidated``: AutoModel's
    save_consolidated ("false", "every", ...)."""
    return {
        "enabled": True,
        "checkpoint_dir": str(ckpt.checkpoints_dir(run_dir)),
        "model_save_format": "safetensors",
        "save_consolidated": consolidated,
        "is_async": is_async,
    }


def mixed_precision_policy(compute_dtype: str) -> dict:
    """FSDP2's mixed-precision policy (the recipe's ``distributed.mp_policy``): compute in ``compute_dtype``,
    gradients reduced in fp32."""
    return {
        "_target_": MIXED_PRECISION,
        "param_dtype": compute_dtype,
        "reduce_dtype": "float32",
        "output_dtype": None,
        "cast_forward_inputs": False,
    }


def lr_scheduler(config, total: int) -> dict:
    """The recipe's ``lr_scheduler`` from NeMo's lr / min_lr / warmup_steps / lr_schedule (a TrainConfig's or an
    SftConfig's) over ``total`` steps: warmup from 0 like Megatron."""
    return {
        "lr_decay_style": "constant" if config.lr_schedule == "constant" else "cosine",
        # AutoModel asserts warmup < decay steps; the last step of a run that is all warmup decays.
        "lr_warmup_steps": min(config.warmup_steps, max(total - 1, 0)),
        "lr_decay_steps": total,
        "init_lr": 0.0,
        "max_lr": config.lr,
        "min_lr": config.min_lr if config.lr_schedule == "cosine" else config.lr,
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


def prefix_output_with_rank() -> None:
    """In a world of more than one rank, every line this process prints starts with its rank (``[rank N] ``)."""
    rank, _, world_size = launch_world()
    if world_size > 1:
        sys.stdout = RankPrefixed(sys.stdout, rank)
        sys.stderr = RankPrefixed(sys.stderr, rank)


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
        _say(" ".join(f"{k}={_fmt(v)}" for k, v in record.items()))

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
    flops_per_token: float | None = None,
):
    """AutoModel's pretraining recipe with nemoflow's metrics, checkpoint bookkeeping and failpoints.

    ``config`` has its inputs on local disk (:func:`localize`); ``recorded`` is the configuration as
    given (gs:// URIs), which the checkpoints' meta.json records; ``mirror`` uploads the checkpoints of
    a remote run directory; ``flops_per_token`` (model FLOPs of one trained token) gives the logged MFU.
    """
    recorded = recorded or config
    import torch
    from nemo_automodel.components.checkpoint.utils import is_checkpoint_incomplete
    from nemo_automodel.components.config.loader import ConfigNode
    from nemo_automodel.recipes.llm.train_ft import TrainFinetuneRecipeForNextTokenPrediction

    from workloads import automodel_shim

    tokens_per_step = config.global_batch_size * config.seq_length
    log_samples = failpoints.enabled("train.log_samples")
    peak = peak_flops() if torch.cuda.is_available() else None

    class NemoflowPretraining(TrainFinetuneRecipeForNextTokenPrediction):
        metrics: MetricsLog | None = None
        last_val_loss: float | None = None
        saved_step: int | None = None  # the save whose staging the next optimizer step may wait for
        failed_in_row: int = 0  # background saves that failed since the last one published
        failed_step: int | None = None  # the step of the last save that failed
        failed_error: BaseException | None = None  # and its error (the cause of a CheckpointSaveError)
        failed_disk_full: bool = False  # and whether the run directory's disk was full then
        prestage = None  # automodel_shim.Prestage: the first save's staging buffers, prepared in the background
        staged_report: bool = False  # the first save after pre-staging records the buffers it used
        write_marks: dict | None = None  # when the pending save's copies and writes ended (perf_counter)
        agree_group = None  # ranks agree on publishing a written save (publish_written_save)

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
            if failpoints.at("train.oom_at_step", done):
                raise torch.OutOfMemoryError("simulated by the failpoint train.oom_at_step")
            if log_samples:
                rows = [
                    hashlib.sha256(row.numpy().tobytes()).hexdigest()[:12] for b in batches for row in b["input_ids"]
                ]
                _say(f"samples step={done} rank={self.dist_env.rank} {','.join(rows)}")
            self.step_lr = self.optimizer[0].param_groups[0]["lr"]  # the lr this step trains with
            self.publish_written_save()
            if self.saved_step is not None:
                # The optimizer may not change the weights before the last save's copy to host memory is done:
                # AutoModel waits for it before opt.step (maybe_wait_for_staging). Wait here first, timed, so the
                # training loop's share of the save is on record (checkpoint_wait_s); AutoModel's wait is then a no-op.
                started = time.perf_counter()
                with phases.within(phases.SAVE):
                    self.checkpointer.maybe_wait_for_staging()
                if self.metrics is not None:
                    record = {"step": self.saved_step, "checkpoint_wait_s": time.perf_counter() - started}
                    if self.staged_report:
                        # every buffer the first save used: equal to what was pre-staged when it served the save
                        stagers = (self.checkpointer._model_ctx.stager, self.checkpointer._optim_ctx.stager)
                        record["checkpoint_staged_gib"] = sum(map(automodel_shim.staged_bytes, stagers)) / 2**30
                    self.metrics.log(record)
                self.saved_step, self.staged_report = None, False
            self.profile_steps(done, start=True)
            # This process's first step compiles (torch.compile is lazy) and warms up: counted as the build.
            phases.switch(phases.STEPS if getattr(self, "stepped", False) else phases.BUILD)
            result = super()._run_train_optim_step(batches, max_grad_norm)
            phases.switch(phases.DATA)  # until the next step: the next batch and the loop's bookkeeping
            self.stepped = True
            self.profile_steps(done, start=False)
            if self.prestage is not None and not self.prestage.optimizer_ready.is_set():
                # the optimizer's state exists from its first step on: its staging buffers can be prepared now
                tensors = automodel_shim.optimizer_tensors(self.optimizer)
                self.prestage.optimizer(self.checkpointer._optim_ctx.stager, tensors)
            return result

        def _get_dp_rank(self, include_cp: bool = False):
            if not include_cp and phases.timer().current == phases.BUILD:
                phases.switch(phases.DATA)  # AutoModel 0.7's setup asks this first when it builds the data loaders
            return super()._get_dp_rank(include_cp=include_cp)

        @phases.timed(phases.BUILD)  # resume: weights, optimizer and data position back from the checkpoint
        def load_checkpoint(self, *args, **kwargs):
            return super().load_checkpoint(*args, **kwargs)

        @phases.timed(phases.VALIDATION)
        def _run_validation_epoch(self, *args, **kwargs):
            return super()._run_validation_epoch(*args, **kwargs)

        def profile_steps(self, done: int, start: bool) -> None:
            """``NEMOFLOW_PROFILE_STEPS=DIR[:FIRST[:COUNT]]`` (default steps 8-10): torch.profiler over those steps.

            Writes ``DIR/steps-rank<R>.txt``, the operators by their own GPU time (CPU time on CPU), to find where a
            step's time goes (benchmarks/bench_train_gpu.py passes it on; off unless set).
            """
            spec = os.environ.get("NEMOFLOW_PROFILE_STEPS")
            if not spec:
                return
            out, first, count = (spec.split(":") + ["8", "3"])[:3]
            first, last = int(first), int(first) + int(count) - 1
            if start and done == first:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self.step_profiler = torch.profiler.profile(activities=activities)
                self.step_profiler.__enter__()
            elif not start and done == last and getattr(self, "step_profiler", None) is not None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.step_profiler.__exit__(None, None, None)
                sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
                table = self.step_profiler.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=90)
                Path(out).mkdir(parents=True, exist_ok=True)
                name = f"{out}/steps-rank{self.dist_env.rank}.txt"
                Path(name).write_text(f"steps {first}-{last}, sorted by {sort}\n{table}\n")
                self.step_profiler = None

        def publish_written_save(self, wait: bool = False) -> None:
            """Publish the last asynchronous save as soon as its files are written, or drop it if its write failed.

            AutoModel publishes an asynchronous save (removes its ``.incomplete`` marker, moves LATEST) only at the
            next save or at the end of training, so a job killed in between would resume from the save before.
            Every rank must publish at the same step (publication runs collectives), so the ranks agree first,
            on a gloo group of their own, and only while a save is pending. ``wait``: until the writes end (before
            the next save and at the end of training).

            A write that failed on any rank (the storage, a full disk, the writer process killed) used to raise
            here and end the run (issue 34: one background write's error ended a 1.1B run): it is
            :meth:`drop_failed_save` instead, on every rank at the same step.
            """
            lifecycle = self.checkpointer.lifecycle
            if not self.checkpointer.config.is_async or lifecycle._pending_checkpoint_dir is None:
                return
            contexts = (self.checkpointer._model_ctx, self.checkpointer._optim_ctx)
            writes = [c.future.upload_completion for c in contexts if c.future is not None]
            if wait:
                concurrent.futures.wait(writes)
            written = all(w.done() for w in writes)
            errors = [w.exception() for w in writes if w.done() and w.exception() is not None]
            # [not written, failed, writer process dead] on this rank; the ranks' maximum is what every rank does
            flags = [int(not written), int(bool(errors)), int(not automodel_shim.writer_alive())]
            if self.agree_group is not None:
                flag = torch.tensor(flags)
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.agree_group)
                flags = flag.tolist()
            if flags[0]:
                return
            if flags[1]:
                self.drop_failed_save(errors[0] if errors else None, replace_writer=bool(flags[2]))
                return
            self.checkpointer.async_wait()  # returns at once: the writes are done
            path = lifecycle._pending_checkpoint_dir
            lifecycle.complete_pending()
            self.failed_in_row = 0
            if self.dist_env.is_main:
                self.record_write(Path(path))
                self.finisher.finish_published()

        def record_write(self, path: Path) -> None:
            """The background write's time and rate (metrics.jsonl ``checkpoint_write_s``, ``checkpoint_gb``,
            ``checkpoint_write_gbps``): from the end of the first copy to host memory to the end of the last write,
            over the bytes of the step directory (every rank's files: the rate of the whole save)."""
            marks, self.write_marks = self.write_marks or {}, None
            staged = [t for k, t in marks.items() if k.endswith("staged")]
            written = [t for k, t in marks.items() if k.endswith("written")]
            if self.metrics is None or not staged or not written or not path.is_dir():
                return
            seconds = max(written) - min(staged)
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            self.metrics.log(
                {
                    "step": ckpt.step_of(path),
                    "checkpoint_write_s": seconds,
                    "checkpoint_gb": size / 1e9,
                    "checkpoint_write_gbps": size / 1e9 / max(seconds, 1e-9),
                }
            )

        def mark_writes(self) -> None:
            """Note when this save's copies to host memory and its writes end (for :meth:`record_write`)."""
            marks = self.write_marks = {}
            for name, context in (("model", self.checkpointer._model_ctx), ("optim", self.checkpointer._optim_ctx)):
                if context.future is None:
                    continue
                for kind, future in (
                    ("staged", context.future.staging_completion),
                    ("written", context.future.upload_completion),
                ):
                    future.add_done_callback(lambda _, key=f"{name}_{kind}": marks.setdefault(key, time.perf_counter()))

        def join_prestage(self, done: int) -> None:
            """Before the first save: the background preparation of its staging buffers is finished (it waits for
            what is left, counted in checkpoint_save_s), and on record."""
            prestage, self.prestage = self.prestage, None
            prestage.join()
            if prestage.error is not None:
                if self.dist_env.is_main:
                    _say(
                        f"warning: the checkpoint staging buffers could not be prepared ahead "
                        f"({_one_line(prestage.error)}); the first save allocates them"
                    )
                return
            self.staged_report = self.checkpointer.config.is_async
            if self.dist_env.is_main:
                _say(
                    f"checkpoint staging buffers ready: {prestage.bytes / 2**30:.2f} GiB of host memory "
                    f"({'pinned, ' if prestage.cuda else ''}shared) prepared in {prestage.seconds:.1f} s in the "
                    "background"
                )
                if self.metrics is not None:
                    self.metrics.log(
                        {
                            "step": done,
                            "checkpoint_prestage_s": prestage.seconds,
                            "checkpoint_prestage_gib": prestage.bytes / 2**30,
                        }
                    )

        def drop_failed_save(self, error: BaseException | None, replace_writer: bool) -> None:
            """A background save failed: report it, remove it, keep training (or stop after too many in a row).

            The save was never published (AutoModel's ``.incomplete`` marker), so nothing ever loads it; it is
            moved aside (one rename: never a half-deleted directory without its marker) and deleted, which gives
            a full disk its space back. The previous checkpoint stays the newest. A writer process that died is
            replaced on every rank (the others' processes share a gloo group with it).
            """
            lifecycle = self.checkpointer.lifecycle
            path = Path(lifecycle._pending_checkpoint_dir)
            for context in (self.checkpointer._model_ctx, self.checkpointer._optim_ctx):
                context.future, context.staging_active = None, False
            lifecycle._pending_checkpoint_dir = lifecycle._pending_best_checkpoint = None
            self.write_marks = None
            self.failed_in_row += 1
            self.failed_step = step = ckpt.step_of(path)
            self.failed_error = error
            reason = _one_line(error) if error is not None else "the write failed on another rank"
            # torch.save inside DCP's writer reports a full disk as "unexpected pos", without an errno: the disk
            # is looked at before the failed save is removed and gives its space back.
            self.failed_disk_full = (error is not None and _disk_full(error)) or _run_dir_full(config)
            if self.failed_disk_full and "No space left" not in reason:
                reason += " (no space left on the device holding the run directory)"
            if replace_writer:
                code = automodel_shim.writer_exit_code()
                died = f"died with exit code {code}" if code is not None else "died on another rank"
                reason += f" (the checkpoint writer process {died}; a new one is started)"
                self.writer_start = automodel_shim.replace_writer(self.checkpointer._model_ctx.process_group)
            if self.dist_env.is_main:
                if path in self.finisher.pending:
                    self.finisher.pending.remove(path)
                ckpt.remove_unpublished(path)
                saved = ckpt.saved_checkpoints(run_dir)
                newest = f"step {saved[-1].step} ({saved[-1].step_dir})" if saved else "none"
                _say(
                    f"warning: the checkpoint of step {step} was not saved: {reason}; training continues, the newest "
                    f"checkpoint is still {newest} ({self.failed_in_row} failed save(s) in a row, the run stops at "
                    f"{config.ckpt_max_failed_saves})"
                )
                if self.metrics is not None:
                    self.metrics.log(
                        {"step": step, "checkpoint_failed": reason, "checkpoint_failed_in_row": self.failed_in_row}
                    )
            if self.failed_in_row >= config.ckpt_max_failed_saves:
                raise CheckpointSaveError(
                    f"{self.failed_in_row} checkpoint saves in a row failed (the last, of step {step}: {reason}); "
                    "stopping: the newest complete checkpoint is kept, fix the storage and run again to resume",
                    disk_full=self.failed_disk_full,
                ) from error

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
            tokens_per_s = self.window_steps * tokens_per_step / max(now - self.window_start, 1e-9)
            record = {
                "step": done,
                "loss": _scalar(m["loss"]),
                "lr": self.step_lr,
                "tokens_per_s": tokens_per_s,
                "grad_norm": _scalar(m["grad_norm"]),
                "consumed_samples": done * config.global_batch_size,
            }
            if torch.cuda.is_available():
                if flops_per_token and peak:
                    # model FLOPs utilisation: the FLOPs the model needs per token x tokens/s over every GPU's peak
                    record["mfu"] = tokens_per_s * flops_per_token / (peak * self.dist_env.world_size)
                record["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            self.window_start, self.window_steps = now, 0
            if self.metrics is not None:
                self.metrics.log(record)
            super().log_train_metrics(log_data)  # W&B, AutoModel's own log; resets the peak-memory window
            if failpoints.at("train.pause_after_step", done):
                handler = self.step_scheduler.sig_handler
                deadline = time.monotonic() + 120
                while not handler._signal_received and time.monotonic() < deadline:
                    time.sleep(0.05)
                    self.publish_written_save()  # a save written meanwhile is published, as between steps

        def log_val_metrics(self, val_name, log_data, metric_logger=None):
            self.last_val_loss = _scalar(log_data.metrics["val_loss"])
            if self.metrics is not None and val_name == "default":
                self.metrics.log({"step": log_data.step + 1, "val_loss": self.last_val_loss})
            super().log_val_metrics(val_name, log_data, metric_logger)

        @phases.timed(phases.SAVE)
        def _finalize_and_close_checkpointer(self):
            started = time.perf_counter()
            self.publish_written_save(wait=True)  # the last save: published, or dropped as failed
            super()._finalize_and_close_checkpointer()  # closes the checkpointer
            done = self.step_scheduler.step
            if self.metrics is not None:
                self.metrics.log({"step": done, "checkpoint_finalize_s": time.perf_counter() - started})
            if self.failed_step is not None and self.failed_step == done:
                # Training ended (or a stop signal came) but its state is not on disk: the run did not do its job.
                saved = ckpt.saved_checkpoints(run_dir)
                raise CheckpointSaveError(
                    f"the last checkpoint (step {done}) was not saved; the newest complete checkpoint is "
                    f"{f'step {saved[-1].step}' if saved else 'none'}: run again to resume from it",
                    disk_full=self.failed_disk_full,
                ) from self.failed_error

        # -------------------------------------------------- checkpoints
        @phases.timed(phases.SAVE)
        def save_checkpoint(self, epoch, step, train_loss, val_loss=None, best_metric_key="default"):
            done = step + 1
            path = Path(self.checkpointer.config.checkpoint_dir) / f"epoch_{epoch}_step_{step}"
            if failpoints.at("train.crash_in_save_at_step", done):
                # Die inside AutoModel's save: weights written, optimizer not, checkpoint never published.
                def die(*args, **kwargs):
                    os.kill(os.getpid(), signal.SIGKILL)

                self.checkpointer.save_optimizer = die
            started = time.perf_counter()
            # The previous save's write, if still running, ends first: published, or dropped as failed (AutoModel's
            # own wait would raise its error and end the run).
            self.publish_written_save(wait=True)
            if self.prestage is not None:
                self.join_prestage(done)
            profile = os.environ.get("NEMOFLOW_PROFILE_SAVES")  # a directory: cProfile of each save's blocking part
            if profile:
                import cProfile

                profiler = cProfile.Profile()
                profiler.enable()
            super().save_checkpoint(epoch, step, train_loss, val_loss, best_metric_key)
            if profile:
                profiler.disable()
                Path(profile).mkdir(parents=True, exist_ok=True)
                profiler.dump_stats(f"{profile}/save-step{done}-rank{self.dist_env.rank}.prof")
            if self.dist_env.is_main:
                # The step directory is AutoModel's reserved (unpublished) directory until the save completes:
                # nemoflow's record goes in with it.
                val = (val_loss or {}).get("default")
                meta = checkpoint_meta(recorded, done, None if val is None else _scalar(val), _scalar(train_loss))
                meta["world_size"] = self.dist_env.world_size
                ckpt.write_text_atomic(path / ckpt.META, json.dumps(meta, indent=1, sort_keys=True, default=str))
            blocked = time.perf_counter() - started
            if self.checkpointer.config.is_async:
                self.mark_writes()
            if self.metrics is not None:
                # Time the training loop waited in the save itself (async: the previous save's write, if still
                # running, and the start of this one's copy to host memory); checkpoint_wait_s follows at the
                # next optimizer step.
                self.metrics.log({"step": done, "checkpoint_save_s": blocked})
            self.window_start += blocked  # tokens_per_s measures training steps only
            self.saved_step = done if self.checkpointer.config.is_async else None
            if failpoints.at("train.crash_after_save_at_step", done):
                os.kill(os.getpid(), signal.SIGKILL)
            if self.dist_env.is_main:
                self.finisher.pending.append(path)
                self.finisher.finish_published()

    recipe = NemoflowPretraining(ConfigNode(cfg))
    recipe.finisher = CheckpointFinisher(run_dir, config.save_top_k, is_checkpoint_incomplete, mirror)
    return recipe


# bf16 dense peak FLOP/s by GPU name (the datasheets' numbers without sparsity), for the logged MFU.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H20": 148e12, "A100": 312e12, "B200": 2250e12, "L40S": 362e12}


def peak_flops() -> float | None:
    """This GPU's bf16 dense peak, or None for a GPU the table does not know (MFU is then not logged)."""
    import torch

    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name.split()), None)


def model_flops_per_token(config: TrainConfig, vocab_size: int) -> float:
    """Training FLOPs per token: 6 x (active parameters without the input embedding) + 12 x layers x hidden x
    seq_length (attention scores), as Megatron and the PaLM paper count them; an MoE counts its top-k experts."""
    params = estimate_parameters(config, vocab_size)
    if config.experts:
        expert = 3 * config.hidden_size * config.ffn_hidden_size
        params -= config.num_layers * expert * (config.experts - config.moe_router_topk)
    dense = params - vocab_size * config.hidden_size
    return 6 * dense + 12 * config.num_layers * config.hidden_size * config.seq_length


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


_STDOUT = threading.Lock()


def _say(line: str) -> None:
    """One whole line on stdout, written at once under a lock: the checkpoint finisher's thread and the training
    loop print at the same time, and print() may write a line and its newline separately. (Hardening, not a
    proven fix: one loaded full run at 85194b4 never showed "saved checkpoint ..." at the start of a line for a
    save that was made; interleaved lines are a suspect, not reproduced.)"""
    with _STDOUT:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class CheckpointFinisher:
    """Rank 0: once AutoModel has published a checkpoint, prune to ``save_top_k`` and upload it (a remote
    run directory), in the background, in publication order (joined before the process exits)."""

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
        self.thread = threading.Thread(target=self._finish, args=(published,), name="nemoflow-finisher", daemon=True)
        self.thread.start()

    def _finish(self, paths: list[Path]) -> None:
        try:
            for path in paths:
                meta = ckpt.step_meta(path)
                _say(f"saved checkpoint {path} (step {meta.get('step')}, val_loss {meta.get('val_loss')})")
                if self.mirror is not None:
                    uri = self.mirror.push_checkpoint(path)
                    self.mirror.push_file("metrics.jsonl")
                    _say(f"uploaded checkpoint {uri}")
            self.prune()
            sys.stdout.flush()
        except BaseException as exc:  # noqa: BLE001 - reported by join() in the training thread
            self.error = exc

    def prune(self) -> None:
        saved = ckpt.saved_checkpoints(self.run_dir)
        protect = {saved[-1].step_dir} if saved else set()
        # Said before each deletion, not after: a job killed mid-prune never leaves a line calling it saved.
        ckpt.prune_checkpoints(
            self.run_dir,
            self.save_top_k,
            protect=protect,
            before_delete=lambda gone: _say(f"pruned checkpoint {gone} (save_top_k={self.save_top_k})"),
        )
        if self.mirror is not None:
            names = {saved[-1].step_dir.name} if saved else set()
            for gone in self.mirror.prune(self.save_top_k, protect=names):
                _say(f"pruned checkpoint {gone} (save_top_k={self.save_top_k})")

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def export_checkpoints(
    run_dir: Path, tokenizer_model: str | None, mirror: staging.RunMirror | None = None
) -> list[Path]:
    """Rank 0 after training: the Hugging Face export of the best and the last saved checkpoint, made by a
    separate process (workloads/consolidate.py: merging shards and hashing gigabytes is no work for the
    training process), then uploaded to a remote run directory (MANIFEST.json last)."""
    saved = ckpt.saved_checkpoints(run_dir)
    needed = [c.step_dir for c in ckpt.to_export(saved) if not c.exported]
    if needed:
        command = [sys.executable, "-m", "workloads.consolidate", *map(str, needed)]
        if tokenizer_model:
            command += ["--tokenizer-model", tokenizer_model]
        print(f"exporting {', '.join(p.name for p in needed)} as Hugging Face safetensors", flush=True)
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:  # through this process's stdout: rank-prefixed like every other line
            print(line, end="", flush=True)
        if proc.wait() != 0:
            raise ExportError(
                f"the export of {', '.join(map(str, needed))} failed (exit {proc.returncode}); the saved checkpoints "
                f"are intact: run python -m workloads.consolidate {run_dir} to export them"
            )
    exported = [c.consolidated for c in ckpt.to_export(saved)]
    if mirror is not None:
        for consolidated in exported:
            print(f"uploaded export {mirror.push_export(consolidated)}", flush=True)
    return exported


def upload_unsent(run_dir: Path, mirror: staging.RunMirror) -> None:
    """Rank 0 at start-up (remote run directory): upload the saved checkpoints newer than the newest remote one
    (a job that stopped between AutoModel's publication and the upload)."""
    remote = mirror.remote_steps()
    newest = tuple(int(x) for x in ckpt.STEP_DIR_RE.match(remote[-1]).groups()) if remote else (-1, -1)
    for saved in ckpt.saved_checkpoints(run_dir):
        if tuple(int(x) for x in ckpt.STEP_DIR_RE.match(saved.step_dir.name).groups()) > newest:
            print(f"uploaded checkpoint {mirror.push_checkpoint(saved.step_dir)} (saved before the last run stopped)")


def async_save_fits(config: TrainConfig, vocab_size: int, world_size: int, cuda: bool) -> tuple[bool, str | None]:
    """Whether this node has the host memory to stage asynchronous saves; (False, the warning line) if not.

    Staging holds a copy of each local rank's model and optimizer state in pinned, shared host memory for
    the whole run (bf16-mixed / fp32: fp32 weights and two fp32 AdamW moments, 12 bytes a parameter; bf16:
    6), divided over the ranks when FSDP2 shards it. The torch.distributed.checkpoint writer process reads it
    from shared memory (/dev/shm), which containers often keep small. Without the room, saves are synchronous
    (training waits for each write) instead of an out-of-memory kill.
    """
    if not config.ckpt_async_save:
        return False, None
    per_param = 6 if (cuda and config.precision == "bf16") else 12
    strategy = resolve_strategy(config, world_size, vocab_size)
    shards = world_size if (strategy == "fsdp2" and world_size > 1) else 1
    per_rank = estimate_parameters(config, vocab_size) * per_param / shards
    needed = per_rank * min(config.procs_per_node, world_size) * 1.1  # 10 % for DCP's metadata and buffers
    room = host_memory_available()
    if needed <= room:
        return True, None
    return False, (
        f"warning: asynchronous checkpoints need {needed / 2**30:.1f} GiB of host memory on this node (pinned, "
        f"shared: a copy of the model and optimizer state per local rank) but {room / 2**30:.1f} GiB is available "
        "(MemAvailable, the cgroup limit, free /dev/shm): saving synchronously (training waits for each save)"
    )


def host_memory_available(root: Path = Path("/")) -> float:
    """Bytes a staging copy may take: the least of MemAvailable, the cgroup's headroom (cgroup v2, or v1's memory
    controller) and /dev/shm's free space. ``root``: where /proc, /sys and /dev are (tests lay out a tree)."""
    limits = []
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limits.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    v2, v1 = root / "sys/fs/cgroup", root / "sys/fs/cgroup/memory"
    own_v2, own_v1 = _own_cgroups(root)
    candidates = []
    for base, own, limit_name, used_name in (
        (v2, own_v2, "memory.max", "memory.current"),
        (v1, own_v1, "memory.limit_in_bytes", "memory.usage_in_bytes"),
    ):
        # this process's own cgroup where the mount shows it (a host), else the mount's root (a container's)
        for directory in ([base / own.lstrip("/")] if own else []) + [base]:
            candidates.append((directory / limit_name, directory / used_name))
    for limit_file, used_file in candidates:
        try:
            limit = limit_file.read_text().strip()
            # "max" (v2) or a page-rounded 2**63 (v1): no limit
            if limit != "max" and int(limit) < 1 << 60:
                limits.append(int(limit) - int(used_file.read_text()))
                break
        except (OSError, ValueError):
            continue
    shm = root / "dev/shm"
    if shm.is_dir():
        limits.append(shutil.disk_usage(shm).free)
    return float(min(limits)) if limits else float("inf")


def _own_cgroups(root: Path) -> tuple[str | None, str | None]:
    """(cgroup v2 path, cgroup v1 memory-controller path) of this process, from /proc/self/cgroup."""
    v2 = v1 = None
    try:
        for line in (root / "proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                v2 = path
            elif "memory" in controllers.split(","):
                v1 = path
    except (OSError, ValueError):
        pass
    return v2, v1


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
        from infra.configs.memory_plan import check_memory

        check_memory(config, world_size=world_size)  # against gpu_memory_gib when the config states it
    phases.switch(phases.DATA)  # the run directory, the inputs staged in and checked
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
            upload_unsent(run_dir, mirror)

    phases.switch(phases.START)  # NeMo AutoModel's imports
    from workloads import automodel_shim

    automodel_shim.pin_ninja()  # the helper cached by the install is the one found (no rebuild)
    if not cuda:
        automodel_shim.apply()
    async_save, why_not = async_save_fits(config, vocab_size, world_size, cuda)
    if why_not and rank == 0:
        print(why_not, flush=True)
    if async_save:
        automodel_shim.keep_staging_buffers(cuda)
    automodel_shim.parallel_writes(config.ckpt_write_threads)
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
    cfg = recipe_config(config, run_dir, vocab_size, world_size, cuda, async_save)
    strategy = cfg["distributed"]["strategy"]
    autocast_bf16 = cuda and config.precision == "bf16-mixed" and (world_size == 1 or strategy == "ddp")
    flops = model_flops_per_token(config, vocab_size)
    recipe = build_recipe(config, run_dir, cfg, autocast_bf16, recorded, mirror, flops)
    phases.switch(phases.BUILD)
    recipe.setup()
    phases.switch(phases.BUILD)  # setup ends with the data loaders: what follows builds (compile, init_from)
    if async_save:
        recipe.writer_start = automodel_shim.start_checkpoint_process(recipe.checkpointer._model_ctx.process_group)
        weights = [p for part in recipe.model_parts for p in part.parameters()]
        recipe.prestage = automodel_shim.Prestage(recipe.checkpointer._model_ctx.stager, weights, cuda)
        if world_size > 1:
            recipe.agree_group = torch.distributed.new_group(backend="gloo")
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
            saved = ckpt.saved_checkpoints(run_dir)
            latest = saved[-1].step_dir if saved else None
            print(f"resuming from {latest} at step {resumed} (consumed_samples={resumed * config.global_batch_size})")
        elif config.init_from:
            print(f"initialised weights from {config.init_from} (reset_optimizer={config.reset_optimizer})")
        sys.stdout.flush()
    try:
        phases.switch(phases.DATA)  # the first batch
        recipe.run_train_validation_loop()
        phases.switch(phases.SAVE)  # the last saves published and uploaded, then the export
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
        writer_start = getattr(recipe, "writer_start", None)
        if writer_start is not None:
            # A run with nothing left to train ends before the writer process it started is up: the start's
            # thread then died at exit with a traceback after the run's last line (the export's error).
            writer_start.join(timeout=300)
        if recipe.metrics is not None:
            log_phases(
                recipe,
                config.num_nodes * (config.gpus_per_node if cuda else config.cpus_per_task),
                "GPU" if cuda else "CPU",
            )
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
        started = time.perf_counter()
        export_checkpoints(run_dir, config.tokenizer_model, mirror)
        best = ckpt.best_checkpoint(run_dir)
        print(
            f"done: {done} steps, best checkpoint {best.path if best else None} "
            f"(exported in {time.perf_counter() - started:.1f} s after training)",
            flush=True,
        )
    return 0


def log_phases(recipe, accelerators: int, unit: str) -> None:
    """Rank 0 at the end of training: this process's phase seconds and goodput (infra/phases.py) as one record
    in metrics.jsonl and in the W&B run's summary; the stage's gpu-time artifact adds the launch and export."""
    record = phases.summary(accelerators, unit)
    recipe.metrics.log({"step": recipe.step_scheduler.step, **record})
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.run.summary.update({"gpu_time": record})


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
    prefix_output_with_rank()
    config = None
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
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except CheckpointSaveError as exc:
        if exc.disk_full or _disk_full(exc) or _run_dir_full(config):
            print(f"error: {NO_SPACE}", file=sys.stderr, flush=True)
        else:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except BaseException as exc:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        if not (_disk_full(exc) or _run_dir_full(config)):
            raise
        # One line after the traceback: what happened and what to do (the incomplete save is never a checkpoint).
        print(f"error: {NO_SPACE} ({exc.__class__.__name__} while writing)", file=sys.stderr, flush=True)
        return 1
    finally:
        phases.write()  # the job's phase seconds for the stage's gpu-time artifact ($NEMOFLOW_PHASES_FILE)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


NO_SPACE = (
    "no space left on the device holding the run directory; the last complete checkpoint is kept: free space "
    "(or move run_dir) and run again to resume"
)


def _one_line(exc: BaseException) -> str:
    """An exception as one line for the log: its type and its message's first line (DCP's CheckpointException: the
    first failing rank's error)."""
    failures = getattr(exc, "failures", None) or {}
    for rank, failure in sorted(failures.items()):
        inner = failure[0] if isinstance(failure, tuple) else getattr(failure, "exception", failure)
        if isinstance(inner, BaseException):
            return f"rank {rank}: {_one_line(inner)}"
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def _run_dir_full(config: TrainConfig | None) -> bool:
    """The file system of a local run directory has (almost) no space left: a write that failed there failed for
    that reason, whatever the writer said (torch.save reports a full disk as "unexpected pos", no errno)."""
    if config is None or not config.run_dir or staging.is_remote(config.run_dir):
        return False
    path = Path(config.run_dir.removeprefix("file://"))
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free < 1 << 20
    except OSError:
        return False


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
