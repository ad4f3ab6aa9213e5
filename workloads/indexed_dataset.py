"""A streaming writer for Megatron's indexed dataset (``.bin`` + ``.idx``).

The files are byte-identical to what megatron-core's ``IndexedDatasetBuilder``
writes (and so to Megatron-LM's ``tools/preprocess_data.py``), and they are read
by ``megatron.core.datasets.indexed_dataset.IndexedDataset``.

On-disk format (all integers little-endian)::

    PREFIX.bin   the token ids of every sequence, back to back, as DTYPE;
                 nothing else (no header, no separators)

    PREFIX.idx   offset  size        field
                 0       9           magic b"MMIDIDX\\x00\\x00"
                 9       8   u64     version, always 1
                 17      1   u8      DTYPE code (see DType below)
                 18      8   u64     S = number of sequences
                 26      8   u64     D = number of document indices (documents + 1)
                 34      4*S int32   length of each sequence, in tokens
                 ..      8*S int64   byte offset of each sequence in PREFIX.bin
                 ..      8*D int64   document indices: document i is sequences
                                     [doc[i], doc[i+1]); doc[0] is 0

A "sequence" is what one call to the tokenizer produced (the whole document,
or one sentence when the JSON value is a list of sentences). A document whose
text produced no tokens has no sequence at all but still adds an entry to the
document indices (an empty document), exactly as Megatron does.

The token dtype is uint16 when the tokenizer's vocabulary has fewer than
65,500 entries, int32 otherwise (megatron-core's ``DType.optimal_dtype``).

Crash safety: the ``.bin`` is streamed to a temporary name next to the final
one and only the index arrays (4 + 8 bytes per sequence, 8 per document) are
kept in memory. ``finalize`` writes the ``.idx`` under a temporary name too and
then renames the ``.bin`` first and the ``.idx`` last: a reader that finds the
``.idx`` finds a complete ``.bin`` beside it, and a crash leaves only
``.tmp-*`` files.
"""

from __future__ import annotations

import contextlib
import os
import struct
import uuid
from array import array
from enum import IntEnum

import numpy as np

from infra.permissions import secure_file

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# Vocabularies this small fit uint16; the margin below 65,536 is megatron-core's choice.
UINT16_VOCAB_LIMIT = 65500


class DType(IntEnum):
    """The dtype codes stored in byte 17 of the ``.idx`` (megatron-core's numbering)."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @property
    def numpy(self) -> np.dtype:
        return np.dtype(self.name)

    @classmethod
    def for_vocab_size(cls, vocab_size: int) -> DType:
        return cls.uint16 if vocab_size < UINT16_VOCAB_LIMIT else cls.int32


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


class IndexedDatasetWriter:
    """Write one ``PREFIX.bin/.idx`` pair incrementally.

    Use as a context manager: the files appear under their final names only
    when the block ends without an exception (then ``finalize`` has run);
    otherwise the temporary files are removed.
    """

    def __init__(self, prefix: str, dtype: DType, buffer_size: int = 8 << 20) -> None:
        self.prefix = prefix
        self.dtype = DType(dtype)
        self._np_dtype = self.dtype.numpy
        directory, name = os.path.split(os.path.abspath(prefix))
        tag = uuid.uuid4().hex[:12]
        self._tmp_bin = os.path.join(directory, f".tmp-{tag}-{name}.bin")
        self._tmp_idx = os.path.join(directory, f".tmp-{tag}-{name}.idx")
        self._bin = open(self._tmp_bin, "wb", buffering=buffer_size)
        # Compact typed arrays: 4 bytes per sequence length, 8 per document index.
        self._lengths = array("i")
        self._doc_index = array("q", [0])
        self.tokens = 0
        self.prepared = False
        self.finalized = False

    @property
    def documents(self) -> int:
        return len(self._doc_index) - 1

    @property
    def sequences(self) -> int:
        return len(self._lengths)

    def add_documents(self, tokens: np.ndarray, seq_lengths: np.ndarray, seqs_per_doc: np.ndarray) -> None:
        """Append a batch of documents.

        ``tokens``: every token of the batch, concatenated; ``seq_lengths``: the
        length of each non-empty sequence, in order (they sum to ``tokens.size``);
        ``seqs_per_doc``: how many of those sequences each document has (0 for an
        empty document).
        """
        if tokens.size:
            if tokens.dtype != self._np_dtype:
                tokens = tokens.astype(self._np_dtype)
            self._bin.write(memoryview(np.ascontiguousarray(tokens)).cast("B"))
        self.tokens += int(tokens.size)
        base = len(self._lengths)
        self._lengths.frombytes(np.asarray(seq_lengths, dtype=np.int32).tobytes())
        ends = base + np.cumsum(np.asarray(seqs_per_doc, dtype=np.int64))
        self._doc_index.frombytes(ends.astype(np.int64).tobytes())

    def prepare(self) -> None:
        """Finish the ``.bin`` and write the ``.idx``, both still under temporary names."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self._np_dtype.itemsize, out=pointers[1:])
        with open(self._tmp_idx, "wb") as fh:
            fh.write(INDEX_MAGIC)
            fh.write(struct.pack("<Q", INDEX_VERSION))
            fh.write(struct.pack("<B", int(self.dtype)))
            fh.write(struct.pack("<Q", len(lengths)))
            fh.write(struct.pack("<Q", len(self._doc_index)))
            fh.write(lengths.tobytes())
            fh.write(pointers.tobytes())
            fh.write(np.frombuffer(self._doc_index, dtype=np.int64).tobytes())
            fh.flush()
            os.fsync(fh.fileno())
        self.prepared = True

    def commit(self) -> None:
        """Move both files to their final names: ``.bin`` first, ``.idx`` last.

        An older ``.idx`` is removed first so that it never pairs with the new ``.bin``.
        """
        for tmp in (self._tmp_bin, self._tmp_idx):
            secure_file(tmp)  # shared storage: the configured mode and group (infra/permissions.py)
        with contextlib.suppress(FileNotFoundError):
            os.remove(idx_path(self.prefix))
        os.replace(self._tmp_bin, bin_path(self.prefix))
        os.replace(self._tmp_idx, idx_path(self.prefix))
        self.finalized = True

    def finalize(self) -> None:
        if not self.prepared:
            self.prepare()
        self.commit()

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and not self.finalized:
            try:
                self.finalize()
            except BaseException:
                self.abort()
                raise
        elif exc_type is not None:
            self.abort()
