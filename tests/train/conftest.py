"""Area fixtures: a small prepared dataset (two Megatron indexed datasets and their blend).

Old Testament and New Testament chapters of the KJV, tokenized with Mixtral's
real sentencepiece model and written with megatron-core's IndexedDatasetBuilder,
exactly what the data stage produces (``{prefix}.bin/.idx``, EOD after each document).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The first 929 KJV chapters are the Old Testament.
OT_CHAPTERS = 929


def _write_indexed(prefix: Path, docs: list[str], sp) -> int:
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.uint16)
    tokens = 0
    for ids in sp.encode(docs):
        ids = ids + [sp.eos_id()]
        builder.add_document(torch.tensor(ids), [len(ids)])
        tokens += len(ids)
    builder.finalize(f"{prefix}.idx")
    return tokens


@pytest.fixture(scope="session")
def train_dataset(tmp_path_factory, kjv_chapters, mixtral_tokenizer_model):
    """{'blend': [0.7, ot_prefix, 0.3, nt_prefix], 'tokenizer_model': path, 'prefixes': [...], 'tokens': n}."""
    import sentencepiece

    root = tmp_path_factory.mktemp("dataset")
    sp = sentencepiece.SentencePieceProcessor(model_file=str(mixtral_tokenizer_model))
    ot, nt = root / "kjv_ot_text_document", root / "kjv_nt_text_document"
    tokens = _write_indexed(ot, kjv_chapters[:OT_CHAPTERS], sp) + _write_indexed(nt, kjv_chapters[OT_CHAPTERS:], sp)
    return {
        "blend": [0.7, str(ot), 0.3, str(nt)],
        "prefixes": [str(ot), str(nt)],
        "tokenizer_model": str(mixtral_tokenizer_model),
        "tokens": tokens,
        "documents": len(kjv_chapters),
    }


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
    )
    config.update(overrides)
    return config


def write_config(config: dict, path: Path) -> Path:
    path.write_text(json.dumps(config))
    return path


def trainer_env(**extra) -> dict:
    env = dict(os.environ)
    env.pop("WANDB_API_KEY", None)
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


def run_trainer(config_path: Path, timeout: float = 180, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "workloads.train", "--config", str(config_path)],
        cwd=REPO,
        env=trainer_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
