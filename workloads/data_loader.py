"""Megatron indexed datasets read through megatron-core, as NeMo reads them.

``build_datasets`` hands the NeMo ``data_prefix`` blend to
``BlendedMegatronDatasetBuilder(GPTDataset, ...)``: the sample order is a
deterministic function of the seed, the split and the number of samples, so
sample ``i`` is the same sample in every run and a resumed run continues at
``consumed_samples``. Index files are cached under ``cache_dir``.

megatron-core's blended dataset asks torch.distributed for its rank, so a
1-rank gloo group (an in-memory store, no port) is started when none exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from infra.configs.train import parse_blend


class DatasetMissingError(FileNotFoundError):
    """A blend prefix lacks its .bin or .idx file."""


class SentencePieceInfo:
    """What a Megatron GPT dataset asks of a tokenizer, for megatron-core (eod, pad, vocab_size,
    unique_identifiers) and for NeMo AutoModel's copy (name_or_path, eos_token_id, pad_token_id).

    The data is already tokenized, so no text is ever encoded here; a real Hugging Face
    tokenizer built from the .model would also need a protobuf that AutoModel's CUDA
    kernels' dependencies (protobuf<7) and transformers' sentencepiece converter disagree on.
    """

    def __init__(self, model_path: str, **_ignored):
        import sentencepiece

        if not os.path.exists(model_path):
            raise FileNotFoundError(f"tokenizer model {model_path} does not exist")
        sp = sentencepiece.SentencePieceProcessor(model_file=model_path)
        self.vocab_size = sp.get_piece_size()
        self.eod = sp.eos_id()
        # Mixtral's model has no pad piece (-1): GPTDataset then masks nothing
        # by accident, and pads a short last sequence with -1 (mapped to 0 and masked).
        self.pad = sp.pad_id()
        self.bos = sp.bos_id()
        self.unique_identifiers = {"class": "SentencePieceInfo", "model": os.path.abspath(model_path)}
        self.name_or_path = os.path.abspath(model_path)

    @property
    def eos_token_id(self) -> int:
        return self.eod

    @property
    def pad_token_id(self) -> int:
        return self.pad

    @property
    def bos_token_id(self) -> int:
        return self.bos


def check_prefixes(blend: list) -> list[str]:
    """Every prefix's .bin and .idx must exist (a path, or a gs:// object); the error names the missing files."""
    from infra import storage

    prefixes, _ = parse_blend(blend)
    missing = [f"{p}{ext}" for p in prefixes for ext in (".bin", ".idx") if not storage.exists(f"{p}{ext}")]
    if missing:
        raise DatasetMissingError(
            "dataset files missing (a prefix names '{prefix}.bin' and '{prefix}.idx'): " + ", ".join(missing)
        )
    return prefixes


SPLIT_NAMES = ("train", "validation", "test")


def sequence_count(prefix: str) -> int:
    """Sequences in a Megatron ``.idx`` (its header only: a path or a gs:// object)."""
    from infra import storage

    with storage.open_read(prefix + ".idx") as fh:
        header = fh.read(34)
    if len(header) < 34 or header[:9] != b"MMIDIDX\x00\x00":
        raise ValueError(f"{prefix}.idx is not a Megatron index (bad magic or truncated header)")
    return int.from_bytes(header[18:26], "little")


def split_counts(sequences: int, split: str) -> list[int | None]:
    """Sequences of a prefix in each of Megatron's (train, validation, test) splits, exactly as
    megatron-core's ``BlendedMegatronDatasetBuilder`` (and NeMo AutoModel's copy) cut them
    (None: a split with no share, which is not built).

    Their arithmetic, written here rather than imported: importing megatron.core for these few lines made the
    trainer's "data loading" phase 3.1-3.6 s longer (2-core machine), time that is megatron.core's import, which
    NeMo AutoModel's own imports (megatron_fsdp) would otherwise pay in "process start and imports": the run's
    gpu-time artifact charged it to the wrong phase. tests/train/test_split_check.py checks the counts against
    both builders' own functions on a grid.
    The split string's numbers (any separator), padded to three with zeros, normalised in float64; a split's
    bounds are the running sums, and an empty share has none.

    >>> split_counts(5, "98,1,1"), split_counts(100, "98,1,1"), split_counts(5, "80,20,0")
    ([5, 0, 0], [98, 1, 1], [4, 1, None])
    """
    import re

    import numpy as np

    shares = [float(x) for x in re.findall(r"[.0-9]+", split)]
    shares += [0.0] * (len(SPLIT_NAMES) - len(shares))
    if len(shares) != len(SPLIT_NAMES) or any(x < 0.0 for x in shares):
        raise ValueError(f"split {split!r}: expected up to {len(SPLIT_NAMES)} non-negative shares, e.g. '98,1,1'")
    weights = np.array(shares, dtype=np.float64)
    shares = (weights / np.sum(weights)).tolist()
    ends = [0]
    for share in shares:
        ends.append(ends[-1] + share)
    counts: list[int | None] = []
    for low, high in zip(ends[:-1], ends[1:]):
        counts.append(None if high <= low else int(round(high * float(sequences))) - int(round(low * float(sequences))))
    return counts


