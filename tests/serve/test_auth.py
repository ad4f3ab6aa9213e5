"""API keys on the server (issue #17 item 1): Bearer on every endpoint but /health, 401 in OpenAI's
shape, a non-loopback bind needs a key or an explicit opt-out, and the key never shows up anywhere."""

from __future__ import annotations

import logging
import secrets
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port, wait_http
from tests.serve.conftest import MODEL_NAME, serve_command, start_server, stop_server
from workloads.serve_http import check_exposure, is_loopback, resolve_api_key

KEY_ENV = "NEMOFLOW_TEST_SERVE_KEY"
REPO = Path(__file__).resolve().parents[2]


def start(checkpoint: Path, log: Path, env: dict[str, str], *extra: str, host: str = "127.0.0.1"):
    port = free_port()
    command = serve_command(checkpoint, port, MODEL_NAME, *extra)
    command[command.index("--host") + 1] = host
    return start_server(command, log, **env), f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def keyed_server(tiny_checkpoint, tmp_path_factory):
    key = "sk-nemoflow-" + secrets.token_hex(16)
    log = tmp_path_factory.mktemp("auth") / "server.log"
    proc, url = start(tiny_checkpoint, log, {KEY_ENV: key}, "--api-key-env", KEY_ENV)
    try:
        wait_http(url + "/health", 90, proc, log)
        yield url, key, proc, log
    finally:
        stop_server(proc)


def test_bearer_key_required_everywhere_but_health(keyed_server):
    import openai

    url, key, _, _ = keyed_server
    assert httpx.get(url + "/health").status_code == 200  # probes need no key
    for method, path, body in [
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
        ("POST", "/v1/chat/completions/", {"prompt": "x", "model": MODEL_NAME, "max-tokens": 1}),
        ("POST", "/tokenize", {"prompt": "x"}),
        ("GET", "/no-such-route", None),
    ]:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": key},
            {"Authorization": f"Basic {key}"},
        ):
            response = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
            assert response.status_code == 401, (path, headers, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key"
            assert response.headers["www-authenticate"] == "Bearer"
            assert key not in response.text
    # the official client sends the key as Authorization: Bearer
    good = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
    assert [m.id for m in good.models.list()] == [MODEL_NAME]
    assert good.completions.create(model=MODEL_NAME, prompt="In the beginning", max_tokens=3, temperature=0).choices
    stream = good.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True
    )
    assert list(stream)
    bad = openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as denied:
        bad.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1)
    assert denied.value.status_code == 401
    seed = httpx.post(
        url + "/v1/chat/completions/",
        json={"prompt": "In the beginning", "model": MODEL_NAME, "max-tokens": 4, "top_p": 0, "top_k": 0.9},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert seed.status_code == 200 and seed.json()["output"]


def test_key_is_not_on_the_command_line_nor_in_the_log(keyed_server):
    _, key, proc, log = keyed_server
    cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
    assert KEY_ENV in cmdline and key not in cmdline
    text = log.read_text()
    assert "API key: required, from $" + KEY_ENV in text  # the log names the variable...
    assert key not in text  # ...never the value, not even after the 401s above


def test_unset_key_variable_fails_at_start_naming_it(tiny_checkpoint, tmp_path):
    proc, _ = start(tiny_checkpoint, tmp_path / "log", {}, "--api-key-env", "NEMOFLOW_NO_SUCH_VARIABLE")
    assert proc.wait(timeout=60) != 0
    assert "the environment variable NEMOFLOW_NO_SUCH_VARIABLE is not set" in (tmp_path / "log").read_text()


@pytest.mark.slow
def test_all_interfaces_without_a_key_needs_the_opt_out(tiny_checkpoint, tmp_path):
    refused, _ = start(tiny_checkpoint, tmp_path / "refused.log", {}, host="0.0.0.0")
    assert refused.wait(timeout=60) != 0
    message = (tmp_path / "refused.log").read_text()
    assert "--host 0.0.0.0 is reachable from other machines and no API key is set" in message
    assert "--allow-unauthenticated" in message

    allowed, url = start(tiny_checkpoint, tmp_path / "open.log", {}, "--allow-unauthenticated", host="0.0.0.0")
    try:
        wait_http(url + "/health", 90, allowed, tmp_path / "open.log")
        assert httpx.get(url + "/v1/models").status_code == 200
        assert "WARNING" in (tmp_path / "open.log").read_text()
        assert "WITHOUT an API key" in (tmp_path / "open.log").read_text()
    finally:
        stop_server(allowed)


def test_exposure_rules(caplog):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.0.0.5")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.1.2.3")
    check_exposure("127.0.0.1", None, False)  # loopback: no key needed
    check_exposure("0.0.0.0", "k", False)  # a key: fine
    with pytest.raises(SystemExit, match="--host :: is reachable"):
        check_exposure("::", None, False)
    with caplog.at_level(logging.WARNING, logger="nemoflow.serve"):
        check_exposure("0.0.0.0", None, True)
    assert "WITHOUT an API key" in caplog.text
    assert resolve_api_key(None) is None
    assert resolve_api_key("K", {"K": " secret \n"}) == "secret"
    with pytest.raises(SystemExit) as empty:
        resolve_api_key("K", {"K": "  "})
    assert "K is not set or empty" in str(empty.value)


def test_serve_help_lists_the_key_options():
    out = subprocess.run(
        [sys.executable, "-m", "workloads.serve", "--help"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert "--api-key-env" in out and "--allow-unauthenticated" in out and "--engine" in out
