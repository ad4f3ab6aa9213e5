"""Area fixtures: a small prepared dataset (two Megatron indexed datasets and their blend).

Old Testament and New Testament chapters of the KJV, tokenized with Mixtral's
real sentencepiece model and written with megatron-core's IndexedDatasetBuilder,
exactly what the data stage produces (``{prefix}.bin/.idx``, EOD after each document).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from tests.train.helpers import REPO, read_metrics, run_trainer, tiny_config, write_config

# megatron-core warns on import that Apex / Transformer Engine are absent: expected on CPU.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

# The first 929 KJV chapters are the Old Testament.
OT_CHAPTERS = 929
OT_SUBSET = 237


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
    # Genesis-Judges and the whole New Testament: real text, half the tokenizing time of the full Bible.
    ot_docs, nt_docs = kjv_chapters[:OT_SUBSET], kjv_chapters[OT_CHAPTERS:]
    tokens = _write_indexed(ot, ot_docs, sp) + _write_indexed(nt, nt_docs, sp)
    return {
        "blend": [0.7, str(ot), 0.3, str(nt)],
        "prefixes": [str(ot), str(nt)],
        "tokenizer_model": str(mixtral_tokenizer_model),
        "tokens": tokens,
        "documents": len(ot_docs) + len(nt_docs),
    }


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, train_dataset, fake_wandb):
    """One uninterrupted 12-step run (checkpoints at 4, 8, 12); tests compare against it."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    config = tiny_config(train_dataset, run_dir)
    # With the recording wandb stand-in importable but no WANDB_API_KEY: W&B must stay silent.
    proc = run_trainer(write_config(config, run_dir.parent / "config.json"), PYTHONPATH=fake_wandb["pythonpath"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {"run_dir": run_dir, "config": config, "metrics": read_metrics(run_dir), "stdout": proc.stdout}


@pytest.fixture(scope="session")
def fake_wandb(tmp_path_factory):
    """A stand-in ``wandb`` package that records every call (the real one would contact the service)."""
    root = tmp_path_factory.mktemp("fake-wandb")
    (root / "wandb").mkdir()
    calls = root / "calls.jsonl"
    # The surface NeMo AutoModel and the trainer use: init (with Settings), the module-level run and its summary,
    # log and finish.
    (root / "wandb" / "__init__.py").write_text(
        "import json, os\n"
        f"_LOG = {str(calls)!r}\n"
        "run = None\n"
        "def _rec(kind, **kw):\n"
        "    with open(_LOG, 'a') as fh: fh.write(json.dumps({'call': kind, 'pid': os.getpid(), **kw}) + '\\n')\n"
        "class Settings:\n"
        "    def __init__(self, **kw): pass\n"
        "class _Summary(dict):\n"
        "    def update(self, data): _rec('summary', keys=sorted(data)); super().update(data)\n"
        "class _Run:\n"
        "    url = 'wandb://stand-in'\n"
        "    def __init__(self): self.summary = _Summary()\n"
        "def init(**kw):\n"
        "    global run\n"
        "    _rec('init', project=kw.get('project'), id=kw.get('id'), key=os.environ.get('WANDB_API_KEY'))\n"
        "    run = _Run()\n"
        "    return run\n"
        "def log(data, step=None, **kw): _rec('log', step=step, keys=sorted(data))\n"
        "def finish(*a, **kw):\n"
        "    global run\n"
        "    _rec('finish')\n"
        "    run = None\n"
    )
    return {"pythonpath": f"{root}{os.pathsep}{REPO}", "calls": calls}