SPLIT_FIXES = {
    "train": "give the train share more weight",
    "validation": "give the validation share more weight (each prefix needs at least one validation document), "
    "set valid_data_prefix to a separate validation set, or set limit_val_batches=0",
    "test": "give the test share more weight, or none (e.g. '90,10,0')",
}


def check_splits(
    data_prefix: list, split: str, splits: tuple[str, ...] = SPLIT_NAMES, valid_data_prefix: list | None = None
) -> None:
    """Refuse, before any dataset is built, a split that leaves a prefix without documents.

    A split of a prefix with no tokens makes megatron-core's ``GPTDataset._get_num_epochs``
    (and NeMo AutoModel's copy) loop forever at 100% CPU, even when no sample is asked of it:
    it adds epochs of 0 tokens until it reaches the tokens asked for. That is what a small
    refresh (4 shards of 4-5 long documents, split 98,1,1: every validation share rounds to 0
    documents) did. ``splits``: the splits that will be built (megatron-core builds every split
    with a share; AutoModel's MegatronPretraining only the one it is asked for).
    """
    prefixes, _ = parse_blend(data_prefix)
    if valid_data_prefix:
        # blend_per_split: each blend is read whole for its own split
        wanted = [("data_prefix", p, "train") for p in prefixes if "train" in splits]
        if "validation" in splits:
            wanted += [("valid_data_prefix", p, "validation") for p in parse_blend(valid_data_prefix)[0]]
        for blend, prefix, name in wanted:
            if sequence_count(prefix) == 0:
                raise ValueError(
                    f"{blend} prefix {prefix} has no documents, so the {name} data would be empty "
                    "(and building its index would never finish): tokenize non-empty data for it"
                )
        return
    for prefix in prefixes:
        total = sequence_count(prefix)
        counts = split_counts(total, split)
        for i, name in enumerate(SPLIT_NAMES):
            if name in splits and counts[i] == 0:
                raise ValueError(
                    f"split {split!r} leaves the {name} split of {prefix} ({total} document(s)) with no documents, "
                    f"and building its index would never finish: {SPLIT_FIXES[name]}"
                )


def ensure_process_group() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


@dataclass
class Datasets:
    train: object | None
    valid: object | None
    tokenizer: SentencePieceInfo


def build_datasets(
    data_prefix: list,
    tokenizer_model: str,
    seq_length: int,
    seed: int,
    train_samples: int,
    valid_samples: int,
    cache_dir: str,
    split: str = "98,1,1",
    valid_data_prefix: list | None = None,
) -> Datasets:
    """The train and validation datasets of a blend (validation = the split, or its own blend)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    check_prefixes(data_prefix)
    if valid_data_prefix:
        check_prefixes(valid_data_prefix)
    check_splits(data_prefix, split, valid_data_prefix=valid_data_prefix)
    ensure_process_group()
    tokenizer = SentencePieceInfo(tokenizer_model)
    os.makedirs(cache_dir, exist_ok=True)
    common = dict(
        random_seed=seed,
        sequence_length=seq_length,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        # A (seq x seq) mask per sample is waste: the model builds its own causal mask.
        create_attention_mask=False,
        path_to_cache=cache_dir,
        mid_level_dataset_surplus=0.005,
    )
    if valid_data_prefix:
        config = GPTDatasetConfig(blend_per_split=[_blend(data_prefix), _blend(valid_data_prefix), None], **common)
    else:
        config = GPTDatasetConfig(blend=_blend(data_prefix), split=split, **common)
    sizes = [train_samples, valid_samples, 0]
    import logging

    # megatron logs every index it builds at INFO: keep the trainer's output readable.
    logging.getLogger("megatron.core").setLevel(logging.WARNING)
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    if train_samples and train is None:
        raise ValueError(f"the split {split!r} leaves no training documents in {data_prefix}")
    if valid_samples and valid is None:
        raise ValueError(
            f"the split {split!r} leaves no validation documents in {data_prefix}; "
            "give the validation share a weight or set valid_data_prefix"
        )
    return Datasets(train=train, valid=valid, tokenizer=tokenizer)


def _blend(data_prefix: list) -> tuple[list[str], list[float] | None]:
    return parse_blend(data_prefix)


def get_batch(dataset, start: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Samples ``start .. start+batch_size-1`` stacked: (tokens, labels, loss_mask)."""
    samples = [dataset[start + i] for i in range(batch_size)]
    tokens = torch.stack([s["tokens"] for s in samples])
    labels = torch.stack([s["labels"] for s in samples])
    loss_mask = torch.stack([s["loss_mask"] for s in samples])
    return tokens, labels, loss_mask
