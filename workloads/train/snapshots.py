"""Checkpoint snapshots in host memory, persisted at the storage's pace (issue 34, item 5; ``ckpt_snapshots``).

A save with snapshots is AutoModel's own synchronous save (the same code, the same files) into one of three slots
in /dev/shm, a tmpfs: host memory, no disk. The trainer then tells the writer process "slot k holds step N" and
trains on. The writer persists the newest complete snapshot into the run's checkpoint directory at the storage's
pace, as a normal save is published: reserved under AutoModel's ``.incomplete`` marker (its
``CheckpointLifecycle``), the files copied and fsynced, ``meta.json`` last, then published (marker removed,
LATEST and LOWEST_VAL moved) and pruned to ``save_top_k``. A snapshot that arrives while another waits replaces
it (reported as ``replaced_by``); a slot is never handed to the trainer while it is being persisted, so nothing is
ever half-written from a slot that changed underneath.

The three slots: one being persisted, one waiting, one the trainer fills. The writer runs in a session of its own
(``start_new_session``): a SIGKILL of the trainer's process group leaves it running; it then persists what it had
received (the snapshot being written and the one waiting) and exits. Its pid file in the checkpoint directory
(:func:`pidfile`) makes the next run of the same run directory wait for it (:func:`wait_for_writer`) before it
resumes from the newest checkpoint.

One writer per node, started by the node's first rank: every local rank's files of a step are in the same slot
(AutoModel's save is collective), so the writer persists all of them from one step; the ranks agree on the slot
through a gloo all-reduce (``loop.py``). Several nodes fall back to ordinary saves (``launch.snapshots_fit``).

Protocol (JSON lines): trainer -> writer on its stdin ``{"op": "acquire"}`` (answered ``{"slot": k}``),
``{"op": "filled", "slot": k, "step": N, "name": "epoch_0_step_{N-1}", "taken": unix time}``; the trainer closing
stdin means "persist what you have and exit". Writer -> trainer on its stdout: the answers and the events
``{"event": "persisted", "step", "path", "val_loss", "persisted_s", "lag_s"}``, ``{"event": "replaced", "step",
"replaced_by"}``, ``{"event": "failed", "step", "error"}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from infra import failpoints, processes
from workloads import checkpoint as ckpt

SLOTS = 3
SLOW_WRITE_S = 4.0  # train.slow_checkpoint_write_at_step: the persist of that step pauses this long half-way
PIDFILE = ".snapshot-writer.pid"


def shm_root(run_dir: Path) -> Path:
    """The run's slots in /dev/shm (one name per run directory: a later run's writer finds and reuses it)."""
    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    return Path(os.environ.get("NEMOFLOW_SNAPSHOT_SHM", "/dev/shm")) / f"nemoflow-snapshots-{digest}"


def slot_dir(run_dir: Path, slot: int) -> Path:
    return shm_root(run_dir) / f"slot{slot}"


def pidfile(run_dir: Path) -> Path:
    return ckpt.checkpoints_dir(run_dir) / PIDFILE


def metrics_record(event: dict) -> dict:
    """A writer's event as its metrics.jsonl record."""
    kind, step = event["event"], event["step"]
    if kind == "persisted":
        return {"step": step, "snapshot_persisted_s": event["persisted_s"], "snapshot_lag_s": event["lag_s"]}
    if kind == "replaced":
        return {"step": step, "snapshot_replaced_by": event["replaced_by"]}
    return {"step": step, "snapshot_failed": event["error"]}


def wait_for_writer(run_dir: Path, timeout_s: float = 3600) -> float:
    """Before a run resumes: wait while a snapshot writer of this run directory (a killed run's) is still
    persisting; returns the seconds waited (0 when none runs: the default path, one file read)."""
    pid = processes.read_pidfile(pidfile(run_dir))
    if pid is None:
        return 0.0
    print(
        f"waiting for the snapshot writer (pid {pid}) of {run_dir} to persist what it holds before resuming",
        flush=True,
    )
    return processes.wait_pidfile(pidfile(run_dir), timeout_s)


