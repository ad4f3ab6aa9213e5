"""Supervised fine-tuning (SFT) of a checkpoint on chat data with NVIDIA NeMo AutoModel, and its check.

    python -m workloads.sft --config sft.json                  # fine-tune (one process: CPU demo, one GPU)
    python -m torch.distributed.run --nproc-per-node 8 -m workloads.sft --config sft.json
    python -m workloads.sft --config sft.json --validate OUT.json   # held-out loss vs the base, generations

``sft.json`` is an :class:`SftConfig` (infra/configs/sft.py). Training is AutoModel's fine-tuning recipe
(``TrainFinetuneRecipeForNextTokenPrediction``, the recipe of its ``llm_finetune`` examples), driven
as workloads/train/ drives it for pretraining: the model is loaded from ``init_from`` (a
checkpoint directory in the Hugging Face layout, the promoted model), the data is AutoModel's
``ChatDataset`` over the train JSONL (OpenAI ``messages``, workloads/chat_data.py), rendered with
:data:`CHAT_TEMPLATE` and masked so that only assistant tokens carry loss (AutoModel's
multi-turn assistant mask), FSDP2 / AdamW / schedule / checkpointing / resume are AutoModel's.

The tokenizer is the checkpoint's own sentencepiece model behind transformers'
``SentencePieceBackend``: token ids are exactly sentencepiece's (the ids the base model was
pretrained on); a converted "fast" tokenizer would differ on runs of whitespace, and
building one needs a protobuf this environment's pins exclude.

The checkpoint lands where pretraining puts its own (``<run_dir>/checkpoints/epoch_0_step_N/model/
consolidated``) with tokenizer.model, meta.json and MANIFEST.json (workloads/checkpoint.py), so
the validator, the inference server and the registry treat it like any other checkpoint.

``--validate`` writes a JSON report: the masked (assistant-only) loss of the fine-tuned and of
the base model on the held-out chat set (the same tokenization for both), and a generation
check: greedy answers to held-out prompts must say something and end their turn (emit ``</s>``),
and are compared with the references (exact-match rate, reported). ``passed`` needs the
fine-tuned loss below the base's and that answer rate at or above ``min_answer_rate``.

Exit codes: 0 done (a failed check is in the report, with --exit-zero), 1 a check failed,
2 bad configuration or data, 75 out of memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

from infra.configs.sft import CHAT_TEMPLATE, SftConfig, load_sft_config  # noqa: E402 - after the warnings filter
from infra.jobs import ExitCode  # noqa: E402 - after the warnings filter


# ----------------------------------------------------------------------------------------------- tokenizer
def chat_tokenizer(model_path: str, chat_template: str = CHAT_TEMPLATE, **_ignored):
    """A transformers tokenizer over a sentencepiece ``.model`` whose ids are sentencepiece's own.

    AutoModel's recipe instantiates it from the dataset config (``tokenizer: {_target_: ...}``).
    The model's pad piece is missing (Mixtral): padding uses ``</s>``, and padded positions carry
    no loss (the assistant mask and the attention mask exclude them).
    """
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    if not os.path.isfile(model_path):
        raise FileNotFoundError(f"tokenizer model {model_path} does not exist")
    tokenizer = SentencePieceBackend(
        vocab_file=model_path, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    tokenizer.chat_template = chat_template
    tokenizer.name_or_path = os.path.dirname(os.path.abspath(model_path))
    return tokenizer


# ----------------------------------------------------------------------------------------------- the recipe
def recipe_config(config: SftConfig, run_dir: Path, cuda: bool, world_size: int) -> dict:
    """SftConfig as NeMo AutoModel's fine-tuning recipe config (what its llm_finetune YAML files hold)."""
    from workloads.train.recipe import checkpoint_section, lr_scheduler, mixed_precision_policy, step_scheduler

    weights_dtype, compute_dtype = ("float32", "float32")
    if cuda and config.precision == "bf16":
        weights_dtype, compute_dtype = "bfloat16", "bfloat16"
    elif cuda and config.precision == "bf16-mixed":
        compute_dtype = "bfloat16"
    tokenizer = {"_target_": "workloads.sft.chat_tokenizer", "model_path": config.tokenizer_path}

    def dataset(path: str) -> dict:
        return {
            "_target_": "nemo_automodel.components.datasets.llm.chat_dataset.ChatDataset",
            "path_or_dataset_id": path,
            "seq_length": config.seq_length,
            "truncation": True,
            "chat_template": config.chat_template,
            "tokenizer": tokenizer,
        }

    total = config.max_steps
    cfg: dict = {
        "seed": config.seed,
        "dist_env": {"backend": "nccl" if cuda else "gloo", "timeout_minutes": 10},
        "model": {
            "_target_": "nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained",
            "pretrained_model_name_or_path": config.init_from,
            "torch_dtype": weights_dtype,
        },
        "dataset": dataset(config.train_data),
        "dataloader": {"shuffle": True},
        "validation_dataset": dataset(config.valid_data),
        "validation_dataloader": {"shuffle": False},
        # the data is small: as many passes as the steps need
        "step_scheduler": step_scheduler(
            config, total, num_epochs=1000, ckpt_every_steps=config.ckpt_every_n_steps or total
        ),
        "checkpoint": checkpoint_section(run_dir, consolidated="every", is_async=False),
        "distributed": {
            "strategy": "fsdp2",
            "dp_size": None,
            "tp_size": 1,
            "cp_size": 1,
            "sequence_parallel": False,
            "mp_policy": mixed_precision_policy(compute_dtype),
        },
        "loss_fn": {"_target_": "nemo_automodel.components.loss.masked_ce.MaskedCrossEntropy"},
        "optimizer": {
            "_target_": "torch.optim.AdamW",
            "lr": config.lr,
            "betas": [0.9, 0.95],
            "weight_decay": config.weight_decay,
            "eps": 1e-8,
        },
        "lr_scheduler": lr_scheduler(config, total),
        "clip_grad_norm": {"max_norm": config.gradient_clip_val},
    }
    if os.environ.get("WANDB_API_KEY"):
        import hashlib

        cfg["wandb"] = {
            "project": os.environ.get("WANDB_PROJECT", "nemoflow"),
            "name": run_dir.name,
            "id": hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12],
            "resume": "allow",
            "dir": str(run_dir),
        }
    return cfg


