"""Dataset preparation stage: download -> extract -> concatenate -> tokenize -> blend.

Built for SlimPajama's 59,166 shards: the flow process only orchestrates, and its cost per
shard is a dictionary lookup, not a Prefect task run.

- :func:`check_shards` (in the flow, one pass): the sources' identities (a ``stat`` per local
  file, one listing per GCS folder; HTTP(S) sources are trusted as recorded unless
  ``revalidate``), compared with the shard manifest (workloads/shard_manifest.py): every shard
  whose record is missing or stale is pending.
- :func:`fetch_shards` (one task run): ONE job array downloads and extracts the pending shards,
  spread over the array's tasks (workloads/fetch_array.py: local processes, a Slurm array, an
  Indexed Job); then the tasks' journals are merged into the manifest, and shards that failed
  are shown (artifact ``failed-shards``) and named in the error. Not called when nothing is
  pending.
- :func:`tokenize_parts` (one task run): ONE job array concatenates and tokenizes every part
  (``shards_per_file`` shards) not already tokenized with the same identity.
- :func:`write_blend` (one task run): NeMo blend weights and the manifest.

A re-run with nothing changed therefore makes two task runs (both ``Cached``), whatever the
number of shards; the Prefect database grows by a bounded amount per run. Progress is one
progress artifact, updated from the array tasks' progress files while the jobs run.

Layout under the dataset URI (``<work_dir>/datasets/<name>`` by default)::

    raw/<chunk>/<shard>.jsonl.zst      downloaded shards (+ .meta.json sidecars from infra.fetch)
    extracted/<chunk>/<shard>.jsonl    streamed out of the .zst (+ .shard.json: the shard's record)
    shards/manifest.jsonl              every shard's record, read by the flow in one go
    shards/journal/, shards/plans/     the fetch job's plan and reports (transient)
    concat/part-00000.jsonl            N shards per part, deterministic order
    tokenized/part-00000_text_document.bin/.idx (+ .stats.json)
    blend.json       NeMo data_prefix as JSON: [w1, "prefix1", w2, "prefix2", ...]
    data_prefix.txt  the same list as NeMo's auto_blend.py prints it
    manifest.json    everything above, machine-readable (DatasetManifest)
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from prefect import task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from infra import storage
from infra.executors import Executor
from infra.jobs import ImageRef, JobFailed, JobSpec, Resources, workload_job
from infra.settings import get_settings
from infra.sources import Source
from tasks.common import cache_policy, code_fingerprint, logger, run_job
from tasks.refs import DatasetRef, TokenizerRef
from workloads.fetch_array import FetchOptions, FetchPlan
from workloads.shard_manifest import (
    is_current,
    journal_dir,
    merge_journals,
    read_manifest,
    url_digest,
)
from workloads.shards import group
from workloads.tokenize_array import (
    PlanItem,
    TokenizedPart,
    TokenizePlan,
    TokenizerSpec,
    finished_part,
    stats_uri,
)

RETRIES = 3
# Fewer shards than this per fetch task would spend more on starting tasks than on shards.
MIN_SHARDS_PER_FETCH_TASK = 64
# At most this many failed shards are listed in the failed-shards artifact (the count is always given).
FAILED_ROWS = 1000


# ----------------------------------------------------------------------------- results


class DatasetManifest(BaseModel):
    name: str
    uri: str
    sources: list[str]
    shards: list[dict]
    parts: list[TokenizedPart]
    blend: list
    tokenizer: TokenizerRef
    json_keys: list[str]
    append_eod: bool
    created: str


class FetchSummary(BaseModel):
    shards: int
    recorded: int
    seconds: float


class ShardsFailed(RuntimeError):
    """Shards could not be downloaded or extracted; the message names them (all are in the artifact)."""


class PartInput(BaseModel):
    """One part to tokenize: its extracted shards in order and the checksums of their downloads."""

    name: str
    inputs: list[str]
    checksums: list[str]
    bytes: int


# ----------------------------------------------------------------------------- progress


class Progress:
    """The run's progress artifact; :meth:`watch` keeps it moving while a job runs."""

    def __init__(self, description: str, total: int, every_s: float = 5.0):
        self.total = max(1, total)
        self.every_s = every_s
        self._shown = -1.0
        self.id = create_progress_artifact(0.0, key="prepare-dataset-progress", description=description)

    def set(self, done: int) -> None:
        value = round(min(100.0, 100.0 * done / self.total), 1)
        if value != self._shown:
            self._shown = value
            update_progress_artifact(self.id, value)

    @contextlib.contextmanager
    def watch(self, poll: Callable[[], int]) -> Iterator[None]:
        """Show ``poll()`` (units done in all) every few seconds until the block ends."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(self.every_s):
                with contextlib.suppress(Exception):  # progress is best effort; the job's result is not
                    self.set(poll())

        thread = threading.Thread(target=loop, name="progress", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=10)


# ----------------------------------------------------------------------------- check (in the flow)


def raw_uri(dataset_uri: str, name: str) -> str:
    return storage.join(dataset_uri, "raw", name)


def extracted_uri(dataset_uri: str, name: str) -> str:
    return storage.join(dataset_uri, "extracted", name.removesuffix(".zst"))


def _scheme(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def _listing(urls: list[str]) -> dict[str, dict]:
    """fsspec info of every object under the folders of ``urls``: one listing per folder, not a call per file."""
    found: dict[str, dict] = {}
    folders = sorted({storage.parent(u) for u in urls})
    for folder in folders:
        fs, path = storage.url_to_fs(folder)
        try:
            entries = fs.ls(path, detail=True)
        except FileNotFoundError:
            continue
        for entry in entries:
            found[storage.to_uri(fs, entry["name"])] = entry
    return found


def source_identities(sources: list[Source]) -> list[dict | None]:
    """What tells a changed source from a known one, per source (None: not checked, see revalidate).

    Local files: size and modification time (infra.fetch.probe, a stat). GCS: size, etag/generation,
    md5, crc32c, from one listing per folder. HTTP(S): None; a HEAD per shard per run is what made
    re-runs cost as much as the work at 59,166 shards (and a rate-limited host would refuse it).
    """
    from infra.fetch import NotFound, probe

    out: list[dict | None] = [None] * len(sources)
    gcs = [i for i, s in enumerate(sources) if _scheme(s.url) in ("gs", "gcs")]
    if gcs:
        listing = _listing([sources[i].url for i in gcs])
        for i in gcs:
            url = sources[i].url.replace("gcs://", "gs://", 1)
            meta = listing.get(url.rstrip("/"))
            if meta is None:
                raise NotFound(f"not found: {url}")
            out[i] = {
                "size": int(meta["size"]) if meta.get("size") is not None else None,
                "etag": meta.get("etag") or (str(meta["generation"]) if meta.get("generation") else None),
                "md5": meta.get("md5Hash"),
                "crc32c": meta.get("crc32c"),
            }
    for i, source in enumerate(sources):
        if _scheme(source.url) == "file":
            info = probe(source.url)
            out[i] = {"size": info.size, "last_modified": info.last_modified}
    return out


@dataclasses.dataclass
class ShardCheck:
    """The flow's view of the sources after :func:`check_shards` (plain data in memory: validating
    59,166 records as models would cost seconds; never a task input)."""

    dataset_uri: str
    names: list[str]
    records: dict[str, dict]
    pending: list[dict]  # FetchItem fields
    code: str
    seconds: float


def check_shards(sources: list[Source], dataset_uri: str, revalidate: bool = False) -> ShardCheck:
    """Which shards need downloading/extracting: one manifest read, one identity per source."""
    started = time.monotonic()
    records = read_manifest(dataset_uri)
    merged, _ = merge_journals(dataset_uri, records)  # what a killed run finished but did not merge
    if merged:
        logger().info("merged %d shard record(s) a previous run left in its journal", merged)
    storage.remove(storage.join(dataset_uri, "shards", "plans"), recursive=True)
    identities = source_identities(sources)
    code = code_fingerprint("workloads.shards")
    pending = []
    for source, remote in zip(sources, identities):
        record = records.get(source.name)
        trusted = remote is not None or not revalidate
        if record is not None and trusted and is_current(record, url_digest(source.url), remote, code):
            continue
        pending.append(_item(dataset_uri, source.name, source.url, remote))
    return ShardCheck(
        dataset_uri=dataset_uri,
        names=[s.name for s in sources],
        records=records,
        pending=pending,
        code=code,
        seconds=time.monotonic() - started,
    )


def _item(dataset_uri: str, name: str, url: str, remote: dict | None) -> dict:
    return {
        "name": name,
        "url": url,
        "raw": raw_uri(dataset_uri, name),
        "extracted": extracted_uri(dataset_uri, name),
        "remote": remote,
    }


def _sizes(uris: list[str]) -> dict[str, int]:
    """Sizes of the files that exist among ``uris`` (a stat each locally, one listing per folder on GCS)."""
    sizes: dict[str, int] = {}
    local = [u for u in uris if storage.is_local(u)]
    for uri in local:
        with contextlib.suppress(OSError):
            sizes[uri] = os.path.getsize(storage.local_path(uri))
    remote = [u for u in uris if not storage.is_local(u)]
    if remote:
        listing = _listing(remote)
        for uri in remote:
            if (meta := listing.get(uri)) is not None:
                sizes[uri] = int(meta.get("size") or 0)
    return sizes


def _part_identity(
    part: PartInput, dataset_uri: str, tokenizer: TokenizerRef, json_keys: list[str], append_eod: bool, code: str
) -> dict:
    return {
        "input": _concat_uri(dataset_uri, part.name),
        "inputs": list(part.inputs),
        "source_checksums": list(part.checksums),
        "extraction": code,
        "tokenizer": tokenizer.fingerprint,
        "json_keys": list(json_keys),
        "append_eod": append_eod,
        "code": code_fingerprint("workloads.tokenize"),
    }


def _concat_uri(dataset_uri: str, part_name: str) -> str:
    return storage.join(dataset_uri, "concat", f"{part_name}.jsonl")


def _output_base(dataset_uri: str, part_name: str) -> str:
    return storage.join(dataset_uri, "tokenized", part_name)


def _part_done(
    part: PartInput, dataset_uri: str, tokenizer: TokenizerRef, json_keys: list[str], append_eod: bool, code: str
) -> bool:
    identity = _part_identity(part, dataset_uri, tokenizer, json_keys, append_eod, code)
    base = _output_base(dataset_uri, part.name)
    return all(finished_part(f"{base}_{key}_document", identity) for key in json_keys)


def plan_parts(check: ShardCheck, shards_per_file: int) -> list[list[str]]:
    """Shard names per part, in the sources' order (the last part smaller)."""
    return group(check.names, shards_per_file)


