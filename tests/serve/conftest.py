"""Fixtures for the inference server tests: a tiny real checkpoint and a real uvicorn server."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port, wait_http
from tests.support.tiny_models import tiny_llama

MODEL_NAME = "tiny-llama"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def vllm_bin(tmp_path) -> Path:
    """A ``vllm`` command that runs the stand-in (engine_standins.py) with vLLM's command line."""
    exe = tmp_path / "bin" / "vllm"
    exe.parent.mkdir()
    standins = Path(__file__).with_name("engine_standins.py")
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{standins}" vllm "$@"\n')
    exe.chmod(0o755)
    return exe


def build_tiny_checkpoint(dest: Path, tokenizer_model: Path) -> Path:
    """The trainer's layout: save_pretrained of a random LlamaForCausalLM + the Mixtral tokenizer."""
    return tiny_llama(dest, tokenizer_model, seed=1234)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, mixtral_tokenizer_model) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", mixtral_tokenizer_model)


def serve_command(checkpoint: Path, port: int, model_name: str = MODEL_NAME, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "workloads.serve",
        "--checkpoint",
        str(checkpoint),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--model-name",
        model_name,
        "--threads",
        "1",
        *extra,
    ]


@pytest.fixture
def cleanup(work_dir):
    """Stop anything a test left registered, so a failing test leaks no process."""
    from infra import services

    yield
    for entry in services.list_services():
        services.stop_service(entry.name, grace_s=1)


def start_server(command: list[str], log: Path, **env: str) -> subprocess.Popen:
    """``command`` (a :func:`serve_command`) in a session of its own, its output in ``log``, this checkout's code
    on its PYTHONPATH; ``env``: more variables."""
    return subprocess.Popen(
        command,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO), **env),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def serving(command: list[str], port: int, log: Path, **env: str) -> Iterator[str]:
    """The server ``command`` starts on ``port``: yields its base URL once /health answers, stops it after."""
    proc = start_server(command, log, **env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", 90, proc, log)
        yield url
    finally:
        stop_server(proc)


@pytest.fixture(scope="session")
def live_server(tiny_checkpoint, tmp_path_factory):
    """A real ``python -m workloads.serve`` process on a free localhost port; yields its base URL."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with serving(serve_command(tiny_checkpoint, port, MODEL_NAME, "--max-tokens-cap", "64"), port, log) as url:
        yield url
