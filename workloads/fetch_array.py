"""One task of the data stage's download + extract job array: ``python -m workloads.fetch_array --plan PLAN.json``.

The data stage (tasks/data/fetching.py) writes a :class:`FetchPlan` and one item file per array task
(``<items_prefix>NNNNN.jsonl``, one :class:`FetchItem` per line: the shards of that task),
then submits ONE array job (N local processes, a Slurm job array, an Indexed Kubernetes
Job). Each task picks its file by ``NEMOFLOW_ARRAY_INDEX`` and, for each of its shards,
``threads`` at a time:

1. skips it if the sidecar beside the extracted file says it is done for this source and
   this extraction code (a retried, requeued or re-run task never redoes a shard);
2. downloads it with ``infra.fetch.download`` (resume, retries with backoff, size and
   checksum verification, atomic; a verified file already there is not fetched again),
   paced by a :class:`~workloads.throttle.HostThrottle` that every task of the job shares;
3. extracts it (``.zst`` -> ``.jsonl``; plain JSON lines are copied); a truncated or corrupt
   archive is downloaded again once, then the shard fails naming itself;
4. writes the shard's record (sidecar, then the task's journal: workloads/shard_manifest.py).

A shard that fails is recorded as failed (one line: what went wrong) and the task goes on
with the others: one bad shard must not stop 59,165 good ones, and on the local backend a
failing task would also keep the array's later tasks from starting. The task therefore exits
0 when it went through its list; the stage reads the failures from the journals, shows them
in the Prefect UI and fails the run naming them. It exits 2 for a plan it cannot use.

Log volume is bounded: a start line, a progress line every ``PROGRESS_EVERY_S`` seconds, a
line per failed shard, the log of shards that needed retries (at most ``NOISY_SHARDS`` of
them) and a summary. At 59,166 shards, a line per event would be 100,000+ rows in Prefect's
database.

Rate limits: ``requests_per_second`` is the whole job's; each task takes an equal share. A
429 seen by any thread starts a cooldown for that host in every task (see workloads.throttle).
"""

from __future__ import annotations

import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from urllib.parse import urlsplit

import orjson
from pydantic import BaseModel, Field

from infra import storage
from infra.configs.fetch import FetchOptions
from infra.jobs import ExitCode
from infra.settings import redact
from workloads.array_task import read_array_task
from workloads.shard_manifest import (
    Journal,
    ShardFailure,
    ShardRecord,
    is_current,
    read_sidecar,
    url_digest,
    write_sidecar,
)
from workloads.throttle import DEFAULT_COOLDOWN_S, HostThrottle

_HTTP_STATUS = re.compile(r"\bHTTP (\d{3})\b")
PROGRESS_EVERY_S = 30.0
NOISY_SHARDS = 20


class FetchItem(BaseModel):
    name: str
    url: str
    raw: str = Field(..., description="where the download goes")
    extracted: str = Field(..., description="where the extracted .jsonl goes")
    remote: dict | None = Field(None, description="the source's identity as the flow saw it; None: HTTP(S)")


class FetchPlan(BaseModel):
    plan_id: str
    tasks: int = Field(..., ge=1)
    shards: int
    items_prefix: str = Field(..., description="task i reads '<items_prefix><i:05d>.jsonl'")
    journal_dir: str
    code: str = Field(..., description="fingerprint of the extraction code, recorded with every shard")
    options: FetchOptions = Field(default_factory=FetchOptions)

    def items_uri(self, task: int) -> str:
        return f"{self.items_prefix}{task:05d}.jsonl"


