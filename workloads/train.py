"""Pretrain (or continue pretraining) a small Llama / Mixtral on a prepared Megatron dataset.

    python -m workloads.train --config run.json

``run.json`` is a :class:`workloads.train_config.TrainConfig`. The model is a
transformers ``LlamaForCausalLM`` / ``MixtralForCausalLM`` with seeded random
weights; data comes from the NeMo blend through megatron-core's
``GPTDataset``; the loop below is the whole trainer: gradient accumulation,
AdamW, warmup + cosine schedule, gradient clipping, periodic validation and
checkpoints (see workloads/checkpoint.py for the layout).

Started again with the same ``run_dir`` it resumes from ``checkpoints/latest``:
weights, optimizer, step, consumed samples and RNG states, so the loss curve
continues exactly where an uninterrupted run would be (bit-identical on CPU).
SIGTERM / SIGUSR1 (Slurm pre-emption) save a checkpoint and exit 76.

Exit codes: 0 done, 2 bad configuration / missing data / unwritable run_dir,
75 out of memory, 76 stopped by a signal after saving.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import time
import warnings
from pathlib import Path

# megatron-core warns at import that Apex / Transformer Engine are absent; we use neither.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

import numpy as np  # noqa: E402 - after the warnings filter, which must precede megatron's import
import torch  # noqa: E402 - see numpy's import
import torch.nn.functional as F  # noqa: E402 - see numpy's import

from workloads import checkpoint as ckpt  # noqa: E402 - see numpy's import
from workloads.data_loader import DatasetMissingError, build_datasets, check_prefixes, get_batch  # noqa: E402 - see numpy's import
from workloads.train_config import (  # noqa: E402 - see numpy's import
    EXIT_OUT_OF_MEMORY,
    EXIT_PREEMPTED,
    ParallelismError,
    TrainConfig,
    check_parallelism,
    lr_at,
)

EXIT_BAD_CONFIG = 2
# Test hooks (no effect unless set): raise OOM at a step, pause after a step, die inside a save.
OOM_AT_STEP_ENV = "NEMOFLOW_TRAIN_TEST_OOM_AT_STEP"
PAUSE_AFTER_STEP_ENV = "NEMOFLOW_TRAIN_TEST_PAUSE_AFTER_STEP"
CRASH_IN_SAVE_ENV = "NEMOFLOW_TRAIN_TEST_CRASH_IN_SAVE_AT_STEP"


def build_model(config: TrainConfig, vocab_size: int, seed: int):
    """A randomly initialised (seeded) Llama or Mixtral of the configured size."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM
    from transformers.utils import logging as hf_logging

    # save_pretrained's progress bars would flood the Prefect log at every checkpoint.
    hf_logging.disable_progress_bar()

    common = dict(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.kv_heads,
        max_position_embeddings=config.seq_length,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    if config.arch == "mixtral":
        model_config = MixtralConfig(
            num_local_experts=config.experts, num_experts_per_tok=config.moe_router_topk, **common
        )
        return MixtralForCausalLM(model_config)
    return LlamaForCausalLM(LlamaConfig(**common))


def lm_loss(model, tokens, labels, loss_mask) -> torch.Tensor:
    """Mean next-token cross-entropy over unmasked positions (+ the MoE load-balancing loss)."""
    moe = hasattr(model.config, "num_local_experts")
    out = model(input_ids=tokens, output_router_logits=True) if moe else model(input_ids=tokens)
    per_token = F.cross_entropy(out.logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    loss = (per_token * loss_mask.flatten()).sum() / loss_mask.sum().clamp(min=1)
    if moe and model.training and out.aux_loss is not None:
        loss = loss + model.config.router_aux_loss_coef * out.aux_loss
    return loss


@torch.no_grad()
def evaluate(model, dataset, batches: int, batch_size: int, device, autocast) -> float:
    """Mean loss over the first ``batches`` batches of ``dataset``: the same samples every time."""
    was_training = model.training
    model.eval()
    losses = []
    for b in range(batches):
        tokens, labels, mask = (t.to(device) for t in get_batch(dataset, b * batch_size, batch_size))
        with autocast():
            losses.append(lm_loss(model, tokens, labels, mask).item())
    model.train(was_training)
    return sum(losses) / len(losses)


def make_optimizer(model, config: TrainConfig) -> torch.optim.AdamW:
    # Like NeMo: no weight decay on biases and norm weights (1-D tensors).
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
    )


def rng_states() -> dict:
    states = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class MetricsLog:
    """metrics.jsonl (one JSON object per line), stdout lines, and W&B when a key is set."""

    def __init__(self, run_dir: Path, config: TrainConfig, resume_step: int):
        self.path = run_dir / "metrics.jsonl"
        if self.path.exists():
            # A killed run may have logged steps past its last checkpoint; they are redone now.
            kept = [line for line in self.path.read_text().splitlines() if _step_of(line) <= resume_step]
            tmp = self.path.with_name(".tmp-metrics.jsonl")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.path)
        self.fh = open(self.path, "a", encoding="utf-8")
        self.wandb = _start_wandb(config, run_dir)

    def log(self, record: dict) -> None:
        self.fh.write(json.dumps(record) + "\n")
        self.fh.flush()
        print(" ".join(f"{k}={_fmt(v)}" for k, v in record.items()), flush=True)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        self.fh.close()
        if self.wandb is not None:
            self.wandb.finish()


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except ValueError:
        return 0


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def _start_wandb(config: TrainConfig, run_dir: Path):
    if not os.environ.get("WANDB_API_KEY"):
        return None
    try:
        import wandb
    except ImportError:
        print("warning: WANDB_API_KEY is set but wandb is not installed; metrics go to metrics.jsonl only", flush=True)
        return None
    import hashlib

    run_id = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]
    return wandb.init(
        project=os.environ.get("WANDB_PROJECT", "nemoflow"),
        name=run_dir.name,
        id=run_id,
        resume="allow",
        config=config.model_dump(exclude={"run_dir"}),
    )


