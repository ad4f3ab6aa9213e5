"""Flow ``prepare-dataset``: raw shards in, Megatron indexed datasets and blend weights out.

    sources -> check (one pass over the shard manifest) -> download + extract (one job array over the
            pending shards) -> concatenate + tokenize (one job array, a task per unfinished part)
            -> blend (NeMo data_prefix + manifest)

The flow process only orchestrates: its work per shard is a lookup in the shard manifest, and
the Prefect task runs are per step (at most three per run), not per shard; the jobs run where
the executor says (local processes using every core, a Slurm job array, an Indexed Job). Run it
with ``nemoflow prepare`` (``--help`` lists the options) or as a Prefect deployment. The default
configuration prepares the embedded demo corpus.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow
from pydantic import BaseModel, ConfigDict, Field, model_validator

from infra import storage
from infra.configs.fetch import FetchOptions
from infra.configs.tokenizer import SENTENCEPIECE_TYPES, TOKENIZER_TYPES, TokenizerConfig
from infra.executors import Executor, default_executor
from infra.jobs import ImageRef
from infra.secrets import CredentialFree
from infra.settings import get_settings, redact
from infra.sources import expand_sources
from tasks.common import logger, result_storage
from tasks.data import (
    Progress,
    check_shards,
    fetch_shards,
    job_paths,
    part_done,
    part_inputs,
    part_keys,
    publish_table,
    settle_parts,
    shards_digest,
    tokenize_parts,
    tokenized_so_far,
    write_blend,
    write_fetch_plan,
)
from tasks.refs import DatasetRef, TokenizerRef
from workloads.jsonl import MAX_LINE_BYTES
from workloads.shard_manifest import index_manifest, read_progress
from workloads.shards import group

DEMO_TEMPLATE = "train/chunk{chunk}/example_train_{shard}.jsonl.zst"


def default_tokenizer_model() -> str:
    """Mixtral-8x7B's sentencepiece tokenizer, shipped inside the mistral-common package."""
    import mistral_common

    return str(Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1")


def _check_tokenizer(config) -> None:
    """Unknown type or missing file: fail before any download (loading it would cost seconds)."""
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

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)  # inputs may hold credentials

    name: str = Field(
        "demo", pattern=r"^[A-Za-z0-9._-]+$", description="dataset name (directory under work_dir/datasets)"
    )
    sources: CredentialFree | list[CredentialFree] | None = Field(
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
    fetch_tasks: int = Field(
        16,
        ge=1,
        description="array tasks the download + extract job is spread over (a Slurm job array, an Indexed Job; "
        "locally, processes as many at once as cores); fewer when there are few shards",
    )
    fetch_threads: int = Field(4, ge=1, description="downloads in flight per fetch task")
    requests_per_second: float | None = Field(
        None,
        gt=0,
        description="cap on download requests per second for the whole fetch job (each task takes an equal "
        "share); a 429 from a host pauses every task for it",
    )
    revalidate: bool = Field(
        False,
        description="ask every HTTP(S) source again (a request per shard) whether it changed, instead of trusting "
        "what was recorded when it was downloaded; local files and GCS objects are always checked",
    )
    skip_malformed: bool = Field(False, description="count and skip malformed JSON lines instead of failing")
    allow_empty: bool = Field(False, description="write an empty dataset for an empty part instead of failing")
    max_line_bytes: int = Field(
        MAX_LINE_BYTES, ge=0, description="fail naming the file and line on a longer JSON line (0 = no limit)"
    )
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


def _describe(spec: str | list[str] | None) -> str:
    """The sources as given (references, never their values), one line: a list shows its first entry."""
    if isinstance(spec, list):
        return redact(spec[0]) + (f" and {len(spec) - 1} more" if len(spec) > 1 else "") if spec else "(none)"
    return redact(spec) if spec else "(none)"


@flow(name="prepare-dataset", log_prints=True)
def prepare_dataset(
    config: PrepareConfig | None = None, executor: Executor | None = None, image: ImageRef | None = None
) -> DatasetRef:
    """``executor``: where the fetch and tokenize job arrays run (default ``NEMOFLOW_EXECUTOR``, local);
    ``image``: what their tasks run in (default: this Python environment)."""
    config = (config or PrepareConfig()).resolved()
    executor = executor or default_executor()
    log = logger()
    started = time.monotonic()
    dataset_uri = config.dataset_uri()
    storage.ensure_writable(dataset_uri)
    results = result_storage()
    fetch, tokenize, blend = (
        t.with_options(result_storage=results) for t in (fetch_shards, tokenize_parts, write_blend)
    )

    # 1. sources, checked against the shard manifest in one pass (no task run per shard)
    sources = expand_sources(config.sources, chunks=config.chunks, shards=config.shards)
    names, urls = [s.name for s in sources], [s.url for s in sources]
    del sources  # plain strings from here on: a Source model costs ~700 bytes a shard
    check = check_shards(names, urls, dataset_uri, config.revalidate)
    n_shards = len(check.names)
    groups = group(check.names, config.shards_per_file)  # N shards per part, in order; the last one smaller
    tokenize_identity = (config.tokenizer, config.json_keys, config.append_eod)
    done, refetch = settle_parts(check, groups, *tokenize_identity)
    log.info(
        "%d source shard(s) from %s -> %s: %d to download/extract (%d of them again: extracted file gone), "
        "%d done (%.2fs)",
        n_shards,
        _describe(config.sources),
        dataset_uri,
        len(check.pending),
        refetch,
        n_shards - len(check.pending),
        check.seconds,
    )
    # progress: a unit per shard downloaded and extracted, and per part tokenized
    recorded = n_shards - len(check.pending)
    progress = Progress(f"Preparing {config.name}: {n_shards} shard(s)", total=n_shards + len(groups))
    progress.set(recorded)

    # 2-3. download and extract the pending shards: ONE job array where the executor says
    if check.pending:
        options = FetchOptions(
            threads=config.fetch_threads,
            requests_per_second=config.requests_per_second,
            delete_compressed=config.delete_compressed,
            revalidate=config.revalidate,
        )
        plan_uri, plan = write_fetch_plan(check, options, config.fetch_tasks)
        rw, ro = job_paths(dataset_uri, check.urls)
        with progress.watch(lambda: recorded + read_progress(plan.journal_dir, plan.plan_id)[0]):
            fetch(plan_uri, len(check.pending), dataset_uri, executor, image, rw, ro)
        check.index = index_manifest(dataset_uri)

    # 4-5. concatenate N shards per part and tokenize: ONE job array (a task per unfinished part)
    keys = part_keys(check, groups)
    unfinished = [
        key
        for i, key in enumerate(keys)
        if i not in done and (key is None or not part_done(key, dataset_uri, *tokenize_identity))
    ]
    todo = part_inputs(check, groups, unfinished)
    with progress.watch(lambda: n_shards + tokenized_so_far(dataset_uri, keys, config.json_keys)):
        tokenized = tokenize(
            keys,
            todo,
            config.tokenizer,
            dataset_uri,
            config.json_keys,
            config.append_eod,
            config.workers,
            config.skip_malformed,
            n=len(keys),
            allow_empty=config.allow_empty,
            max_line_bytes=config.max_line_bytes,
            executor=executor,
            image=image,
        )

    # 6. blend weights (NeMo data_prefix) and the manifest
    dataset = blend(
        config.name,
        dataset_uri,
        check.names,
        shards_digest(check),
        tokenized,
        config.tokenizer,
        config.json_keys,
        config.append_eod,
        config.blend_alpha,
    )
    progress.set(progress.total)
    publish_table(dataset, tokenized, time.monotonic() - started)
    log.info(
        "prepared %s: %d documents, %d tokens in %d file(s); manifest %s",
        config.name,
        dataset.documents,
        dataset.tokens,
        len(dataset.prefixes),
        dataset.manifest_uri,
    )
    return dataset