class SnapshotWriter:
    """The trainer's side: the writer process, its answers and its events (node's first rank only)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.answers: queue.Queue = queue.Queue()
        self.events: queue.Queue = queue.Queue()
        self.reader = threading.Thread(target=self._read, name="nemoflow-snapshot-events", daemon=True)
        self.reader.start()
        self.taken = self.persisted = self.replaced = self.failed = 0

    @classmethod
    def start(cls, run_dir: Path, save_top_k: int) -> SnapshotWriter:
        root = shm_root(run_dir)
        shutil.rmtree(root, ignore_errors=True)  # a previous writer's, finished (wait_for_writer ran first)
        for slot in range(SLOTS):
            (root / f"slot{slot}").mkdir(parents=True)
        command = [
            sys.executable,
            "-m",
            "workloads.train.snapshots",
            "--run-dir",
            str(run_dir),
            "--save-top-k",
            str(save_top_k),
        ]
        # its own session: a SIGKILL of the trainer's process group (a cancelled job, a killed node agent's
        # group kill) does not reach it; stderr stays the job's log
        proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        processes.write_pidfile(pidfile(run_dir), proc.pid)  # the writer removes it when it exits
        return cls(proc)

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            (self.events if "event" in message else self.answers).put(message)
        self.answers.put(None)  # the writer exited

    def _send(self, message: dict) -> None:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def acquire(self, timeout_s: float = 600) -> int:
        """A free slot (neither persisting nor waiting), emptied for the next save."""
        self._send({"op": "acquire"})
        answer = self.answers.get(timeout=timeout_s)
        if answer is None:
            raise RuntimeError(f"the snapshot writer process exited (exit code {self.proc.poll()})")
        return int(answer["slot"])

    def filled(self, slot: int, step: int, taken: float) -> None:
        self._send({"op": "filled", "slot": slot, "step": step, "name": ckpt.step_dir_name(step), "taken": taken})
        self.taken += 1

    def drain(self) -> list[dict]:
        """The events received so far."""
        found = []
        while True:
            try:
                found.append(self.events.get_nowait())
            except queue.Empty:
                break
        for event in found:
            kind = event["event"]
            self.persisted += kind == "persisted"
            self.replaced += kind == "replaced"
            self.failed += kind == "failed"
        return found

    def finish(self, timeout_s: float = 3600) -> list[dict]:
        """Close: the writer persists what it holds and exits; its last events."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        self.proc.wait(timeout=timeout_s)
        self.reader.join(timeout=10)
        return self.drain()


# -------------------------------------------------------------------------------------------- the writer process


