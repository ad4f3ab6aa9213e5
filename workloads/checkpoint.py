"""The checkpoint format: one directory per step, complete or absent.

Layout (serving and the continued-pretraining refresh read it; keep it)::

    <run_dir>/checkpoints/step-000050/
        config.json, model.safetensors   transformers save_pretrained (AutoModelForCausalLM.from_pretrained loads it)
        tokenizer.model                  copy of the sentencepiece model the data was tokenized with
        trainer_state.pt                 optimizer state, step, consumed_samples, RNG states (torch.load)
        meta.json                        step, val_loss, train_loss, consumed_samples, tokens_seen, arch,
                                         data_prefix, split, seq_length, seed, init_from
        MANIFEST.json                    written LAST: {"files": {name: {"size", "sha256"}}}
    <run_dir>/checkpoints/latest         text: the name of the newest complete checkpoint
    <run_dir>/checkpoints/best           text: the name of the checkpoint with the lowest val_loss

A checkpoint is written into ``.tmp-step-*`` beside its final name and renamed
into place once MANIFEST.json is written and everything is fsynced, so a
crash never leaves a partial directory under a ``step-*`` name. ``latest`` and
``best`` are replaced atomically (write a temporary file, ``os.replace``).
This module imports torch lazily: the Prefect tasks read checkpoints with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STEP_RE = re.compile(r"^step-(\d{6,})$")
MANIFEST = "MANIFEST.json"
META = "meta.json"
TRAINER_STATE = "trainer_state.pt"
TMP_PREFIX = ".tmp-"


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def step_name(step: int) -> str:
    return f"step-{step:06d}"


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


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_manifest(directory: Path) -> dict[str, Any]:
    """Size and sha256 of every file in ``directory`` (MANIFEST.json itself excluded)."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        files[path.relative_to(directory).as_posix()] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    manifest = {"format": "nemoflow-checkpoint/1", "files": files}
    with open(directory / MANIFEST, "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
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


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    model,
    trainer_state: dict[str, Any],
    meta: dict[str, Any],
    tokenizer_model: str | None = None,
    crash_hook=None,
) -> Path:
    """Write a complete checkpoint for ``step`` and point ``latest`` at it; returns its directory.

    ``crash_hook(tmp_dir)`` runs just before the manifest is written (tests
    kill the process there to prove a half-written checkpoint stays invisible).
    """
    import torch

    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_name(step)
    tmp = root / f"{TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer_model:
            shutil.copyfile(tokenizer_model, tmp / "tokenizer.model")
        torch.save(trainer_state, tmp / TRAINER_STATE)
        (tmp / META).write_text(json.dumps(meta, indent=1, sort_keys=True, default=str))
        if crash_hook is not None:
            crash_hook(tmp)
        for path in tmp.rglob("*"):
            if path.is_file():
                with open(path, "rb+") as fh:
                    os.fsync(fh.fileno())
        write_manifest(tmp)
        _fsync_dir(tmp)
        if final.exists():
            # Re-saving a step (a run stopped right after a checkpoint): swap the old one out first.
            old = root / f"{TMP_PREFIX}old-{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_text_atomic(root / "latest", final.name + "\n")
    return final


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    val_loss: float | None
    meta: dict[str, Any]


def list_checkpoints(run_dir: str | os.PathLike) -> list[CheckpointInfo]:
    """Complete checkpoints (with a manifest), oldest first; temporary directories are ignored."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = STEP_RE.match(entry.name)
        if not match or not (entry / MANIFEST).exists():
            continue
        meta = read_meta(entry)
        found.append(CheckpointInfo(entry, int(match.group(1)), meta.get("val_loss"), meta))
    return sorted(found, key=lambda c: c.step)


def read_meta(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(checkpoint_dir) / META
    return json.loads(path.read_text()) if path.exists() else {}


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint ``latest`` names (it must be complete), else the newest complete one."""
    root = checkpoints_dir(run_dir)
    pointer = root / "latest"
    if pointer.exists():
        candidate = root / pointer.read_text().strip()
        if (candidate / MANIFEST).exists():
            return candidate
    complete = list_checkpoints(run_dir)
    return complete[-1].path if complete else None


def best_checkpoint(run_dir: str | os.PathLike) -> CheckpointInfo | None:
    """The complete checkpoint with the lowest val_loss (the latest when none has one)."""
    complete = list_checkpoints(run_dir)
    if not complete:
        return None
    scored = [c for c in complete if c.val_loss is not None]
    if not scored:
        return complete[-1]
    return min(scored, key=lambda c: (c.val_loss, -c.step))


def prune_checkpoints(run_dir: str | os.PathLike, save_top_k: int) -> list[Path]:
    """Keep the best ``save_top_k`` by val_loss plus the latest; delete the rest; update ``best``.

    Without validation losses the newest ``save_top_k`` are kept. Temporary
    directories left by a crash are removed too. Returns the deleted paths.
    """
    root = checkpoints_dir(run_dir)
    complete = list_checkpoints(run_dir)
    deleted: list[Path] = []
    if not complete:
        return deleted
    best = best_checkpoint(run_dir)
    if best is not None:
        _write_text_atomic(root / "best", best.path.name + "\n")
    if save_top_k < 0:
        keep = {c.path for c in complete}
    else:
        scored = sorted((c for c in complete if c.val_loss is not None), key=lambda c: (c.val_loss, -c.step))
        unscored = sorted((c for c in complete if c.val_loss is None), key=lambda c: -c.step)
        keep = {c.path for c in (scored + unscored)[:save_top_k]}
        latest = latest_checkpoint(run_dir)
        if latest is not None:
            keep.add(latest)
        if best is not None:
            keep.add(best.path)
    for info in complete:
        if info.path not in keep:
            shutil.rmtree(info.path)
            deleted.append(info.path)
    for entry in root.iterdir():
        if entry.name.startswith(TMP_PREFIX) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
    return deleted


def load_trainer_state(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    import torch

    # Our own file (optimizer tensors, RNG states, numbers): not an untrusted download.
    return torch.load(Path(checkpoint_dir) / TRAINER_STATE, map_location="cpu", weights_only=False)


def load_weights(model, checkpoint_dir: str | os.PathLike) -> None:
    """Load ``model.safetensors`` into an already built model (strict: every tensor must match)."""
    from safetensors.torch import load_file

    path = Path(checkpoint_dir) / "model.safetensors"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: not a complete checkpoint")
    state = load_file(path)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(f"{path} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
