"""A :class:`TrainConfig` as NeMo AutoModel's pretraining recipe config (the dict its YAML files hold); the
sections SFT shares (workloads/sft.py)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from infra.configs.moe import backend_config as moe_backend_config
from infra.configs.moe import resolve_moe_impl
from infra.configs.train import TrainConfig, parse_blend, resolve_strategy
from workloads import checkpoint as ckpt
from workloads import staging

MIXED_PRECISION = "torch.distributed.fsdp.MixedPrecisionPolicy"


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


def served_config(config: TrainConfig, vocab_size: int, cuda: bool) -> dict:
    """The ``config.json`` a server can start on before the run exists (``serve.start_early``): the fields the model's
    transformers config is built from here (``hf_model_config``), its model type and architecture (named as
    workloads/consolidate.py names it in the export) and its weights' dtype. The export's config.json holds the same
    config in full (every field of transformers' defaults besides); transformers, which vLLM reads either with,
    fills in the same defaults. Built without importing transformers (and torch with it: 10-15 s on the H200 node,
    which delayed the early server's start and every cached re-run at f0aa6d9)."""
    node = hf_model_config(config, vocab_size)
    target = node.pop("_target_").rsplit(".", 1)[-1]  # transformers.LlamaConfig
    model_type = target.removesuffix("Config").lower()
    return {
        **node,
        "architectures": node.get("architectures") or [target.replace("Config", "ForCausalLM")],
        "model_type": model_type,
        "dtype": _dtypes(config, cuda)[0],
    }


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
