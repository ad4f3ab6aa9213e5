"""Reference outputs built the way Megatron-LM's tools/preprocess_data.py builds them.

``megatron_reference`` follows preprocess_data.py's ``Encoder.encode`` + megatron-core's
``IndexedDatasetBuilder`` step by step: per key, a string is one sentence and a
list is several; empty sentences are dropped; with append_eod the EOD id goes
after the last sentence of a document that has tokens; every record is one
``add_document``. ``legacy_gpt2_encode`` is GPT-2 byte-level BPE in pure Python
(the algorithm of Megatron's former ``GPT2Tokenizer``), for a cross-check.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np


def megatron_reference(
    prefix: Path, records: list[dict], keys, encode, eod: int, vocab_size: int, append_eod: bool
) -> None:
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    builders = {
        key: IndexedDatasetBuilder(f"{prefix}_{key}_document.bin", dtype=DType.optimal_dtype(vocab_size))
        for key in keys
    }
    for record in records:
        for key in keys:
            text = record[key]
            sentences = text if isinstance(text, list) else [text]
            doc_ids, sentence_lens = [], []
            for sentence in sentences:
                ids = encode(sentence)
                if len(ids) > 0:
                    doc_ids.extend(ids)
                    sentence_lens.append(len(ids))
            if len(doc_ids) > 0 and append_eod:
                doc_ids.append(eod)
                sentence_lens[-1] += 1
            builders[key].add_document(doc_ids, sentence_lens)
    for key in keys:
        builders[key].finalize(f"{prefix}_{key}_document.idx")


def assert_same_files(ours: str, ref: str) -> None:
    for ext in (".bin", ".idx"):
        a, b = Path(ours + ext).read_bytes(), Path(str(ref) + ext).read_bytes()
        assert len(a) == len(b), f"{ext}: {len(a)} bytes vs reference {len(b)}"
        if a != b:
            first = next(i for i in range(len(a)) if a[i] != b[i])
            raise AssertionError(f"{ours}{ext} differs from the reference at byte {first}")


def _bytes_to_unicode() -> dict[int, str]:
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class LegacyGPT2:
    """GPT-2 BPE written from the algorithm (no special-token handling, like Megatron's old class)."""

    def __init__(self, vocab_file: Path, merges_file: Path) -> None:
        import regex

        self.encoder = json.loads(Path(vocab_file).read_text())
        lines = Path(merges_file).read_text(encoding="utf-8").split("\n")[1:]
        self.ranks = {tuple(line.split()): i for i, line in enumerate(lines) if line}
        self.b2u = _bytes_to_unicode()
        self.pat = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
        self.bpe = lru_cache(maxsize=None)(self._bpe)

    def _bpe(self, token: str) -> tuple[str, ...]:
        word = list(token)
        while len(word) > 1:
            pairs = [(self.ranks.get((word[i], word[i + 1]), float("inf")), i) for i in range(len(word) - 1)]
            rank, _ = min(pairs)
            if rank == float("inf"):
                break
            first, second = next((word[i], word[i + 1]) for r, i in pairs if r == rank)
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and word[i] == first and word[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        return tuple(word)

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in self.pat.findall(text):
            mapped = "".join(self.b2u[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[t] for t in self.bpe(mapped))
        return ids


def read_back(prefix: str) -> tuple[list[np.ndarray], np.ndarray]:
    """Sequences and document indices as megatron-core's IndexedDataset reads them."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)  # keep a reference while its arrays are in use (it unmaps on __del__)
    sequences = [np.array(ds[i]) for i in range(len(ds))]
    documents = np.array(ds.document_indices)
    del ds
    return sequences, documents
