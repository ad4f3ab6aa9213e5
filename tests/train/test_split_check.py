"""A split that leaves a prefix without documents is refused before any dataset is built.

megatron-core's ``GPTDataset._get_num_epochs`` (and NeMo AutoModel's copy, which the trainer
uses) adds epochs of 0 tokens forever when a split of a prefix has no documents: a CPT refresh
whose new data was 4 shards of 4-5 long documents (split 98,1,1, so every validation share
rounds to nothing) hung at 100% CPU for good. These tests build that dataset for real.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.train.conftest import _write_indexed
from tests.train.helpers import REPO, run_trainer, tiny_config, write_config
from workloads.data_loader import check_splits, split_counts

pytestmark = pytest.mark.filterwarnings("ignore:.*Transformer Engine and Apex")


@pytest.fixture(scope="module")
def refresh_sized(tmp_path_factory, kjv_chapters, mixtral_tokenizer_model):
    """Four parts of 4, 5, 4 and 5 long documents (8 KJV chapters each), as a small nightly drop makes."""
    import sentencepiece

    root = tmp_path_factory.mktemp("refresh-sized")
    sp = sentencepiece.SentencePieceProcessor(model_file=str(mixtral_tokenizer_model))
    blend, start = [], 0
    for i, docs in enumerate((4, 5, 4, 5)):
        prefix = root / f"part-{i:05d}_text_document"
        texts = [" ".join(kjv_chapters[start + 8 * d : start + 8 * d + 8]) for d in range(docs)]
        start += 8 * docs
        _write_indexed(prefix, texts, sp)
        blend += [0.25, str(prefix)]
    empty = root / "empty_text_document"
    _write_indexed(empty, [], sp)
    return {"blend": blend, "tokenizer_model": str(mixtral_tokenizer_model), "empty": str(empty)}


def test_split_counts_are_megatrons(refresh_sized):
    """The counts are what megatron-core's builder cuts (its own split parser, its rounding)."""
    assert split_counts(4, "98,1,1") == [4, 0, 0]
    assert split_counts(5, "80,20,0") == [4, 1, None]
    assert split_counts(1000, "98/1/1") == [980, 10, 10]
    assert split_counts(3, "1,1,1") == [1, 1, 1]


def test_split_counts_equal_megatron_core_and_automodel_on_a_grid():
    """The arithmetic is ours (importing megatron.core for it put 3.1-3.6 s of imports in the trainer's "data
    loading" phase), so it is checked against both builders' own functions: megatron-core's (the validation job)
    and NeMo AutoModel's copy (the trainer)."""
    from megatron.core.datasets import blended_megatron_dataset_config as mcore
    from nemo_automodel.components.datasets.llm.megatron import gpt_dataset as automodel

    def theirs(module, sequences, split):
        matrix = module.convert_split_vector_to_split_matrix(module.parse_and_normalize_split(split))
        return [
            None if b is None else int(round(b[1] * float(sequences))) - int(round(b[0] * float(sequences)))
            for b in matrix
        ]

    splits = [
        "98,1,1",
        "99,1,0",
        "90,5,5",
        "80,20,0",
        "1,1,1",
        "969,30,1",
        "0.9,0.05,0.05",
        "7/2/1",
        "100",
        "50,50",
        "33,33,34",
        "1,98,1",
        "0,1,0",
        "949,50,1",
        "97.5,2,0.5",
    ]
    for split in splits:
        for sequences in (*range(0, 60), 99, 100, 101, 997, 1000, 12_345, 1_000_003):
            ours = split_counts(sequences, split)
            assert ours == theirs(mcore, sequences, split) == theirs(automodel, sequences, split), (split, sequences)


def test_the_split_check_leaves_megatron_core_unimported(refresh_sized):
    """The check runs in the trainer's "data loading" phase: an import there (megatron.core's, 3.1-3.6 s) is
    charged to data loading in the run's gpu-time artifact, though it is import time."""
    code = (
        "import sys; from workloads.data_loader import check_splits; "
        f"check_splits({refresh_sized['blend']!r}, '75,25,0', ('train', 'validation')); "
        "print(sorted(m for m in sys.modules if m.startswith('megatron')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_check_names_the_split_the_prefix_and_the_fixes(refresh_sized):
    blend = refresh_sized["blend"]
    with pytest.raises(ValueError) as info:
        check_splits(blend, "98,1,1", ("train", "validation"))
    message = str(info.value)
    assert message.startswith(
        f"split '98,1,1' leaves the validation split of {blend[1]} (4 document(s)) with no documents"
    )
    assert "valid_data_prefix" in message and "limit_val_batches=0" in message and "\n" not in message
    check_splits(blend, "98,1,1", ("train",))  # no validation built (limit_val_batches=0): nothing to refuse
    check_splits(blend, "75,25,0", ("train", "validation"))  # one validation document per part
    with pytest.raises(ValueError, match=r"leaves the test split of .*part-00000_text_document"):
        check_splits(blend, "50,25,1")  # megatron-core builds every split with a share
    with pytest.raises(ValueError, match=r"leaves the train split"):
        check_splits(blend, "1,98,1", ("train",))
    with pytest.raises(ValueError, match=rf"^valid_data_prefix prefix {refresh_sized['empty']} has no documents"):
        check_splits(blend, "98,1,1", ("train", "validation"), valid_data_prefix=[refresh_sized["empty"]])
    check_splits(blend, "98,1,1", ("train", "validation"), valid_data_prefix=[blend[1]])


@pytest.mark.slow
def test_trainer_fails_fast_instead_of_hanging(refresh_sized, tmp_path):
    """Before the check: no output for good (killed by the timeout here). Now: exit 2 and one line, at once."""
    config = write_config(tiny_config(refresh_sized, tmp_path / "run", max_steps=2), tmp_path / "run.json")
    started = time.monotonic()
    proc = run_trainer(config, timeout=120)
    took = time.monotonic() - started
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: split '98,1,1' leaves the validation split of {refresh_sized['blend'][1]} (4 document(s)) with no "
        "documents, and building its index would never finish: give the validation share more weight (each prefix "
        "needs at least one validation document), set valid_data_prefix to a separate validation set, or set "
        "limit_val_batches=0"
    ]
    assert took < 60, f"took {took:.0f}s"
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
    check = subprocess.run(
        [sys.executable, "-m", "workloads.train", "--config", str(config), "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 2 and "leaves the validation split" in check.stderr


@pytest.mark.slow
def test_megatron_core_reader_fails_fast_too(refresh_sized, tmp_path):
    """build_datasets (the checkpoint validator's reader) builds every split with a share, asked for or not."""
    code = (
        "import json, sys\n"
        "from workloads.data_loader import build_datasets\n"
        "d = json.loads(sys.argv[1])\n"
        "try:\n"
        "    build_datasets(d['blend'], d['tokenizer_model'], 64, 1, 16, 0, sys.argv[2])\n"
        "except ValueError as exc:\n"
        "    print(f'error: {exc}')\n"
    )
    import json

    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(refresh_sized), str(tmp_path / "cache")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert "error: split '98,1,1' leaves the validation split" in proc.stdout, proc.stderr[-2000:]