def part_input(check: ShardCheck, index: int, names: list[str]) -> PartInput | None:
    """The part's inputs from the records (None while one of its shards has none)."""
    records = [check.records.get(n) for n in names]
    if any(r is None for r in records):
        return None
    return PartInput(
        name=f"part-{index:05d}",
        inputs=[r["extracted"] for r in records],
        checksums=[r["sha256"] for r in records],
        bytes=sum(r["bytes"] for r in records),
    )


def part_inputs(check: ShardCheck, groups: list[list[str]]) -> list[PartInput]:
    """Every part's inputs, once every shard has a record (after the fetch step)."""
    parts = []
    for index, names in enumerate(groups):
        part = part_input(check, index, names)
        if part is None:
            missing = next(n for n in names if n not in check.records)
            raise RuntimeError(f"shard {missing} has no record after the fetch step (see {check.dataset_uri}/shards)")
        parts.append(part)
    return parts


def needed_again(
    check: ShardCheck,
    groups: list[list[str]],
    tokenizer: TokenizerRef,
    json_keys: list[str],
    append_eod: bool,
    urls: dict[str, str],
) -> int:
    """Shards whose extracted file is gone although a part that needs it is not tokenized yet.

    A part already tokenized needs nothing (its extracted shards may have been deleted to save
    space); a part still to tokenize needs every shard's extracted file, so missing ones are
    fetched again. Costs a stat per shard of the parts left to do, nothing for finished parts.
    Adds them to ``check.pending``; returns how many.
    """
    pending = {item["name"] for item in check.pending}
    wanted: list[str] = []
    for index, names in enumerate(groups):
        part = part_input(check, index, names)
        if part is not None and _part_done(part, check.dataset_uri, tokenizer, json_keys, append_eod, check.code):
            continue
        wanted += [n for n in names if n not in pending]
    if not wanted:
        return 0
    sizes = _sizes([check.records[n]["extracted"] for n in wanted])
    missing = [n for n in wanted if sizes.get(check.records[n]["extracted"]) != check.records[n]["bytes"]]
    for name in missing:
        check.pending.append(_item(check.dataset_uri, name, urls[name], check.records[name]["remote"]))
    return len(missing)


