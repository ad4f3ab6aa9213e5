"""Where a secret could come to rest after a run, searched for real (tests reuse it: the e2e runs too).

    leaks = find_leaks({"HF_TOKEN": value, ...}, flow_run_ids=[run_id], work_dir=work_dir, texts={"stdout": out})
    assert leaks == []

Looked at: the Prefect server's SQLite file (and its WAL), every flow run's parameters as the API
(and so the UI) returns them, every artifact, the logs of the given flow runs and of their
subflows, every file under ``work_dir`` (sbatch scripts, manifests, sidecars, results, checkpoints)
and any text given (a command's output, a worker log).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path


def read_all(client, method: str, **filters) -> list:
    """Every page of a Prefect client ``read_*`` call."""
    items, offset = [], 0
    while True:
        page = getattr(client, method)(limit=200, offset=offset, **filters)
        items += page
        if len(page) < 200:
            return items
        offset += 200


def run_family(client, flow_run_ids: Iterable) -> list:
    """The flow runs ``flow_run_ids`` and every subflow run below them."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterFlowRunId

    found: dict[str, object] = {}
    frontier = [str(i) for i in flow_run_ids]
    while frontier:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=frontier)))
        found.update({str(r.id): r for r in runs})
        tasks = read_all(
            client, "read_task_runs", task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=frontier))
        )
        task_ids = {str(t.id) for t in tasks}
        children = [r for r in read_all(client, "read_flow_runs") if str(r.parent_task_run_id) in task_ids]
        frontier = [str(r.id) for r in children if str(r.id) not in found]
    return list(found.values())


def find_leaks(
    secrets: Mapping[str, str],
    *,
    flow_run_ids: Iterable = (),
    work_dir: str | os.PathLike | None = None,
    texts: Mapping[str, str] | None = None,
    database: str | os.PathLike | None = None,
) -> list[str]:
    """``"NAME in WHERE"`` for every secret value found; empty when none is anywhere.

    The Prefect API is the current settings' (``temporary_settings`` for another server);
    ``database``: its SQLite file (default ``$PREFECT_HOME/prefect.db``).
    """
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    leaks: list[str] = []

    def scan(where: str, content: str | bytes) -> None:
        for name, value in secrets.items():
            if value and (value.encode() if isinstance(content, bytes) else value) in content:
                leaks.append(f"{name} in {where}")

    for where, text in (texts or {}).items():
        scan(where, text)
    database = Path(database or Path(os.environ["PREFECT_HOME"]) / "prefect.db")
    assert database.exists(), database
    for suffix in ("", "-wal", "-journal"):
        path = database.with_name(database.name + suffix)
        if path.exists():
            scan(path.name, path.read_bytes())
    with get_client(sync_client=True) as client:
        for run in read_all(client, "read_flow_runs"):
            scan(f"the parameters of flow run {run.name}", json.dumps(run.parameters))
        for artifact in read_all(client, "read_artifacts"):
            scan(f"artifact {artifact.key or artifact.id}", json.dumps(artifact.model_dump(mode="json")))
        family = [r.id for r in run_family(client, flow_run_ids)] if flow_run_ids else []
        if family:
            logs = read_all(client, "read_logs", log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=family)))
            for log in logs:
                scan("a log line of the run", log.message)
    if work_dir is not None:
        for root, _, files in os.walk(work_dir):
            for name in files:
                path = Path(root) / name
                if not path.is_symlink():
                    scan(str(path.relative_to(work_dir)), path.read_bytes())
    return leaks
