"""What a run prints and records: rank-prefixed lines, metrics.jsonl, the phases' record, the MFU's FLOPs."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

from infra import phases
from infra.configs.train import TrainConfig, estimate_parameters
from workloads import checkpoint as ckpt
from workloads.train.launch import launch_world


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
        say(" ".join(f"{k}={_fmt(v)}" for k, v in record.items()))

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


def scalar(value):
    item = getattr(value, "item", None)
    return float(item()) if callable(item) else value


_STDOUT = threading.Lock()


def say(line: str) -> None:
    """One whole line on stdout, written at once under a lock: the checkpoint finisher's thread and the training
    loop print at the same time, and print() may write a line and its newline separately. (Hardening, not a
    proven fix: one loaded full run at 85194b4 never showed "saved checkpoint ..." at the start of a line for a
    save that was made; interleaved lines are a suspect, not reproduced.)"""
    with _STDOUT:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


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


def log_phases(recipe, accelerators: int, unit: str) -> None:
    """Rank 0 at the end of training: this process's phase seconds and goodput (infra/phases.py) as one record
    in metrics.jsonl and in the W&B run's summary; the stage's gpu-time artifact adds the launch and export."""
    record = phases.summary(accelerators, unit)
    recipe.metrics.log({"step": recipe.step_scheduler.step, **record})
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.run.summary.update({"gpu_time": record})


def finish_wandb() -> None:
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()
