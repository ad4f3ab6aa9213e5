"""The training configuration, and the parallelism arithmetic checked before launch.

Field names follow NeMo / Megatron (``global_batch_size``, ``micro_batch_size``,
``tensor_model_parallel_size``, ``val_check_interval``, ``ckpt_every_n_steps``...)
so a NeMo user recognises them; workloads/train/recipe.py maps them onto NeMo AutoModel's
pretraining recipe config. An unknown key is an error that names it (a typo such as
``max_step`` must not train with defaults). This module imports no torch: Prefect
tasks import it to validate a config before they spend compute on it.

    python -m workloads.train --config run.json      # run.json = TrainConfig as JSON
    python -m torch.distributed.run --nproc-per-node 8 -m workloads.train --config run.json
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from infra.configs.moe import resolve_moe_impl
from infra.jobs import ExitCode

# The trainer's exit codes are the contract's (every backend reads them): 75 out of memory, 76 stopped
# by a pre-emption signal after saving a checkpoint (resubmit to resume), 2 a bad configuration.
EXIT_OUT_OF_MEMORY = ExitCode.OUT_OF_MEMORY
EXIT_PREEMPTED = ExitCode.PREEMPTED
EXIT_BAD_CONFIG = ExitCode.BAD_CONFIG


class RunLayout:
    """``procs_per_node`` and ``world_size`` of a run's config (a model with fields ``num_nodes``,
    ``gpus_per_node`` and ``nproc_per_node``): pretraining's and fine-tuning's alike."""

    @property
    def procs_per_node(self) -> int:
        """Training processes per node: one per GPU, or nproc_per_node (CPU: gloo processes)."""
        return self.nproc_per_node or self.gpus_per_node or 1

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.procs_per_node


class TrainConfig(BaseModel, RunLayout):
    """Everything one training run needs; serialised to ``<run_dir>/train_config.json``."""

    model_config = ConfigDict(extra="forbid")

    # ---- model (a small Llama or Mixtral built from a transformers config, random init)
    arch: Literal["llama", "mixtral"] = "llama"
    hidden_size: int = Field(256, ge=1)
    num_layers: int = Field(4, ge=1)
    num_attention_heads: int = Field(4, ge=1)
    num_key_value_heads: int | None = Field(None, ge=1, description="GQA groups; None = num_attention_heads")
    ffn_hidden_size: int = Field(1024, ge=1)
    num_moe_experts: int | None = Field(None, ge=1, description="mixtral only (default 4)")
    moe_router_topk: int = Field(2, ge=1)
    moe_impl: Literal["auto", "grouped", "hf"] = Field(
        "auto",
        description="mixtral only: grouped = NeMo AutoModel's MoE layers (torch._grouped_mm experts, expert "
        "parallel); hf = transformers' MixtralForCausalLM (experts in a loop, no expert parallel, no compile); "
        "auto = grouped. Either writes Hugging Face Mixtral checkpoints (infra/configs/moe.py)",
    )
    moe_aux_loss_coeff: float = Field(
        0.0, ge=0, description="mixtral, moe_impl grouped: load-balancing loss coefficient (NeMo name; 0 = off)"
    )
    vocab_size: int | None = Field(None, description="None = the tokenizer's vocabulary size")

    # ---- data
    data_prefix: list | None = Field(
        None, description="NeMo blend: [w1, 'prefix1', w2, 'prefix2', ...] or ['prefix'] (the pretrain task fills it)"
    )
    valid_data_prefix: list | None = Field(None, description="separate validation blend (else the split)")
    split: str = Field("98,1,1", description="train,validation,test proportions of each prefix's documents")
    tokenizer_model: str | None = Field(None, description="sentencepiece .model of the dataset (the task fills it)")
    seq_length: int = Field(256, description="tokens per sample")

    # ---- batch and length of training
    global_batch_size: int = Field(8, ge=1)
    micro_batch_size: int = Field(8, ge=1)
    max_steps: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1, description="token budget: steps = tokens // (gbs * seq_length)")

    # ---- optimiser and schedule
    lr: float = Field(3e-4, gt=0)
    min_lr: float = Field(3e-5, ge=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    weight_decay: float = Field(0.1, ge=0)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    gradient_clip_val: float | None = Field(1.0, description="max global grad norm; None disables clipping")

    # ---- validation, checkpoints, logs
    val_check_interval: int = Field(50, ge=1, description="validate every N steps")
    limit_val_batches: int = Field(4, ge=0, description="validation batches (the same fixed ones every time)")
    ckpt_every_n_steps: int = Field(50, ge=1)
    save_top_k: int = Field(3, description="keep the best k checkpoints by val_loss plus the latest; -1 = all")
    log_every_n_steps: int = Field(10, ge=1)
    seed: int = 1234
    run_dir: str | None = Field(None, description="output directory (local path or shared volume)")
    init_from: str | None = Field(None, description="checkpoint directory to continue pretraining from")
    reset_optimizer: bool = Field(True, description="with init_from: start a fresh optimizer and schedule")

    # ---- numerics and speed (NeMo AutoModel)
    precision: Literal["bf16-mixed", "bf16", "32"] = Field(
        "bf16-mixed",
        description="GPU numerics (NeMo names): bf16-mixed = bf16 compute, fp32 master weights and optimizer "
        "state; bf16 = bf16 weights too; 32 = fp32. CPU always trains in fp32",
    )
    enable_compile: bool = Field(False, description="torch.compile each decoder layer (AutoModel enable_compile)")
    activation_checkpointing: bool = Field(False, description="recompute activations in backward (saves memory)")
    ckpt_async_save: bool = Field(True, description="write checkpoints in the background (NeMo ckpt_async_save)")
    ckpt_async_min_mib: float = Field(
        256,
        ge=0,
        description="a model and optimizer state smaller than this (MiB a rank) is saved synchronously: its write takes "
        "well under a second, less than starting the background writer process (about 5 CPU-seconds of imports)",
    )
    ckpt_write_threads: int = Field(
        4,
        ge=1,
        le=64,
        description="files each rank writes in parallel per checkpoint save (torch.distributed.checkpoint's "
        "thread_count): one stream reaches about 60 % of a fast disk",
    )
    ckpt_max_failed_saves: int = Field(
        3,
        ge=1,
        description="a failed background save is reported and training continues (the previous checkpoint stays "
        "the newest); this many failed saves in a row stop the run",
    )
    ckpt_while_writing: Literal["wait", "skip", "replace"] = Field(
        "wait",
        description="a save due while the previous background save is still being written: wait for that write "
        "(every save happens; the loop stalls when saves come faster than the storage writes them), or skip this "
        "one (reported in metrics.jsonl and the run's artifact; saves then happen at the storage's pace, the "
        "newest checkpoint at most one write and one save interval old, and the loop never waits for a write), "
        "or replace: every save is first copied within the GPU's memory (one more copy of the model and optimizer "
        "state per GPU, checked before the run), so the loop waits neither for the copy to host memory nor for a "
        "write; a save due during a write waits in that copy and is written when the write ends, and a newer save "
        "replaces it (reported). The last step's save and a save on a signal are never skipped or replaced",
    )
    ckpt_snapshots: bool = Field(
        False,
        description="each save is a snapshot: AutoModel's save into host shared memory (/dev/shm, three slots of "
        "the state a rank), which the loop waits for (1.1B on an H200: 11 s a save, slower than the default "
        "asynchronous saves), then training goes on; a writer process of its own persists the newest snapshot at "
        "the storage's pace (one that arrives while another waits replaces it) and outlives a killed trainer. "
        "Needs the memory (checked before the run, else saves as without it) and one node",
    )
    strategy: Literal["auto", "fsdp2", "ddp"] = Field(
        "auto",
        description="data-parallel engine (NeMo / AutoModel distributed.strategy): ddp = a full replica per rank, "
        "gradients all-reduced; fsdp2 = weights, gradients and optimizer state sharded over the ranks; "
        "auto = ddp for a dense model of at most 500M parameters on one node without tensor/context parallel, "
        "else fsdp2 (the rule: infra.configs.train.resolve_strategy)",
    )

    # ---- where it runs (the arithmetic check, and how many processes torchrun starts)
    num_nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0, description="0 = CPU")
    nproc_per_node: int | None = Field(
        None, ge=1, description="processes per node (torchrun --nproc-per-node); None = gpus_per_node, or 1 on CPU"
    )
    tensor_model_parallel_size: int = Field(1, ge=1)
    pipeline_model_parallel_size: int = Field(1, ge=1)
    context_parallel_size: int = Field(1, ge=1)
    expert_model_parallel_size: int = Field(1, ge=1)
    gpu_memory_gib: float | None = Field(
        None,
        gt=0,
        description="memory of one GPU: the layout's memory per GPU is checked against it before launch "
        "(infra/configs/memory_plan.py); None = the executor's (Slurm preset, GKE accelerator label) where known",
    )
    cpus_per_task: int = Field(2, ge=1)
    mem: str | None = None
    time: str | None = Field(None, description="job time limit, sbatch syntax")

    @field_validator("split")
    @classmethod
    def _check_split(cls, value: str) -> str:
        parts = value.replace("/", ",").split(",")
        try:
            weights = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"split {value!r} must be comma-separated numbers like '98,1,1'") from None
        if len(weights) != 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"split {value!r} must be three non-negative numbers (train,validation,test)")
        return value

    @field_validator("data_prefix", "valid_data_prefix")
    @classmethod
    def _check_blend(cls, value: list | None) -> list | None:
        if value is not None:
            parse_blend(value)
        return value

    @model_validator(mode="after")
    def _check_length(self) -> TrainConfig:
        if (self.max_steps is None) == (self.max_tokens is None):
            raise ValueError("set exactly one of max_steps and max_tokens")
        return self

    @model_validator(mode="after")
    def _check_while_writing(self) -> TrainConfig:
        if self.ckpt_while_writing != "wait" and (not self.ckpt_async_save or self.ckpt_snapshots):
            other = "ckpt_async_save: false" if not self.ckpt_async_save else "ckpt_snapshots: true"
            what = {"skip": "skips", "replace": "keeps the newest"}[self.ckpt_while_writing]
            raise ValueError(
                f"ckpt_while_writing: {self.ckpt_while_writing} {what} a save while a background save is being "
                f"written; with {other} no save is written in the background: drop one of the two"
            )
        return self

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def experts(self) -> int | None:
        if self.arch != "mixtral":
            return None
        return self.num_moe_experts or 4

    @property
    def total_steps(self) -> int:
        """max_steps, or the token budget in steps (as NeMo computes it from a token count)."""
        if self.max_steps is not None:
            return self.max_steps
        return max(1, self.max_tokens // (self.global_batch_size * self.seq_length))


def load_train_config(text: str) -> TrainConfig:
    """A TrainConfig from JSON; a bad or unknown key raises ``ValueError`` with one line naming it.

    >>> load_train_config('{"max_step": 10}')
    Traceback (most recent call last):
    ...
    ValueError: unknown TrainConfig key 'max_step' (did you mean 'max_steps'?)
    """
    try:
        return TrainConfig.model_validate_json(text)
    except ValidationError as exc:
        raise ValueError(describe_validation_error(exc)) from None


def describe_validation_error(exc: ValidationError) -> str:
    """Pydantic's report as one line per problem, unknown keys named with the closest valid key."""
    unknown, other = [], []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"])
        if error["type"] == "extra_forbidden":
            unknown.append(where)
        elif error["type"] == "json_invalid":
            other.append(f"not valid JSON: {error['msg']}")
        else:
            other.append(f"{where or 'config'}: {error['msg']}")
    parts = []
    if unknown:
        unknown.sort()
        names = ", ".join(f"'{key}'" for key in unknown)
        hints = {
            key: match[0]
            for key in unknown
            if (match := difflib.get_close_matches(key, list(TrainConfig.model_fields), n=1, cutoff=0.6))
        }
        hint = ""
        if len(unknown) == 1 and hints:
            hint = f" (did you mean '{hints[unknown[0]]}'?)"
        elif hints:
            hint = " (did you mean " + ", ".join(f"'{v}' for '{k}'" for k, v in hints.items()) + "?)"
        parts.append(f"unknown TrainConfig key{'s' if len(unknown) > 1 else ''} {names}{hint}")
    parts += other
    return "; ".join(parts)


