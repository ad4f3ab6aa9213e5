"""What the data stage's steps hand each other (the manifest, part keys) and its progress artifact."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from prefect.artifacts import create_progress_artifact, update_progress_artifact
from pydantic import BaseModel, Field

from tasks.refs import TokenizerRef
from workloads.tokenize_array import TokenizedPart


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
