"""Inputs from object storage on the node's disk, and a run directory kept in object storage.

Training and evaluation read Megatron ``.bin``/``.idx`` files through memory maps, and NeMo
AutoModel writes checkpoints with torch.distributed.checkpoint to a file system: neither reads or
writes ``gs://`` itself. A job whose data, checkpoint or run directory is on GCS therefore works on
node-local copies:

    local = stage_in("gs://b/datasets/x/tokenizer.model")       # a file, copied once, then reused
    blend = local_blend([0.5, "gs://b/d/part-0_text_document", 0.5, "gs://b/d/part-1_text_document"])
    ckpt = local_checkpoint("gs://b/runs/llama-1/checkpoints/epoch_0_step_59/model/consolidated")
    mirror = RunMirror("gs://b/runs/llama-1"); mirror.pull()   # train in mirror.local ...
    mirror.push_checkpoint(step_dir); mirror.push_file("metrics.jsonl")

Copies live under the stage directory (``$NEMOFLOW_HOME/cache/stage``, default
``~/.nemoflow/cache/stage``; node-local on a cluster unless the home directory is shared). A copy
is reused while its source's fingerprint (the md5/crc32c GCS states; sha256 for files) is the one
recorded beside it, so a dataset is downloaded once per node, not once per job. Copies are atomic
(never a half file under its final name) and made under a file lock, so the ranks of one node (or
two jobs on it) share one copy. Local paths pass through unchanged.

The run directory: AutoModel resumes from the newest saved step directory under
``<run_dir>/checkpoints``. :class:`RunMirror` downloads the newest checkpoint the remote run
directory holds (if the node has nothing newer) before training, and uploads each checkpoint
once AutoModel has published it: every file of the step directory (the resume state, so a job
restarted on another node resumes), its ``meta.json`` last, so a remote step directory with a
``meta.json`` is complete; after training, the Hugging Face exports (``model/consolidated``, its
``MANIFEST.json`` last). Checkpoints pruned locally are deleted remotely (``meta.json`` first).
This needs the whole run on one node: several nodes would each hold only their ranks' shards.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock

from infra import storage
from infra.settings import DEFAULT_HOME

MANIFEST = "MANIFEST.json"
SOURCE_RECORD = ".nemoflow-source.json"
CHECKPOINT_MARKER = "meta.json"  # a remote step directory is complete (resumable) with it
EXPORT_MARKER = "model/consolidated/" + MANIFEST  # and its Hugging Face export with this


def stage_dir() -> Path:
    return Path(os.environ.get("NEMOFLOW_HOME", DEFAULT_HOME)).expanduser() / "cache" / "stage"


def is_remote(uri: str | os.PathLike | None) -> bool:
    return uri is not None and not storage.is_local(str(uri))


def _slot(uri: str) -> Path:
    """The cache directory of one remote object or directory (named by its URI)."""
    return stage_dir() / hashlib.sha256(storage.normalize(uri).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    directory.mkdir(parents=True, exist_ok=True)
    with FileLock(directory / ".lock"):
        yield


def _read_record(directory: Path) -> dict[str, str]:
    try:
        return json.loads((directory / SOURCE_RECORD).read_text())
    except (FileNotFoundError, ValueError):
        return {}


def _fetch(uri: str, dest: Path, record: dict[str, str]) -> bool:
    """Copy ``uri`` to ``dest`` unless the copy there has the source's fingerprint; True if copied."""
    fingerprint = storage.fingerprint(uri)
    if record.get(dest.name) == fingerprint and dest.is_file():
        return False
    storage.get_file(uri, str(dest))  # atomic: a .tmp name until complete
    record[dest.name] = fingerprint
    storage.write_json(str(dest.parent / SOURCE_RECORD), record)
    return True


def stage_in(uri: str) -> str:
    """A local path holding the file ``uri`` (the path itself when it is local)."""
    if not is_remote(uri):
        return storage.local_path(str(uri))
    if not storage.exists(uri):
        raise FileNotFoundError(f"no such file: {uri}")
    directory = _slot(storage.parent(uri))
    with _locked(directory):
        dest = directory / storage.basename(uri)
        _fetch(uri, dest, _read_record(directory))
    return str(dest)