def build_recipe(config: SftConfig, run_dir: Path, cfg: dict):
    """AutoModel's fine-tuning recipe with nemoflow's metrics.jsonl and checkpoint completion."""
    from nemo_automodel.components.config.loader import ConfigNode
    from nemo_automodel.recipes.llm.train_ft import TrainFinetuneRecipeForNextTokenPrediction

    from workloads import checkpoint as ckpt
    from workloads.train.output import MetricsLog, scalar

    class NemoflowFinetune(TrainFinetuneRecipeForNextTokenPrediction):
        metrics: MetricsLog | None = None

        def _make_progress_bar(self, *args, **kwargs):
            return None

        def start_metrics(self) -> None:
            if self.dist_env.is_main:
                self.metrics = MetricsLog(run_dir, self.step_scheduler.step)

        def log_train_metrics(self, log_data):
            done = log_data.step + 1
            if self.metrics is not None and (done % config.log_every_n_steps == 0 or done == config.max_steps):
                m = log_data.metrics
                self.metrics.log(
                    {
                        "step": done,
                        "loss": scalar(m["loss"]),
                        "grad_norm": scalar(m["grad_norm"]),
                        "lr": scalar(m.get("lr", 0.0)),
                    }
                )
            super().log_train_metrics(log_data)

        def log_val_metrics(self, val_name, log_data, metric_logger=None):
            if self.metrics is not None and val_name == "default":
                self.metrics.log({"step": log_data.step + 1, "val_loss": scalar(log_data.metrics["val_loss"])})
            super().log_val_metrics(val_name, log_data, metric_logger)

        def save_checkpoint(self, epoch, step, train_loss, val_loss=None, best_metric_key="default"):
            super().save_checkpoint(epoch, step, train_loss, val_loss, best_metric_key)
            if not self.dist_env.is_main:
                return
            path = Path(self.checkpointer.config.checkpoint_dir) / f"epoch_{epoch}_step_{step}"
            consolidated = ckpt.consolidated_dir(path)
            val = (val_loss or {}).get("default")
            meta = {
                "step": step + 1,
                "val_loss": None if val is None else scalar(val),
                "train_loss": scalar(train_loss),
                "kind": "sft",
                "init_from": config.init_from,
                "train_data": config.train_data,
                "valid_data": config.valid_data,
                "seq_length": config.seq_length,
                "seed": config.seed,
                "chat_template": config.chat_template,
                "engine": "nemo-automodel",
            }
            ckpt.write_meta(consolidated, meta, config.tokenizer_path)
            ckpt.name_architecture(consolidated)
            ckpt.write_manifest(consolidated)
            print(f"saved checkpoint {consolidated} (step {step + 1})", flush=True)

    return NemoflowFinetune(ConfigNode(cfg))


def check_inputs(config: SftConfig) -> None:
    missing = [name for name in ("init_from", "train_data", "valid_data") if not getattr(config, name)]
    if missing:
        raise ValueError(
            f"{', '.join(missing)} not set: the base checkpoint and the chat data (the sft stage fills them)"
        )