class _Writer:
    def __init__(self, run_dir: Path, save_top_k: int):
        self.run_dir, self.save_top_k = run_dir, save_top_k
        self.root = shm_root(run_dir)
        self.checkpoints = ckpt.checkpoints_dir(run_dir)
        self.lifecycle = None  # AutoModel's, made at the first persist
        self.lock = threading.Condition()
        self.filling: set[int] = set()
        self.waiting: dict | None = None
        self.persisting: int | None = None
        self.closed = False
        self.out_lock = threading.Lock()
        self.out_open = True

    def emit(self, message: dict) -> None:
        with self.out_lock:
            if self.out_open:
                try:
                    sys.stdout.write(json.dumps(message) + "\n")
                    sys.stdout.flush()
                    return
                except OSError:  # the trainer is gone (a broken pipe): persisting goes on
                    self.out_open = False
                    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            if "event" in message:
                # what the trainer would have logged, into metrics.jsonl itself: no trainer writes it now (the next
                # run of this run directory opens it only after this process exits: wait_for_writer)
                with open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(metrics_record(message)) + "\n")

    def log(self, line: str) -> None:
        try:
            sys.stderr.write(f"snapshot writer: {line}\n")
            sys.stderr.flush()
        except OSError:
            pass

    def commands(self) -> None:
        for line in sys.stdin:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            with self.lock:
                if message["op"] == "acquire":
                    busy = self.filling | {self.persisting} | ({self.waiting["slot"]} if self.waiting else set())
                    slot = next(s for s in range(SLOTS) if s not in busy)
                    target = self.root / f"slot{slot}"
                    shutil.rmtree(target, ignore_errors=True)
                    target.mkdir(parents=True)
                    self.filling.add(slot)
                    self.emit({"slot": slot})
                elif message["op"] == "filled":
                    self.filling.discard(message["slot"])
                    message["received"] = time.time()
                    if self.waiting is not None:
                        replaced = self.waiting
                        self.log(f"snapshot of step {replaced['step']} replaced by step {message['step']}")
                        self.emit({"event": "replaced", "step": replaced["step"], "replaced_by": message["step"]})
                    self.waiting = message
                    self.lock.notify_all()
        with self.lock:
            self.closed = True
            self.lock.notify_all()

    def run(self) -> None:
        threading.Thread(target=self.commands, name="commands", daemon=True).start()
        # AutoModel's lifecycle (torch and all: seconds of imports) while the trainer builds, not at the first persist
        _import_lifecycle()
        while True:
            with self.lock:
                while self.waiting is None and not self.closed:
                    self.lock.wait()
                if self.waiting is None:
                    return
                job, self.waiting = self.waiting, None
                self.persisting = job["slot"]
            try:
                self.persist(job)
            finally:
                with self.lock:
                    self.persisting = None

    def persist(self, job: dict) -> None:
        CheckpointLifecycle, read_checkpoint_metric = _import_lifecycle()
        if self.lifecycle is None:  # no process group: this process alone publishes
            self.lifecycle = CheckpointLifecycle(config=_LifecycleConfig(str(self.checkpoints)))
        step, name = job["step"], job["name"]
        source = self.root / f"slot{job['slot']}" / name
        dest = self.checkpoints / name
        self.log(f"persisting the snapshot of step {step} to {dest}")
        started = time.perf_counter()
        try:
            self.lifecycle.reserve(str(dest))  # AutoModel's reservation: the .incomplete marker first
            files = sorted(p for p in source.rglob("*") if p.is_file() and p.name not in (ckpt.META, ckpt.INCOMPLETE))
            for i, file in enumerate(files + [source / ckpt.META]):
                if i == len(files) // 2 and failpoints.hits("train.slow_checkpoint_write_at_step", step):
                    self.log(f"slow write (failpoint): pausing {SLOW_WRITE_S:g} s half-way through step {step}")
                    time.sleep(SLOW_WRITE_S)
                if file.exists():
                    _copy_synced(file, dest / file.relative_to(source))
            for directory in sorted({dest, *(p for p in dest.rglob("*") if p.is_dir())}):
                ckpt._fsync_dir(directory)
            best = read_checkpoint_metric(dest, "default")
            val_loss = ckpt.step_meta(dest).get("val_loss")
            self.lifecycle.publish(str(dest), best_val_metric=best, metric_key="default")  # marker gone, LATEST
            saved = ckpt.saved_checkpoints(self.run_dir)
            ckpt.prune_checkpoints(
                self.run_dir,
                self.save_top_k,
                protect={saved[-1].step_dir} if saved else set(),
                before_delete=lambda gone: self.log(f"pruned checkpoint {gone} (save_top_k={self.save_top_k})"),
            )
        except Exception as exc:  # noqa: BLE001 - reported to the trainer; the unpublished save is removed
            self.log(f"the snapshot of step {step} was not persisted: {exc}")
            self.emit({"event": "failed", "step": step, "error": f"{exc.__class__.__name__}: {exc}"})
            if (dest / ckpt.INCOMPLETE).exists():
                ckpt.remove_unpublished(dest)
            return
        now = time.perf_counter()
        self.log(f"persisted the snapshot of step {step} in {now - started:.2f} s")
        self.emit(
            {
                "event": "persisted",
                "step": step,
                "path": str(dest),
                "val_loss": val_loss,
                "persisted_s": now - started,
                "lag_s": time.time() - job["taken"],
            }
        )


def _import_lifecycle():
    from nemo_automodel.components.checkpoint.lifecycle import CheckpointLifecycle
    from nemo_automodel.components.checkpoint.utils import read_checkpoint_metric

    return CheckpointLifecycle, read_checkpoint_metric


class _LifecycleConfig:
    """What ``CheckpointLifecycle`` reads of AutoModel's checkpoint config (pruning is nemoflow's save_top_k)."""

    def __init__(self, checkpoint_dir: str):
        self.checkpoint_dir = checkpoint_dir
        self.max_recent_checkpoints = None


def _copy_synced(source: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(source, "rb") as src, open(dest, "wb") as dst:
        shutil.copyfileobj(src, dst, 16 << 20)
        dst.flush()
        os.fsync(dst.fileno())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workloads.train.snapshots")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--save-top-k", type=int, required=True)
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    try:
        _Writer(run_dir, args.save_top_k).run()
    finally:
        shutil.rmtree(shm_root(run_dir), ignore_errors=True)
        pidfile(run_dir).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
