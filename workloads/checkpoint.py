"""The checkpoint layout: NeMo AutoModel's checkpoints, plus what nemoflow's stages read from them.

Layout (the trainer writes it; validation, serving and the continued-pretraining
refresh read the consolidated directory, which is the checkpoint they are handed)::

    <run_dir>/checkpoints/                      AutoModel's checkpoint_dir
        epoch_0_step_49/                        one AutoModel checkpoint, taken after 50 optimizer steps
            meta.json                           nemoflow's record of the save: step, val_loss, train_loss,
                                                consumed_samples, tokens_seen, arch, data_prefix, split,
                                                seq_length, seed, init_from, world_size (written at save time)
            model/shard-*.safetensors, model/.hf_metadata/, optim/, dataloader/, rng/, step_scheduler.pt,
            losses.json, config.yaml            AutoModel's sharded resume state (torch.distributed.checkpoint,
                                                written in the background; resume is automatic)
            model/consolidated/                 THE checkpoint nemoflow hands on (CheckpointInfo.path), made for
                                                the checkpoints that need it (the best and the last of a run)
                                                after training, by a separate process (workloads/consolidate.py):
                config.json, generation_config.json,
                model-0000i-of-0000n.safetensors,
                model.safetensors.index.json    AutoModel's consolidated Hugging Face export
                                                (AutoModelForCausalLM.from_pretrained loads it as it is)
                tokenizer.model                 copy of the sentencepiece model the data was tokenized with
                meta.json                       the step directory's meta.json
                MANIFEST.json                   written LAST: {"files": {name: {"size", "sha256"}}}
        LATEST, LOWEST_VAL                      AutoModel's pointers (symlinks)

Two kinds of complete, never confused:

* *saved* (resumable): AutoModel writes each checkpoint under an ``.incomplete`` marker and
  publishes it (marker removed, LATEST moved) only when every rank's files are written.
  :func:`saved_checkpoints` lists those; pruning (``save_top_k``) and resume work on them.
* *exported*: a saved checkpoint whose ``model/consolidated/MANIFEST.json`` exists. The export
  process writes the manifest last, atomically, so a crash at any point leaves no directory that
  :func:`list_checkpoints` reports. The later stages take only exported checkpoints.

The run directory may also be a ``gs://`` URI: the trainer then works in a node-local copy and
uploads each saved checkpoint (its ``meta.json`` last) and each export (its ``MANIFEST.json`` last)
(workloads/staging.py), and :func:`stored_checkpoints` reads the exported checkpoints of a run
directory wherever it is.
This module imports neither torch nor AutoModel: the Prefect tasks read checkpoints with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra import storage
from infra.permissions import secure_file, secure_tree

STEP_DIR_RE = re.compile(r"^epoch_(\d+)_step_(\d+)$")
CONSOLIDATED = Path("model") / "consolidated"
MANIFEST = "MANIFEST.json"
META = "meta.json"
TOKENIZER = "tokenizer.model"
TMP_PREFIX = ".tmp-"
# AutoModel's in-progress marker (nemo_automodel.components.checkpoint.utils._INCOMPLETE_CHECKPOINT_MARKER;
# tests/train/test_checkpoint.py checks that it is still AutoModel's name).
INCOMPLETE = ".incomplete"


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir_name(step: int, epoch: int = 0) -> str:
    """AutoModel's directory for the checkpoint taken after ``step`` optimizer steps (it counts from 0)."""
    return f"epoch_{epoch}_step_{step - 1}"


def step_of(step_dir: str | os.PathLike) -> int:
    """The optimizer steps done when the checkpoint in AutoModel's ``step_dir`` was taken (``epoch_0_step_7``: 8)."""
    match = STEP_DIR_RE.match(Path(step_dir).name)
    if match is None:
        raise ValueError(f"{step_dir} is not an AutoModel checkpoint directory (epoch_E_step_S)")
    return int(match.group(2)) + 1


