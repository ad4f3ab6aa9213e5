"""Where a training job's W&B run went: ``<run_dir>/wandb_run.json``, for the stage's Prefect artifact.

The trainers (workloads/train/, workloads/sft.py) log to W&B through NeMo AutoModel when
``WANDB_API_KEY`` is set; right after AutoModel started the run, rank 0 calls
:func:`record_active_run`, which writes the run's id, project, link (online) or local directory
(``WANDB_MODE=offline``: ``<run_dir>/wandb/offline-run-*``, uploaded later with ``wandb sync``).
Never the key: the record holds no environment and no settings.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

RECORD = "wandb_run.json"


def record_active_run(run_dir: str | os.PathLike) -> dict | None:
    """Write the record of the W&B run this process has open (None, and nothing written, without one)."""
    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    if run is None:
        return None
    offline = bool(getattr(run, "offline", False)) or os.environ.get("WANDB_MODE") in ("offline", "dryrun")
    files_dir = getattr(run, "dir", None)  # .../wandb/<offline-run|run>-<time>-<id>/files
    record = {
        "id": getattr(run, "id", None),
        "project": getattr(run, "project", None),
        "name": getattr(run, "name", None),
        "mode": "offline" if offline else "online",
        "url": None if offline else getattr(run, "url", None),
        "path": str(Path(files_dir).parent) if files_dir else None,
    }
    path = Path(run_dir) / RECORD
    tmp = path.with_name(f".tmp-{os.getpid()}-{RECORD}")
    try:
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, path)
    except OSError as exc:  # the record is for the UI: training goes on without it
        print(f"warning: could not write {path}: {exc}", file=sys.stderr, flush=True)
    return record


def read_record(run_dir: str | os.PathLike) -> dict | None:
    path = Path(run_dir) / RECORD
    if not path.is_file():
        return None
    return json.loads(path.read_text())