def prepare_run_dir(run_dir: str | None) -> Path:
    """The run directory, created and checked writable (an unwritable one is a configuration error)."""
    if not run_dir:
        raise ValueError("run_dir is not set: where should checkpoints and metrics go?")
    path = Path(run_dir.removeprefix("file://"))
    probe = path / "checkpoints" / f".tmp-probe-{os.getpid()}"
    try:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise PermissionError(f"run_dir {path} is not writable ({exc.strerror or exc})") from None
    return path


def train(config: SftConfig) -> int:
    from workloads.train.launch import launch_world

    rank, _, world_size = launch_world()
    check_inputs(config)
    for path, what in (
        (config.init_from, "init_from"),
        (config.train_data, "train_data"),
        (config.valid_data, "valid_data"),
    ):
        if not os.path.exists(path):
            raise FileNotFoundError(f"{what} {path} does not exist")
    if not (Path(config.init_from) / "config.json").is_file():
        raise FileNotFoundError(f"init_from {config.init_from} has no config.json: not a checkpoint directory")
    if not os.path.isfile(config.tokenizer_path):
        raise FileNotFoundError(f"tokenizer model {config.tokenizer_path} does not exist (set tokenizer_model)")
    if world_size != config.world_size:
        raise ValueError(
            f"the configuration asks for {config.world_size} processes but {world_size} were started: launch with "
            f"python -m torch.distributed.run --nnodes {config.num_nodes} --nproc-per-node {config.procs_per_node}"
        )

    import torch

    cuda = torch.cuda.is_available() and config.gpus_per_node > 0
    run_dir = prepare_run_dir(config.run_dir)
    from workloads import checkpoint as ckpt

    if rank == 0:
        ckpt.write_text_atomic(run_dir / "sft_config.json", config.model_dump_json(indent=1))
    if not cuda:
        from workloads import automodel_shim

        automodel_shim.apply()
    os.environ.setdefault("LOGGING_LEVEL", str(30))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    recipe = build_recipe(config, run_dir, recipe_config(config, run_dir, cuda, world_size))
    recipe.setup()
    recipe.start_metrics()
    if rank == 0:
        from workloads.wandb_run import record_active_run

        record_active_run(run_dir)
        params = sum(p.numel() for p in recipe.model_parts[0].parameters())
        print(
            f"NeMo AutoModel SFT of {config.init_from}: {params / 1e6:.2f}M parameters, "
            f"{len(recipe.dataloader.dataset)} train conversations, steps={config.max_steps}, "
            f"global_batch_size={config.global_batch_size}, {'cuda' if cuda else 'cpu (gloo)'} x {world_size}",
            flush=True,
        )
    try:
        recipe.run_train_validation_loop()
    except (torch.OutOfMemoryError, MemoryError):
        print(f"out of memory: lower micro_batch_size ({config.micro_batch_size}) or seq_length", flush=True)
        return ExitCode.OUT_OF_MEMORY
    finally:
        if recipe.metrics is not None:
            recipe.metrics.close()
        from workloads.train.output import finish_wandb

        finish_wandb()
    if recipe.step_scheduler.sigterm_flag and recipe.step_scheduler.step < config.max_steps:
        return ExitCode.PREEMPTED
    if rank == 0:
        latest = ckpt.latest_checkpoint(run_dir)
        print(f"done: {recipe.step_scheduler.step} steps, checkpoint {latest.path if latest else None}", flush=True)
    return 0


# ----------------------------------------------------------------------------------------------- the check
def _encoded(config: SftConfig, path: str, limit: int) -> list[dict]:
    """The first ``limit`` conversations of ``path`` as AutoModel's ChatDataset tokenizes them for training."""
    from nemo_automodel.components.datasets.llm.chat_dataset import ChatDataset

    dataset = ChatDataset(
        path,
        chat_tokenizer(config.tokenizer_path, config.chat_template),
        seq_length=config.seq_length,
        truncation=True,
        chat_template=config.chat_template,
    )
    return [dataset[i] for i in range(min(limit, len(dataset)))]


def masked_loss(model, samples: list[dict]) -> float:
    """Mean next-token cross-entropy over the assistant tokens of ``samples`` (the SFT objective)."""
    import torch
    import torch.nn.functional as F

    device = next(model.parameters()).device
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for sample in samples:
            ids = torch.tensor([sample["input_ids"]], device=device)
            labels = torch.tensor([sample["labels"]], device=device)
            logits = model(input_ids=ids).logits.float()
            losses = F.cross_entropy(logits[0], labels[0], ignore_index=-100, reduction="sum")
            total += losses.item()
            count += int((labels[0] != -100).sum())
    if not count:
        raise ValueError("the held-out conversations have no assistant tokens to score")
    return total / count