def remove_unpublished(step_dir: str | os.PathLike) -> None:
    """Delete a save that was never published (its write failed): renamed out of the step-directory namespace in
    one step first, so a crash during the deletion leaves a name nothing lists, never a step directory that lost
    its ``.incomplete`` marker before its files. Refuses a published checkpoint."""
    step_dir = Path(step_dir)
    if not step_dir.exists():
        return
    if not (step_dir / INCOMPLETE).exists():
        raise ValueError(f"{step_dir} is a published checkpoint, not a failed save: not deleting it")
    aside = step_dir.with_name(f"{TMP_PREFIX}failed-{step_dir.name}-{uuid.uuid4().hex[:8]}")
    os.rename(step_dir, aside)
    shutil.rmtree(aside, ignore_errors=True)


def consolidated_dir(step_dir: str | os.PathLike) -> Path:
    return Path(step_dir) / CONSOLIDATED


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, fsync, rename over ``path``."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        secure_file(tmp)  # shared storage: the configured mode and group (infra/permissions.py)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_manifest(directory: Path) -> dict[str, Any]:
    """Size and sha256 of every file in ``directory`` (MANIFEST.json itself excluded), written atomically.

    For a consolidated directory, the whole checkpoint first gets the configured modes (infra/permissions.py):
    the checkpoint is complete now, and AutoModel gives some files modes of its own (consolidate.sh 0755).
    """
    if directory.parts[-2:] == CONSOLIDATED.parts:
        secure_tree(directory.parent.parent)
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        if path.name.startswith(TMP_PREFIX):
            continue
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
        files[path.relative_to(directory).as_posix()] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    manifest = {"format": "nemoflow-checkpoint/2", "files": files}
    write_text_atomic(directory / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    _fsync_dir(directory)
    return manifest


def verify_manifest(directory: str | os.PathLike) -> list[str]:
    """Problems with a checkpoint's files (missing, wrong size, wrong sha256); empty when intact."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST
    if not manifest_path.exists():
        return [f"{manifest_path} is missing (the checkpoint was never completed)"]
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError) as exc:
        return [f"{manifest_path} is unreadable: {exc}"]
    problems = []
    for name, expected in files.items():
        path = directory / name
        if not path.exists():
            problems.append(f"{name}: missing")
            continue
        size = path.stat().st_size
        if size != expected["size"]:
            problems.append(f"{name}: size {size} != manifest {expected['size']}")
            continue
        actual = sha256_file(path)
        if actual != expected["sha256"]:
            problems.append(f"{name}: sha256 {actual[:12]}... != manifest {expected['sha256'][:12]}...")
    return problems


def write_meta(consolidated: Path, meta: dict[str, Any], tokenizer_model: str | None) -> None:
    """tokenizer.model and meta.json into a consolidated directory (before its manifest)."""
    consolidated.mkdir(parents=True, exist_ok=True)
    if tokenizer_model:
        tmp = consolidated / f"{TMP_PREFIX}{TOKENIZER}"
        shutil.copyfile(tokenizer_model, tmp)
        secure_file(tmp)
        os.replace(tmp, consolidated / TOKENIZER)
    write_text_atomic(consolidated / META, json.dumps(meta, indent=1, sort_keys=True, default=str))


ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}


def name_architecture(consolidated: Path) -> None:
    """Fill ``architectures`` in config.json when the export left it null (AutoModel 0.7 does for configs
    built in memory): transformers infers the class from ``model_type``, but vLLM and TensorRT-LLM read it."""
    path = consolidated / "config.json"
    config = json.loads(path.read_text())
    if not config.get("architectures") and config.get("model_type") in ARCHITECTURES:
        config["architectures"] = [ARCHITECTURES[config["model_type"]]]
        write_text_atomic(path, json.dumps(config, indent=2, sort_keys=True) + "\n")


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint: ``path`` is its consolidated directory (usable wherever a path is)."""

    path: Path
    step: int
    val_loss: float | None
    meta: dict[str, Any]

    @property
    def step_dir(self) -> Path:
        """AutoModel's checkpoint directory (resume state) that holds this one."""
        return self.path.parent.parent

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)


