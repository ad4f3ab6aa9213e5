"""Tokenizers named like Megatron-LM's ``--tokenizer-type``, with ids identical to Megatron's.

=========================== ====================================== ===========================
``--tokenizer-type``        files                                  ids are those of
=========================== ====================================== ===========================
GPTSentencePieceTokenizer   ``--tokenizer-model`` (.model)         ``sentencepiece`` encode
SentencePieceTokenizer      (same; Llama2Tokenizer is an alias)    (same, see below)
GPT2BPETokenizer            ``--vocab-file`` + ``--merge-file``    transformers' GPT-2 BPE
HuggingFaceTokenizer        ``--tokenizer-model``: tokenizer.json, ``tokenizer(text).input_ids``
                            a directory, or a hub model id         (special tokens included)
=========================== ====================================== ===========================

The end-of-document id (``--append-eod``) is the tokenizer's EOS (``</s>`` = 2 for
Mixtral, ``<|endoftext|>`` = 50256 for GPT-2), as in Megatron-LM since its
tokenizers moved to ``megatron.core.tokenizers`` (Feb 2026). Older Megatron-LM
releases gave ``SentencePieceTokenizer`` extra special tokens (``<EOD>`` etc.)
and so a different EOD id; ``GPTSentencePieceTokenizer`` never did.

Speed without trusting a faster library blindly: each tokenizer has a
*reference* (the library Megatron calls, so its ids are Megatron's by
construction) and, where it loads, a *fast* ``gigatoken`` twin. The fast twin
is used only after it produced the reference's ids on a probe set of awkward
texts (whitespace runs, unicode, byte fallback, special-token look-alikes),
and ``tokenize_file`` keeps comparing it with the reference on a sample of the
real documents, restarting with the reference if they ever disagree. A
transformers-converted fast tokenizer of a sentencepiece model is never used:
it differs from sentencepiece on ~46% of real documents.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from infra.configs.tokenizer import HF_TYPES, SENTENCEPIECE_TYPES, TOKENIZER_TYPES, TokenizerConfig

log = logging.getLogger("nemoflow.tokenize")


# Texts on which a fast implementation most often drifts from the reference.
PROBE_TEXTS = [
    "",
    " ",
    "   ",
    "\n\n\n",
    "\t \t",
    "Hello world",
    " leading and trailing spaces  ",
    "multiple   spaces\tand\ttabs\n\nand  newlines \n ",
    "In the beginning God created the heaven and the earth.",
    "Ünïcödé — “quotes” ‘single’ … naïve café façade ½ ©",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 🤖🚀👩‍👩‍👧 and ZWJ",
    "math ∑∫√∞ ≠ ≤ ≥ and greek αβγδ",
    "control \x00\x01\x7f chars and \u200b zero width \ufeff bom",
    "<s> </s> <unk> <pad> <|endoftext|> [INST] special look-alikes [/INST]",
    "1234567890 3.14159 1e-10 0x1F",
    "def f(x):\n    return x ** 2  # code\n\tindent",
    "a" * 300,
    " ".join(["word"] * 200),
    "\u00a0non-breaking\u00a0spaces\u3000ideographic space",
    "ﬁ ligature Ⅻ roman ｆｕｌｌｗｉｄｔｈ",
]


class TokenizerError(ValueError):
    """The tokenizer cannot be built; the message names the type or file."""


def _flatten(ids: Sequence[Sequence[int]], dtype=np.int64) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=dtype), lengths
    flat = np.fromiter((t for x in ids for t in x), dtype=dtype, count=total)
    return flat, lengths


class Tokenizer:
    """Encodes batches of texts with Megatron's ids.

    ``encode_batch`` returns every token concatenated plus one length per text.
    ``backend`` names the implementation in use; ``reference`` (when the fast
    twin is in use) is the implementation the ids must equal.
    """

    name: str
    backend: str
    vocab_size: int
    eod: int | None
    reference: Tokenizer | None = None

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def needs_reference(self, text: str) -> bool:
        """True for texts the fast twin must not encode: they hold a special token's string."""
        return False

    def describe(self) -> str:
        return f"{self.name} ({self.backend}, vocab {self.vocab_size}, eod {self.eod})"


