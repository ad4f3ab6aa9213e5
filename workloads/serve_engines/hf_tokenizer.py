"""The checkpoint's sentencepiece model as a Hugging Face ``tokenizer.json`` that gives the same token ids.

vLLM tokenizes with transformers. The export (workloads/consolidate.py) writes only ``tokenizer.model``, and
transformers' own conversion of it differs from sentencepiece (what the model trained on) wherever
whitespace repeats: sentencepiece cuts a run of spaces before a word as "▁▁" + "▁word", the converted
tokenizer as "▁▁▁" + "word" (on 4 of the first 300 KJV chapters; also on any indented prompt). This builds
the tokenizer from the model's own pieces with sentencepiece's word split (a run of spaces keeps its last
space for the word that follows) and BPE merges ranked by the merged piece's score, and checks it against
sentencepiece before vLLM is given it (tests/serve/test_hf_tokenizer.py: every KJV chapter).

Prompts start with BOS, as the built-in engine's do (its ``--no-bos`` is the exception).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

SPACE = "\u2581"  # sentencepiece's "▁"
# Probes checked on every build (a mismatch refuses the tokenizer): whitespace runs, leading and trailing
# spaces, newlines and tabs, bytes outside the vocabulary, digits and punctuation.
PROBES = [
    "In the beginning God created the heaven and the earth.",
    "a  b   c\n\n\n d\t\te  ",
    "   leading spaces",
    "trailing spaces   ",
    "    def f(x):\n        return x  # indented",
    "x\r\ny \u00e9\u00e8 \u4e2d\u6587 \U0001f600 1234567 3.14159",
    "",
    " ",
]


class TokenizerMismatch(RuntimeError):
    """The built tokenizer's ids differ from sentencepiece's: vLLM must not serve with it."""


def build_tokenizer_json(model_file: str | os.PathLike) -> str:
    """tokenizer.json (as text) for a sentencepiece BPE model with a dummy prefix and no whitespace folding."""
    import sentencepiece
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    vocab = {p: i for i, p in enumerate(pieces)}
    if sp.encode_as_pieces("a  b") != [f"{SPACE}a", SPACE, f"{SPACE}b"] and sp.encode_as_pieces("a  b") != [
        f"{SPACE}a",
        f"{SPACE}{SPACE}b",
    ]:
        raise TokenizerMismatch(
            f"{model_file}: not a sentencepiece model with a dummy prefix that keeps repeated spaces "
            f"('a  b' -> {sp.encode_as_pieces('a  b')}); vLLM would tokenize it differently"
        )
    normal = {i for i in range(len(pieces)) if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i))}
    # BPE merges: every split of a piece into two pieces, ranked by the merged piece's score (its id in a
    # sentencepiece BPE model), as sentencepiece merges the best-scoring pair first.
    merges = []
    for i in sorted(normal, key=lambda i: (-sp.get_score(i), i)):
        piece = pieces[i]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if vocab.get(left) in normal and vocab.get(right) in normal:
                merges.append((left, right))
    byte_fallback = any(sp.is_byte(i) for i in range(len(pieces)))
    unk = pieces[sp.unk_id()] if sp.unk_id() >= 0 else None
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=byte_fallback))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    # sentencepiece's words: "▁word", a run of spaces before a word minus its last one, a trailing run
    words = f"{SPACE}?[^{SPACE}]+|{SPACE}+(?={SPACE}[^{SPACE}])|{SPACE}+"
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(words), behavior="isolated")
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    bos = sp.bos_id()
    if bos >= 0:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{pieces[bos]} $A", pair=f"{pieces[bos]} $A {pieces[bos]} $B", special_tokens=[(pieces[bos], bos)]
        )
    return tok.to_str()


def tokenizer_config(model_file: str | os.PathLike) -> dict:
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))

    def piece(i: int) -> str | None:
        return sp.id_to_piece(i) if i >= 0 else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": piece(sp.bos_id()),
        "eos_token": piece(sp.eos_id()),
        "unk_token": piece(sp.unk_id()),
        "pad_token": piece(sp.pad_id()),
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
        "nemoflow": "built from tokenizer.model by workloads/serve_engines/hf_tokenizer.py; ids equal sentencepiece's",
    }


def mismatches(tokenizer_json: str, model_file: str | os.PathLike, texts: list[str]) -> list[str]:
    """The texts whose ids differ between the tokenizer (with BOS) and sentencepiece (BOS + its ids)."""
    import sentencepiece
    from tokenizers import Tokenizer

    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    tok = Tokenizer.from_str(tokenizer_json)
    bos = [sp.bos_id()] if sp.bos_id() >= 0 else []
    got = tok.encode_batch(texts)
    return [t for t, enc in zip(texts, got, strict=True) if enc.ids != bos + sp.encode(t)]


def tokenizer_dir(checkpoint: str | os.PathLike, cache: str | os.PathLike | None = None) -> Path | None:
    """A directory vLLM can load as ``--tokenizer`` for this checkpoint (made once per tokenizer.model, checked
    against sentencepiece on :data:`PROBES`), or None when the checkpoint brings its own tokenizer.json or has
    no tokenizer.model."""
    ckpt = Path(checkpoint)
    model = ckpt / "tokenizer.model"
    if (ckpt / "tokenizer.json").is_file() or not model.is_file():
        return None
    digest = hashlib.sha256(model.read_bytes()).hexdigest()[:16]
    root = Path(cache or os.environ.get("NEMOFLOW_TOKENIZER_CACHE") or Path(tempfile.gettempdir()) / "nemoflow-tok")
    out = root / digest
    if (out / "tokenizer.json").is_file():
        return out
    text = build_tokenizer_json(model)
    bad = mismatches(text, model, PROBES)
    if bad:
        raise TokenizerMismatch(
            f"{model}: the Hugging Face tokenizer built from it differs from sentencepiece on {bad[0]!r}"
        )
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{digest}-", dir=root))
    (tmp / "tokenizer.json").write_text(text)
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(model), indent=1) + "\n")
    shutil.copyfile(model, tmp / "tokenizer.model")
    try:
        os.rename(tmp, out)  # whole or not at all; another server may have made it meanwhile
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
