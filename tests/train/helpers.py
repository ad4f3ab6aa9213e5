"""Helpers shared by the training tests (run the trainer as users do, read its metrics)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def bench_train_gpu():
    """benchmarks/bench_train_gpu.py as a module (a script, not a package): its save accounting, tested on what the
    trainer writes."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_train_gpu", REPO / "benchmarks" / "bench_train_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_config(dataset: dict, run_dir: Path, **overrides) -> dict:
    """A Llama small enough to train a few steps in seconds on 2 shared cores."""
    config = dict(
        arch="llama",
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        ffn_hidden_size=128,
        seq_length=64,
        global_batch_size=8,
        micro_batch_size=4,
        max_steps=12,
        lr=3e-3,
        min_lr=3e-4,
        warmup_steps=2,
        val_check_interval=4,
        limit_val_batches=2,
        ckpt_every_n_steps=4,
        save_top_k=2,
        log_every_n_steps=1,
        seed=1234,
        data_prefix=dataset["blend"],
        tokenizer_model=dataset["tokenizer_model"],
        run_dir=str(run_dir),
        ckpt_async_min_mib=0,  # the background writer, as a model of real size saves (these tests are about it)
    )
    config.update(overrides)
    return config


def write_config(config: dict, path: Path) -> Path:
    path.write_text(json.dumps(config))
    return path


def tiny_config_file(dataset: dict, run_dir: Path, path: Path, **overrides) -> Path:
    """:func:`tiny_config` written to ``path``: the file :func:`run_trainer` takes."""
    return write_config(tiny_config(dataset, run_dir, **overrides), path)


def trainer_env(**extra) -> dict:
    env = dict(os.environ)
    env.pop("WANDB_API_KEY", None)
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


def run_trainer(config_path: Path, timeout: float = 300, nproc: int = 1, **env) -> subprocess.CompletedProcess:
    """``python -m workloads.train``, or under ``torch.distributed.run --nproc-per-node nproc`` (gloo on CPU)."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return subprocess.run(
        [*launcher, "-m", "workloads.train", "--config", str(config_path)],
        cwd=REPO,
        env=trainer_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


TIMING_ONLY = (
    "checkpoint_save_s",
    "checkpoint_wait_s",
    "checkpoint_finalize_s",
    "checkpoint_prestage_s",
    "checkpoint_write_s",
    "phase_s",
)


def deterministic_part(metrics: list[dict]) -> list[dict]:
    """Metrics without wall-clock fields or records: these must match exactly between runs."""
    return [
        {k: v for k, v in m.items() if k != "tokens_per_s"} for m in metrics if not any(t in m for t in TIMING_ONLY)
    ]


def saved_steps(*outputs: str) -> dict[int, str]:
    """{step: "intact"} for the checkpoints the trainer's output says it saved and did not prune since (what
    existed before a fault; AutoModel names a step directory after the 0-based step: epoch_0_step_{N-1})."""
    import re

    saved = {}
    for line in "\n".join(outputs).splitlines():
        if match := re.search(r"saved checkpoint \S+ \(step (\d+)", line):
            saved[int(match.group(1))] = "intact"
        elif match := re.search(r"pruned checkpoint \S*epoch_\d+_step_(\d+)\b", line):
            saved.pop(int(match.group(1)) + 1, None)
    return saved


def checkpoints_now(run_dir: Path) -> dict[int, str]:
    """{step: "intact" | what is wrong} of the saved checkpoints on disk: every file torch.distributed.checkpoint's
    metadata names is there and long enough for the bytes it records, and a Hugging Face export, where one was
    made, matches the sha256 and size its MANIFEST.json recorded. With ``saved_steps`` before a fault, the fault
    table's ``Row.compare`` counts the checkpoints a fault damaged or removed as data lost."""
    from workloads import checkpoint as ckpt

    found = {}
    for info in ckpt.saved_checkpoints(run_dir):
        problems = dcp_problems(info.step_dir / "model") + dcp_problems(info.step_dir / "optim")
        if info.exported:
            problems += ckpt.verify_manifest(info.consolidated)
        found[info.step] = "; ".join(problems) or "intact"
    return found


def record_saves(row, run_dir: Path, *outputs: str) -> None:
    """The fault-ledger row's data check: the checkpoints the trainer's ``outputs`` said it saved, against those
    on disk in ``run_dir`` now."""
    row.compare(saved_steps(*outputs), checkpoints_now(run_dir))


def dcp_problems(path: Path) -> list[str]:
    """What is wrong with one torch.distributed.checkpoint directory: with a ``.metadata`` (AutoModel's optimizer
    state), every file it indexes is there and long enough for the bytes it records; without one (AutoModel
    writes the model as Hugging Face safetensors shards, their index in each file's header), every shard's
    header parses and its tensors' byte ranges fit in the file."""
    if not (path / ".metadata").exists():
        shards = sorted(path.glob("*.safetensors"))
        return (
            [f"{path.name}: no .metadata and no safetensors shards"]
            if not shards
            else [problem for shard in shards for problem in safetensors_problems(shard)]
        )
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any unreadable metadata is damage to report
        return [f"{path.name}/.metadata unreadable: {exc}"]
    problems = []
    for item in (metadata.storage_data or {}).values():
        file = path / item.relative_path
        if not file.is_file():
            problems.append(f"{path.name}/{item.relative_path}: missing")
        elif file.stat().st_size < item.offset + item.length:
            problems.append(f"{path.name}/{item.relative_path}: shorter than its recorded data")
    return sorted(set(problems))


def safetensors_problems(file: Path) -> list[str]:
    """A safetensors file's header (8-byte length, then JSON) parses and every tensor's data lies in the file."""
    import struct

    try:
        with open(file, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
    except (OSError, ValueError, struct.error) as exc:
        return [f"{file.name}: unreadable header ({exc})"]
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if file.stat().st_size < 8 + length + end:
        return [f"{file.name}: shorter than its tensors ({file.stat().st_size} < {8 + length + end} bytes)"]
    return []


def tensor_layout(path: Path) -> dict[str, tuple]:
    """Every tensor in the safetensors files of ``path``: its name, shape and dtype (not its values)."""
    from safetensors import safe_open

    found = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as fh:
            for key in fh.keys():
                tensor = fh.get_slice(key)
                found[key] = (tuple(tensor.get_shape()), tensor.get_dtype())
    return found