def generate_answers(model, tokenizer, rows: list[dict], max_new_tokens: int, min_new_tokens: int = 1) -> list[dict]:
    """Greedy answers to the last user turn of each row (the conversation up to it)."""
    import torch

    device = next(model.parameters()).device
    out = []
    for row in rows:
        messages = row["messages"]
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompt_ids = tokenizer.apply_chat_template(messages[:last], tokenize=True, return_dict=False)
        if isinstance(prompt_ids, dict):
            prompt_ids = prompt_ids["input_ids"]
        ids = torch.tensor([list(prompt_ids)], device=device)
        with torch.no_grad():
            generated = model.generate(
                ids,
                max_new_tokens=max_new_tokens,
                min_new_tokens=min_new_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.eos_token_id,
            )[0, ids.shape[1] :].tolist()
        ended = tokenizer.eos_token_id in generated
        if ended:
            generated = generated[: generated.index(tokenizer.eos_token_id)]
        answer = tokenizer.decode(generated, skip_special_tokens=True).strip()
        out.append(
            {
                "prompt": messages[last - 1]["content"] if last else "",
                "reference": messages[last]["content"],
                "answer": answer,
                "ended_turn": ended,
                "answered": ended and bool(answer),
                "exact_match": answer == messages[last]["content"].strip(),
            }
        )
    return out


def validate(config: SftConfig, checkpoint: str) -> dict:
    """The report of ``--validate`` (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from workloads import chat_data
    from workloads import checkpoint as ckpt

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    problems = ckpt.verify_manifest(checkpoint)
    samples = _encoded(config, config.valid_data, config.eval_examples)
    base = AutoModelForCausalLM.from_pretrained(config.init_from, dtype=torch.float32).to(device)
    base_loss = masked_loss(base, samples)
    del base
    tuned = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(device)
    tuned_loss = masked_loss(tuned, samples)
    rows = chat_data.read_jsonl(config.valid_data)[: config.generation_examples]
    tokenizer = chat_tokenizer(config.tokenizer_path, config.chat_template)
    generations = generate_answers(tuned, tokenizer, rows, config.max_new_tokens, config.min_new_tokens)
    answered = sum(g["answered"] for g in generations) / len(generations) if generations else 1.0
    exact = sum(g["exact_match"] for g in generations) / len(generations) if generations else 0.0
    checks = [
        {
            "name": "files_complete",
            "passed": not problems,
            "detail": "; ".join(problems) if problems else "every file of MANIFEST.json, with its sha256",
        },
        {
            "name": "held_out_loss_below_base",
            "passed": tuned_loss < base_loss,
            "detail": f"assistant-token loss on {len(samples)} held-out conversations: fine-tuned {tuned_loss:.4f}, "
            f"base {base_loss:.4f}",
        },
        {
            "name": "generation_answers",
            "passed": answered >= config.min_answer_rate,
            "detail": f"{answered:.0%} of {len(generations)} greedy answers were non-empty and ended with </s> "
            f"(need {config.min_answer_rate:.0%}); exact match {exact:.0%}",
        },
    ]
    return {
        "checkpoint": checkpoint,
        "base": config.init_from,
        "passed": all(c["passed"] for c in checks),
        "failed": [c["name"] for c in checks if not c["passed"]],
        "checks": checks,
        "held_out_loss": tuned_loss,
        "base_held_out_loss": base_loss,
        "held_out_examples": len(samples),
        "answer_rate": answered,
        "exact_match_rate": exact,
        "generations": generations,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workloads.sft", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="SftConfig as a JSON file")
    parser.add_argument("--validate", metavar="OUT", help="check a fine-tuned checkpoint; write the report to OUT")
    parser.add_argument("--checkpoint", help="with --validate: the checkpoint (default: the run's latest)")
    parser.add_argument("--exit-zero", action="store_true", help="with --validate: exit 0 when a check failed")
    args = parser.parse_args(argv)
    from workloads.train.output import prefix_output_with_rank

    prefix_output_with_rank()
    try:
        config = load_sft_config(Path(args.config).read_text())
        check_inputs(config)
        if args.validate:
            from workloads import checkpoint as ckpt

            checkpoint = args.checkpoint
            if checkpoint is None:
                latest = ckpt.latest_checkpoint(config.run_dir or "")
                if latest is None:
                    raise FileNotFoundError(f"{config.run_dir}/checkpoints holds no complete checkpoint")
                checkpoint = str(latest.path)
            report = validate(config, checkpoint)
            ckpt.write_text_atomic(Path(args.validate), json.dumps(report, indent=1))
            print(json.dumps({k: v for k, v in report.items() if k != "generations"}, indent=1), flush=True)
            return 0 if report["passed"] or args.exit_zero else 1
        return train(config)
    except (PermissionError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return ExitCode.BAD_CONFIG
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
