"""The data stage end to end against a Prefect server on PostgreSQL, as teams run it at scale.

``nemoflow prepare`` runs as a user runs it (its own process, PREFECT_API_URL pointing at the
server); the server's database is the local PostgreSQL (devtools/postgres.py), which the test
reads directly: where the runs landed, how many task runs each made, how much it grew.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from workloads.demo_data import write_slimpajama_layout

pytestmark = [pytest.mark.prefect, pytest.mark.slow]


def _prepare(server, work_dir, *args: str) -> dict:
    env = dict(os.environ, PREFECT_API_URL=server.api, NEMOFLOW_WORK_DIR=str(work_dir))
    proc = subprocess.run(
        [sys.executable, "-m", "nemoflow.cli", "prepare", *args, "--json"], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout[proc.stdout.index("{") :])


def _runs(server, expected: list[int], timeout: float = 60) -> list[tuple[str, str, int]]:
    """(flow run id, state, task runs) per prepare-dataset run, oldest first, read from PostgreSQL itself.

    Task-run states reach the database as events, after the client process ended: wait for them.
    """
    import time

    deadline = time.monotonic() + timeout
    while True:
        rows = server.sql(
            "SELECT f.id, f.state_name, (SELECT count(*) FROM task_run t WHERE t.flow_run_id = f.id AND "
            "t.state_type IN ('COMPLETED', 'FAILED')) FROM flow_run f JOIN flow ON flow.id = f.flow_id "
            "WHERE flow.name = 'prepare-dataset' ORDER BY f.created"
        )
        runs = [(i, state, int(n)) for i, state, n in (line.split("|") for line in rows.splitlines())]
        if [n for *_, n in runs] == expected or time.monotonic() > deadline:
            return runs
        time.sleep(0.5)


def test_prepare_against_a_postgresql_backed_server(postgres_prefect_server, work_dir, tmp_path):
    server = postgres_prefect_server
    assert server.sql("SHOW server_version").startswith(("15", "16", "17"))
    write_slimpajama_layout(tmp_path / "src", chunks=3, shards_per_chunk=100)
    template = str(tmp_path / "src" / "train" / "chunk{chunk}" / "example_train_{shard}.jsonl.zst")
    args = ["--name", "pg", "--sources", template, "--shards", "0-99", "--shards-per-file", "120"]

    cold = _prepare(server, work_dir, *args, "--chunks", "1-2")
    grown_before = server.size()
    again = _prepare(server, work_dir, *args, "--chunks", "1-2")
    growth = server.size() - grown_before
    grown = _prepare(server, work_dir, *args, "--chunks", "1-3")

    assert again["blend"] == cold["blend"] and len(grown["prefixes"]) == 3
    runs = _runs(server, expected=[3, 2, 3])
    assert [state for _, state, _ in runs] == ["Completed"] * 3
    # Task runs per run do not grow with the shards: fetch + tokenize + blend, then only the two Cached ones.
    assert [n for *_, n in runs] == [3, 2, 3]
    no_op = runs[1][0]
    states = server.sql(f"SELECT state_name FROM task_run WHERE flow_run_id = '{no_op}' ORDER BY name").split()
    assert states == ["Cached", "Cached"]
    # What a no-op run over 200 shards adds to the database: a flow run, two task runs, their states,
    # events and a few log lines (measured: ~0.1 MB; the per-shard design added ~25 KB per task run).
    assert growth < 1_000_000, growth
    logs = int(server.sql(f"SELECT count(*) FROM log WHERE flow_run_id = '{no_op}'"))
    assert 0 < logs < 30