# ----------------------------------------------------------------------------- download + extract


def new_plan_id() -> str:
    """Time-sortable, unique: journals are merged in this order."""
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]


def write_fetch_plan(
    dataset_uri: str, items: list[dict], code: str, options: FetchOptions, max_tasks: int
) -> tuple[str, FetchPlan]:
    """The plan and one item file per array task (every ``tasks``-th shard: chunks spread evenly)."""
    plan_id = new_plan_id()
    tasks = max(1, min(max_tasks, math.ceil(len(items) / MIN_SHARDS_PER_FETCH_TASK)))
    base = storage.join(dataset_uri, "shards", "plans", plan_id)
    plan = FetchPlan(
        plan_id=plan_id,
        tasks=tasks,
        shards=len(items),
        items_prefix=storage.join(base, "task-"),
        journal_dir=journal_dir(dataset_uri),
        code=code,
        options=options,
    )
    for index in range(tasks):
        storage.write_bytes(plan.items_uri(index), b"\n".join(orjson.dumps(i) for i in items[index::tasks]) + b"\n")
    plan_uri = storage.join(base, "plan.json")
    storage.write_json(plan_uri, plan.model_dump(mode="json"))
    return plan_uri, plan


def _secret_env() -> list[str]:
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
        secret_env=_secret_env(),  # HF_TOKEN goes to huggingface.co only (infra.fetch)
    )