class StopSignal:
    """SIGTERM / SIGUSR1 ask for a checkpoint and a clean exit at the next step boundary."""

    def __init__(self):
        self.signum: int | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def __bool__(self) -> bool:
        return self.signum is not None


def prepare_run_dir(config: TrainConfig) -> Path:
    if not config.run_dir:
        raise ValueError("run_dir is not set: where should checkpoints and metrics go?")
    if "://" in config.run_dir and not config.run_dir.startswith("file://"):
        raise ValueError(f"run_dir {config.run_dir} must be a local path or a shared volume mounted on the node")
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


def train(config: TrainConfig) -> int:
    # ---------------------------------------------------------------- checks before any compute
    cuda = torch.cuda.is_available()
    # The arithmetic is about the cluster the config describes; this process trains on one device.
    plan = check_parallelism(config)
    if not config.data_prefix or not config.tokenizer_model:
        raise ValueError("data_prefix and tokenizer_model must be set (the prepared dataset's blend and tokenizer)")
    run_dir = prepare_run_dir(config)
    check_prefixes(config.data_prefix)
    if config.valid_data_prefix:
        check_prefixes(config.valid_data_prefix)
    if config.init_from and not (Path(config.init_from) / "model.safetensors").is_file():
        raise FileNotFoundError(f"init_from {config.init_from} has no model.safetensors: not a checkpoint directory")
    (run_dir / "train_config.json").write_text(config.model_dump_json(indent=1))

    device = torch.device("cuda" if cuda else "cpu")
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else _no_autocast
    # This trainer is one process: it keeps the global batch by accumulating every micro batch itself.
    accumulation = config.global_batch_size // config.micro_batch_size
    total_steps = plan.total_steps
    samples_per_step = config.global_batch_size
    oom_at = int(os.environ.get(OOM_AT_STEP_ENV, "-1"))
    pause_after = int(os.environ.get(PAUSE_AFTER_STEP_ENV, "-1"))
    crash_at = int(os.environ.get(CRASH_IN_SAVE_ENV, "-1"))

    # ---------------------------------------------------------------- data
    datasets = build_datasets(
        config.data_prefix,
        config.tokenizer_model,
        config.seq_length,
        config.seed,
        train_samples=total_steps * samples_per_step,
        valid_samples=config.limit_val_batches * config.micro_batch_size,
        cache_dir=str(run_dir / "index-cache"),
        split=config.split,
        valid_data_prefix=config.valid_data_prefix,
    )
    vocab_size = config.vocab_size or datasets.tokenizer.vocab_size

    # ---------------------------------------------------------------- model, optimizer, resume
    model = build_model(config, vocab_size, config.seed).to(device)
    optimizer = make_optimizer(model, config)
    step, consumed_samples = 0, 0
    resume_from = ckpt.latest_checkpoint(run_dir)
    if resume_from is not None:
        ckpt.load_weights(model, resume_from)
        state = ckpt.load_trainer_state(resume_from)
        optimizer.load_state_dict(state["optimizer"])
        step, consumed_samples = state["step"], state["consumed_samples"]
        set_rng_states(state["rng"])
        print(f"resuming from {resume_from} at step {step} (consumed_samples={consumed_samples})", flush=True)
    elif config.init_from:
        ckpt.load_weights(model, config.init_from)
        if not config.reset_optimizer:
            optimizer.load_state_dict(ckpt.load_trainer_state(config.init_from)["optimizer"])
        print(f"initialised weights from {config.init_from} (reset_optimizer={config.reset_optimizer})", flush=True)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model {config.arch}: {params / 1e6:.2f}M parameters, device={device}, steps={total_steps}, "
        f"global_batch_size={config.global_batch_size} micro_batch_size={config.micro_batch_size} "
        f"accumulation={accumulation} seq_length={config.seq_length}",
        flush=True,
    )

    metrics = MetricsLog(run_dir, config, step)
    stop = StopSignal()
    val_loss: float | None = None
    last_val_step = -1

    def validate() -> float | None:
        nonlocal val_loss, last_val_step
        if datasets.valid is None or config.limit_val_batches == 0:
            return None
        if last_val_step != step:
            val_loss = evaluate(
                model, datasets.valid, config.limit_val_batches, config.micro_batch_size, device, autocast
            )
            last_val_step = step
            metrics.log({"step": step, "val_loss": val_loss})
        return val_loss

    def save(train_loss: float | None) -> Path:
        meta = {
            "step": step,
            "val_loss": validate(),
            "train_loss": train_loss,
            "consumed_samples": consumed_samples,
            "tokens_seen": consumed_samples * config.seq_length,
            "arch": config.arch,
            "data_prefix": config.data_prefix,
            "valid_data_prefix": config.valid_data_prefix,
            "split": config.split,
            "seq_length": config.seq_length,
            "micro_batch_size": config.micro_batch_size,
            "limit_val_batches": config.limit_val_batches,
            "seed": config.seed,
            "init_from": config.init_from,
        }
        state = {
            "optimizer": optimizer.state_dict(),
            "step": step,
            "consumed_samples": consumed_samples,
            "rng": rng_states(),
            "config": config.model_dump(),
        }
        hook = (lambda tmp: os.kill(os.getpid(), signal.SIGKILL)) if step == crash_at else None
        path = ckpt.save_checkpoint(run_dir, step, model, state, meta, config.tokenizer_model, crash_hook=hook)
        ckpt.prune_checkpoints(run_dir, config.save_top_k)
        print(f"saved checkpoint {path} (val_loss={meta['val_loss']})", flush=True)
        return path

    # ---------------------------------------------------------------- the loop
    model.train()
    train_loss = None
    t_last, tokens_since = time.perf_counter(), 0
    try:
        while step < total_steps:
            lr = lr_at(step, config)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = 0.0
            for micro in range(accumulation):
                if step + 1 == oom_at:
                    raise torch.OutOfMemoryError("simulated by " + OOM_AT_STEP_ENV)
                start = consumed_samples + micro * config.micro_batch_size
                tokens, labels, mask = (t.to(device) for t in get_batch(datasets.train, start, config.micro_batch_size))
                with autocast():
                    loss = lm_loss(model, tokens, labels, mask) / accumulation
                loss.backward()
                loss_sum += loss.item()
            if config.gradient_clip_val:
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.gradient_clip_val).item()
            else:
                grad_norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            consumed_samples += samples_per_step
            tokens_since += samples_per_step * config.seq_length
            train_loss = loss_sum
            if not math.isfinite(train_loss):
                print(f"loss is {train_loss} at step {step}: stopping (lower lr or check the data)", flush=True)
                return 1

            if step % config.log_every_n_steps == 0 or step == total_steps:
                now = time.perf_counter()
                metrics.log(
                    {
                        "step": step,
                        "loss": train_loss,
                        "lr": lr,
                        "tokens_per_s": tokens_since / max(now - t_last, 1e-9),
                        "grad_norm": grad_norm,
                        "consumed_samples": consumed_samples,
                    }
                )
                t_last, tokens_since = now, 0
            if step % config.val_check_interval == 0 or step == total_steps:
                validate()
            if step == pause_after:
                deadline = time.monotonic() + 120
                while not stop and time.monotonic() < deadline:
                    time.sleep(0.05)
            if step % config.ckpt_every_n_steps == 0 or step == total_steps:
                save(train_loss)
            elif stop:
                save(train_loss)
            if stop and step < total_steps:
                print(
                    f"received {signal.Signals(stop.signum).name}: checkpoint saved at step {step}, exiting", flush=True
                )
                return EXIT_PREEMPTED
    except (torch.OutOfMemoryError, MemoryError):
        print(
            f"out of memory at step {step + 1} with micro_batch_size={config.micro_batch_size}, "
            f"seq_length={config.seq_length}: lower micro_batch_size",
            flush=True,
        )
        return EXIT_OUT_OF_MEMORY
    finally:
        metrics.close()
    best = ckpt.best_checkpoint(run_dir)
    print(f"done: {step} steps, final loss {train_loss}, best checkpoint {best.path if best else None}", flush=True)
    return 0


class _no_autocast:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


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
    try:
        config = TrainConfig.model_validate_json(Path(args.config).read_text())
        if args.check:
            plan = check_parallelism(config)
            check_prefixes(config.data_prefix)
            print(json.dumps(plan.__dict__))
            return 0
        return train(config)
    except (ParallelismError, DatasetMissingError, PermissionError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_CONFIG
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
