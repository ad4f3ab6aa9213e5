"""The storage writers of the trainer's checkpoint saves: several files per rank written in parallel.

torch.distributed.checkpoint's background writer process writes what AutoModel hands it: the optimizer state
with a ``FileSystemWriter`` (one file per rank unless ``thread_count`` says more) and the model weights with
AutoModel's safetensors writer (one file per rank, whatever its ``thread_count``). One stream wrote a 1.1B
save (13.2 GB) at ~0.78 GB/s on an H200 node whose disk takes 1.24 GiB/s (issue 34): both writers here split
a rank's state into ``threads`` files of about equal size, written by as many threads at once.

Instances are pickled into DCP's writer process, which imports this module to unpickle them; the failpoints of
the background write (``train.fail_checkpoint_write_at_step``, ``train.kill_checkpoint_writer_at_step``,
``train.slow_background_write_at_step``, ``train.kill_trainer_during_write_at_step``) fire there, in the process
that really writes.

``keep_writing`` (``ckpt_while_writing: replace``): a save the writer process has received is finished even if
the trainer is killed meanwhile. The process leaves the trainer's session at its first write (torchrun and job
agents kill a failed worker's whole process group), records its pid in the checkpoint directory
(``.checkpoint-writer-<pid>.pid``: the next run waits for it) and marks each part of a save written once DCP's
``finish`` has run for it (``model/`` and ``optim/``: ``.nemoflow-written``, every rank's files then written).
The next run publishes a save whose two parts are marked but which the killed trainer never published
(workloads/train/checkpoints.py ``recover_written_save``).
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import queue
import re
import signal
import sys
import time
from pathlib import Path

from nemo_automodel.components.checkpoint._backports.hf_storage import _HuggingFaceStorageWriter
from nemo_automodel.components.checkpoint._backports.hf_utils import _gen_file_name
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _split_by_size_and_type

from infra import failpoints, processes

_STEP = re.compile(r"epoch_\d+_step_(\d+)")
SLOW_WRITE_S = 6.0  # train.slow_background_write_at_step: that save's write waits this long first (a slow storage)
_SLOWED: set[int] = set()  # the saves already slowed (the writer process writes several files a save)
WRITTEN = ".nemoflow-written"  # keep_writing: in model/ and optim/ once DCP's finish has run for that part
WRITER_PIDFILE = ".checkpoint-writer-{pid}.pid"  # keep_writing: in the checkpoint directory
_DETACHED: list[bool] = []


class ParallelFileSystemWriter(FileSystemWriter):
    """DCP's file writer (the optimizer state), ``thread_count`` files per rank, with the writer's failpoints."""

    keep_writing = False

    def write_data(self, plan, planner):
        _received(self)
        _failpoints(self.path, f"__{plan.storage_data.prefix}0.distcp", part="optim")
        return super().write_data(plan, planner)

    def finish(self, metadata, results):
        super().finish(metadata, results)
        _written(self)


class ParallelSafetensorsWriter(_HuggingFaceStorageWriter):
    """AutoModel's safetensors writer (the model weights), its rank's tensors split over ``thread_count`` files.

    AutoModel's reader and the export list every ``*.safetensors`` file of the directory and read each one's
    header, so a rank's weights may lie in several files (``shard-<rank>-model-<i>-of-<n>.safetensors``).
    """

    keep_writing = False

    def finish(self, metadata, results):
        super().finish(metadata, results)
        _written(self)

    def write_data(self, plan, planner):
        shard_index = plan.storage_data.get("shard_index")
        _received(self)
        _failpoints(self.path, _gen_file_name(1, 1, shard_index), part="model")
        if self.thread_count <= 1 or not plan.items or "fqn_to_index_mapping" in plan.storage_data:
            return super().write_data(plan, planner)
        buckets = [b for b in _split_by_size_and_type(self.thread_count, plan.items) if b]
        files: queue.Queue = queue.Queue()
        for index, items in enumerate(buckets, start=1):
            name = _gen_file_name(index, len(buckets), shard_index)
            files.put((self.fs.concat_path(self.path, name), name, items))
        return self._write_data(planner, files)


def parallel(writer, path: str, threads: int, keep_writing: bool = False):
    """The writer a save of ``path`` uses: AutoModel's ``writer`` (None for the optimizer state, its safetensors
    writer for the model) made to write ``threads`` files at once. Anything else (object storage) is kept.
    ``keep_writing``: see the module docstring."""
    if writer is None:
        if "://" in str(path):
            return None
        writer = ParallelFileSystemWriter(path, thread_count=threads)
    elif type(writer) is _HuggingFaceStorageWriter:
        # The same writer, its class swapped for the subclass that only adds the split (no state of its own).
        writer.__class__ = ParallelSafetensorsWriter
        writer.thread_count = threads
    else:
        return writer
    if keep_writing:
        writer.keep_writing = True
    return writer


def writer_pidfiles(checkpoints: Path) -> list[Path]:
    """The pid files of keep_writing writer processes in a checkpoint directory (live or left by dead ones)."""
    return sorted(Path(checkpoints).glob(WRITER_PIDFILE.format(pid="*")))


def _received(writer) -> None:
    """keep_writing, in the writer process, at a part's first write: out of the trainer's session, pid on record."""
    if not writer.keep_writing or _STEP.search(str(writer.path)) is None:
        return
    if multiprocessing.parent_process() is None:
        return  # not DCP's writer process (a synchronous save writes in the trainer itself): nothing to outlive
    if not _DETACHED:
        _DETACHED.append(True)
        try:
            os.setsid()  # a kill of the trainer's process group no longer reaches this process
        except OSError:
            pass
    checkpoints = Path(writer.path).parent.parent
    pidfile = checkpoints / WRITER_PIDFILE.format(pid=os.getpid())
    if not pidfile.exists():
        processes.write_pidfile(pidfile, os.getpid())


def _written(writer) -> None:
    """keep_writing, in the writer process (DCP's coordinator): this part of the save is written on every rank."""
    if writer.keep_writing and _STEP.search(str(writer.path)) is not None:
        marker = Path(writer.path) / WRITTEN
        with open(marker, "w") as fh:
            fh.flush()
            os.fsync(fh.fileno())


def _failpoints(path, name: str, part: str) -> None:
    """Inside the writer process, before the real write: part of a file, then an I/O error or a SIGKILL."""
    match = _STEP.search(str(path))
    if match is None:
        return
    done = int(match.group(1)) + 1
    if part == "optim" and failpoints.at("train.kill_trainer_during_write_at_step", done):
        # the trainer handed over the save's last part (its model part is being or was written): it dies now,
        # and this write goes on afterwards
        print(f"checkpoint writer (pid {os.getpid()}): SIGKILL of the trainer (failpoint)", file=sys.stderr, flush=True)
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(1.0)
    if done not in _SLOWED and failpoints.hits("train.slow_background_write_at_step", done):
        _SLOWED.add(done)  # once a save: its first file's write waits, as a slow storage would
        time.sleep(SLOW_WRITE_S)
    fail = failpoints.hits("train.fail_checkpoint_write_at_step", done)
    kill = failpoints.hits("train.kill_checkpoint_writer_at_step", done)
    if not (fail or kill):
        return
    half = Path(path) / name
    half.parent.mkdir(parents=True, exist_ok=True)
    with open(half, "wb") as fh:  # what a write cut short leaves: the start of a file
        fh.write(b"\0" * 65536)
    if kill:
        os.kill(os.getpid(), signal.SIGKILL)
    raise OSError(errno.EIO, f"Input/output error (simulated by a failpoint) writing {half}")
