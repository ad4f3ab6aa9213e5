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
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from prefect import task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import INPUTS, NO_CACHE
from pydantic import BaseModel, Field

from infra import storage
from infra.configs.fetch import FetchOptions
from infra.executors import Executor
from infra.jobs import ImageRef, JobFailed, JobSpec, Resources, workload_job
from infra.settings import get_settings
from tasks.common import CodeVersion, cache_policy, code_fingerprint, logger, run_job, transient_only
from tasks.refs import DatasetRef, TokenizerRef
from workloads.fetch_array import FetchPlan
from workloads.jsonl import MAX_LINE_BYTES
from workloads.shard_manifest import (
    ShardEntry,
    index_manifest,
    journal_dir,
    manifest_lines,
    merge_journals,
    state_key,
    url_digest,
)
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
MIN_SHARDS_PER_FETCH_TASK = 256
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


class PartKey(BaseModel):
    """One part as the tokenize step's cache key sees it: the content of its shards, in order."""

    name: str
    shards: int
    shards_sha256: str = Field(
        ..., description="over (extracted file, sha256 of its download) in order + extraction code"
    )
    bytes: int


class PartInput(PartKey):
    """A part still to tokenize: its extracted shards too (only unfinished parts carry the list)."""

    inputs: list[str]


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
            with contextlib.suppress(Exception):
                self.set(poll())  # where the step ended, also when it failed


# ----------------------------------------------------------------------------- check (in the flow)


def raw_uri(dataset_uri: str, name: str) -> str:
    return storage.join(dataset_uri, "raw", name)


def extracted_uri(dataset_uri: str, name: str) -> str:
    return storage.join(dataset_uri, "extracted", name.removesuffix(".zst"))