def job_paths(dataset_uri: str, urls: list[str]) -> tuple[list[str], list[str]]:
    """(read-write, read-only) directories a job sees in a container: the dataset, the local sources' root."""
    rw = [storage.local_path(dataset_uri)] if storage.is_local(dataset_uri) else []
    local = [storage.local_path(u) for u in urls if _scheme(u) == "file"]
    ro = [os.path.commonpath([os.path.dirname(p) for p in local])] if local else []
    return rw, ro


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
    records = read_manifest(dataset_uri)
    merged, failures = merge_journals(dataset_uri, records)
    if failures:
        _failed_table(failures, plan.shards)
        named = "; ".join(f"{name}: {error}" for name, error in sorted(failures.items())[:3])
        more = f" (and {len(failures) - 3} more: see the failed-shards artifact)" if len(failures) > 3 else ""
        raise ShardsFailed(f"{len(failures)} of {plan.shards} shard(s) failed: {named}{more}")
    if job_error is not None:
        raise job_error
    storage.remove(storage.parent(plan_uri), recursive=True)
    return FetchSummary(shards=plan.shards, recorded=merged, seconds=time.monotonic() - started)


# ----------------------------------------------------------------------------- tokenize


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
        secret_env=_secret_env(),
    )


def tokenize_cache_policy():
    return cache_policy("workloads.tokenize", "workloads.tokenize_array", "workloads.shards", "tasks.data")


