"""Download + extract: ONE job array over the pending shards, its journals merged into the shard manifest."""

from __future__ import annotations

import math
import os
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import orjson
from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from infra import storage
from infra.configs.fetch import FetchOptions
from infra.executors import Executor
from infra.jobs import ImageRef, JobFailed, JobSpec, Resources, workload_job
from infra.settings import get_settings
from tasks.common import logger, run_job, transient_only
from tasks.data.checking import ShardCheck, extracted_uri, raw_uri, url_scheme
from tasks.data.records import FetchSummary, ShardsFailed
from workloads.fetch_array import FetchPlan
from workloads.shard_manifest import journal_dir, merge_journals

# Fewer shards than this per fetch task would spend more on starting tasks than on shards.
MIN_SHARDS_PER_FETCH_TASK = 256
# At most this many failed shards are listed in the failed-shards artifact (the count is always given).
FAILED_ROWS = 1000


def new_plan_id() -> str:
    """Time-sortable, unique: journals are merged in this order."""
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]


def fetch_task_count(shards: int, max_tasks: int) -> int:
    """Array tasks for ``shards`` pending shards: ``max_tasks``, fewer when each would get under
    MIN_SHARDS_PER_FETCH_TASK."""
    return max(1, min(max_tasks, math.ceil(shards / MIN_SHARDS_PER_FETCH_TASK)))


def write_fetch_plan(check: ShardCheck, options: FetchOptions, max_tasks: int) -> tuple[str, FetchPlan]:
    """The plan and one item file per array task (every ``tasks``-th pending shard: chunks spread evenly)."""
    dataset_uri = check.dataset_uri
    plan_id = new_plan_id()
    tasks = fetch_task_count(len(check.pending), max_tasks)
    base = storage.join(dataset_uri, "shards", "plans", plan_id)
    plan = FetchPlan(
        plan_id=plan_id,
        tasks=tasks,
        shards=len(check.pending),
        items_prefix=storage.join(base, "task-"),
        journal_dir=journal_dir(dataset_uri),
        code=check.code,
        options=options,
    )
    for index in range(tasks):
        with storage.atomic_open(plan.items_uri(index), "wb") as fh:
            for position, remote in check.pending[index::tasks]:
                name = check.names[position]
                item = {
                    "name": name,
                    "url": check.urls[position],
                    "raw": raw_uri(dataset_uri, name),
                    "extracted": extracted_uri(dataset_uri, name),
                }
                fh.write(orjson.dumps(item)[:-1] + b',"remote":' + remote + b"}\n")  # a FetchItem
    plan_uri = storage.join(base, "plan.json")
    storage.write_json(plan_uri, plan.model_dump(mode="json"))
    return plan_uri, plan


def secret_env() -> list[str]:
    return [name for name in ("HF_TOKEN",) if name in get_settings().secret_env()]


def build_fetch_job(
    plan_uri: str,
    tasks: int,
    image: ImageRef | None = None,
    paths: list[str] | None = None,
    read_only: list[str] | None = None,
) -> JobSpec:
    """ONE array job: each task downloads and extracts its share of the pending shards."""
    return workload_job(
        "nemoflow-fetch",
        "workloads.fetch_array",
        ["--plan", plan_uri],
        image=image,
        resources=Resources(cpus_per_task=1),
        array_size=tasks,
        paths=paths or [],
        read_only=read_only or [],
        secret_env=secret_env(),  # HF_TOKEN goes to huggingface.co only (infra.fetch)
    )


def job_paths(dataset_uri: str, urls: list[str]) -> tuple[list[str], list[str]]:
    """(read-write, read-only) directories a job sees in a container: the dataset, the local sources' root."""
    rw = [storage.local_path(dataset_uri)] if storage.is_local(dataset_uri) else []
    folders = sorted({os.path.dirname(storage.local_path(u)) for u in urls if url_scheme(u) == "file"})
    if not folders:
        return rw, []
    root = os.path.commonpath(folders)
    return rw, [root] if root != "/" else folders  # never the whole file system


def planned_fetch_job(dataset_uri: str, urls: list[str], max_tasks: int, image: ImageRef | None = None) -> JobSpec:
    """The fetch job a cold run over ``urls`` submits, without writing a plan (``nemoflow render``)."""
    rw, ro = job_paths(dataset_uri, urls)
    plan_uri = storage.join(dataset_uri, "shards", "plans", "PLAN-ID", "plan.json")
    return build_fetch_job(plan_uri, fetch_task_count(len(urls), max_tasks), image, rw, ro)


def _failed_table(failures: dict[str, str], total: int) -> None:
    rows = [{"shard": name, "error": error} for name, error in sorted(failures.items())[:FAILED_ROWS]]
    more = len(failures) - len(rows)
    create_table_artifact(
        key="failed-shards",
        table=rows,
        description=f"{len(failures)} of {total} shard(s) failed"
        + (f" ({more} more not listed)" if more > 0 else "")
        + "; the others are done and are not fetched again. Fix the cause and run again.",
    )


@task(
    name="fetch-shards",
    task_run_name="download and extract {n} shard(s)",
    retries=1,
    retry_delay_seconds=30,
    # each shard was retried with backoff inside the job: retry the step only when the job itself failed
    retry_condition_fn=transient_only(ShardsFailed),
    # Never cached: it is called only when shards are pending, and each shard's own record (its
    # sidecar) is the content-addressed cache a retry or a re-run consults.
    cache_policy=NO_CACHE,
)
def fetch_shards(
    plan_uri: str,
    n: int,
    dataset_uri: str,
    executor: Executor | Any = None,
    image: ImageRef | None = None,
    paths: list[str] | None = None,
    read_only: list[str] | None = None,
) -> FetchSummary:
    """Run the fetch job array for the plan, merge its journals, fail naming the shards that failed."""
    log = logger()
    started = time.monotonic()
    plan = FetchPlan.model_validate(storage.read_json(plan_uri))
    log.info("downloading and extracting %d shard(s) as one job array of %d task(s)", plan.shards, plan.tasks)
    job_error: JobFailed | None = None
    try:
        run_job(build_fetch_job(plan_uri, plan.tasks, image, paths, read_only), executor)
    except JobFailed as exc:
        job_error = exc
    merged, failures = merge_journals(dataset_uri)
    if failures:
        _failed_table(failures, plan.shards)
        named = "; ".join(f"{name}: {error}" for name, error in sorted(failures.items())[:3])
        more = f" (and {len(failures) - 3} more: see the failed-shards artifact)" if len(failures) > 3 else ""
        raise ShardsFailed(f"{len(failures)} of {plan.shards} shard(s) failed: {named}{more}")
    if job_error is not None:
        raise job_error
    storage.remove(storage.parent(plan_uri), recursive=True)
    return FetchSummary(shards=plan.shards, recorded=merged, seconds=time.monotonic() - started)
