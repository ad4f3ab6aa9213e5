"""The demo's pipeline end to end on an authenticated Prefect API, with an endpoint key (issue #17, items 1-2).

`nemoflow deploy --auth` starts a Prefect server that checks HTTP Basic credentials (a generated
auth string), creates the pools and deploys prefect.yaml; a process worker runs `end-to-end/local`
with the tiny model. Then: anonymous API calls get 401, the endpoint answers only with its key, and
neither the auth string, the endpoint key nor HF_TOKEN is in the server's database, any flow run's
parameters, artifacts, the run's logs, the work dir, the server and worker logs or the CLI output.
Everything runs in subprocesses with a fresh shell's environment and homes in the test's directory.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid

import pytest

from tests.conftest import ENSURE_LOCAL_WORKER, REPO, VENV_BIN, free_port
from tests.security.leaks import find_leaks
from tests.support.tiny import TINY_TRAIN

pytestmark = [pytest.mark.slow, pytest.mark.prefect]


def run(argv: list[str], env: dict[str, str], timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_end_to_end_with_an_authenticated_api_and_a_keyed_endpoint_leaves_no_secret(tmp_path):
    import httpx
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    secrets = {
        "NEMOFLOW_SERVE_API_KEY": "sk-SENTINEL-" + uuid.uuid4().hex,
        "HF_TOKEN": "hf_SENTINEL" + uuid.uuid4().hex,
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_WORKER_QUERY_SECONDS="2",
        NEMOFLOW_HOME=str(tmp_path / "nemoflow-home"),
        NEMOFLOW_WORK_DIR=str(tmp_path / "work"),
        **secrets,
    )
    env.pop("WANDB_API_KEY", None)
    port, serve_port, name = free_port(), free_port(), "nemoflow-auth-e2e"
    api = f"http://127.0.0.1:{port}/api"
    outputs: dict[str, str] = {}
    try:
        deployed = run([str(VENV_BIN / "nemoflow"), "deploy", "--auth", "--port", str(port)], env)
        outputs["nemoflow deploy --auth"] = deployed.stdout + deployed.stderr
        assert deployed.returncode == 0, outputs["nemoflow deploy --auth"]
        auth = (tmp_path / "nemoflow-home" / "prefect" / "auth-string").read_text().strip()
        secrets["auth string"] = auth
        anonymous = httpx.post(f"{api}/flow_runs/filter", json={}, timeout=10)
        assert anonymous.status_code == 401
        worker = run(ENSURE_LOCAL_WORKER, env)
        assert worker.returncode == 0, worker.stderr
        config = {"train": TINY_TRAIN, "serve": {"port": serve_port, "model_name": name}, "validation_threshold": 9.5}
        watched = run(
            [
                str(VENV_BIN / "prefect"),
                "deployment",
                "run",
                "end-to-end/local",
                "--params",
                json.dumps({"config": config}),
                "--watch",
                "--watch-timeout",
                "900",
            ],
            env,
            timeout=1000,
        )
        outputs["prefect deployment run"] = watched.stdout + watched.stderr
        logs = {p.name: p.read_text(errors="replace") for p in (tmp_path / "nemoflow-home" / "prefect").glob("*.log")}
        assert watched.returncode == 0, (
            outputs["prefect deployment run"][-4000:] + logs.get("worker-local.log", "")[-4000:]
        )
        run_id = re.search(r"UUID:\s*([0-9a-f-]{36})", watched.stdout).group(1)

        # the endpoint answered the smoke test with its key, and refuses a request without it
        summary = json.loads((tmp_path / "work" / "flow-runs" / f"{run_id}.json").read_text())
        assert summary["answer"].strip() and summary["endpoint"].endswith(f":{serve_port}")
        denied = httpx.post(summary["endpoint"] + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert denied.status_code == 401

        with temporary_settings(updates={PREFECT_API_URL: api, PREFECT_API_AUTH_STRING: auth}):
            leaks = find_leaks(
                secrets,
                flow_run_ids=[run_id],
                work_dir=tmp_path / "work",
                texts={**outputs, **logs},
                database=tmp_path / "prefect-home" / "prefect.db",
            )
            # the search looks where the run left its records: the endpoint's key variable is named there
            named = find_leaks(
                {"key name": "NEMOFLOW_SERVE_API_KEY"},
                flow_run_ids=[run_id],
                database=tmp_path / "prefect-home" / "prefect.db",
            )
        assert leaks == []
        assert "key name in a log line of the run" in named or any(n.startswith("key name in artifact") for n in named)
    finally:
        run([str(VENV_BIN / "nemoflow"), "serve", "stop", name], env, timeout=60)
        run([sys.executable, "-c", "from devtools import prefect_local as pl; pl.stop_all()"], env, timeout=120)
