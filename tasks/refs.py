"""The small typed artifacts stages hand to each other (URIs, counts, checksums).

Large data never travels through Prefect results: these models point at it.
Stage modules may subclass or extend them; keep fields JSON-serialisable.
"""

from __future__ import annotations

from datetime import UTC, datetime

from pydantic import BaseModel, Field


def now() -> datetime:
    return datetime.now(UTC)


class ImageRef(BaseModel):
    """The environment a stage ran in (lineage): a staged .sqsh, a registry image, or the local Python env."""

    kind: str = Field(..., description="'sqsh', 'registry' or 'python-env'")
    uri: str = Field(..., description="path/URI of the .sqsh, the image reference, or the python executable")
    checksum: str | None = None
    digest: str | None = None
    size: int | None = None
    source: str | None = None


class TokenizerRef(BaseModel):
    """A tokenizer as Megatron's preprocess_data.py flags name it."""

    type: str = Field("GPTSentencePieceTokenizer", description="Megatron --tokenizer-type")
    model: str | None = Field(None, description="--tokenizer-model (sentencepiece .model, HF tokenizer.json or id)")
    vocab_file: str | None = None
    merge_file: str | None = None
    fingerprint: str | None = Field(None, description="hash of the tokenizer files (cache key)")


class DatasetRef(BaseModel):
    """A prepared dataset: Megatron indexed datasets and their blend."""

    prefixes: list[str] = Field(..., description="output prefixes, '{prefix}' of '{prefix}.bin/.idx'")
    blend: list = Field(..., description="NeMo data_prefix: [w1, 'prefix1', w2, 'prefix2', ...]")
    manifest_uri: str
    tokenizer: TokenizerRef
    documents: int
    tokens: int
    bytes: int


class CheckpointRef(BaseModel):
    uri: str = Field(..., description="directory of one complete checkpoint (HF save_pretrained layout)")
    step: int
    val_loss: float | None = None
    run_dir: str | None = Field(None, description="the training run directory holding all checkpoints")
    image: ImageRef | None = None
    dataset_manifest: str | None = None


class EndpointRef(BaseModel):
    url: str = Field(..., description="base URL, e.g. http://127.0.0.1:8000")
    model: str
    backend: str = "local"
    handle: str | None = Field(None, description="backend id to stop it: pid, Slurm job id, k8s name")
    checkpoint: str | None = None
