"""The model registry: which checkpoint serves, where it came from, and everything it saw.

    reg = ModelRegistry("gs://bucket/nemoflow/registry")     # or a local directory
    state = reg.read()
    reg.register(ModelRecord(id=..., checkpoint=..., parent=state.promoted, ...), promote=True,
                 expected_generation=state.generation)
    reg.rollback()

Layout under the registry URI::

    registry.json              the current document (RegistryState), replaced atomically
    history/00000007.json      one file per committed change (generation 7): append-only log

Every change is a read-modify-write of ``registry.json`` guarded by its
``generation`` number: a writer states the generation it read, and the commit
is refused (:class:`ConcurrentUpdate`) when the document moved on meanwhile,
so two refreshes never both promote from the same base. The read-modify-write
is exact on both kinds of storage:

- a local registry: the check and the write happen under an ``flock``;
- ``gs://``: the document is read with its object generation and written with
  the precondition ``ifGenerationMatch`` (GCS refuses the upload with 412 when
  another writer replaced the object since): a writer that did not state a
  generation re-reads and re-applies its change; one that did gets
  :class:`ConcurrentUpdate`. An object upload is atomic on GCS: readers see the
  old document or the new one, never a part.

Elsewhere the document is written with :func:`infra.storage.write_json`
(temporary file, then rename or copy): a failed write leaves the previous
document in place.

The registry also keeps what a continued-pretraining refresh needs between
runs: ``processed_sources`` (every input already trained on, with its
checksum) and ``held_out`` (the fixed held-out set candidates and the promoted
model are compared on).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

from filelock import FileLock
from pydantic import BaseModel, Field

from infra import storage
from infra.retry import RetryPolicy
from infra.settings import get_settings

DOCUMENT = "registry.json"
HISTORY = "history"
# gs://: how often a writer that did not state a generation re-reads and re-applies its change after another
# writer's commit won the race (each round, one of the racing writers commits).
COMMIT_ATTEMPTS = 30


class _LostRace(Exception):
    """Another writer committed the generation this one read: re-read and re-apply (retried)."""


# A lost race is retried, nothing else: the waits are full-jitter backoff from 20 ms up to 1 s.
COMMIT_RETRY = RetryPolicy(
    attempts=COMMIT_ATTEMPTS,
    initial=0.02,
    maximum=1.0,
    budget=None,
    transient=lambda exc: isinstance(exc, _LostRace),
)


class RegistryError(RuntimeError):
    """The registry cannot do what was asked; the message says why."""


class ConcurrentUpdate(RegistryError):
    """Another writer committed since this one read the registry."""


class UnknownModel(RegistryError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0] if self.args else ""


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class SourceRecord(BaseModel):
    """One input file a model was trained on."""

    name: str
    url: str
    sha256: str | None = None
    size: int | None = None


class HeldOut(BaseModel):
    """The fixed held-out set: the validation split of ``data_prefix`` with this split, seed and length."""

    data_prefix: list
    tokenizer_model: str | None = None
    seq_length: int
    split: str = "98,1,1"
    seed: int = 1234
    num_batches: int = 8
    origin: str = Field("", description="where it came from, e.g. 'validation split of model m-... dataset'")


class ModelRecord(BaseModel):
    id: str
    checkpoint: str = Field(..., description="checkpoint directory URI")
    parent: str | None = Field(None, description="id of the model it continued from")
    created_at: str = Field(default_factory=now)
    data: list[SourceRecord] = Field(default_factory=list, description="new inputs this model trained on")
    dataset_manifest: str | None = None
    metrics: dict = Field(default_factory=dict, description="val_loss, held_out_loss, tokens, ...")
    image: dict | None = None
    code_version: str | None = None
    flow_run_id: str | None = None
    note: str = ""


class Serving(BaseModel):
    """What answers on the user-facing endpoint: the service, its port and where it runs."""

    model: str
    service: str
    port: int
    model_name: str
    url: str
    executor: dict | None = Field(None, description="the executor it runs on (infra.executors), None = local")


class RegistryState(BaseModel):
    generation: int = 0
    promoted: str | None = None
    promotions: list[str] = Field(default_factory=list, description="promotion stack; rollback pops it")
    models: dict[str, ModelRecord] = Field(default_factory=dict)
    processed_sources: dict[str, SourceRecord] = Field(default_factory=dict, description="by source url")
    held_out: HeldOut | None = None
    serving: Serving | None = None
    updated_at: str | None = None

    def model(self, model_id: str) -> ModelRecord:
        if model_id not in self.models:
            known = ", ".join(sorted(self.models)) or "none"
            raise UnknownModel(f"no model {model_id!r} in the registry (known: {known})")
        return self.models[model_id]

    def promoted_model(self) -> ModelRecord | None:
        return self.models.get(self.promoted) if self.promoted else None

    def lineage(self, model_id: str) -> list[ModelRecord]:
        """The model and its ancestors, newest first."""
        chain, seen = [], set()
        current: str | None = model_id
        while current and current not in seen and current in self.models:
            seen.add(current)
            chain.append(self.models[current])
            current = self.models[current].parent
        return chain


def code_version(repo: str | None = None) -> str:
    """``git:<commit>`` (``+dirty`` with local changes) of the checkout, else ``sha256:`` of its Python files."""
    root = Path(repo or Path(__file__).resolve().parents[1])
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return f"git:{commit}" + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        digest = hashlib.sha256()
        for path in sorted(root.glob("[a-z]*/**/*.py")):
            if ".venv" in path.parts:
                continue
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
        return "sha256:" + digest.hexdigest()[:16]


def _gcs_client():
    """A google-cloud-storage client configured as :func:`infra.storage.filesystem` configures gcsfs: the
    NEMOFLOW_GCS_ENDPOINT (an emulator) anonymously, else Google's with the default credentials."""
    from google.cloud import storage as gcs

    settings = get_settings()
    if settings.gcs_endpoint:
        from google.auth.credentials import AnonymousCredentials

        return gcs.Client(
            project=settings.gcs_project or "nemoflow",
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": settings.gcs_endpoint},
        )
    return gcs.Client(project=settings.gcs_project)


