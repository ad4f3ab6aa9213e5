"""The run's errors, and how a failure is told in one line (a full disk above all)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from infra.configs.train import TrainConfig
from workloads import staging


class LaunchError(ValueError):
    """The processes started do not match what the configuration asks for."""


class ExportError(RuntimeError):
    """The Hugging Face export after training failed; the saved checkpoints are intact."""


class CheckpointSaveError(RuntimeError):
    """Saves failed ``ckpt_max_failed_saves`` times in a row, or the run's last save failed: the run stops (the
    newest complete checkpoint is kept; its ``__cause__`` is the last write's error). ``disk_full``: the last
    failure came with the run directory's disk full (its space is back once the failed save is removed)."""

    def __init__(self, message: str, disk_full: bool = False):
        super().__init__(message)
        self.disk_full = disk_full


NO_SPACE = (
    "no space left on the device holding the run directory; the last complete checkpoint is kept: free space "
    "(or move run_dir) and run again to resume"
)


def one_line(exc: BaseException) -> str:
    """An exception as one line for the log: its type and its message's first line (DCP's CheckpointException: the
    first failing rank's error)."""
    failures = getattr(exc, "failures", None) or {}
    for rank, failure in sorted(failures.items()):
        inner = failure[0] if isinstance(failure, tuple) else getattr(failure, "exception", failure)
        if isinstance(inner, BaseException):
            return f"rank {rank}: {one_line(inner)}"
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def run_dir_full(config: TrainConfig | None) -> bool:
    """The file system of a local run directory has (almost) no space left: a write that failed there failed for
    that reason, whatever the writer said (torch.save reports a full disk as "unexpected pos", no errno)."""
    if config is None or not config.run_dir or staging.is_remote(config.run_dir):
        return False
    path = Path(config.run_dir.removeprefix("file://"))
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free < 1 << 20
    except OSError:
        return False


def disk_full(exc: BaseException) -> bool:
    """ENOSPC anywhere in the exception's chain, or in torch.distributed.checkpoint's per-rank failures."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if "[Errno 28]" in str(e):  # DCP wraps the ranks' exceptions, keeping their text
            return True
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
        for failure in (getattr(e, "failures", None) or {}).values():  # DCP's CheckpointException: rank -> error
            inner = failure[0] if isinstance(failure, tuple) else getattr(failure, "exception", failure)
            if isinstance(inner, BaseException):
                todo.append(inner)
            elif "[Errno 28]" in str(failure):
                return True
    return False
