"""vLLM tokenizes with transformers; the model trained on sentencepiece's ids. The tokenizer.json vLLM gets
(workloads/serve_engines/hf_tokenizer.py) must give the same ids on real text, whitespace runs included,
where transformers' own conversion of tokenizer.model does not."""

from __future__ import annotations

import json
import shutil

import pytest

from workloads.serve_engines import hf_tokenizer


@pytest.fixture(scope="module")
def built(mixtral_tokenizer_model):
    return hf_tokenizer.build_tokenizer_json(mixtral_tokenizer_model)


def test_ids_equal_sentencepiece_on_every_kjv_chapter(built, mixtral_tokenizer_model, kjv_chapters):
    import sentencepiece

    texts = kjv_chapters + hf_tokenizer.PROBES
    spaced = [t for t in texts if "  " in t]
    assert len(kjv_chapters) == 1189 and spaced  # the corpus has the whitespace runs this is about
    assert hf_tokenizer.mismatches(built, mixtral_tokenizer_model, texts) == []
    sp = sentencepiece.SentencePieceProcessor(model_file=str(mixtral_tokenizer_model))
    assert sp.encode("a  b") != sp.encode("a b")  # the runs are tokens of their own


def test_the_word_split_is_what_makes_whitespace_runs_equal(built, mixtral_tokenizer_model, kjv_chapters):
    """The same vocabulary and merges with a plain split at every space (Metaspace) agree on ordinary prose but
    not on runs of spaces: sentencepiece keeps a run before a word as one piece ("▁▁" + "▁c")."""
    data = json.loads(built)
    data["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "never", "split": True}
    plain = json.dumps(data)
    texts = kjv_chapters[:100] + ["a  b   c", "   leading"]
    bad = hf_tokenizer.mismatches(plain, mixtral_tokenizer_model, texts)
    assert "a  b   c" in bad and "   leading" in bad
    assert hf_tokenizer.mismatches(built, mixtral_tokenizer_model, texts) == []


def test_transformers_loads_the_directory_with_the_same_ids(mixtral_tokenizer_model, kjv_chapters, tmp_path):
    """What vLLM does with --tokenizer DIR: AutoTokenizer.from_pretrained(DIR) (tokenizer.json + config)."""
    import sentencepiece
    from transformers import AutoTokenizer

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copyfile(mixtral_tokenizer_model, ckpt / "tokenizer.model")
    out = hf_tokenizer.tokenizer_dir(ckpt, cache=tmp_path / "cache")
    assert out is not None and sorted(p.name for p in out.iterdir()) == [
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
    ]
    assert hf_tokenizer.tokenizer_dir(ckpt, cache=tmp_path / "cache") == out  # made once per tokenizer.model
    tok = AutoTokenizer.from_pretrained(str(out))
    sp = sentencepiece.SentencePieceProcessor(model_file=str(mixtral_tokenizer_model))
    texts = kjv_chapters[:200] + hf_tokenizer.PROBES
    assert [t for t in texts if tok.encode(t) != [sp.bos_id(), *sp.encode(t)]] == []
    assert tok.decode(tok.encode("a  b   c\n d"), skip_special_tokens=True) == "a  b   c\n d"
    assert tok.eos_token_id == sp.eos_id() and tok.bos_token_id == sp.bos_id()


def test_a_checkpoint_with_its_own_tokenizer_json_is_left_alone(tmp_path, mixtral_tokenizer_model):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copyfile(mixtral_tokenizer_model, ckpt / "tokenizer.model")
    (ckpt / "tokenizer.json").write_text("{}")
    assert hf_tokenizer.tokenizer_dir(ckpt, cache=tmp_path / "cache") is None
    assert hf_tokenizer.tokenizer_dir(tmp_path / "empty", cache=tmp_path / "cache") is None