def local_prefix(prefix: str) -> str:
    """A Megatron dataset prefix with its ``.bin`` and ``.idx`` on local disk."""
    if not is_remote(prefix):
        return prefix
    missing = [prefix + ext for ext in (".bin", ".idx") if not storage.exists(prefix + ext)]
    if missing:
        raise FileNotFoundError(
            "dataset files missing (a prefix names '{prefix}.bin' and '{prefix}.idx'): " + ", ".join(missing)
        )
    directory = _slot(storage.parent(prefix))
    with _locked(directory):
        record = _read_record(directory)
        for ext in (".idx", ".bin"):
            _fetch(prefix + ext, directory / (storage.basename(prefix) + ext), record)
    return str(directory / storage.basename(prefix))


def local_blend(blend: list | None) -> list | None:
    """A NeMo ``data_prefix`` (``[w1, p1, w2, p2, ...]`` or ``[p1, p2, ...]``) with every prefix local."""
    if blend is None:
        return None
    return [local_prefix(item) if isinstance(item, str) else item for item in blend]


def local_checkpoint(uri: str, *, strict: bool = True) -> str:
    """A local directory holding the checkpoint ``uri``: every file its MANIFEST.json lists, the manifest
    last (without a manifest: every file of the directory).

    ``strict=False`` skips listed files that are missing (the validator then reports them as missing);
    otherwise a missing one raises, naming it.
    """
    if not is_remote(uri):
        return storage.local_path(str(uri))
    directory = _slot(uri) / storage.basename(uri)
    listing = storage.join(uri, MANIFEST)
    with _locked(directory):
        if storage.exists(listing):
            names = sorted(storage.read_json(listing).get("files", {})) + [MANIFEST]
        else:
            names = sorted(storage.basename(p) for p in storage.listdir(uri) if not storage.basename(p).startswith("."))
        if not names:
            raise FileNotFoundError(f"checkpoint {uri} does not exist or is empty")
        record = _read_record(directory)
        for name in names:
            source = storage.join(uri, name)
            if not storage.exists(source):
                if strict:
                    raise FileNotFoundError(f"checkpoint {uri} has no {name} (listed in its MANIFEST.json)")
                continue
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            _copy_unless_current(source, directory, name, record)
    return str(directory)


def stage_tree(uri: str) -> str:
    """A local copy of every file under the remote directory ``uri`` (a whole AutoModel step directory)."""
    if not is_remote(uri):
        return storage.local_path(str(uri))
    directory = _slot(uri) / storage.basename(uri)
    with _locked(directory):
        fs, root = storage.url_to_fs(uri)
        record = _read_record(directory)
        for path in sorted(fs.find(root)):
            relative = path[len(root) :].lstrip("/")
            if not relative or Path(relative).name.startswith(storage.TMP_MARK):
                continue
            _copy_unless_current(storage.to_uri(fs, path), directory, relative, record)
    return str(directory)


def _copy_unless_current(source: str, directory: Path, name: str, record: dict[str, str]) -> None:
    """Copy ``source`` to ``directory/name`` unless the copy there is of the same version (``record``, the
    fingerprints copied so far, says so); the record is written after each copy, so a crash re-copies one file."""
    dest = directory / name
    fingerprint = storage.fingerprint(source)
    if record.get(name) == fingerprint and dest.is_file():
        return
    storage.get_file(source, str(dest))
    record[name] = fingerprint
    storage.write_json(str(directory / SOURCE_RECORD), record)