def parse_blend(blend: list) -> tuple[list[str], list[float] | None]:
    """A NeMo ``data_prefix`` into (prefixes, weights).

    >>> parse_blend([0.7, "/d/ot_text_document", 0.3, "/d/nt_text_document"])
    (['/d/ot_text_document', '/d/nt_text_document'], [0.7, 0.3])
    >>> parse_blend(["/d/all_text_document"])
    (['/d/all_text_document'], None)
    """
    if not blend:
        raise ValueError("data_prefix is empty; expected [weight, prefix, ...] or [prefix, ...]")
    if all(isinstance(item, str) and not _is_number(item) for item in blend):
        return [str(p) for p in blend], None
    if len(blend) % 2:
        raise ValueError(f"data_prefix {blend!r} has an odd length; expected [weight, prefix, weight, prefix, ...]")
    prefixes, weights = [], []
    for weight, prefix in zip(blend[0::2], blend[1::2]):
        if not _is_number(weight) or float(weight) < 0:
            raise ValueError(f"data_prefix weight {weight!r} (before {prefix!r}) is not a non-negative number")
        if not isinstance(prefix, str) or _is_number(prefix):
            raise ValueError(f"data_prefix entry {prefix!r} after weight {weight!r} is not a path prefix")
        prefixes.append(prefix)
        weights.append(float(weight))
    if sum(weights) <= 0:
        raise ValueError(f"data_prefix weights {weights} sum to zero")
    return prefixes, weights


