"""end-to-end through the real path a user takes: prefect.yaml -> `prefect deploy` -> a process
worker -> `prefect deployment run end-to-end/local --watch`, then the run page in headless Chromium.

The model is shrunk through the deployment run's parameters so this stays quick on 2 cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import (
    REPO,
    VENV_BIN,
    flow_run_artifacts,
    free_port,
    prefect_worker_env,
    prefect_worker_process,
)
from tests.support.require import need
from tests.support.tiny import TINY_TRAIN

pytestmark = [pytest.mark.slow, pytest.mark.prefect]


def _prefect(args: list[str], env: dict, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(VENV_BIN / "prefect"), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"prefect {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def _flow_run_id(output: str) -> str:
    import re

    match = re.search(r"UUID:\s*([0-9a-f-]{36})", output)
    assert match, output
    return match.group(1)


def _task_states(flow_run_id: str, timeout: float = 30) -> dict[str, str]:
    """Final states of the run's task runs, subflow included (states arrive as events: wait for them)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId

    deadline = time.monotonic() + timeout
    while True:
        states = {}
        with get_client(sync_client=True) as client:
            children = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
            )
            ids = [flow_run_id] + [str(r.id) for r in children]
            # A subflow appears in its parent as a task run of its own; its stages are its task runs.
            subflow_slots = {r.parent_task_run_id for r in children}
            for task_run in client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)), limit=200
            ):
                if task_run.id not in subflow_slots:
                    states[task_run.name] = task_run.state.name
        if not any(s in ("Pending", "Running", "Scheduled") for s in states.values()) or time.monotonic() > deadline:
            return states
        time.sleep(0.5)


@pytest.fixture
def local_pool(prefect_server, work_dir, tmp_path):
    """The `local` process pool, deployments from prefect.yaml, and a worker; torn down after."""
    with deployed_local_pool(prefect_server, work_dir, tmp_path) as env:
        yield env


@contextlib.contextmanager
def deployed_local_pool(prefect_server, work_dir, tmp_path, **extra: str):
    """`local_pool`'s set-up and teardown; ``extra``: more variables for the worker (and so its flow runs)."""
    env = prefect_worker_env(
        prefect_server,
        work_dir,
        tmp_path / "home",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_WORKER_QUERY_SECONDS="2",
        **extra,
    )
    from devtools.prefect_local import ensure_pools

    ensure_pools(prefect_server)  # prefect deploy refuses pools that do not exist
    deployed = _prefect(["--no-prompt", "deploy", "--all"], env)
    for name in ("end-to-end/local", "prepare-dataset/local", "end-to-end/slurm", "end-to-end/k8s"):
        assert f"Deployment '{name}' successfully" in deployed.stdout, deployed.stdout
    worker = prefect_worker_process("local", "process", env, tmp_path / "worker.log")
    try:
        yield env
    finally:
        _stop_pool(worker)


def _stop_pool(worker: subprocess.Popen) -> None:
    from infra import services

    for handle in services.list_services():
        services.stop_service(handle.name)
    for _ in range(2):  # Prefect workers drain on the first SIGTERM
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
    if worker.poll() is None:
        os.killpg(worker.pid, signal.SIGKILL)


def _run_deployment(env: dict, config: dict) -> tuple[int, str, str]:
    proc = _prefect(
        ["deployment", "run", "end-to-end/local", "--params", json.dumps({"config": config}), "--watch"],
        env,
        check=False,
    )
    return proc.returncode, proc.stdout + proc.stderr, _flow_run_id(proc.stdout)


