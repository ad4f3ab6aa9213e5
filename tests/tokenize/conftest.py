"""Fixtures for the tokenizer tests: real GPT-2 BPE files, a real HF tokenizer, real text.

GPT-2's ``gpt2-vocab.json`` / ``gpt2-merges.txt`` are rebuilt from the r50k ranks
that openai-whisper's sdist ships (``whisper/assets/gpt2.tiktoken``): the vocab
maps each token's bytes (in GPT-2's byte-to-unicode alphabet) to its rank, and
each merge is the pair that byte-pair encoding of a token, using only lower
ranks, ends with. The sdist is cached under ~/.cache/nemoflow-test.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.support.require import missing
from tests.tokenize.reference import _bytes_to_unicode  # GPT-2 byte-to-unicode table, one copy

CACHE = Path(os.environ.get("NEMOFLOW_TEST_CACHE", Path.home() / ".cache" / "nemoflow-test"))
WHISPER = "openai-whisper==20250625"


def _merge_pair(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < limit and (best is None or rank < best[0]):
                best = (rank, i)
        assert best is not None, token
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts[0], parts[1]


def build_gpt2_files(tiktoken_file: Path, out: Path) -> tuple[Path, Path]:
    ranks: dict[bytes, int] = {}
    for line in tiktoken_file.read_text().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    b2u = _bytes_to_unicode()

    def enc(token: bytes) -> str:
        return "".join(b2u[x] for x in token)

    vocab = {enc(tok): rank for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])}
    vocab["<|endoftext|>"] = len(vocab)
    merges = ["#version: 0.2"]
    for tok, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) > 1:
            a, b = _merge_pair(tok, ranks)
            merges.append(f"{enc(a)} {enc(b)}")
    vocab_path, merges_path = out / "gpt2-vocab.json", out / "gpt2-merges.txt"
    vocab_path.write_text(json.dumps(vocab))
    merges_path.write_text("\n".join(merges) + "\n", encoding="utf-8")
    return vocab_path, merges_path


@pytest.fixture(scope="session")
def gpt2_files() -> tuple[Path, Path]:
    """(gpt2-vocab.json, gpt2-merges.txt), rebuilt from openai-whisper's sdist."""
    out = CACHE / "gpt2"
    vocab, merges = out / "gpt2-vocab.json", out / "gpt2-merges.txt"
    if vocab.exists() and merges.exists():
        return vocab, merges
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "gpt2.lock", "w") as lock:  # pytest-xdist workers: one downloads and builds, the others wait
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build_gpt2_files(out, vocab, merges)


def _build_gpt2_files(out: Path, vocab: Path, merges: Path) -> tuple[Path, Path]:
    if vocab.exists() and merges.exists():
        return vocab, merges
    sdists = sorted((CACHE / "whisper-sdist").glob("openai_whisper-*.tar.gz"))
    if not sdists:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                WHISPER,
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                str(CACHE / "whisper-sdist"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        sdists = sorted((CACHE / "whisper-sdist").glob("openai_whisper-*.tar.gz"))
        if proc.returncode != 0 or not sdists:
            missing(
                f"{WHISPER} from PyPI for the GPT-2 BPE files (download failed: {proc.stderr[-300:]})",
                "let pip reach PyPI once (the sdist is cached under ~/.cache afterwards)",
            )
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdists[-1]) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("whisper/assets/gpt2.tiktoken"))
        (out / "gpt2.tiktoken").write_bytes(tar.extractfile(member).read())
    tmp = out / ".tmp"
    tmp.mkdir(exist_ok=True)
    v, m = build_gpt2_files(out / "gpt2.tiktoken", tmp)
    os.replace(m, merges)
    os.replace(v, vocab)
    return vocab, merges


@pytest.fixture(scope="session")
def hf_tokenizer_dir(gpt2_files, tmp_path_factory) -> Path:
    """A HuggingFace tokenizer directory (tokenizer.json + config) made offline from the GPT-2 files."""
    import transformers

    out = tmp_path_factory.mktemp("hf-gpt2")
    tok = transformers.GPT2Tokenizer(vocab=str(gpt2_files[0]), merges=str(gpt2_files[1]))
    tok.save_pretrained(str(out))
    assert (out / "tokenizer.json").exists()
    return out


EDGE_DOCS = [
    "",  # empty document: no tokens, no EOD, still a document
    "   ",  # only whitespace
    "\n\n\t \n",
    "words   with    runs     of      spaces\n\n\nand\t\ttabs  ",
    "Ünïcödé — “quotes” naïve café; 日本語のテキスト; emoji 🤖🚀👩‍👩‍👧; math ∑∫√∞",
    "literal control strings: <s> </s> <unk> <|endoftext|> [INST] x [/INST]",
    "mixed\r\nline endings\rinside the text",
]


@pytest.fixture(scope="session")
def corpus(kjv_chapters) -> list[str]:
    """KJV chapters (real text) plus edge cases, and one very long document."""
    long_doc = "\n".join(kjv_chapters[:60])  # ~250 KB in one document
    docs = list(kjv_chapters[:300])
    docs[5:5] = EDGE_DOCS
    docs.insert(100, long_doc)
    docs.append("")  # an empty last document
    return docs


def mixtral_flags(tokenizer_model) -> list[str]:
    """The tokenizer flags these tests give ``nemoflow preprocess`` and ``python -m workloads.tokenize``:
    Mixtral's sentencepiece model, as Megatron's GPTSentencePieceTokenizer."""
    return ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", str(tokenizer_model)]


def write_jsonl(path: Path, records: list[dict], compress: bool = False) -> Path:
    data = b"".join(json.dumps(r, ensure_ascii=False).encode("utf-8") + b"\n" for r in records)
    if compress:
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path