def _scheme(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def _folder_listing(folder: str) -> dict[str, dict]:
    """fsspec info of every object in ``folder``, by URI (one listing call, not one per object)."""
    fs, path = storage.url_to_fs(folder)
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return {}
    return {storage.to_uri(fs, entry["name"]): entry for entry in entries}


def iter_identities(urls: list[str]) -> Iterator[dict | None]:
    """What tells a changed source from a known one, per source (None: not checked, see revalidate).

    Local files: size and modification time (infra.fetch.probe, a stat). GCS: size, etag/generation,
    md5, crc32c, from one listing per folder (sources come folder by folder). HTTP(S): None; a HEAD
    per shard per run is what made re-runs cost as much as the work at 59,166 shards (and a
    rate-limited host would refuse it).
    """
    from infra.fetch import NotFound, probe

    folder, listing = None, {}
    for url in urls:
        scheme = _scheme(url)
        if scheme == "file":
            info = probe(url)
            yield {"size": info.size, "last_modified": info.last_modified}
        elif scheme in ("gs", "gcs"):
            url = "gs://" + url.split("://", 1)[1]
            if storage.parent(url) != folder:
                folder = storage.parent(url)
                listing = _folder_listing(folder)
            meta = listing.get(url)
            if meta is None:
                raise NotFound(f"not found: {url}")
            yield {
                "size": int(meta["size"]) if meta.get("size") is not None else None,
                "etag": meta.get("etag") or (str(meta["generation"]) if meta.get("generation") else None),
                "md5": meta.get("md5Hash"),
                "crc32c": meta.get("crc32c"),
            }
        else:
            yield None


@dataclasses.dataclass
class ShardCheck:
    """The flow's view of the sources after :func:`check_shards`: plain data, a few hundred bytes a
    shard (names and URLs as strings, not Source models; records as :class:`ShardEntry`; the pending
    shards' identities as JSON bytes). Never a task input."""

    dataset_uri: str
    names: list[str]
    urls: list[str]
    index: dict[str, ShardEntry]
    pending: list[tuple[int, bytes]]  # (position in names/urls, the identity the flow saw as JSON: b"null" if none)
    code: str
    seconds: float


def _compact_json(value: Any) -> bytes:
    # Not orjson: each bytes object it returns keeps a ~4 KB buffer (234 MB for 59,166 kept results).
    return json.dumps(value, separators=(",", ":")).encode()


def check_shards(names: list[str], urls: list[str], dataset_uri: str, revalidate: bool = False) -> ShardCheck:
    """Which shards need downloading/extracting: one manifest read, one identity per source.

    ``names``/``urls``: the sources' (:func:`infra.sources.expand_sources`) as plain strings, so the
    caller can free the Source models (~700 bytes a shard) first.
    """
    started = time.monotonic()
    merged, _ = merge_journals(dataset_uri, clean=True)  # what a killed run finished but did not merge
    if merged:
        logger().info("merged %d shard record(s) a previous run left in its journal", merged)
    storage.remove(storage.join(dataset_uri, "shards", "plans"), recursive=True)
    code = code_fingerprint("workloads.shards")
    index = index_manifest(dataset_uri)
    pending: list[tuple[int, bytes]] = []
    for position, (name, url, remote) in enumerate(zip(names, urls, iter_identities(urls))):
        entry = index.get(name)
        if entry is not None:
            digest = url_digest(url)
            if remote is not None:
                current = entry.full == state_key(digest, code, remote)
            else:
                current = not revalidate and entry.trusted == state_key(digest, code)
            if current:
                continue
        pending.append((position, _compact_json(remote)))
    return ShardCheck(dataset_uri, names, urls, index, pending, code, time.monotonic() - started)


def _sizes(uris: list[str]) -> dict[str, int]:
    """Sizes of the files that exist among ``uris`` (a stat each locally, one listing per folder on GCS)."""
    sizes: dict[str, int] = {}
    listings: dict[str, dict[str, dict]] = {}
    for uri in uris:
        if storage.is_local(uri):
            with contextlib.suppress(OSError):
                sizes[uri] = os.path.getsize(storage.local_path(uri))
            continue
        folder = storage.parent(uri)
        if folder not in listings:
            listings[folder] = _folder_listing(folder)
        if (meta := listings[folder].get(uri)) is not None:
            sizes[uri] = int(meta.get("size") or 0)
    return sizes


def _concat_uri(dataset_uri: str, part_name: str) -> str:
    return storage.join(dataset_uri, "concat", f"{part_name}.jsonl")


def _output_base(dataset_uri: str, part_name: str) -> str:
    return storage.join(dataset_uri, "tokenized", part_name)


def part_keys(check: ShardCheck, groups: list[list[str]]) -> list[PartKey | None]:
    """Each part's content key from the shard records (None while one of its shards has none)."""
    keys: list[PartKey | None] = []
    for index, names in enumerate(groups):
        entries = [check.index.get(n) for n in names]
        if any(e is None for e in entries):
            keys.append(None)
            continue
        digest = hashlib.sha256(check.code.encode() + b"\n")
        for name, entry in zip(names, entries):
            digest.update(f"{extracted_uri(check.dataset_uri, name)}\0{entry.sha256}\n".encode())
        keys.append(
            PartKey(
                name=f"part-{index:05d}",
                shards=len(names),
                shards_sha256=digest.hexdigest(),
                bytes=sum(e.bytes for e in entries),
            )
        )
    return keys


def part_identity(
    key: PartKey, dataset_uri: str, tokenizer: TokenizerRef, json_keys: list[str], append_eod: bool
) -> dict:
    """What a tokenized part's stats file must state for the part to count as done."""
    return {
        "input": _concat_uri(dataset_uri, key.name),
        "shards": key.shards,
        "shards_sha256": key.shards_sha256,
        "tokenizer": tokenizer.fingerprint,
        "json_keys": list(json_keys),
        "append_eod": append_eod,
        "code": code_fingerprint("workloads.tokenize"),
    }


def part_done(key: PartKey, dataset_uri: str, tokenizer: TokenizerRef, json_keys: list[str], append_eod: bool) -> bool:
    identity = part_identity(key, dataset_uri, tokenizer, json_keys, append_eod)
    base = _output_base(dataset_uri, key.name)
    return all(finished_part(f"{base}_{k}_document", identity) for k in json_keys)


def settle_parts(
    check: ShardCheck, groups: list[list[str]], tokenizer: TokenizerRef, json_keys: list[str], append_eod: bool
) -> tuple[set[int], int]:
    """(parts already tokenized from the shards as recorded, shards to extract again).

    A part whose shards are all current and which is tokenized with the same identity needs
    nothing (its extracted shards may even have been deleted to save space). Any other part needs
    every shard's extracted file, so recorded shards whose file is gone are fetched again (added to
    ``check.pending``). Costs a stat per shard of the parts left to do, nothing for finished parts.
    """
    pending = {position for position, _ in check.pending}
    done: set[int] = set()
    wanted: list[int] = []
    start = 0
    for index, (key, names) in enumerate(zip(part_keys(check, groups), groups)):
        positions = range(start, start + len(names))
        start += len(names)
        untouched = not any(p in pending for p in positions)
        if key is not None and untouched and part_done(key, check.dataset_uri, tokenizer, json_keys, append_eod):
            done.add(index)
        else:
            wanted += [p for p in positions if p not in pending]
    if not wanted:
        return done, 0
    uris = {p: extracted_uri(check.dataset_uri, check.names[p]) for p in wanted}
    sizes = _sizes(list(uris.values()))
    missing = [p for p in wanted if sizes.get(uris[p]) != check.index[check.names[p]].bytes]
    identities = iter_identities([check.urls[p] for p in missing])
    check.pending += [(p, _compact_json(remote)) for p, remote in zip(missing, identities)]
    return done, len(missing)


def part_inputs(check: ShardCheck, groups: list[list[str]], keys: list[PartKey | None]) -> list[PartInput]:
    """The parts given (by key) with their extracted shards, for the tokenize plan."""
    out = []
    by_name = {f"part-{i:05d}": names for i, names in enumerate(groups)}
    for key in keys:
        if key is None:
            raise RuntimeError(f"a shard of the dataset has no record after the fetch step (see {check.dataset_uri})")
        inputs = [extracted_uri(check.dataset_uri, n) for n in by_name[key.name]]
        out.append(PartInput(**key.model_dump(), inputs=inputs))
    return out


# ----------------------------------------------------------------------------- download + extract


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
    folders = sorted({os.path.dirname(storage.local_path(u)) for u in urls if _scheme(u) == "file"})
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
        base = _output_base(dataset_uri, part.name)
        for key in json_keys:
            done = finished_part(f"{base}_{key}_document", identity)
            if done is None:
                raise RuntimeError(f"the tokenize job ended but {base}_{key}_document is missing or incomplete")
            out.append(done)
    return out


def tokenized_so_far(dataset_uri: str, parts: list[PartKey], json_keys: list[str]) -> int:
    """Parts whose stats file exists (progress while the tokenize job runs; the task checks identities)."""
    key = json_keys[-1]
    return sum(storage.exists(stats_uri(f"{_output_base(dataset_uri, p.name)}_{key}_document")) for p in parts)


def shards_digest(check: ShardCheck) -> str:
    """Content identity of the dataset's shards, in order (a cache key part for the blend)."""
    digest = hashlib.sha256()
    for name in check.names:
        digest.update(f"{name}\0{check.index[name].sha256}\n".encode())
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
    retry_condition_fn=transient_only(),
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

    ordered = sorted(parts, key=lambda p: p.prefix)
    blend = blend_weights([(p.prefix, p.bin_bytes) for p in ordered], alpha)
    manifest = DatasetManifest(
        name=name,
        uri=dataset_uri,
        sources=[],
        shards=[],
        parts=ordered,
        blend=blend,
        tokenizer=tokenizer,
        json_keys=json_keys,
        append_eod=append_eod,
        created=now().isoformat(),
    )
    lines = {orjson.loads(line)["name"]: line for line in manifest_lines(dataset_uri)}

    def shard_entries() -> Iterator[dict]:
        for n in shards:
            r = orjson.loads(lines[n])
            yield {
                "name": n,
                "url": r["url"],
                "uri": r["raw"],
                "size": r["size"],
                "sha256": r["sha256"],
                "etag": r["etag"],
            }

    manifest_uri = storage.join(dataset_uri, "manifest.json")
    storage.write_text(storage.join(dataset_uri, "blend.json"), json.dumps(blend) + "\n")
    storage.write_text(storage.join(dataset_uri, "data_prefix.txt"), auto_blend_text(blend) + "\n")
    with storage.atomic_open(manifest_uri, "w") as fh:
        write_json_streaming(
            fh,
            manifest.model_dump(mode="json"),
            {"shards": shard_entries(), "sources": (orjson.loads(lines[n])["url"] for n in shards)},
        )
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


def write_json_streaming(fh, obj: dict, streamed: dict[str, Iterable]) -> None:
    """Write ``obj`` exactly as ``json.dumps(obj, indent=2, sort_keys=True) + "\\n"`` (storage.write_json's
    format), with the lists of ``streamed`` produced item by item instead of held in memory: a
    SlimPajama manifest lists 59,166 shards."""

    def dumps(value: Any, indent: str) -> str:
        return json.dumps(value, indent=2, sort_keys=True, default=str).replace("\n", "\n" + indent)

    fh.write("{")
    for i, key in enumerate(sorted({**obj, **streamed})):
        fh.write(("," if i else "") + "\n  " + json.dumps(key) + ": ")
        if key not in streamed:
            fh.write(dumps(obj[key], "  "))
            continue
        empty = True
        for item in streamed[key]:
            fh.write(("[" if empty else ",") + "\n    " + dumps(item, "    "))
            empty = False
        fh.write("[]" if empty else "\n  ]")
    fh.write("\n}\n")


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
