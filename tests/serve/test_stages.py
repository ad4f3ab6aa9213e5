"""The Prefect stages: deploy_inference / stop_inference and smoke_test, on a real Prefect server."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
from prefect import flow

from infra import services
from infra.jobs import ServiceSpec
from tasks.common import result_storage
from tasks.refs import CheckpointRef, EndpointRef
from tasks.serve import deploy_inference, service_name, stop_inference
from tasks.smoke import (
    SmokeTestFailed,
    is_transient,
    openai_request,
    run_smoke,
    seed_request,
    smoke_test,
    smoke_with_retries,
)
from tests.conftest import free_port
from tests.serve.test_services import standin
from tests.support import fault_ledger
from workloads.serve_http import PortRelay

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
    return smoke_test(endpoint, timeout_s=timeout_s, retry_s=5)


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
    result = run_smoke(slow, seed_request("slow", "In the beginning"), timeout_s=1)
    assert not result.passed and result.status == f"no answer from {slow.url}/v1/chat/completions/ within 1s"
    assert not is_transient(result)  # a server that answers too slowly is a failure, not a blip

    nowhere = EndpointRef(url=f"http://127.0.0.1:{free_port()}", model="none")
    result = run_smoke(nowhere, seed_request("none", "x"), timeout_s=5)
    assert not result.passed and result.status.startswith(f"could not reach {nowhere.url}/v1/chat/completions/")
    assert is_transient(result)


def test_smoke_sends_the_seed_body(live_server):
    endpoint = EndpointRef(url=live_server, model="tiny-llama")
    body = seed_request(endpoint.model, "In the beginning")
    assert json.dumps(body) == (
        '{"prompt": "In the beginning", "model": "tiny-llama", "max-tokens": 2048, "top_p": 0, "top_k": 0.9, '
        '"temperature": 1.0}'
    )
    result = run_smoke(endpoint, body, timeout_s=30)
    assert result.passed, result.status
    assert result.http_status == 200 and result.output.strip() and result.shape == "seed"
    openai_shape = run_smoke(endpoint, openai_request(endpoint.model, "In the beginning", 5), 30, shape="openai")
    assert openai_shape.passed and 0 < openai_shape.completion_tokens <= 5


def test_smoke_retries_until_the_server_comes_up(live_server, tmp_path):
    """A connection refused at first (the server is still starting) is retried with backoff."""
    import threading

    port = free_port()
    endpoint = EndpointRef(url=f"http://127.0.0.1:{port}", model="tiny-llama")
    relay = PortRelay("127.0.0.1", port, int(live_server.rsplit(":", 1)[1]))
    threading.Timer(2.0, relay.join).start()  # the endpoint starts answering after ~2 s
    retries: list[str] = []
    try:
        result = smoke_with_retries(
            endpoint,
            seed_request("tiny-llama", "In the beginning", 8),
            30,
            retry_s=30,
            on_retry=lambda n, status, sleep: retries.append(status),
        )
    finally:
        relay.leave()
    assert result.passed, result.status
    assert result.attempts >= 2 and retries and all(s.startswith("could not reach") for s in retries)


@flow(name="test-smoke-down")
def smoke_down(endpoint: EndpointRef):
    return smoke_test(endpoint, retry_s=3)


@pytest.mark.slow
def test_smoke_failure_that_persists_names_the_endpoint_and_log(prefect_server, work_dir, cleanup, tmp_path):
    from prefect.artifacts import Artifact

    port = free_port()
    handle = services.start_service(standin("standin-busy", port, "busy"), tmp_path / "logs")
    endpoint = EndpointRef(url=handle.url, model="standin-busy", handle="standin-busy")
    with pytest.raises(SmokeTestFailed) as failed:
        smoke_down(endpoint)
    message = str(failed.value)
    assert f"at {handle.url}/v1/chat/completions/ failed: HTTP 503" in message
    assert "still failing after" in message and "attempts over 3s" in message
    assert "last server log lines:" in message and "standin busy on" in message  # the server's own output
    report = Artifact.get("smoke-test-standin-busy")
    assert report is not None and "FAILED" in report.data and "standin busy on" in report.data


@flow(name="test-smoke-keyed")
def smoke_keyed(endpoint: EndpointRef, key_env: str):
    return smoke_test(endpoint, max_tokens=6, api_key_env=key_env)


@pytest.mark.slow
def test_smoke_sends_the_key_and_keeps_it_out_of_artifacts_and_logs(
    prefect_server, work_dir, cleanup, tiny_checkpoint, tmp_path, monkeypatch, caplog
):
    import secrets

    from prefect.artifacts import Artifact

    from tests.serve.conftest import serve_command

    key = "sk-smoke-" + secrets.token_hex(12)
    monkeypatch.setenv("NEMOFLOW_SMOKE_TEST_KEY", key)
    port = free_port()
    command = serve_command(tiny_checkpoint, port, "keyed", "--api-key-env", "NEMOFLOW_SMOKE_TEST_KEY")
    handle = services.start_service(
        ServiceSpec(name="keyed", command=command, port=port), tmp_path / "logs", ready_timeout_s=90
    )
    endpoint = EndpointRef(url=handle.url, model="keyed", handle="keyed")
    # without the key: 401 is not transient, the failure is immediate and says so
    with pytest.raises(SmokeTestFailed, match="HTTP 401"):
        smoke_only(endpoint)
    with caplog.at_level("INFO"):
        result = smoke_keyed(endpoint, "NEMOFLOW_SMOKE_TEST_KEY")
    assert result.passed and result.output.strip()
    report = Artifact.get("smoke-test-keyed")
    assert "$NEMOFLOW_SMOKE_TEST_KEY" in report.data and key not in report.data
    assert key not in caplog.text
    assert key not in Path(handle.log_path).read_text()
    assert key not in json.dumps(result.model_dump())


CANCELLED_DEPLOY = """
import json
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
@pytest.mark.faults
def test_flow_run_terminated_before_ready_leaves_no_server(prefect_server, work_dir, cleanup, tmp_path):
    """Cancelling a flow run SIGTERMs its process; Prefect turns that into an exception in the task."""
    row = fault_ledger.open_row("flow-run process SIGTERMed (cancel) before its server was ready")
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
    row.injected += runner.poll() is None  # alive when the SIGTERM is sent
    runner.send_signal(signal.SIGTERM)  # what a worker does to cancel the run: only the flow's process
    output = runner.communicate(timeout=60)[0]
    assert not services.pid_alive(entry.pid, entry.proc_start), output
    assert services.group_members(entry.pid) == []
    assert services.list_services() == []