def test_end_to_end_deployment_then_all_cached_and_ui_shows_artifacts(local_pool, prefect_server, work_dir):
    port = free_port()
    config = {"train": TINY_TRAIN, "serve": {"port": port, "model_name": "nemoflow-e2e"}, "validation_threshold": 9.5}
    started = time.monotonic()
    code, output, run_id = _run_deployment(local_pool, config)
    first = time.monotonic() - started
    assert code == 0, output
    summary = json.loads((work_dir / "flow-runs" / f"{run_id}.json").read_text())
    assert summary["answer"].strip(), summary
    assert summary["val_loss"] < summary["untrained_loss"]
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as resp:
        assert json.load(resp)["data"][0]["id"] == "nemoflow-e2e"

    # Nothing changed: every stage is Cached, and the endpoint keeps answering.
    started = time.monotonic()
    code, output, second_id = _run_deployment(local_pool, config)
    second = time.monotonic() - started
    assert code == 0, output
    states = _task_states(second_id)
    assert states and {n: s for n, s in states.items() if s != "Cached"} == {}, states
    print(f"first run {first:.1f}s, cached re-run {second:.1f}s")
    # Each run's stage times, as the API recorded them: the first trained, the second ran nothing.
    times = {row["stage"]: row for row in _artifact_table(run_id, "end-to-end-stage-times")}
    pretrain = next(row for name, row in times.items() if name.startswith("pretrain"))
    assert pretrain["state"] == "Completed" and pretrain["seconds"] > 1, times
    assert any("(in prepare-dataset" in name for name in times), times  # the subflow's stages too
    cached = _artifact_table(second_id, "end-to-end-stage-times")
    assert cached and {row["state"] for row in cached} == {"Cached"}, cached
    _gpu_time_adds_up(run_id, times, work_dir)
    # The cached re-run ran no job: it held nothing, and says so.
    nothing = json.loads((work_dir / "flow-runs" / second_id / "gpu-time.json").read_text())
    assert nothing["stages"] == [] and nothing["held"] == 0 and nothing["goodput"] is None, nothing
    assert "nothing was held" in _artifact_markdown(second_id, "gpu-time-summary")

    _ui_shows_artifacts(prefect_server, run_id)


def _gpu_time_adds_up(run_id: str, stage_times: dict[str, dict], work_dir: Path) -> None:
    """The run's gpu-time artifact (CPU-seconds here: no GPUs): each stage's phases, measured apart (the job's
    own phases, its launch and exit measured by the stage), add up to the seconds the stage held; the
    training job's agree with Prefect's own stage time and with the trainer's record in metrics.jsonl; the
    goodput is the training steps' share of what the run held."""
    from infra import phases

    rows = _artifact_table(run_id, "gpu-time")
    assert rows and all("CPU-s" in row for row in rows), rows
    jobs, parts = [], []  # each record's rows end with its "all" row
    for row in rows:
        assert row["seconds"] >= -0.05, row  # no phase ran backwards (clocks compared across processes)
        if row["phase"] == "all":
            jobs.append((row, {p["phase"]: p["seconds"] for p in parts}))
            parts = []
        else:
            parts.append(row)
    stages = {total["stage"]: seen for total, seen in jobs}
    assert {"pretrain", "validate-checkpoint", "deploy-inference", "smoke-test"} <= set(stages), rows
    for total, seen in jobs:
        slack = max(0.5, 0.02 * total["seconds"])
        assert abs(sum(seen.values()) - total["seconds"]) <= slack, (total, seen)
        assert phases.UNITEMISED not in seen, (total, seen)  # every stage here reports its phases
    pretrain = stages["pretrain"]
    for phase in (phases.START, phases.BUILD, phases.DATA, phases.STEPS, phases.VALIDATION, phases.SAVE):
        assert pretrain.get(phase, 0) > 0, (phase, pretrain)
    assert stages["validate-checkpoint"][phases.VALIDATION] > 0 and stages["validate-checkpoint"][phases.BUILD] > 0
    assert stages["deploy-inference"][phases.START] > 0 and stages["deploy-inference"][phases.BUILD] > 0
    assert stages["smoke-test"][phases.GENERATION] > 0
    # The training job lies inside Prefect's pretrain task run (which also writes its files and artifacts).
    held = next(total for total, _ in jobs if total["stage"] == "pretrain")
    prefect_s = next(row["seconds"] for name, row in stage_times.items() if name.startswith("pretrain"))
    assert prefect_s - 15 <= held["seconds"] <= prefect_s + 0.5, (held, prefect_s)
    # Goodput from the table's own rows: training-step CPU-seconds over all CPU-seconds held.
    accounting = json.loads((work_dir / "flow-runs" / run_id / "gpu-time.json").read_text())
    steps = sum(row["CPU-s"] for row in rows if row["phase"] == phases.STEPS)
    whole = sum(total["CPU-s"] for total, _ in jobs)
    assert 0 < accounting["goodput"] < 1 and abs(accounting["goodput"] - steps / whole) < 0.002, (accounting, steps)
    assert f"goodput {accounting['goodput'] * 100:.1f} %" in _artifact_markdown(run_id, "gpu-time-summary")
    # The trainer logged the same phase seconds in metrics.jsonl (W&B's summary gets that record).
    record = next(
        json.loads(line)
        for path in work_dir.rglob("metrics.jsonl")
        for line in path.read_text().splitlines()
        if '"phase_s"' in line
    )
    assert abs(record["phase_s"][phases.STEPS] - pretrain[phases.STEPS]) < 0.01, (record, pretrain)
    print("gpu-time:", json.dumps(accounting["goodput"]), json.dumps(rows))
    print(_artifact_markdown(run_id, "gpu-time-summary"))