class SentencePieceReference(Tokenizer):
    backend = "sentencepiece"

    def __init__(self, name: str, model: str, threads: int) -> None:
        import sentencepiece as spm

        self.name = name
        self.model = model
        try:
            self.sp = spm.SentencePieceProcessor(model_file=model)
        except (OSError, RuntimeError) as exc:
            raise TokenizerError(f"cannot load sentencepiece model {model}: {exc}") from exc
        self.vocab_size = self.sp.get_piece_size()
        eos = self.sp.eos_id()
        self.eod = eos if eos >= 0 else None
        self.threads = max(1, threads)
        # sentencepiece reads "<s>" in text as the characters; gigatoken reads it as
        # the control token. Texts holding such a piece go to sentencepiece itself.
        specials = sorted(_non_normal_pieces(self.sp, model), key=len, reverse=True)
        self._special_re = re.compile("|".join(re.escape(s) for s in specials)) if specials else None

    def encode(self, text: str) -> list[int]:
        return self.sp.encode_as_ids(text)

    def needs_reference(self, text: str) -> bool:
        return bool(self._special_re is not None and self._special_re.search(text))

    def encode_batch(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        return _flatten(self.sp.encode(texts, num_threads=self.threads))


def _non_normal_pieces(sp, model: str) -> set[str]:
    """Control, unknown, user-defined and unused pieces (not byte-fallback pieces)."""
    try:
        from sentencepiece import sentencepiece_model_pb2

        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(Path(model).read_bytes())
        normal, byte = proto.SentencePiece.NORMAL, proto.SentencePiece.BYTE
        return {p.piece for p in proto.pieces if p.type not in (normal, byte) and p.piece}
    except Exception:  # noqa: BLE001 - without protobuf, the API misses only user-defined pieces
        return {
            sp.id_to_piece(i)
            for i in range(sp.get_piece_size())
            if (sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i)) and not sp.is_byte(i)
        }


class HuggingFaceReference(Tokenizer):
    """transformers' tokenizer called as Megatron's HuggingFaceTokenizer wrapper calls it."""

    backend = "transformers"

    def __init__(self, name: str, hf_tokenizer, source: str) -> None:
        self.name = name
        self.hf = hf_tokenizer
        self.source = source
        # Megatron's wrapper fills in sep/eos and cls/bos from each other; only eos matters here.
        eos = hf_tokenizer.eos_token or hf_tokenizer.sep_token
        self.eod = hf_tokenizer.convert_tokens_to_ids(eos) if eos is not None else None
        self.vocab_size = len(hf_tokenizer)
        specials = sorted({str(t) for t in getattr(hf_tokenizer, "all_special_tokens", []) if t}, key=len, reverse=True)
        added = getattr(hf_tokenizer, "added_tokens_decoder", {}) or {}
        specials += [str(t) for t in added.values() if str(t) not in specials]
        self._special_re = re.compile("|".join(re.escape(s) for s in specials)) if specials else None

    def encode(self, text: str) -> list[int]:
        return list(self.hf(text).input_ids)

    def needs_reference(self, text: str) -> bool:
        return bool(self._special_re is not None and self._special_re.search(text))

    def encode_batch(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        if not texts:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return _flatten(self.hf(texts, return_attention_mask=False)["input_ids"])


class GigatokenTwin(Tokenizer):
    """gigatoken encoding, used only while it agrees with ``reference``."""

    backend = "gigatoken"

    def __init__(self, reference: Tokenizer, giga) -> None:
        self.reference = reference
        self.giga = giga
        self.name = reference.name
        self.vocab_size = reference.vocab_size
        self.eod = reference.eod

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.giga.encode(text)]

    def encode_batch(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        if not texts:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        arr = self.giga.encode_batch(texts)
        layout = arr.layout
        offsets = getattr(layout, "offsets", None)
        content = getattr(layout, "content", None)
        if offsets is not None and content is not None and hasattr(content, "data"):
            # Zero-copy view of the Rust buffers: flat ids and per-text offsets.
            offs = np.asarray(offsets.data)
            flat = np.asarray(content.data)[offs[0] : offs[-1]]
            return flat, np.diff(offs)
        import awkward as ak

        return np.asarray(ak.flatten(arr)), np.asarray(ak.num(arr))

    def needs_reference(self, text: str) -> bool:
        return self.reference.needs_reference(text)


def mismatches(fast: Tokenizer, reference: Tokenizer, texts: Sequence[str]) -> list[int]:
    """Indices of ``texts`` on which the two tokenizers give different ids."""
    checked = [t for t in texts if not fast.needs_reference(t)]
    if not checked:
        return []
    flat, lengths = fast.encode_batch(list(checked))
    ends = np.cumsum(lengths)
    bad = []
    for i, text in enumerate(checked):
        got = flat[ends[i] - lengths[i] : ends[i]].tolist()
        if got != reference.encode(text):
            bad.append(texts.index(text))
    return bad


def _require_file(value: str | None, flag: str, tokenizer_type: str) -> str:
    if not value:
        raise TokenizerError(f"{tokenizer_type} needs {flag}")
    path = Path(value).expanduser()
    if not path.exists():
        raise TokenizerError(f"{tokenizer_type}: {flag} {value} does not exist")
    if not path.is_file():
        raise TokenizerError(f"{tokenizer_type}: {flag} {value} is not a file")
    return str(path)


def _set_threads(threads: int) -> None:
    # Rust thread pools (gigatoken, HF tokenizers) size themselves once, on first use.
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, threads)))
    os.environ.setdefault("RAYON_RS_NUM_CPUS", str(max(1, threads)))


