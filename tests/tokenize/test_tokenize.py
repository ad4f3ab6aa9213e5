"""The tokenizer and indexed-dataset writer against Megatron's own reference path.

Real parts throughout: Mixtral's sentencepiece model, GPT-2's BPE files, a
HuggingFace tokenizer.json made from them, King James Bible chapters, and
megatron-core's IndexedDatasetBuilder / IndexedDataset as the reference writer
and reader.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.tokenize.conftest import write_jsonl
from tests.tokenize.reference import LegacyGPT2, assert_same_files, megatron_reference, read_back
from workloads.tokenize import TokenizerConfig, load_tokenizer, tokenize_file
from workloads.tokenizers import GigatokenTwin, SentencePieceReference


def _sp(model) -> object:
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(model))


@pytest.mark.parametrize("fast", [True, False], ids=["gigatoken", "sentencepiece"])
def test_sentencepiece_matches_megatron_reference(tmp_path, corpus, mixtral_tokenizer_model, fast):
    records = [{"text": t} for t in corpus]
    src = write_jsonl(tmp_path / "in.jsonl", records)
    config = TokenizerConfig(type="GPTSentencePieceTokenizer", model=str(mixtral_tokenizer_model), fast=fast)
    stats = tokenize_file(str(src), str(tmp_path / "ours"), config, append_eod=True, workers=2, batch_bytes=256 << 10)
    assert stats.backend == ("gigatoken" if fast else "sentencepiece")
    sp = _sp(mixtral_tokenizer_model)
    megatron_reference(tmp_path / "ref", records, ["text"], sp.encode_as_ids, sp.eos_id(), sp.get_piece_size(), True)
    assert_same_files(stats.outputs["text"], str(tmp_path / "ref_text_document"))
    assert stats.documents == len(corpus) and stats.dtype == "uint16" and stats.vocab_size == 32000

    # Read back with megatron-core: each document is its sentencepiece ids + EOD; empty ones stay empty.
    sequences, documents = read_back(stats.outputs["text"])
    assert len(documents) == len(corpus) + 1
    for i in (0, 5, 6, 100, 250, len(corpus) - 1):
        seqs = sequences[documents[i] : documents[i + 1]]
        expected = sp.encode_as_ids(corpus[i])
        if expected:
            assert [s.tolist() for s in seqs] == [expected + [2]]
        else:
            assert seqs == []
    assert sum(len(s) for s in sequences) == stats.tokens


def test_zst_input_multiple_keys_sentence_lists_no_eod(tmp_path, corpus, mixtral_tokenizer_model):
    records = [
        {"text": t, "title": f"Chapter {i}" if i % 7 else "", "sents": t.split("\n") if i % 3 else [], "id": i}
        for i, t in enumerate(corpus[:120])
    ]
    records[10]["sents"] = ["", "  ", "In the beginning", ""]
    keys = ["text", "title", "sents"]
    src = write_jsonl(tmp_path / "in.jsonl.zst", records, compress=True)
    config = TokenizerConfig(type="SentencePieceTokenizer", model=str(mixtral_tokenizer_model))
    for eod in (False, True):
        stats = tokenize_file(
            str(src), str(tmp_path / f"ours{eod}"), config, json_keys=keys, append_eod=eod, batch_bytes=64 << 10
        )
        sp = _sp(mixtral_tokenizer_model)
        megatron_reference(tmp_path / f"ref{eod}", records, keys, sp.encode_as_ids, sp.eos_id(), 32000, eod)
        for key in keys:
            assert_same_files(stats.outputs[key], str(tmp_path / f"ref{eod}_{key}_document"))
    assert set(stats.outputs) == set(keys)
    assert stats.bytes_in > src.stat().st_size  # uncompressed bytes are counted


def test_gpt2_bpe_matches_megatron_reference(tmp_path, corpus, gpt2_files):
    import transformers

    vocab, merges = gpt2_files
    records = [{"text": t} for t in corpus[:150]]
    src = write_jsonl(tmp_path / "in.jsonl", records)
    config = TokenizerConfig(type="GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))
    stats = tokenize_file(str(src), str(tmp_path / "ours"), config, append_eod=True)
    ref_tok = transformers.GPT2Tokenizer(vocab=str(vocab), merges=str(merges))
    megatron_reference(tmp_path / "ref", records, ["text"], lambda t: ref_tok(t).input_ids, 50256, len(ref_tok), True)
    assert_same_files(stats.outputs["text"], str(tmp_path / "ref_text_document"))
    assert stats.vocab_size == 50257 and stats.dtype == "uint16"

    # The HF GPT-2 tokenizer (what Megatron calls now) agrees with plain GPT-2 BPE (what it called before)
    # on real text; literal "<|endoftext|>" is the known exception (now the special token).
    legacy = LegacyGPT2(vocab, merges)
    for text in [t for t in corpus[:60] if "<|endoftext|>" not in t]:
        assert ref_tok(text).input_ids == legacy.encode(text), text[:60]


@pytest.mark.parametrize("form", ["directory", "tokenizer.json"])
def test_huggingface_tokenizer_matches_reference(tmp_path, corpus, hf_tokenizer_dir, form):
    import transformers

    model = hf_tokenizer_dir if form == "directory" else tmp_path / "bare" / "tokenizer.json"
    if form == "tokenizer.json":
        model.parent.mkdir()
        model.write_bytes((hf_tokenizer_dir / "tokenizer.json").read_bytes())
    records = [{"text": t} for t in corpus[:80]]
    src = write_jsonl(tmp_path / "in.jsonl", records)
    stats = tokenize_file(
        str(src), str(tmp_path / "ours"), TokenizerConfig(type="HuggingFaceTokenizer", model=str(model))
    )
    ref = transformers.AutoTokenizer.from_pretrained(str(hf_tokenizer_dir))
    megatron_reference(
        tmp_path / "ref", records, ["text"], lambda t: ref(t).input_ids, ref.eos_token_id, len(ref), True
    )
    assert_same_files(stats.outputs["text"], str(tmp_path / "ref_text_document"))


def test_int32_dtype_for_large_vocab(tmp_path, hf_tokenizer_dir, kjv_chapters):
    """A vocabulary of 65,500 or more ids is stored as int32 (megatron-core's rule)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(hf_tokenizer_dir))
    tok.add_tokens([f"<extra_{i}>" for i in range(65500 - len(tok))])
    big = tmp_path / "big"
    tok.save_pretrained(str(big))
    records = [{"text": t} for t in kjv_chapters[:20]] + [{"text": "a <extra_65000> b"}]
    src = write_jsonl(tmp_path / "in.jsonl", records)
    stats = tokenize_file(
        str(src), str(tmp_path / "ours"), TokenizerConfig(type="HuggingFaceTokenizer", model=str(big))
    )
    assert stats.dtype == "int32" and stats.vocab_size == 65500
    ref = transformers.AutoTokenizer.from_pretrained(str(big))
    megatron_reference(
        tmp_path / "ref", records, ["text"], lambda t: ref(t).input_ids, ref.eos_token_id, len(ref), True
    )
    assert_same_files(stats.outputs["text"], str(tmp_path / "ref_text_document"))


def test_fast_path_disagreement_falls_back_to_reference(tmp_path, kjv_chapters, mixtral_tokenizer_model, gpt2_files):
    """A fast twin that gives other ids (here: GPT-2's BPE) is caught and the file is redone."""
    import gigatoken
    import transformers

    reference = SentencePieceReference("GPTSentencePieceTokenizer", str(mixtral_tokenizer_model), 2)
    wrong = gigatoken.Tokenizer(transformers.GPT2Tokenizer(vocab=str(gpt2_files[0]), merges=str(gpt2_files[1])))
    twin = GigatokenTwin(reference, wrong)
    records = [{"text": t} for t in kjv_chapters[:50]]
    src = write_jsonl(tmp_path / "in.jsonl", records)
    stats = tokenize_file(str(src), str(tmp_path / "ours"), twin, append_eod=True)
    assert stats.backend == "sentencepiece"
    sp = _sp(mixtral_tokenizer_model)
    megatron_reference(tmp_path / "ref", records, ["text"], sp.encode_as_ids, 2, 32000, True)
    assert_same_files(stats.outputs["text"], str(tmp_path / "ref_text_document"))
    assert not list(tmp_path.glob(".tmp-*"))


def test_gigatoken_is_verified_and_used_for_sentencepiece(mixtral_tokenizer_model, kjv_chapters):
    tok = load_tokenizer(TokenizerConfig(type="GPTSentencePieceTokenizer", model=str(mixtral_tokenizer_model)))
    assert tok.backend == "gigatoken"
    # literal control-piece strings are read as text by sentencepiece: they must go to the reference
    assert tok.needs_reference("x </s> y") and not tok.needs_reference(kjv_chapters[0])
    flat, lengths = tok.encode_batch(kjv_chapters[:200])
    sp = _sp(mixtral_tokenizer_model)
    assert np.concatenate([np.asarray(x) for x in sp.encode(kjv_chapters[:200])]).tolist() == flat.tolist()


def test_fingerprint_is_content_based(tmp_path, mixtral_tokenizer_model, gpt2_files):
    copy = tmp_path / "copy.model"
    copy.write_bytes(Path(mixtral_tokenizer_model).read_bytes())
    a = TokenizerConfig(type="GPTSentencePieceTokenizer", model=str(mixtral_tokenizer_model)).fingerprint()
    assert a == TokenizerConfig(type="GPTSentencePieceTokenizer", model=str(copy)).fingerprint()
    assert a != TokenizerConfig(type="SentencePieceTokenizer", model=str(copy)).fingerprint()
    data = bytearray(copy.read_bytes())
    data[-1] ^= 1
    copy.write_bytes(bytes(data))
    assert a != TokenizerConfig(type="GPTSentencePieceTokenizer", model=str(copy)).fingerprint()
    g = TokenizerConfig(type="GPT2BPETokenizer", vocab_file=str(gpt2_files[0]), merge_file=str(gpt2_files[1]))
    assert len(g.fingerprint()) == 64 and g.fingerprint() != a
