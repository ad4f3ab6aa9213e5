"""What a tokenizer is, as Megatron-LM's ``--tokenizer-type`` and its files name it, and its cache key.

The data flow checks and fingerprints it before any download; the tokenize job (workloads/tokenizers.py)
loads it. No tokenizer library is imported here.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pydantic import BaseModel, ConfigDict

SENTENCEPIECE_TYPES = ("GPTSentencePieceTokenizer", "SentencePieceTokenizer", "Llama2Tokenizer")
HF_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer")
TOKENIZER_TYPES = SENTENCEPIECE_TYPES + HF_TYPES


class TokenizerConfig(BaseModel):
    """What ``--tokenizer-type/--tokenizer-model/--vocab-file/--merge-file`` say."""

    model_config = ConfigDict(frozen=True)

    type: str
    model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    # Use the verified gigatoken twin when there is one (ids are identical either way).
    fast: bool = True

    def files(self) -> list[Path]:
        """The local files whose content defines the tokenizer (empty for a hub id)."""
        out: list[Path] = []
        for value in (self.model, self.vocab_file, self.merge_file):
            if not value:
                continue
            path = Path(value).expanduser()
            if path.is_dir():
                out.extend(sorted(p for p in path.rglob("*") if p.is_file()))
            elif path.exists():
                out.append(path)
        return out

    def fingerprint(self) -> str:
        """sha256 over the type and the content of every tokenizer file: the cache key.

        Paths do not enter it (the same files elsewhere give the same key); a hub
        model id that is not a local path enters by name.
        """
        digest = hashlib.sha256()
        digest.update(f"type={self.type}\n".encode())
        for role, value in (("model", self.model), ("vocab", self.vocab_file), ("merges", self.merge_file)):
            if not value:
                continue
            path = Path(value).expanduser()
            if path.is_dir():
                for file in sorted(p for p in path.rglob("*") if p.is_file()):
                    digest.update(f"{role}:{file.relative_to(path).as_posix()}\n".encode())
                    digest.update(_file_digest(file))
            elif path.exists():
                digest.update(f"{role}:\n".encode())
                digest.update(_file_digest(path))
            else:
                digest.update(f"{role}=hub:{value}\n".encode())
        return digest.hexdigest()


def _file_digest(path: Path) -> bytes:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(8 << 20):
            digest.update(block)
    return digest.digest()