class ModelRegistry:
    """A registry at ``uri`` (local directory or gs://); see the module docstring."""

    def __init__(self, uri: str):
        self.uri = storage.normalize(uri)
        self.conflicts = 0  # gs://: commits that lost a race and were re-applied (for logs and tests)

    @property
    def document_uri(self) -> str:
        return storage.join(self.uri, DOCUMENT)

    def read(self) -> RegistryState:
        if not storage.exists(self.document_uri):
            return RegistryState()
        try:
            return RegistryState.model_validate(storage.read_json(self.document_uri))
        except ValueError as exc:
            raise RegistryError(f"model registry {self.document_uri} is not a valid registry document: {exc}") from exc

    def history(self) -> list[dict]:
        entries = [u for u in storage.listdir(storage.join(self.uri, HISTORY)) if u.endswith(".json")]
        return [storage.read_json(u) for u in sorted(entries) if storage.TMP_MARK not in storage.basename(u)]

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        if not storage.is_local(self.uri):
            yield
            return
        storage.makedirs(self.uri)
        with FileLock(os.path.join(storage.local_path(self.uri), ".lock")):
            yield

    def commit(
        self,
        change: Callable[[RegistryState], str],
        expected_generation: int | None = None,
        action: str = "update",
    ) -> RegistryState:
        """Apply ``change`` (mutates the state, returns a one-line description) and commit it atomically.

        Raises :class:`ConcurrentUpdate` if ``expected_generation`` is given and is not the current one.
        """
        if storage.scheme(self.uri) in ("gs", "gcs"):
            return self._commit_gcs(change, expected_generation, action)
        with self._lock():
            state = self.read()
            new, entry = _apply(self.uri, state, change, expected_generation, action)
            if not storage.is_local(self.uri) and self.read().generation != state.generation:
                # other object stores: best effort (no precondition used here)
                raise ConcurrentUpdate(f"registry {self.uri} changed while committing generation {new.generation}")
            storage.write_json(self.document_uri, new.model_dump(mode="json"))
            self._write_history(entry)
            return new

    def _write_history(self, entry: dict) -> None:
        # After the document: the history records what was committed, never a change that failed.
        storage.write_json(storage.join(self.uri, HISTORY, f"{entry['generation']:08d}.json"), entry)

    def _commit_gcs(self, change, expected_generation: int | None, action: str) -> RegistryState:
        """Read registry.json with its object generation, apply ``change``, upload only if that generation is
        still the current one (ifGenerationMatch); on a lost race re-read and re-apply, unless the caller
        stated the generation it based its change on."""

        def attempt() -> RegistryState:
            state, object_generation = self._read_gcs()
            new, entry = _apply(self.uri, state, change, expected_generation, action)
            if self._upload_if_generation(_document_bytes(new), object_generation):
                self._write_history(entry)
                return new
            if expected_generation is not None:
                raise ConcurrentUpdate(
                    f"registry {self.uri} changed while committing generation {new.generation}: another refresh "
                    "or a person changed it meanwhile; nothing was written"
                )
            raise _LostRace(new.generation)

        def lost(exc: BaseException, attempt_number: int, sleep_s: float) -> None:
            self.conflicts += 1

        try:
            # jittered backoff: the racers spread out
            return COMMIT_RETRY.retrying(on_retry=lost)(attempt)
        except _LostRace:
            self.conflicts += 1
            raise ConcurrentUpdate(
                f"registry {self.uri}: other writers committed first {COMMIT_ATTEMPTS} times in a row; nothing was "
                "written (try again)"
            ) from None

    def _gcs_object(self):
        fs, path = storage.url_to_fs(self.document_uri)
        bucket, key, _ = fs.split_path(path)
        return fs, bucket, key

    def _read_gcs(self) -> tuple[RegistryState, int]:
        """The document and its object generation (0: no document yet), from one download."""
        fs, bucket, key = self._gcs_object()
        try:
            headers, data = fs.call("GET", "b/{}/o/{}", bucket, key, alt="media")
        except FileNotFoundError:
            return RegistryState(), 0
        generation = headers.get("x-goog-generation")
        if generation is None:  # GCS always sends it; an emulator may not
            generation = fs.call("GET", "b/{}/o/{}", bucket, key, json_out=True)["generation"]
        try:
            return RegistryState.model_validate(json.loads(data)), int(generation)
        except ValueError as exc:
            raise RegistryError(f"model registry {self.document_uri} is not a valid registry document: {exc}") from exc

    def _upload_if_generation(self, data: bytes, generation: int) -> bool:
        """Upload ``data`` as the document if its object generation is still ``generation`` (0: if it does not
        exist); False when another writer's object is there now.

        The precondition is GCS's own (``if_generation_match``, google-cloud-storage's upload): gcsfs can only
        ask "create if absent", not "replace this generation".
        """
        from google.api_core.exceptions import PreconditionFailed

        fs, bucket, key = self._gcs_object()
        try:
            _gcs_client().bucket(bucket).blob(key).upload_from_string(
                data, content_type="application/json", if_generation_match=generation
            )
        except PreconditionFailed:  # 412: the document moved on
            # A retried upload whose first try had landed also ends here: then the document is ours.
            try:
                _, current = fs.call("GET", "b/{}/o/{}", bucket, key, alt="media")
            except FileNotFoundError:
                return False
            return current == data
        finally:
            fs.invalidate_cache(storage.url_to_fs(self.document_uri)[1])
        return True

    # ------------------------------------------------------------ the operations people and flows use

    def register(
        self,
        record: ModelRecord,
        *,
        promote: bool = False,
        sources: list[SourceRecord] | None = None,
        held_out: HeldOut | None = None,
        serving: Serving | None = None,
        expected_generation: int | None = None,
    ) -> RegistryState:
        """Add a model (optionally promote it, mark ``sources`` processed, fix the held-out set)."""

        def change(state: RegistryState) -> str:
            if record.parent and record.parent not in state.models:
                raise UnknownModel(f"parent {record.parent!r} of {record.id!r} is not in the registry")
            state.models[record.id] = record
            for source in sources or []:
                state.processed_sources[source.url] = source
            if held_out is not None and state.held_out is None:
                state.held_out = held_out
            if serving is not None:
                state.serving = serving
            if promote:
                _promote(state, record.id)
                return f"registered and promoted {record.id}"
            return f"registered {record.id}"

        return self.commit(change, expected_generation, "promote" if promote else "register")

    def promote(
        self, model_id: str, expected_generation: int | None = None, serving: Serving | None = None
    ) -> RegistryState:
        def change(state: RegistryState) -> str:
            state.model(model_id)
            if state.promoted == model_id:
                raise RegistryError(f"{model_id} is already promoted")
            _promote(state, model_id)
            if serving is not None:
                state.serving = serving
            return f"promoted {model_id}"

        return self.commit(change, expected_generation, "promote")

    def rollback(self, expected_generation: int | None = None, serving: Serving | None = None) -> RegistryState:
        """Promote the model promoted before the current one again."""

        def change(state: RegistryState) -> str:
            if len(state.promotions) < 2:
                raise RegistryError(f"nothing to roll back to: promotion history is {state.promotions or 'empty'}")
            current = state.promotions.pop()
            state.promoted = state.promotions[-1]
            if serving is not None:
                state.serving = serving
            return f"rolled back from {current} to {state.promoted}"

        return self.commit(change, expected_generation, "rollback")

    def set_serving(self, serving: Serving | None, expected_generation: int | None = None) -> RegistryState:
        def change(state: RegistryState) -> str:
            state.serving = serving
            return f"serving {serving.model if serving else 'nothing'}"

        return self.commit(change, expected_generation, "serving")


