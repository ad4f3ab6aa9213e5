"""The small typed artifacts stages hand to each other (URIs, counts, checksums).

Large data never travels through Prefect results: these models point at it.
Stage modules may subclass or extend them; keep fields JSON-serialisable.
"""

from __future__ import annotations

from datetime import UTC, datetime

from pydantic import BaseModel, Field

from infra.executors import Executor, LocalExecutor
from infra.jobs import ImageRef

__all__ = ["ChatDataRef", "CheckpointRef", "DatasetRef", "EndpointRef", "ImageRef", "TokenizerRef", "now"]


def now() -> datetime:
    return datetime.now(UTC)


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


class ChatDataRef(BaseModel):
    """Chat data for fine-tuning: normalized JSONL of OpenAI ``messages`` rows, split into train and held out."""

    train: str = Field(..., description="normalized train JSONL (a path the jobs can read)")
    held_out: str
    train_examples: int
    held_out_examples: int
    source: str
    fingerprint: str


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
    executor: Executor = Field(default_factory=LocalExecutor, description="where the server runs")
    handle: str | None = Field(None, description="the service's name on its backend (stop/inspect it by this)")
    checkpoint: str | None = None
    api_key_env: str | None = Field(
        None, description="the environment variable holding the endpoint's API key (its name, never the key)"
    )

    @property
    def backend(self) -> str:
        return self.executor.kind
