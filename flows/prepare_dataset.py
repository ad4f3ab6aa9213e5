"""Flow ``prepare-dataset``: raw shards in, Megatron indexed datasets and blend weights out.

    sources -> download (per shard) -> extract (per shard) -> concatenate (N shards per part)
            -> tokenize (one job array, a task per part, where the executor says) -> blend (NeMo data_prefix + manifest)

Run it with ``nemoflow prepare`` (``--help`` lists the options) or as a Prefect
deployment. The default configuration prepares the embedded demo corpus.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prefect import flow, unmapped
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.futures import as_completed
from pydantic import BaseModel, ConfigDict, Field, model_validator

from infra import storage
from infra.executors import Executor, default_executor
from infra.fetch import probe
from infra.jobs import ImageRef
from infra.settings import get_settings
from infra.sources import expand_sources
from tasks.common import logger, result_storage
from tasks.data import (
    concatenate_part,
    download_shard,
    extract_shard,
    publish_table,
    tokenize_parts,
    write_blend,
)
from tasks.refs import DatasetRef, TokenizerRef
from workloads.shards import group

DEMO_TEMPLATE = "train/chunk{chunk}/example_train_{shard}.jsonl.zst"


def default_tokenizer_model() -> str:
    """Mixtral-8x7B's sentencepiece tokenizer, shipped inside the mistral-common package."""
    import mistral_common

    return str(Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1")


def _check_tokenizer(config) -> None:
    """Unknown type or missing file: fail before any download (loading it would cost seconds)."""
    from workloads.tokenizers import SENTENCEPIECE_TYPES, TOKENIZER_TYPES

    if config.type not in TOKENIZER_TYPES:
        raise ValueError(f"unknown tokenizer type {config.type!r}; supported: {', '.join(TOKENIZER_TYPES)}")
    required = {"GPT2BPETokenizer": ("vocab_file", "merge_file")}.get(
        config.type, ("model",) if config.type in SENTENCEPIECE_TYPES else ()
    )
    for field in required:
        value = getattr(config, field)
        if not value:
            raise ValueError(f"tokenizer {config.type} needs --{field.replace('_', '-')}")
        if not Path(value).expanduser().exists():
            raise FileNotFoundError(f"tokenizer {field.replace('_', ' ')} not found: {value}")


class PrepareConfig(BaseModel):
    """Everything the data stage needs; the defaults prepare the embedded demo corpus."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        "demo", pattern=r"^[A-Za-z0-9._-]+$", description="dataset name (directory under work_dir/datasets)"
    )
    sources: str | list[str] | None = Field(
        None,
        description="a list of URIs, a glob, or a URL template with {chunk}/{shard}; "
        "unset = the embedded demo corpus (King James Bible, SlimPajama layout)",
    )
    chunks: str | None = Field(None, description="chunk range for {chunk}, e.g. '1-10'")
    shards: str | None = Field(None, description="shard range for {shard}, e.g. '0-99' or '0,3,5-7'")
    output: str | None = Field(None, description="dataset URI (default: <work_dir>/datasets/<name>)")
    shards_per_file: int = Field(1200, ge=1, description="shards concatenated per tokenized file (the seed uses 1,200)")
    tokenizer: TokenizerRef = Field(default_factory=TokenizerRef)
    json_keys: list[str] = Field(default_factory=lambda: ["text"], min_length=1)
    append_eod: bool = True
    workers: int = Field(2, ge=1, description="tokenizer worker processes per file")
    skip_malformed: bool = Field(False, description="count and skip malformed JSON lines instead of failing")
    delete_compressed: bool = Field(False, description="delete .zst downloads after successful extraction")
    blend_alpha: float = Field(1.0, gt=0, description="weight = size**alpha / sum (NeMo auto_blend's blending_alpha)")

    @model_validator(mode="after")
    def _check(self) -> PrepareConfig:
        if self.sources is None and (self.chunks or self.shards):
            raise ValueError("chunks/shards given without sources: they fill a URL template's {chunk}/{shard}")
        return self

    def dataset_uri(self) -> str:
        return (
            storage.normalize(self.output)
            if self.output
            else storage.join(get_settings().work_dir, "datasets", self.name)
        )

    def resolved(self, materialize: bool = True) -> PrepareConfig:
        """Fill the demo corpus and the default tokenizer; fingerprint the tokenizer (cache key).

        ``materialize=False`` (``nemoflow render``): name the demo corpus without writing it.
        """
        from workloads.tokenize import TokenizerConfig

        update: dict = {}
        if self.sources is None:
            from workloads.demo_data import write_slimpajama_layout

            root = storage.join(get_settings().work_dir, "demo-source")
            if materialize:
                write_slimpajama_layout(storage.local_path(root), chunks=2, shards_per_chunk=4)
            update.update(sources=storage.join(root, DEMO_TEMPLATE), chunks="1-2", shards="0-3")
            if self.shards_per_file == 1200:
                update["shards_per_file"] = 2  # four parts, so the demo's blend has something to weigh
        tokenizer = self.tokenizer
        if tokenizer.model is None and tokenizer.vocab_file is None and "SentencePiece" in tokenizer.type:
            tokenizer = tokenizer.model_copy(update={"model": default_tokenizer_model()})
        config = TokenizerConfig(
            type=tokenizer.type, model=tokenizer.model, vocab_file=tokenizer.vocab_file, merge_file=tokenizer.merge_file
        )
        _check_tokenizer(config)
        update["tokenizer"] = tokenizer.model_copy(update={"fingerprint": config.fingerprint()})
        return self.model_copy(update=update)


@flow(name="prepare-dataset", log_prints=True)
def prepare_dataset(
    config: PrepareConfig | None = None, executor: Executor | None = None, image: ImageRef | None = None
) -> DatasetRef:
    """``executor``: where the tokenize job array runs (default ``NEMOFLOW_EXECUTOR``, local);
    ``image``: what its tasks run in (default: this Python environment)."""
    config = (config or PrepareConfig()).resolved()
    executor = executor or default_executor()
    log = logger()
    started = time.monotonic()
    dataset_uri = config.dataset_uri()
    storage.ensure_writable(dataset_uri)
    results = result_storage()
    download, extract, concat, tokenize, blend = (
        t.with_options(result_storage=results)
        for t in (download_shard, extract_shard, concatenate_part, tokenize_parts, write_blend)
    )

    # 1. sources, and their cheap identities (etag/size/checksum) for the cache keys
    sources = expand_sources(config.sources, chunks=config.chunks, shards=config.shards)
    log.info("%d source shard(s) -> %s", len(sources), dataset_uri)
    with ThreadPoolExecutor(max_workers=16) as pool:
        remotes = list(pool.map(lambda s: probe(s.url), sources))
    steps = 2 * len(sources) + len(sources)  # download + extract per shard, tokenize weighted by shards
    progress = create_progress_artifact(0.0, key="prepare-dataset-progress", description=f"Preparing {config.name}")
    done = 0

    def advance(n: int = 1) -> None:
        nonlocal done
        done += n
        update_progress_artifact(progress, min(100.0, 100.0 * done / steps))

    # 2-3. download and extract every shard (fanned out)
    fetched_futures = download.map(sources, remotes, unmapped(dataset_uri))
    extract_futures = extract.map(sources, fetched_futures, unmapped(dataset_uri), unmapped(config.delete_compressed))
    for _ in as_completed(list(fetched_futures) + list(extract_futures)):
        advance()
    fetched = [f.result() for f in fetched_futures]
    extracted = [f.result() for f in extract_futures]

    # 4. concatenate N shards per part (deterministic order; the last part smaller)
    groups = group(list(zip(extracted, fetched)), config.shards_per_file)
    concat_futures = [
        concat.submit(f"part-{i:05d}", [e for e, _ in g], dataset_uri, [f.sha256 for _, f in g])
        for i, g in enumerate(groups)
    ]
    concats = [f.result() for f in concat_futures]
    checksums = [[f.sha256 for _, f in g] for g in groups]

    # 5. tokenize: ONE job array (a task per unfinished part) where the executor says
    parts = tokenize(
        concats,
        checksums,
        config.tokenizer,
        dataset_uri,
        config.json_keys,
        config.append_eod,
        config.workers,
        config.skip_malformed,
        n=len(concats),
        executor=executor,
        image=image,
    )
    advance(len(sources))

    # 6. blend weights (NeMo data_prefix) and the manifest
    dataset = blend(
        config.name,
        dataset_uri,
        sources,
        fetched,
        parts,
        config.tokenizer,
        config.json_keys,
        config.append_eod,
        config.blend_alpha,
    )
    update_progress_artifact(progress, 100.0)
    publish_table(dataset, parts, time.monotonic() - started)
    log.info(
        "prepared %s: %d documents, %d tokens in %d file(s); manifest %s",
        config.name,
        dataset.documents,
        dataset.tokens,
        len(dataset.prefixes),
        dataset.manifest_uri,
    )
    return dataset