def _apply(uri: str, state: RegistryState, change, expected_generation: int | None, action: str):
    """The next state (``change`` applied to a copy of ``state``) and its history entry."""
    if expected_generation is not None and state.generation != expected_generation:
        raise ConcurrentUpdate(
            f"registry {uri} is at generation {state.generation}, not {expected_generation}: "
            "another refresh or a person changed it meanwhile; nothing was written"
        )
    new = state.model_copy(deep=True)
    description = change(new)
    new.generation = state.generation + 1
    new.updated_at = now()
    entry = {
        "generation": new.generation,
        "action": action,
        "description": description,
        "promoted": new.promoted,
        "previous": state.promoted,
        "at": new.updated_at,
    }
    return new, entry


def _document_bytes(state: RegistryState) -> bytes:
    """What :func:`infra.storage.write_json` writes, so both paths produce the same document."""
    return (json.dumps(state.model_dump(mode="json"), indent=2, sort_keys=True, default=str) + "\n").encode()


def _promote(state: RegistryState, model_id: str) -> None:
    state.promoted = model_id
    state.promotions.append(model_id)


def new_model_id(checkpoint: str) -> str:
    """``m-<UTC time>-<hash of the checkpoint>``: sorts by time, unique per checkpoint."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    return f"m-{stamp}-{hashlib.sha256(storage.normalize(checkpoint).encode()).hexdigest()[:6]}"