def _scheme(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def _host(url: str) -> str | None:
    """The host a request goes to (None for local files, which need no pacing)."""
    scheme = _scheme(url)
    if scheme == "file":
        return None
    if scheme in ("gs", "gcs"):
        return "storage.googleapis.com"
    return urlsplit(url).hostname or url


def _http_identity(size: int | None, etag: str | None) -> dict:
    return {"size": size, "etag": etag}


class ShardFetcher:
    """Everything one array task does to one shard (see the module docstring)."""

    def __init__(self, plan: FetchPlan, throttle: HostThrottle, log=print):
        self.plan = plan
        self.throttle = throttle
        self.log = log
        self.noisy = 0
        self._lock = threading.Lock()

    def _download(self, item: FetchItem, remote: dict | None, host: str | None):
        from infra.fetch import download

        lines: list[str] = []

        def note(line: str) -> None:
            lines.append(line)
            if host is not None:
                self.throttle.note_log_line(host, line)

        if host is not None:
            self.throttle.wait(host)
        remote = remote or {}
        try:
            result = download(
                item.url, item.raw, expected_size=remote.get("size"), expected_sha256=remote.get("sha256"), log=note
            )
        finally:
            # Show the log of a shard that needed more than one attempt (the rest is noise at this scale).
            if len(lines) > 3 or any("failed" in line for line in lines):
                with self._lock:
                    self.noisy += 1
                    show = self.noisy <= NOISY_SHARDS
                if show:
                    for line in lines:
                        self.log(line)
        return result

    def _probe(self, item: FetchItem, host: str | None) -> dict:
        """The HTTP(S) source's identity now (revalidation), with retries that respect 429s."""
        from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

        from infra.fetch import FetchError, NotFound, probe

        def transient(exc: BaseException) -> bool:
            if not isinstance(exc, FetchError) or isinstance(exc, NotFound):
                return False
            status = _HTTP_STATUS.search(str(exc))
            code = int(status.group(1)) if status else None  # None: the host could not be reached
            if code == 429 and host is not None:
                self.throttle.cool_down(host, DEFAULT_COOLDOWN_S)
            return code is None or code in (408, 429) or code >= 500

        for attempt in Retrying(
            stop=stop_after_attempt(6),
            wait=wait_exponential_jitter(initial=1, max=60),
            retry=retry_if_exception(transient),
            reraise=True,
        ):
            with attempt:
                if host is not None:
                    self.throttle.wait(host)
                info = probe(item.url)
        return _http_identity(info.size, info.etag)

    def _extract(self, item: FetchItem, raw_uri: str):
        from workloads.shards import ExtractResult, concatenate, extract_zst

        if not raw_uri.endswith(".zst"):
            # Already plain JSON lines: "extracting" is a verified copy under extracted/.
            copied = concatenate([raw_uri], item.extracted)
            return ExtractResult(uri=copied.uri, bytes=copied.bytes, lines=copied.lines, source=raw_uri)
        return extract_zst(raw_uri, item.extracted, delete_source=self.plan.options.delete_compressed)

    def fetch(self, item: FetchItem) -> tuple[ShardRecord, bool]:
        """(the shard's record, whether it was reused as it was)."""
        from workloads.shards import CorruptArchive

        digest = url_digest(item.url)
        host = _host(item.url)
        remote = item.remote
        known = read_sidecar(item.extracted)
        if remote is None and known is not None and self.plan.options.revalidate and known.url_sha256 == digest:
            remote = self._probe(item, host)
            if {k: known.remote.get(k) for k in remote} != remote:
                known = known.model_copy(update={"remote": {}})  # changed at the source: not current
        if known is not None and is_current(known.model_dump(), digest, remote, self.plan.code):
            return known, True
        fetched = self._download(item, remote, host)
        if (
            known is not None
            and known.sha256 == fetched.sha256
            and known.code == self.plan.code
            and known.extracted == item.extracted
        ):
            # Same bytes as when it was extracted (a touched file, a re-probed URL): the extraction stands.
            extracted = (known.bytes, known.lines)
        else:
            try:
                result = self._extract(item, fetched.uri)
            except CorruptArchive as first:
                self.log(redact(f"{item.name}: {first}; fetching it again once"))
                storage.remove(fetched.uri)
                storage.remove(fetched.uri + ".meta.json")
                fetched = self._download(item, None, host)
                try:
                    result = self._extract(item, fetched.uri)
                except CorruptArchive as second:
                    raise CorruptArchive(
                        f"shard {item.name} is corrupt even after a fresh download: {second}"
                    ) from second
            extracted = (result.bytes, result.lines)
        record = ShardRecord(
            name=item.name,
            url=fetched.url,
            url_sha256=digest,
            remote=remote if remote is not None else _http_identity(fetched.size, fetched.etag),
            raw=item.raw,
            size=fetched.size,
            sha256=fetched.sha256,
            etag=fetched.etag,
            extracted=item.extracted,
            bytes=extracted[0],
            lines=extracted[1],
            code=self.plan.code,
        )
        write_sidecar(record)
        return record, False


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return redact(text if len(text) < 1000 else text[:1000] + "...")


def run_task(plan: FetchPlan, index: int, log=print) -> Journal:
    items = [
        FetchItem.model_validate(orjson.loads(line)) for line in storage.read_bytes(plan.items_uri(index)).splitlines()
    ]
    journal = Journal(plan.journal_dir, plan.plan_id, index, total=len(items))
    rate = plan.options.requests_per_second / plan.tasks if plan.options.requests_per_second else None
    throttle = HostThrottle(rate, shared_dir=plan.journal_dir)
    fetcher = ShardFetcher(plan, throttle, log)
    log(f"task {index + 1}/{plan.tasks}: {len(items)} shard(s), {plan.options.threads} at a time")
    started = last_report = time.monotonic()
    reused = fetched_bytes = 0
    failures: list[ShardFailure] = []
    with ThreadPoolExecutor(max_workers=plan.options.threads) as pool:
        futures = {pool.submit(fetcher.fetch, item): item for item in items}
        for future in as_completed(futures):
            item = futures[future]
            try:
                record, was_reused = future.result()
            except Exception as exc:  # noqa: BLE001 - one shard's failure is recorded; the others go on
                failure = ShardFailure(name=item.name, error=_one_line(exc))
                failures.append(failure)
                journal.add(failure)
                log(f"FAILED {item.name}: {failure.error}")
                continue
            journal.add(record)
            reused += was_reused
            fetched_bytes += 0 if was_reused else record.size
            if time.monotonic() - last_report >= PROGRESS_EVERY_S:
                last_report = time.monotonic()
                log(f"task {index + 1}: {journal.done + journal.failed}/{len(items)} shard(s) done")
    journal.flush()
    seconds = time.monotonic() - started
    log(
        f"task {index + 1}/{plan.tasks}: {journal.done} done ({reused} already there), {len(failures)} failed, "
        f"{fetched_bytes / 1e6:.1f} MB in {seconds:.1f}s"
        + (f", waited {throttle.paused_s:.0f}s for rate limits" if throttle.paused_s else "")
    )
    return journal


def main(argv: list[str] | None = None) -> int:
    task = read_array_task(argv, __doc__, FetchPlan, lambda plan: plan.tasks, "task")
    if task is None:
        return ExitCode.BAD_CONFIG
    plan, index = task
    run_task(plan, index, log=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