@task(
    name="tokenize",
    task_run_name="tokenize {n} part(s)",
    retries=2,
    retry_delay_seconds=10,
    cache_policy=tokenize_cache_policy(),
    cache_expiration=timedelta(days=30),
    persist_result=True,
)
def tokenize_parts(
    parts: list[PartInput],
    tokenizer: TokenizerRef,
    dataset_uri: str,
    json_keys: list[str],
    append_eod: bool,
    workers: int,
    skip_malformed: bool,
    n: int,
    executor: Executor | Any = None,
    image: ImageRef | None = None,
) -> list[TokenizedPart]:
    """Concatenate and tokenize every part not already tokenized with the same identity, as ONE
    array job where the executor says; parts finished by an earlier (even failed) run are reused."""
    log = logger()
    code = code_fingerprint("workloads.shards")
    items: list[PlanItem] = []
    for part in parts:
        identity = _part_identity(part, dataset_uri, tokenizer, json_keys, append_eod, code)
        base = _output_base(dataset_uri, part.name)
        if all(finished_part(f"{base}_{key}_document", identity) for key in json_keys):
            continue
        items.append(
            PlanItem(
                input=_concat_uri(dataset_uri, part.name),
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
        identity = _part_identity(part, dataset_uri, tokenizer, json_keys, append_eod, code)
        base = _output_base(dataset_uri, part.name)
        for key in json_keys:
            done = finished_part(f"{base}_{key}_document", identity)
            if done is None:
                raise RuntimeError(f"the tokenize job ended but {base}_{key}_document is missing or incomplete")
            out.append(done)
    return out


def tokenized_so_far(dataset_uri: str, parts: list[PartInput], json_keys: list[str]) -> int:
    """Parts whose stats file exists (progress while the tokenize job runs; the task checks identities)."""
    key = json_keys[-1]
    return sum(storage.exists(stats_uri(f"{_output_base(dataset_uri, p.name)}_{key}_document")) for p in parts)


def shards_digest(check: ShardCheck) -> str:
    """Content identity of the dataset's shards, in order (a cache key part for the blend)."""
    digest = hashlib.sha256()
    for name in check.names:
        digest.update(name.encode() + b"\0" + check.records[name]["sha256"].encode() + b"\n")
    return digest.hexdigest()


# ----------------------------------------------------------------------------- blend


def blend_weights(prefixes_and_sizes: list[tuple[str, int]], alpha: float = 1.0) -> list:
    """NeMo ``data_prefix``: weights proportional to each file's ``.bin`` size (to the power alpha).

    Same rule as NeMo's auto_blend.py for GPT (every .bin is its own split):
    weight = size**alpha / sum(size**alpha), rounded to 6 digits.

    >>> blend_weights([("a", 300), ("b", 100)])
    [0.75, 'a', 0.25, 'b']
    """
    if not prefixes_and_sizes:
        raise ValueError("nothing to blend: no tokenized files")
    powered = [(p, math.pow(size, alpha)) for p, size in prefixes_and_sizes]
    total = sum(w for _, w in powered)
    if total <= 0:
        raise ValueError("nothing to blend: every tokenized file is empty")
    out: list = []
    for prefix, weight in powered:
        out.extend([round(weight / total, 6), prefix])
    return out


def auto_blend_text(blend: list) -> str:
    """The blend exactly as NeMo's auto_blend.py prints it (Python repr, no spaces)."""
    return str(blend).replace(" ", "")


@task(
    name="blend",
    task_run_name="blend {name}",
    retries=RETRIES,
    retry_delay_seconds=5,
    cache_policy=cache_policy("tasks.data"),
    cache_expiration=timedelta(days=30),
    persist_result=True,
)
def write_blend(
    name: str,
    dataset_uri: str,
    shards: list[str],
    shards_sha256: str,
    parts: list[TokenizedPart],
    tokenizer: TokenizerRef,
    json_keys: list[str],
    append_eod: bool,
    alpha: float = 1.0,
) -> DatasetRef:
    """``shards``: the dataset's shard names in order; ``shards_sha256`` (:func:`shards_digest`) keys the
    cache by their content. Their details come from the shard manifest."""
    from tasks.refs import now

    records = read_manifest(dataset_uri)
    ordered = sorted(parts, key=lambda p: p.prefix)
    blend = blend_weights([(p.prefix, p.bin_bytes) for p in ordered], alpha)
    manifest = DatasetManifest(
        name=name,
        uri=dataset_uri,
        sources=[records[n]["url"] for n in shards],
        shards=[
            {
                "name": n,
                "url": records[n]["url"],
                "uri": records[n]["raw"],
                "size": records[n]["size"],
                "sha256": records[n]["sha256"],
                "etag": records[n]["etag"],
            }
            for n in shards
        ],
        parts=ordered,
        blend=blend,
        tokenizer=tokenizer,
        json_keys=json_keys,
        append_eod=append_eod,
        created=now().isoformat(),
    )
    manifest_uri = storage.join(dataset_uri, "manifest.json")
    storage.write_text(storage.join(dataset_uri, "blend.json"), json.dumps(blend) + "\n")
    storage.write_text(storage.join(dataset_uri, "data_prefix.txt"), auto_blend_text(blend) + "\n")
    storage.write_json(manifest_uri, manifest.model_dump(mode="json"))
    logger().info("data_prefix=%s", auto_blend_text(blend))
    return DatasetRef(
        prefixes=[p.prefix for p in ordered],
        blend=blend,
        manifest_uri=manifest_uri,
        tokenizer=tokenizer,
        documents=sum(p.documents for p in ordered),
        tokens=sum(p.tokens for p in ordered),
        bytes=sum(p.bytes_in for p in ordered),
    )


def publish_table(dataset: DatasetRef, parts: list[TokenizedPart], seconds: float) -> None:
    rows = [
        {
            "file": storage.basename(p.prefix),
            "documents": p.documents,
            "tokens": p.tokens,
            "text MB": round(p.bytes_in / 1e6, 2),
            ".bin MB": round(p.bin_bytes / 1e6, 2),
            "MB/s": "cached" if p.reused else round(p.bytes_in / 1e6 / max(p.seconds, 1e-9), 2),
            "weight": dataset.blend[2 * i],
        }
        for i, p in enumerate(sorted(parts, key=lambda p: p.prefix))
    ]
    rows.append(
        {
            "file": "TOTAL",
            "documents": dataset.documents,
            "tokens": dataset.tokens,
            "text MB": round(dataset.bytes / 1e6, 2),
            ".bin MB": round(sum(p.bin_bytes for p in parts) / 1e6, 2),
            "MB/s": round(dataset.bytes / 1e6 / max(seconds, 1e-9), 2),
            "weight": 1.0,
        }
    )
    create_table_artifact(
        key="prepared-dataset",
        table=rows,
        description=f"Prepared dataset: {dataset.manifest_uri}\n\n`data_prefix={auto_blend_text(dataset.blend)}`",
    )