# ------------------------------------------------------------------------------------- the run directory
class RunMirror:
    """A node-local working copy of a remote run directory (see the module docstring)."""

    def __init__(self, uri: str):
        self.uri = storage.normalize(uri)
        self.local = _slot(self.uri) / storage.basename(self.uri)

    def remote(self, relative: str | os.PathLike) -> str:
        return storage.join(self.uri, *Path(relative).parts)

    def relative(self, path: str | os.PathLike) -> Path:
        return Path(path).relative_to(self.local)

    def remote_steps(self) -> list[str]:
        """Complete remote step directories (names), oldest first."""
        from workloads import checkpoint as ckpt

        storage.url_to_fs(self.uri)[0].invalidate_cache()  # what other nodes uploaded, not a cached listing
        found = []
        for marker in storage.glob(self.remote("checkpoints") + "/*/" + CHECKPOINT_MARKER):
            step = storage.basename(marker.removesuffix("/" + CHECKPOINT_MARKER))
            if ckpt.STEP_DIR_RE.match(step):
                found.append(step)
        return sorted(found, key=lambda n: tuple(int(x) for x in ckpt.STEP_DIR_RE.match(n).groups()))

    def pull(self, log=print) -> Path:
        """Bring the newest remote checkpoint (and metrics.jsonl) here unless this node has it or a newer one."""
        from workloads import checkpoint as ckpt

        with _locked(self.local):
            steps = self.remote_steps()
            saved = ckpt.saved_checkpoints(self.local)
            local = saved[-1] if saved else None
            pulled = False
            if steps:
                newest = steps[-1]
                step = int(ckpt.STEP_DIR_RE.match(newest).group(2)) + 1
                if local is None or local.step < step:
                    target = ckpt.checkpoints_dir(self.local) / newest
                    fs, root = storage.url_to_fs(self.remote(Path("checkpoints") / newest))
                    files = [p for p in sorted(fs.find(root)) if not Path(p).name.startswith(storage.TMP_MARK)]
                    # the marker last: until it is here, the local copy is incomplete
                    files.sort(key=lambda p: p == root.rstrip("/") + "/" + CHECKPOINT_MARKER)
                    for path in files:
                        storage.get_file(storage.to_uri(fs, path), str(target / path[len(root) :].lstrip("/")))
                    log(f"resuming from {self.uri}/checkpoints/{newest}: copied {len(files)} files to {target}")
                    pulled = True
            # the metrics of the steps the pulled checkpoint covers (the trainer drops any logged after it)
            metrics = self.remote("metrics.jsonl")
            if (pulled or not (self.local / "metrics.jsonl").exists()) and storage.exists(metrics):
                storage.get_file(metrics, str(self.local / "metrics.jsonl"))
        return self.local

    def push_checkpoint(self, step_dir: str | os.PathLike) -> str:
        """Upload a saved step directory (without its export), its meta.json last; returns the remote URI."""
        step_dir = Path(step_dir)
        export = step_dir / Path(EXPORT_MARKER).parent
        files = sorted(
            p
            for p in step_dir.rglob("*")
            if p.is_file() and not p.name.startswith(storage.TMP_MARK) and export not in p.parents
        )
        marker = step_dir / CHECKPOINT_MARKER
        files.sort(key=lambda p: p == marker)
        for path in files:
            storage.put_file(str(path), self.remote(self.relative(path)))
        return self.remote(self.relative(step_dir))

    def push_export(self, consolidated: str | os.PathLike) -> str:
        """Upload a Hugging Face export (``model/consolidated``), its MANIFEST.json last; returns the remote URI."""
        consolidated = Path(consolidated)
        files = sorted(p for p in consolidated.rglob("*") if p.is_file() and not p.name.startswith(storage.TMP_MARK))
        files.sort(key=lambda p: p == consolidated / MANIFEST)
        for path in files:
            storage.put_file(str(path), self.remote(self.relative(path)))
        return self.remote(self.relative(consolidated))

    def saved(self) -> list:
        """The remote saved checkpoints (complete step directories), oldest first, with their val_loss."""
        from workloads import checkpoint as ckpt

        found = []
        for name in self.remote_steps():
            step_dir = self.remote(Path("checkpoints") / name)
            meta = storage.read_json(storage.join(step_dir, CHECKPOINT_MARKER))
            step = int(meta.get("step", int(ckpt.STEP_DIR_RE.match(name).group(2)) + 1))
            found.append(
                ckpt.StoredCheckpoint(
                    storage.join(step_dir, EXPORT_MARKER.rsplit("/", 1)[0]), step, meta.get("val_loss"), meta
                )
            )
        return found

    def prune(self, save_top_k: int, protect: set[str] = frozenset()) -> list[str]:
        """Apply ``save_top_k`` to the remote checkpoints (those earlier jobs uploaded count too), never
        deleting the step directories named in ``protect``; returns the deleted remote step directories."""
        from workloads import checkpoint as ckpt

        complete = self.saved()
        keep = ckpt.kept(complete, save_top_k) | {self.remote(Path("checkpoints") / name) for name in protect}
        deleted = []
        for info in complete:
            if info.step_dir not in keep:
                # the markers first: a deletion cut short leaves an incomplete (ignored) checkpoint
                storage.remove(storage.join(info.step_dir, CHECKPOINT_MARKER))
                storage.remove(storage.join(info.uri, MANIFEST))
                storage.remove(info.step_dir, recursive=True)
                deleted.append(info.step_dir)
        return deleted

    def push_file(self, name: str) -> None:
        if (self.local / name).is_file():
            storage.put_file(str(self.local / name), self.remote(name))
