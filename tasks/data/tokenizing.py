"""Concatenate + tokenize: ONE job array over the parts not tokenized with the same identity."""

from __future__ import annotations

import hashlib
import os
from datetime import timedelta
from typing import Any

from prefect import task
from prefect.cache_policies import INPUTS

from infra import storage
from infra.executors import Executor
from infra.jobs import ImageRef, JobSpec, Resources, workload_job
from tasks.common import CodeVersion, logger, run_job, transient_only
from tasks.data.checking import ShardCheck, concat_uri, output_base, part_identity
from tasks.data.fetching import secret_env
from tasks.data.records import PartInput, PartKey
from tasks.refs import TokenizerRef
from workloads.jsonl import MAX_LINE_BYTES
from workloads.tokenize_array import PlanItem, TokenizedPart, TokenizePlan, TokenizerSpec, finished_part, stats_uri


def build_tokenize_job(
    plan_uri: str, items: int, workers: int, image: ImageRef | None = None, paths: list[str] | None = None
) -> JobSpec:
    """ONE array job: a task per unfinished part (local processes, a Slurm array, an Indexed Job)."""
    return workload_job(
        "nemoflow-tokenize",
        "workloads.tokenize_array",
        ["--plan", plan_uri],
        image=image,
        resources=Resources(cpus_per_task=workers),
        array_size=items,
        paths=paths or [],
        # a Hugging Face tokenizer named by its hub id is downloaded by the job
        secret_env=secret_env(),
    )


def tokenize_cache_policy():
    """Inputs (the parts' content keys, tokenizer, flags) and the producing code; ``todo`` (what the
    flow saw unfinished) is left out: it follows from the keys and the files, and a key that was
    tokenized before is a cache hit whatever the files say now (as every cached task)."""
    return (INPUTS - "todo") + CodeVersion(
        modules=("workloads.tokenize", "workloads.tokenize_array", "workloads.shards", "tasks.data")
    )


@task(
    name="tokenize",
    task_run_name="tokenize {n} part(s)",
    retries=2,
    retry_delay_seconds=10,
    retry_condition_fn=transient_only(),
    cache_policy=tokenize_cache_policy(),
    cache_expiration=timedelta(days=30),
    persist_result=True,
)
def tokenize_parts(
    parts: list[PartKey],
    todo: list[PartInput],
    tokenizer: TokenizerRef,
    dataset_uri: str,
    json_keys: list[str],
    append_eod: bool,
    workers: int,
    skip_malformed: bool,
    n: int,
    executor: Executor | Any = None,
    image: ImageRef | None = None,
    allow_empty: bool = False,
    max_line_bytes: int = MAX_LINE_BYTES,
) -> list[TokenizedPart]:
    """Concatenate and tokenize the parts of ``todo`` not already tokenized with the same identity, as
    ONE array job where the executor says; then read every part's result. Parts finished by an
    earlier (even failed) run are reused."""
    log = logger()
    items: list[PlanItem] = []
    for part in todo:
        identity = part_identity(part, dataset_uri, tokenizer, json_keys, append_eod)
        base = output_base(dataset_uri, part.name)
        if all(finished_part(f"{base}_{key}_document", identity) for key in json_keys):
            continue
        items.append(
            PlanItem(
                input=concat_uri(dataset_uri, part.name),
                inputs=part.inputs,
                output_prefix=base,
                identity=identity,
                bytes=part.bytes,
                concatenate=True,
            )
        )
    if items:
        plan_uri = storage.join(dataset_uri, "tokenized", "array-plan.json")
        plan = TokenizePlan(
            items=items,
            tokenizer=TokenizerSpec(
                type=tokenizer.type,
                model=tokenizer.model,
                vocab_file=tokenizer.vocab_file,
                merge_file=tokenizer.merge_file,
            ),
            json_keys=json_keys,
            append_eod=append_eod,
            workers=workers,
            skip_malformed=skip_malformed,
            allow_empty=allow_empty,
            max_line_bytes=max_line_bytes,
        )
        storage.write_json(plan_uri, plan.model_dump(mode="json"))
        tokenizer_files = [f for f in (tokenizer.model, tokenizer.vocab_file, tokenizer.merge_file) if f]
        local = [storage.local_path(dataset_uri)] if storage.is_local(dataset_uri) else []
        local += [os.path.dirname(os.path.abspath(f)) for f in tokenizer_files if os.path.exists(f)]
        log.info("concatenating and tokenizing %d of %d part(s) as one job array", len(items), len(parts))
        run_job(build_tokenize_job(plan_uri, len(items), workers, image, local), executor)
    else:
        log.info("all %d part(s) already tokenized with the same tokenizer and flags", len(parts))
    out: list[TokenizedPart] = []
    for part in parts:
        identity = part_identity(part, dataset_uri, tokenizer, json_keys, append_eod)
        base = output_base(dataset_uri, part.name)
        for key in json_keys:
            done = finished_part(f"{base}_{key}_document", identity)
            if done is None:
                raise RuntimeError(f"the tokenize job ended but {base}_{key}_document is missing or incomplete")
            out.append(done)
    return out


def tokenized_so_far(dataset_uri: str, parts: list[PartKey], json_keys: list[str]) -> int:
    """Parts whose stats file exists (progress while the tokenize job runs; the task checks identities)."""
    key = json_keys[-1]
    return sum(storage.exists(stats_uri(f"{output_base(dataset_uri, p.name)}_{key}_document")) for p in parts)


def shards_digest(check: ShardCheck) -> str:
    """Content identity of the dataset's shards, in order (a cache key part for the blend)."""
    digest = hashlib.sha256()
    for name in check.names:
        digest.update(f"{name}\0{check.index[name].sha256}\n".encode())
    return digest.hexdigest()
