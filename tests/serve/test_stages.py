"""The Prefect stages: deploy_inference / stop_inference and smoke_test, on a real Prefect server."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from prefect import flow

from infra import services
from tasks.common import result_storage
from tasks.refs import CheckpointRef, EndpointRef
from tasks.serve import deploy_inference, service_name, stop_inference
from tasks.smoke import SmokeTestFailed, run_smoke, seed_request, smoke_test
from tests.conftest import free_port
from tests.serve.test_services import standin

MODEL = "tiny-llama-stage"


@flow(name="test-deploy-and-smoke")
def deploy_and_smoke(checkpoint: CheckpointRef, port: int):
    results = result_storage()
    deployed = deploy_inference.with_options(result_storage=results)(
        checkpoint, port=port, model_name=MODEL, ready_timeout_s=90, return_state=True
    )
    endpoint = deployed.result()
    smoked = smoke_test.with_options(result_storage=results)(endpoint, max_tokens=8, return_state=True)
    return deployed.name, smoked.name, endpoint, smoked.result()


@flow(name="test-teardown")
def teardown(endpoint: EndpointRef) -> bool:
    return stop_inference(endpoint)


@flow(name="test-smoke-only")
def smoke_only(endpoint: EndpointRef, timeout_s: float = 30):
    return smoke_test(endpoint, timeout_s=timeout_s)


@pytest.fixture
def cleanup(work_dir):
    yield
    for entry in services.list_services():
        services.stop_service(entry.name, grace_s=1)


@pytest.mark.slow
def test_deploy_is_cached_while_serving_and_redeploys_otherwise(
    prefect_server, work_dir, cleanup, tiny_checkpoint, tmp_path
):
    port = free_port()
    checkpoint = CheckpointRef(uri=str(tiny_checkpoint), step=1)
    # something else already serves under this name (an older deploy): it must be replaced, not leaked
    older = services.start_service(standin(service_name(MODEL), free_port(), "empty"), tmp_path / "logs")

    deploy_state, smoke_state, endpoint, smoke = deploy_and_smoke(checkpoint, port)
    assert (deploy_state, smoke_state) == ("Completed", "Completed")
    assert endpoint.url == f"http://127.0.0.1:{port}" and endpoint.model == MODEL
    assert smoke.passed and smoke.output.strip() and smoke.latency_s < 30
    assert not services.pid_alive(older.pid, older.proc_start)
    first = services.get_service(service_name(MODEL))
    assert first is not None and first.checkpoint == str(tiny_checkpoint) and first.pid != older.pid

    # nothing changed and the server still answers: every stage is a cache hit, same process
    deploy_state, smoke_state, endpoint2, _ = deploy_and_smoke(checkpoint, port)
    assert (deploy_state, smoke_state) == ("Cached", "Cached")
    assert endpoint2 == endpoint
    assert services.get_service(service_name(MODEL)).pid == first.pid
    answer = httpx.post(endpoint.url + "/v1/completions", json={"prompt": "Amen", "max_tokens": 2}, timeout=30)
    assert answer.status_code == 200

    # after an explicit teardown the cached result is stale: the next run deploys again
    assert teardown(endpoint) is True
    assert not services.pid_alive(first.pid, first.proc_start)
    deploy_state, smoke_state, _, _ = deploy_and_smoke(checkpoint, port)
    assert (deploy_state, smoke_state) == ("Completed", "Completed")
    second = services.get_service(service_name(MODEL))
    assert services.is_healthy(second) and second.pid != first.pid
    assert teardown(endpoint) is True
    assert services.list_services() == []


def test_deploy_rejects_unimplemented_backends(prefect_server, work_dir, tiny_checkpoint):
    with pytest.raises(ValueError, match="unknown executor kind 'nomad'"):
        deploy_inference.fn(CheckpointRef(uri=str(tiny_checkpoint), step=1), executor="nomad")


def test_smoke_fails_clearly_on_an_empty_completion(prefect_server, work_dir, cleanup, tmp_path):
    from prefect.artifacts import Artifact

    port = free_port()
    services.start_service(standin("standin-empty", port, "empty"), tmp_path / "logs")
    endpoint = EndpointRef(url=f"http://127.0.0.1:{port}", model="standin-empty", handle="standin-empty")
    with pytest.raises(SmokeTestFailed, match="returned an empty completion"):
        smoke_only(endpoint)
    report = Artifact.get("smoke-test-standin-empty")
    assert report is not None
    assert "FAILED" in report.data and "empty completion" in report.data and "In the beginning" in report.data


def test_smoke_reports_timeouts_and_unreachable_endpoints(work_dir, cleanup, tmp_path):
    port = free_port()
    services.start_service(standin("standin-slow", port, "slow"), tmp_path / "logs")
    slow = EndpointRef(url=f"http://127.0.0.1:{port}", model="slow")
    result = run_smoke(slow, seed_request(slow, "In the beginning", 20, 0.7, 0.9, 1), timeout_s=1)
    assert not result.passed and result.status == f"no answer from {slow.url}/v1/completions within 1s"

    nowhere = EndpointRef(url=f"http://127.0.0.1:{free_port()}", model="none")
    result = run_smoke(nowhere, seed_request(nowhere, "x", 5, 0.7, 0.9, 1), timeout_s=5)
    assert not result.passed and result.status.startswith(f"could not reach {nowhere.url}/v1/completions")


def test_smoke_sends_the_seed_body(live_server):
    endpoint = EndpointRef(url=live_server, model="tiny-llama")
    body = seed_request(endpoint, "In the beginning", 20, 0.7, 0.9, 1)
    assert set(body) == {"prompt", "model", "max-tokens", "temperature", "top_p", "top_k"}
    result = run_smoke(endpoint, body, timeout_s=30)
    assert result.passed, result.status
    assert result.http_status == 200 and 0 < result.completion_tokens <= 20 and result.output.strip()


CANCELLED_DEPLOY = """
import sys
from pathlib import Path
from prefect import flow, task
from infra import services
from infra.jobs import ServiceSpec

@task
def deploy(port):
    script = "import time; print('loading', flush=True); time.sleep(600)  # cancelled-deploy-marker"
    spec = ServiceSpec(name="cancelled-deploy", command=[sys.executable, "-c", script], port=port)
    services.start_service(spec, sys.argv[2], ready_timeout_s=300)

@flow
def deploy_flow(port: int):
    deploy(port)

deploy_flow(int(sys.argv[1]))
"""


@pytest.mark.slow
def test_flow_run_terminated_before_ready_leaves_no_server(prefect_server, work_dir, cleanup, tmp_path):
    """Cancelling a flow run SIGTERMs its process; Prefect turns that into an exception in the task."""
    import os
    import signal
    import subprocess
    import time

    repo = str(Path(__file__).resolve().parents[2])
    runner = subprocess.Popen(
        [sys.executable, "-c", CANCELLED_DEPLOY, str(free_port()), str(tmp_path / "logs")],
        cwd=repo,
        env=dict(os.environ, PYTHONPATH=repo),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 90
    entry = None
    while entry is None and time.monotonic() < deadline and runner.poll() is None:
        entry = services.get_service("cancelled-deploy")
        time.sleep(0.2)
    assert entry is not None and entry.state == "starting", runner.communicate()[0] if runner.poll() else ""
    runner.send_signal(signal.SIGTERM)  # what a worker does to cancel the run: only the flow's process
    output = runner.communicate(timeout=60)[0]
    assert not services.pid_alive(entry.pid, entry.proc_start), output
    assert services.group_members(entry.pid) == []
    assert services.list_services() == []
