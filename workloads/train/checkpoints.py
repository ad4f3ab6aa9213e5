"""Rank 0's part of the checkpoints: nemoflow's meta.json, pruning and uploading published saves in the
background, the Hugging Face export after training, uploads a stopped job left undone."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from infra import processes
from infra.configs.train import TrainConfig
from workloads import checkpoint as ckpt
from workloads import staging
from workloads.train.errors import ExportError
from workloads.train.output import say


def checkpoint_meta(config: TrainConfig, step: int, val_loss: float | None, train_loss: float | None) -> dict:
    consumed = step * config.global_batch_size
    return {
        "step": step,
        "val_loss": val_loss,
        "train_loss": train_loss,
        "consumed_samples": consumed,
        "tokens_seen": consumed * config.seq_length,
        "arch": config.arch,
        "data_prefix": config.data_prefix,
        "valid_data_prefix": config.valid_data_prefix,
        "split": config.split,
        "seq_length": config.seq_length,
        "micro_batch_size": config.micro_batch_size,
        "limit_val_batches": config.limit_val_batches,
        "seed": config.seed,
        "init_from": config.init_from,
        "precision": config.precision,
        "engine": "nemo-automodel",
    }


def recover_written_save(run_dir: Path, timeout_s: float = 3600) -> Path | None:
    """``ckpt_while_writing: replace``: publish the save a killed trainer left unpublished although its writer
    process finished it (workloads/checkpoint_writers.py ``keep_writing``); the step directory published, or None.

    First waits while such a writer process (pid files in the checkpoint directory) still writes. Then the newest
    unpublished save newer than the newest published one, whose model and optimizer parts are both marked written
    and whose meta.json is there, is published as the trainer would have: AutoModel's ``.incomplete`` marker
    removed, LATEST (and LOWEST_VAL) moved. Every rank calls it before anything loads a checkpoint; a lock makes
    one of them publish and the others find it done. Without marked saves (every other mode) it only lists a
    directory.
    """
    import fcntl

    from workloads.checkpoint_writers import WRITTEN, writer_pidfiles

    checkpoints = ckpt.checkpoints_dir(run_dir)
    if not checkpoints.is_dir():
        return None
    marked = [m.parent.parent for m in checkpoints.glob(f"epoch_*_step_*/model/{WRITTEN}")]
    unpublished = [d for d in marked if (d / ckpt.INCOMPLETE).exists()]
    if not writer_pidfiles(checkpoints) and not unpublished:
        return None  # every run but a killed one of ckpt_while_writing: replace: nothing is written here
    deadline = time.monotonic() + timeout_s
    for pidfile in writer_pidfiles(checkpoints):
        pid = processes.read_pidfile(pidfile)
        if pid is not None:
            say(f"waiting for the checkpoint writer (pid {pid}) of a killed run to finish its save before resuming")
            processes.wait_pidfile(pidfile, max(0.0, deadline - time.monotonic()))
    with open(checkpoints / ".recover.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for pidfile in writer_pidfiles(checkpoints):
            if processes.read_pidfile(pidfile) is None:
                pidfile.unlink(missing_ok=True)
        saved = ckpt.saved_checkpoints(run_dir)
        newest = saved[-1].step if saved else 0
        # the writer may have finished a save after the first look: marked, still unpublished, newer than the newest
        marked = [m.parent.parent for m in checkpoints.glob(f"epoch_*_step_*/model/{WRITTEN}")]
        for step_dir in sorted(marked, key=ckpt.step_of, reverse=True):
            if ckpt.step_of(step_dir) <= newest or not (step_dir / ckpt.INCOMPLETE).exists():
                continue
            if not (step_dir / "optim" / WRITTEN).exists() or not (step_dir / ckpt.META).exists():
                continue
            from nemo_automodel.components.checkpoint.lifecycle import CheckpointLifecycle
            from nemo_automodel.components.checkpoint.utils import read_checkpoint_metric

            from workloads.train.snapshots import _LifecycleConfig

            lifecycle = CheckpointLifecycle(config=_LifecycleConfig(str(checkpoints)))
            best = read_checkpoint_metric(step_dir, "default")
            lifecycle.publish(str(step_dir), best_val_metric=best, metric_key="default")
            say(
                f"recovered checkpoint {step_dir} (step {ckpt.step_of(step_dir)}): its writer finished it after the "
                "trainer was killed"
            )
            return step_dir
    return None


class CheckpointFinisher:
    """Rank 0: once AutoModel has published a checkpoint, prune to ``save_top_k`` and upload it (a remote
    run directory), in the background, in publication order (joined before the process exits)."""

    def __init__(self, run_dir: Path, save_top_k: int, is_incomplete, mirror: staging.RunMirror | None = None):
        self.run_dir, self.save_top_k, self.is_incomplete = run_dir, save_top_k, is_incomplete
        self.mirror = mirror
        self.pending: list[Path] = []
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def finish_published(self) -> None:
        published = [p for p in self.pending if p.is_dir() and not self.is_incomplete(p)]
        if not published:
            return
        self.pending = [p for p in self.pending if p not in published]
        self.join()
        self.thread = threading.Thread(target=self._finish, args=(published,), name="nemoflow-finisher", daemon=True)
        self.thread.start()

    def _finish(self, paths: list[Path]) -> None:
        try:
            for path in paths:
                meta = ckpt.step_meta(path)
                say(f"saved checkpoint {path} (step {meta.get('step')}, val_loss {meta.get('val_loss')})")
                if self.mirror is not None:
                    uri = self.mirror.push_checkpoint(path)
                    self.mirror.push_file("metrics.jsonl")
                    say(f"uploaded checkpoint {uri}")
            self.prune()
            sys.stdout.flush()
        except BaseException as exc:  # noqa: BLE001 - reported by join() in the training thread
            self.error = exc

    def prune(self) -> None:
        saved = ckpt.saved_checkpoints(self.run_dir)
        protect = {saved[-1].step_dir} if saved else set()
        # Said before each deletion, not after: a job killed mid-prune never leaves a line calling it saved.
        ckpt.prune_checkpoints(
            self.run_dir,
            self.save_top_k,
            protect=protect,
            before_delete=lambda gone: say(f"pruned checkpoint {gone} (save_top_k={self.save_top_k})"),
        )
        if self.mirror is not None:
            names = {saved[-1].step_dir.name} if saved else set()
            for gone in self.mirror.prune(self.save_top_k, protect=names):
                say(f"pruned checkpoint {gone} (save_top_k={self.save_top_k})")

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def export_checkpoints(
    run_dir: Path, tokenizer_model: str | None, mirror: staging.RunMirror | None = None
) -> list[Path]:
    """Rank 0 after training: the Hugging Face export of the best and the last saved checkpoint, made by a
    separate process (workloads/consolidate.py: merging shards and hashing gigabytes is no work for the
    training process), then uploaded to a remote run directory (MANIFEST.json last)."""
    saved = ckpt.saved_checkpoints(run_dir)
    needed = [c.step_dir for c in ckpt.to_export(saved) if not c.exported]
    if needed:
        command = [sys.executable, "-m", "workloads.consolidate", *map(str, needed)]
        if tokenizer_model:
            command += ["--tokenizer-model", tokenizer_model]
        print(f"exporting {', '.join(p.name for p in needed)} as Hugging Face safetensors", flush=True)
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:  # through this process's stdout: rank-prefixed like every other line
            print(line, end="", flush=True)
        if proc.wait() != 0:
            raise ExportError(
                f"the export of {', '.join(map(str, needed))} failed (exit {proc.returncode}); the saved checkpoints "
                f"are intact: run python -m workloads.consolidate {run_dir} to export them"
            )
    exported = [c.consolidated for c in ckpt.to_export(saved)]
    if mirror is not None:
        for consolidated in exported:
            print(f"uploaded export {mirror.push_export(consolidated)}", flush=True)
    return exported


def upload_unsent(run_dir: Path, mirror: staging.RunMirror) -> None:
    """Rank 0 at start-up (remote run directory): upload the saved checkpoints newer than the newest remote one
    (a job that stopped between AutoModel's publication and the upload)."""
    remote = mirror.remote_steps()
    newest = tuple(int(x) for x in ckpt.STEP_DIR_RE.match(remote[-1]).groups()) if remote else (-1, -1)
    for saved in ckpt.saved_checkpoints(run_dir):
        if tuple(int(x) for x in ckpt.STEP_DIR_RE.match(saved.step_dir.name).groups()) > newest:
            print(f"uploaded checkpoint {mirror.push_checkpoint(saved.step_dir)} (saved before the last run stopped)")