def read_meta(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(checkpoint_dir) / META
    return json.loads(path.read_text()) if path.exists() else {}


def step_dirs(run_dir: str | os.PathLike) -> list[Path]:
    """AutoModel checkpoint directories (complete or not), oldest step first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR_RE.match(p.name) and p.is_dir() and not p.is_symlink()]
    return sorted(found, key=lambda p: tuple(int(x) for x in STEP_DIR_RE.match(p.name).groups()))


def list_checkpoints(run_dir: str | os.PathLike) -> list[CheckpointInfo]:
    """Exported checkpoints (published, their Hugging Face export's manifest written), oldest first."""
    found = []
    for step_dir in step_dirs(run_dir):
        consolidated = consolidated_dir(step_dir)
        if (step_dir / INCOMPLETE).exists() or not (consolidated / MANIFEST).exists():
            continue
        meta = read_meta(consolidated)
        step = meta.get("step", int(STEP_DIR_RE.match(step_dir.name).group(2)) + 1)
        found.append(CheckpointInfo(consolidated, int(step), meta.get("val_loss"), meta))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(run_dir: str | os.PathLike) -> CheckpointInfo | None:
    """The newest complete checkpoint."""
    complete = list_checkpoints(run_dir)
    return complete[-1] if complete else None


def best_checkpoint(run_dir: str | os.PathLike) -> CheckpointInfo | None:
    """The complete checkpoint with the lowest val_loss (the latest when none has one)."""
    return best_of(list_checkpoints(run_dir))


@dataclass(frozen=True)
class SavedCheckpoint:
    """A saved (published, resumable) AutoModel checkpoint; ``exported`` when its Hugging Face export is complete."""

    step_dir: Path
    step: int
    val_loss: float | None
    meta: dict[str, Any]

    @property
    def consolidated(self) -> Path:
        return consolidated_dir(self.step_dir)

    @property
    def exported(self) -> bool:
        return (self.consolidated / MANIFEST).exists()


def step_meta(step_dir: str | os.PathLike) -> dict[str, Any]:
    """The step directory's meta.json; for a checkpoint written before it existed, AutoModel's losses.json."""
    step_dir = Path(step_dir)
    for path in (step_dir / META, consolidated_dir(step_dir) / META):
        if path.exists():
            return json.loads(path.read_text())
    losses = step_dir / "losses.json"
    meta = json.loads(losses.read_text()) if losses.exists() else {}
    match = STEP_DIR_RE.match(step_dir.name)
    if match:
        meta.setdefault("step", int(match.group(2)) + 1)
    return meta


def saved_checkpoints(run_dir: str | os.PathLike) -> list[SavedCheckpoint]:
    """Published AutoModel checkpoints (no ``.incomplete`` marker), oldest first: what resume and pruning see."""
    found = []
    for step_dir in step_dirs(run_dir):
        if (step_dir / INCOMPLETE).exists():
            continue
        meta = step_meta(step_dir)
        step = int(meta.get("step", int(STEP_DIR_RE.match(step_dir.name).group(2)) + 1))
        found.append(SavedCheckpoint(step_dir, step, meta.get("val_loss"), meta))
    return sorted(found, key=lambda c: c.step)


def to_export(saved: list) -> list:
    """The checkpoints of a finished run that get a Hugging Face export: the best by val_loss and the last
    (one when they are the same). Works on :class:`SavedCheckpoint` and remote records alike."""
    if not saved:
        return []
    best = best_of(saved)
    return [best] if best.step_dir == saved[-1].step_dir else sorted([best, saved[-1]], key=lambda c: c.step)


def prune_checkpoints(
    run_dir: str | os.PathLike,
    save_top_k: int,
    protect: set[Path] | None = None,
    before_delete: Callable[[Path], None] | None = None,
) -> list[Path]:
    """Keep the best ``save_top_k`` saved checkpoints by val_loss plus the latest; delete the rest.

    Without validation losses the newest ``save_top_k`` are kept; -1 keeps all.
    Only saved (published) checkpoints are considered, so a checkpoint still being written
    is never touched; ``protect`` names AutoModel step directories that must stay (its LATEST
    target). ``before_delete`` is called with each step directory before it is touched (the
    trainer reports it then, so its output never calls a deleted checkpoint saved). Returns the
    deleted AutoModel step directories.
    """
    saved = saved_checkpoints(run_dir)
    if save_top_k < 0 or not saved:
        return []
    keep = kept(saved, save_top_k) | {Path(p) for p in (protect or set())}
    deleted = []
    for info in saved:
        if info.step_dir not in keep:
            if before_delete is not None:
                before_delete(info.step_dir)
            # Unpublish first (AutoModel's marker, then the export's manifest): a crash half-way leaves an
            # incomplete directory that nothing loads and the next save of that step replaces.
            (info.step_dir / INCOMPLETE).touch()
            (info.consolidated / MANIFEST).unlink(missing_ok=True)
            shutil.rmtree(info.step_dir, ignore_errors=True)
            deleted.append(info.step_dir)
    return deleted


def kept(complete: list, save_top_k: int) -> set:
    """The step directories ``save_top_k`` keeps of ``complete`` (oldest first): the best by val_loss (the
    newest without one) and the latest. Works on :class:`SavedCheckpoint`, :class:`CheckpointInfo` and
    :class:`StoredCheckpoint`."""
    if save_top_k < 0:
        return {c.step_dir for c in complete}
    scored = sorted((c for c in complete if c.val_loss is not None), key=lambda c: (c.val_loss, -c.step))
    unscored = sorted((c for c in complete if c.val_loss is None), key=lambda c: -c.step)
    keep = {c.step_dir for c in (scored + unscored)[: max(save_top_k, 1)]}
    if complete:
        keep.add(complete[-1].step_dir)
    return keep


# ------------------------------------------------------------------------ wherever the run directory is
@dataclass(frozen=True)
class StoredCheckpoint:
    """A complete checkpoint in a run directory on any storage (a path or ``gs://``): ``uri`` is its
    consolidated directory, what the later stages are handed."""

    uri: str
    step: int
    val_loss: float | None
    meta: dict[str, Any]

    @property
    def step_dir(self) -> str:
        return storage.parent(storage.parent(self.uri))


def stored_checkpoints(run_dir: str) -> list[StoredCheckpoint]:
    """Complete checkpoints of ``run_dir`` (local or remote), oldest first."""
    if storage.is_local(run_dir):
        return [
            StoredCheckpoint(str(c.path), c.step, c.val_loss, c.meta)
            for c in list_checkpoints(storage.local_path(run_dir))
        ]
    # another process (the trainer) wrote them: listings this process cached earlier are stale
    storage.url_to_fs(run_dir)[0].invalidate_cache()
    found = []
    pattern = storage.join(run_dir, "checkpoints", "*", *CONSOLIDATED.parts, MANIFEST)
    for marker in storage.glob(pattern):
        consolidated = storage.parent(marker)
        match = STEP_DIR_RE.match(storage.basename(storage.parent(storage.parent(consolidated))))
        if not match:
            continue
        meta_uri = storage.join(consolidated, META)
        meta = storage.read_json(meta_uri) if storage.exists(meta_uri) else {}
        step = int(meta.get("step", int(match.group(2)) + 1))
        found.append(StoredCheckpoint(consolidated, step, meta.get("val_loss"), meta))
    return sorted(found, key=lambda c: c.step)


def best_of(complete: list) -> Any:
    """The lowest val_loss (the latest when none has one; of equal ones the latest) of ``complete`` (oldest
    first): what :func:`best_checkpoint` and :func:`to_export` choose. Works on :class:`CheckpointInfo`,
    :class:`SavedCheckpoint` and :class:`StoredCheckpoint`; None when ``complete`` is empty."""
    if not complete:
        return None
    scored = [c for c in complete if c.val_loss is not None]
    return min(scored, key=lambda c: (c.val_loss, -c.step)) if scored else complete[-1]
