"""A small prepared dataset for stage tests: two real Megatron indexed datasets (KJV chapters, Mixtral's tokenizer)
and their DatasetRef, as the data stage hands it on."""

from __future__ import annotations

from pathlib import Path


def small_dataset_ref(root: Path, chapters: list[str], tokenizer_model: Path, per_part: int = 200):
    import numpy
    import sentencepiece
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from tasks.refs import DatasetRef, TokenizerRef

    root.mkdir(parents=True, exist_ok=True)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_model))
    prefixes, tokens = [], 0
    # Old Testament from Genesis, New Testament from Matthew (chapter 929). With the default split
    # (98,1,1) each part's validation split needs a few documents: 200 chapters give it two; an empty
    # one hangs AutoModel 0.7's Megatron GPTDataset in _get_num_epochs (observed), so do not go lower.
    for name, docs in (("ot", chapters[:per_part]), ("nt", chapters[929 : 929 + per_part])):
        prefix = root / f"kjv_{name}_text_document"
        builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.uint16)
        for ids in sp.encode(docs):
            builder.add_document(torch.tensor(ids + [sp.eos_id()]), [len(ids) + 1])
            tokens += len(ids) + 1
        builder.finalize(f"{prefix}.idx")
        prefixes.append(str(prefix))
    (root / "manifest.json").write_text("{}")
    return DatasetRef(
        prefixes=prefixes,
        blend=[0.6, prefixes[0], 0.4, prefixes[1]],
        manifest_uri=str(root / "manifest.json"),
        tokenizer=TokenizerRef(model=str(tokenizer_model)),
        documents=2 * per_part,
        tokens=tokens,
        bytes=0,
    )