def _load_hf(config: TokenizerConfig) -> HuggingFaceReference:
    import transformers

    if config.type == "GPT2BPETokenizer":
        vocab = _require_file(config.vocab_file, "--vocab-file", config.type)
        merges = _require_file(config.merge_file, "--merge-file", config.type)
        try:
            hf = transformers.GPT2Tokenizer(vocab=vocab, merges=merges)
        except Exception as exc:
            raise TokenizerError(f"GPT2BPETokenizer: cannot read {vocab} / {merges}: {exc}") from exc
        return HuggingFaceReference(config.type, hf, f"{vocab} + {merges}")

    model = config.model
    if not model:
        raise TokenizerError("HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json, a directory or a hub id)")
    path = Path(model).expanduser()
    try:
        if path.is_file():
            if path.name.endswith(".json") and not (path.parent / "tokenizer_config.json").exists():
                hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
                _guess_eos(hf, path)
            else:
                hf = transformers.AutoTokenizer.from_pretrained(str(path.parent))
        elif path.is_dir():
            hf = transformers.AutoTokenizer.from_pretrained(str(path))
        elif model.startswith((".", "/", "~")) or model.endswith((".json", ".model")):
            raise TokenizerError(f"HuggingFaceTokenizer: --tokenizer-model {model} does not exist")
        else:
            # Not a local path: a hub model id ("gpt2", "org/name"), as Megatron accepts; needs the hub or its cache.
            try:
                hf = transformers.AutoTokenizer.from_pretrained(model)
            except Exception as exc:
                raise TokenizerError(
                    f"HuggingFaceTokenizer: --tokenizer-model {model} is not a local file or directory, "
                    f"and loading it as a Hugging Face hub id failed: {exc}"
                ) from exc
    except TokenizerError:
        raise
    except Exception as exc:
        raise TokenizerError(f"HuggingFaceTokenizer: cannot load {model}: {exc}") from exc
    return HuggingFaceReference(config.type, hf, model)


def _guess_eos(hf, path: Path) -> None:
    """A bare tokenizer.json names no EOS; take its single end-of-text-like special token."""
    candidates = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
    vocab = hf.get_vocab()
    found = [c for c in candidates if c in vocab]
    if found:
        hf.eos_token = found[0]
    else:
        log.warning("%s names no end-of-text token; --append-eod will be refused", path)


def load_tokenizer(config: TokenizerConfig, workers: int = 2, verify: bool = True) -> Tokenizer:
    """Build the tokenizer ``config`` describes; the fast twin only if it matches on the probes."""
    _set_threads(workers)
    if config.type in SENTENCEPIECE_TYPES:
        model = _require_file(config.model, "--tokenizer-model", config.type)
        reference: Tokenizer = SentencePieceReference(config.type, model, workers)
    elif config.type in HF_TYPES:
        reference = _load_hf(config)
    else:
        raise TokenizerError(f"unknown tokenizer type {config.type!r}; supported: {', '.join(TOKENIZER_TYPES)}")
    if not config.fast:
        return reference
    twin = _gigatoken_twin(reference)
    if twin is None:
        return reference
    if verify:
        bad = mismatches(twin, reference, PROBE_TEXTS)
        if bad:
            log.warning(
                "gigatoken disagrees with %s on %d probe text(s) (first: %r); using %s",
                reference.backend,
                len(bad),
                PROBE_TEXTS[bad[0]][:60],
                reference.backend,
            )
            return reference
    return twin


def _gigatoken_twin(reference: Tokenizer) -> Tokenizer | None:
    try:
        import gigatoken
    except ImportError:
        log.info("gigatoken is not installed; using %s", reference.backend)
        return None
    try:
        if isinstance(reference, SentencePieceReference):
            return GigatokenTwin(reference, gigatoken.Tokenizer.from_sentencepiece(reference.model))
        if isinstance(reference, HuggingFaceReference):
            giga = gigatoken.Tokenizer(reference.hf)
            return GigatokenTwin(reference, giga)
    except Exception as exc:  # noqa: BLE001 - any failure just means: no fast path
        log.info("gigatoken cannot load this tokenizer (%s); using %s", exc, reference.backend)
    return None