def _artifact_markdown(flow_run_id: str, key: str) -> str:
    return flow_run_artifacts(flow_run_id, key)[0].data


def _artifact_table(flow_run_id: str, key: str) -> list[dict]:
    data = flow_run_artifacts(flow_run_id, key)[0].data
    return json.loads(data) if isinstance(data, str) else data


ARTIFACT_KEYS = (
    "end-to-end-summary",
    "staged-image",
    "loss-curve-",
    "checkpoint-validation-",
    "endpoint-",
    "smoke-test-",
    "end-to-end-stage-times",
    "gpu-time",
    "gpu-time-summary",
)


def _ui_shows_artifacts(api: str, flow_run_id: str) -> None:
    """Open the run page like a person and find the artifacts on its Artifacts tab."""
    need(Path("/usr/bin/chromium").exists(), "Debian's chromium", "apt-get install chromium (scripts/setup.sh --test)")
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    ui = api.removesuffix("/api")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path="/usr/bin/chromium",
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        # Tall: the page renders artifact cards only once they scroll into view, and the task runs' come after
        # the flow run's (four of them since the gpu-time pair).
        page = browser.new_page(viewport={"width": 1400, "height": 4000})
        page.goto(f"{ui}/runs/flow-run/{flow_run_id}")
        page.get_by_text("Artifacts", exact=True).first.click()
        # The flow run's artifacts render first, the task runs' after them: wait for each one looked for.
        for key in ARTIFACT_KEYS:
            try:
                page.get_by_text(key).first.wait_for(timeout=30000)
            except PlaywrightTimeout:
                break  # the assertion below names the one missing and shows the page
        text = page.inner_text("body")
        page.screenshot(path=str(Path(os.environ.get("NEMOFLOW_SCREENSHOT_DIR", "/tmp")) / "nemoflow-run.png"))
        browser.close()
    for key in ARTIFACT_KEYS:
        assert key in text, f"artifact {key!r} not on the run page:\n{text[-3000:]}"


def test_failed_validation_stops_before_deployment(local_pool, work_dir):
    port = free_port()
    config = {
        "train": TINY_TRAIN,
        "serve": {"port": port, "model_name": "nemoflow-never"},
        "validation_threshold": 0.01,
    }
    code, output, run_id = _run_deployment(local_pool, config)
    assert code != 0
    from prefect import get_client

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(run_id).state
    assert state.is_failed() and "threshold" in (state.message or "") + output, state.message
    from infra import services

    assert services.get_service("nemoflow-never") is None
    states = _task_states(run_id)
    assert not any(name.startswith("deploy") for name in states), states


def test_invalid_config_fails_before_compute():
    from flows.end_to_end import EndToEndConfig

    with pytest.raises(ValueError, match=r"global_batch_size=30.*micro_batch_size"):
        EndToEndConfig(train={**TINY_TRAIN, "global_batch_size": 30, "micro_batch_size": 4})
    with pytest.raises(ValueError, match="unknown executor kind 'nomad'; choose one of local, slurm, k8s"):
        EndToEndConfig(executor="nomad")
    with pytest.raises(ValueError, match="kubernetes"):
        EndToEndConfig(executor="kubernetes")  # one name for one meaning: k8s


def test_partial_train_settings_change_the_demo_model_not_replace_it():
    """prefect.yaml's end-to-end/slurm passes train: {cpus_per_task: 1}; that once dropped max_steps."""
    from flows.end_to_end import EndToEndConfig, demo_train_config

    config = EndToEndConfig(train={"cpus_per_task": 1})
    assert config.train.cpus_per_task == 1
    assert config.train.max_steps == demo_train_config().max_steps
    assert config.train.hidden_size == demo_train_config().hidden_size
    budget = EndToEndConfig(train={"max_tokens": 100_000})
    assert budget.train.max_steps is None and budget.train.max_tokens == 100_000
    import yaml

    for deployment in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]:
        if deployment["entrypoint"].startswith("flows/end_to_end.py"):
            EndToEndConfig(**deployment.get("parameters", {}).get("config", {}))  # every deployment's config is valid