def _is_number(value) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    try:
        float(value)
        return True
    except (TypeError, ValueError):
        return False


class ParallelismError(ValueError):
    """The sizes do not divide: the message names every broken rule and its numbers."""


@dataclass(frozen=True)
class ParallelPlan:
    world_size: int
    data_parallel_size: int
    gradient_accumulation_steps: int
    total_steps: int


def check_parallelism(config: TrainConfig, on_cpu: bool | None = None, world_size: int | None = None) -> ParallelPlan:
    """Check the Megatron parallelism arithmetic; raise naming each broken rule.

    world = num_nodes x processes per node (one per GPU; nproc_per_node gloo
    processes on CPU), or ``world_size`` when the launcher already knows it;
    world must split into tensor x pipeline x context parallel groups, the
    rest is data parallel; the global batch must be a whole number of micro
    batches on every data-parallel rank (the quotient is the gradient accumulation).
    Whether the layout fits the GPUs' memory is infra/configs/memory_plan.py's ``check_memory``.
    """
    cpu = config.gpus_per_node == 0 if on_cpu is None else on_cpu
    world = world_size or config.world_size
    tp, pp, cp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size, config.context_parallel_size
    ep = config.expert_model_parallel_size
    errors: list[str] = []
    model_parallel = tp * pp * cp
    if world % model_parallel:
        errors.append(
            f"world size {world} (num_nodes={config.num_nodes} x {config.procs_per_node} processes per node) is not "
            f"divisible by tensor({tp}) x pipeline({pp}) x context({cp}) parallel = {model_parallel}"
        )
        dp = max(1, world // model_parallel)
    else:
        dp = world // model_parallel
    per_step = config.micro_batch_size * dp
    if config.global_batch_size % per_step:
        errors.append(
            f"global_batch_size={config.global_batch_size} is not divisible by micro_batch_size"
            f"({config.micro_batch_size}) x data_parallel_size({dp}) = {per_step}"
        )
    if config.num_attention_heads % tp:
        errors.append(
            f"num_attention_heads={config.num_attention_heads} is not divisible by tensor_model_parallel_size={tp}"
        )
    if config.num_attention_heads % config.kv_heads:
        errors.append(
            f"num_attention_heads={config.num_attention_heads} is not divisible by "
            f"num_key_value_heads={config.kv_heads}"
        )
    elif config.kv_heads % tp and tp % config.kv_heads:
        errors.append(f"num_key_value_heads={config.kv_heads} and tensor_model_parallel_size={tp} do not divide")
    if config.hidden_size % config.num_attention_heads:
        errors.append(
            f"hidden_size={config.hidden_size} is not divisible by num_attention_heads={config.num_attention_heads}"
        )
    elif (config.hidden_size // config.num_attention_heads) % 2:
        errors.append(
            f"head size hidden_size/num_attention_heads = {config.hidden_size // config.num_attention_heads} "
            "is odd; rotary embeddings need an even head size"
        )
    if config.num_layers % pp:
        errors.append(f"num_layers={config.num_layers} is not divisible by pipeline_model_parallel_size={pp}")
    if config.seq_length <= 0:
        errors.append(f"seq_length={config.seq_length} must be positive")
    elif config.seq_length % (2 * cp) and cp > 1:
        errors.append(f"seq_length={config.seq_length} is not divisible by 2 x context_parallel_size({cp})")
    if config.experts is not None:
        if config.experts % ep:
            errors.append(f"num_moe_experts={config.experts} is not divisible by expert_model_parallel_size={ep}")
        if config.moe_router_topk > config.experts:
            errors.append(f"moe_router_topk={config.moe_router_topk} exceeds num_moe_experts={config.experts}")
        if (dp * cp) % ep:
            # AutoModel's MoE mesh: the expert-parallel groups are carved out of the data x context parallel ranks.
            errors.append(
                f"expert_model_parallel_size={ep} does not divide data_parallel_size({dp}) x "
                f"context_parallel_size({cp}) = {dp * cp} (world size {world} / tensor({tp}) x pipeline({pp}))"
            )
    elif ep != 1:
        errors.append(f"expert_model_parallel_size={ep} needs arch='mixtral' (a dense model has no experts)")
    errors += _engine_limits(config, cpu)
    if config.min_lr > config.lr:
        errors.append(f"min_lr={config.min_lr} is above lr={config.lr}")
    total = config.total_steps
    if config.warmup_steps > total:
        errors.append(f"warmup_steps={config.warmup_steps} exceeds the run's {total} steps")
    if errors:
        raise ParallelismError("invalid training configuration:\n  - " + "\n  - ".join(errors))
    return ParallelPlan(
        world_size=world,
        data_parallel_size=dp,
        gradient_accumulation_steps=config.global_batch_size // per_step,
        total_steps=total,
    )


# auto picks DDP up to this many parameters: a replica's training state under bf16-mixed (fp32 weights, fp32
# gradients, fp32 AdamW m and v: 16 bytes a parameter) is then at most 8 GB, a tenth of an 80 GB GPU.
DDP_AUTO_MAX_PARAMETERS = 500_000_000


def estimate_parameters(config: TrainConfig, vocab_size: int) -> int:
    """Parameters of the untied Llama / Mixtral TrainConfig describes (embeddings and output layer included)."""
    hidden, ffn = config.hidden_size, config.ffn_hidden_size
    head = hidden // config.num_attention_heads
    attention = 2 * hidden * hidden + 2 * hidden * config.kv_heads * head
    mlp = 3 * hidden * ffn * (config.experts or 1) + (hidden * config.experts if config.experts else 0)
    return 2 * vocab_size * hidden + config.num_layers * (attention + mlp + 2 * hidden) + hidden


def resolve_strategy(config: TrainConfig, world_size: int, vocab_size: int) -> Literal["fsdp2", "ddp"]:
    """The AutoModel ``distributed.strategy`` a run uses.

    * One process: ``fsdp2``, whatever ``strategy`` says. AutoModel wraps nothing on one rank with either
      strategy, but its DDP path then casts the weights to bf16 on a GPU (pure bf16, no fp32 master weights),
      while its FSDP2 path keeps them as ``precision`` asks (nemoflow adds bf16 autocast for bf16-mixed).
    * ``fsdp2`` / ``ddp``: as given (ddp refuses tensor / context parallel, see check_parallelism).
    * ``auto``: ``ddp`` when the model fits comfortably on one GPU and the run is one node of data parallel
      only: one node (``num_nodes == 1``), no tensor / context / expert parallel, a dense model (arch llama:
      with an MoE, experts that get no token leave parameters without gradients, which DDP must search for),
      and at most ``DDP_AUTO_MAX_PARAMETERS`` (500M) parameters. Otherwise ``fsdp2``.

    Why: measured on 2 x H200 (README, "Training on H200"), a 134M Llama with FSDP2 ran slower on two GPUs
    than on one (0.94x): its per-layer all-gathers and reduce-scatters are small, latency-bound collectives,
    while DDP's bucketed all-reduce overlaps the backward pass (the DDP reference loop: 1.88x). At 1.1B
    FSDP2 scaled like DDP (1.77x vs 1.79x) and shards the 16 bytes a parameter of training state, so larger
    models, several nodes and model parallelism keep FSDP2.
    """
    if world_size <= 1:
        return "fsdp2"
    if config.strategy != "auto":
        return config.strategy
    data_parallel_only = (
        config.tensor_model_parallel_size,
        config.context_parallel_size,
        config.expert_model_parallel_size,
        config.pipeline_model_parallel_size,
    ) == (1, 1, 1, 1)
    small = estimate_parameters(config, vocab_size) <= DDP_AUTO_MAX_PARAMETERS
    if config.num_nodes == 1 and data_parallel_only and config.arch == "llama" and small:
        return "ddp"
    return "fsdp2"


def _engine_limits(config: TrainConfig, cpu: bool) -> list[str]:
    """What the training engine (NeMo AutoModel 0.7, FSDP2) cannot run, each as one sentence with the fix."""
    errors = []
    tp, pp, cp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size, config.context_parallel_size
    ep = config.expert_model_parallel_size
    moe_impl = resolve_moe_impl(config.arch, config.moe_impl)
    errors += _moe_limits(config, moe_impl, cpu)
    if cpu and (tp, pp, cp) != (1, 1, 1):
        errors.append(
            f"tensor/pipeline/context parallel sizes ({tp}/{pp}/{cp}) need GPUs: on CPU only data parallel (and "
            "expert parallel, moe_impl 'grouped') runs (set gpus_per_node, or the sizes to 1)"
        )
        return errors
    if config.strategy == "ddp" and (tp > 1 or cp > 1 or ep > 1):
        errors.append(
            f"strategy='ddp' keeps a whole replica of the model on every rank, so it cannot run "
            f"tensor_model_parallel_size={tp} / context_parallel_size={cp} / expert_model_parallel_size={ep}; "
            "use strategy 'fsdp2' (or 'auto')"
        )
    if pp > 1:
        errors.append(
            f"pipeline_model_parallel_size={pp} is not supported by nemoflow's AutoModel trainer (AutoModel's pipeline "
            "schedule is not wired in); use tensor_model_parallel_size, context_parallel_size or more data parallel ranks"
        )
    if cp > 1 and config.arch == "mixtral":
        errors.append(
            f"context_parallel_size={cp} is not supported for arch='mixtral' by AutoModel 0.7 "
            "(its context parallel covers dense models); set it to 1"
        )
    return errors


def _moe_limits(config: TrainConfig, moe_impl: str | None, cpu: bool) -> list[str]:
    """The MoE implementations' limits (infra/configs/moe.py): what each cannot run, naming the field and the fix."""
    errors = []
    tp, ep = config.tensor_model_parallel_size, config.expert_model_parallel_size
    if moe_impl is None:
        if config.moe_impl != "auto":
            errors.append(f"moe_impl={config.moe_impl!r} needs arch='mixtral' (a dense model has no experts)")
        if config.moe_aux_loss_coeff:
            errors.append(f"moe_aux_loss_coeff={config.moe_aux_loss_coeff} needs arch='mixtral'")
        return errors
    if moe_impl == "hf":
        if ep > 1:
            errors.append(
                f"expert_model_parallel_size={ep} needs moe_impl 'grouped' (or 'auto'): the Hugging Face Mixtral "
                "(moe_impl='hf') has no expert parallelism, FSDP2 shards its experts instead; supported with "
                "moe_impl='hf': 1"
            )
        if config.enable_compile:
            errors.append(
                "enable_compile=true with moe_impl='hf' crashes in torch.compile (transformers' MoE grouped_mm "
                "fallback backward guards on a data-dependent size: GuardOnDataDependentSymNode); set "
                "enable_compile false, or moe_impl 'grouped' (or 'auto')"
            )
        if config.moe_aux_loss_coeff:
            errors.append(
                f"moe_aux_loss_coeff={config.moe_aux_loss_coeff} needs moe_impl 'grouped' (or 'auto'): the recipe "
                "computes the loss from the HF Mixtral's logits, which leaves its router loss out"
            )
        return errors
    # grouped: AutoModel's MoE layers (the MiniMax-M2 model, which declares no tensor parallelism)
    if tp > 1:
        errors.append(
            f"tensor_model_parallel_size={tp} is not supported with moe_impl='grouped': AutoModel 0.7's MoE model "
            "declares no tensor parallelism; shard with expert_model_parallel_size and data parallel ranks "
            "(FSDP2), or use moe_impl 'hf'; supported with moe_impl='grouped': 1"
        )
    if cpu and config.enable_compile:
        errors.append(
            "enable_compile=true with moe_impl='grouped' needs GPUs: torch.compile traces torch._grouped_mm for bf16 "
            "inputs only, and CPU trains in fp32; set enable_compile false on CPU"
        )
    if not cpu and config.precision == "32":
        errors.append(
            "precision='32' with moe_impl='grouped': torch._grouped_mm computes in bf16 only on GPUs; use precision "
            "'bf16-mixed' (fp32 master weights) or 'bf16', or moe_impl 'hf'"
        )
    unaligned = {
        name: value
        for name, value in (("hidden_size", config.hidden_size), ("ffn_hidden_size", config.ffn_hidden_size))
        if value % 8
    }
    if unaligned:
        sizes = ", ".join(f"{name}={value}" for name, value in unaligned.items())
        errors.append(
            f"{sizes} must be a multiple of 8 with moe_impl='grouped': torch._grouped_mm needs 16-byte aligned "
            "rows (8 bf16 values); round the size, or use moe_impl 'hf'"
        )
    return errors


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then cosine to min_lr or constant."""
    if config.warmup_steps and step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.lr_schedule == "constant":
        return config.lr
    total = config.total_steps
    decay_steps = max(1, total - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * progress))
