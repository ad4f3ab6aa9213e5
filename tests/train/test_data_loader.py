"""Reading the blend through megatron-core: deterministic order, separate validation blends, clear errors."""

from __future__ import annotations

import pytest
import torch

from workloads.data_loader import DatasetMissingError, build_datasets, check_prefixes, get_batch

pytestmark = pytest.mark.filterwarnings("ignore:.*Transformer Engine and Apex")


def test_sample_order_is_a_function_of_the_seed(train_dataset, tmp_path):
    def first_batch(cache: str, seed: int) -> torch.Tensor:
        data = build_datasets(
            train_dataset["blend"],
            train_dataset["tokenizer_model"],
            64,
            seed,
            train_samples=16,
            valid_samples=4,
            cache_dir=str(tmp_path / cache),
        )
        return get_batch(data.train, 8, 4)[0]

    a, b = first_batch("a", 1234), first_batch("b", 1234)
    assert torch.equal(a, b)  # fresh index caches, same seed: the same samples (what resume relies on)
    assert not torch.equal(a, first_batch("c", 99))


def test_separate_validation_blend_reads_only_that_data(train_dataset, tmp_path, kjv_chapters):
    import sentencepiece

    ot, nt = train_dataset["prefixes"]
    data = build_datasets(
        [ot],
        train_dataset["tokenizer_model"],
        64,
        7,
        train_samples=8,
        valid_samples=8,
        cache_dir=str(tmp_path),
        valid_data_prefix=[1.0, nt],
    )
    sp = sentencepiece.SentencePieceProcessor(model_file=train_dataset["tokenizer_model"])
    nt_text = "\n".join(kjv_chapters[929:])
    tokens, labels, mask = get_batch(data.valid, 0, 8)
    assert torch.equal(tokens[:, 1:], labels[:, :-1]) and mask.shape == (8, 64)
    checked = 0
    for row in tokens:
        ids = [int(t) for t in row[8:40] if int(t) != sp.eos_id()]
        if len(ids) == len(row[8:40]):  # a window inside one chapter
            assert sp.decode(ids).strip() in nt_text
            checked += 1
    assert checked >= 4


def test_missing_prefix_names_both_files(train_dataset, tmp_path):
    with pytest.raises(DatasetMissingError) as err:
        check_prefixes([0.5, train_dataset["prefixes"][0], 0.5, str(tmp_path / "gone")])
    assert f"{tmp_path / 'gone'}.bin" in str(err.value) and f"{tmp_path / 'gone'}.idx" in str(err.value)
