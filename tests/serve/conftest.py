"""Fixtures for the inference server tests: a tiny real checkpoint and a real uvicorn server."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port, wait_http

MODEL_NAME = "tiny-llama"


def build_tiny_checkpoint(dest: Path, tokenizer_model: Path) -> Path:
    """The trainer's layout: save_pretrained of a random LlamaForCausalLM + the Mixtral tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)  # a fixed random model: greedy outputs are reproducible across runs
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(dest)
    shutil.copyfile(tokenizer_model, dest / "tokenizer.model")
    return dest


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


@pytest.fixture(scope="session")
def live_server(tiny_checkpoint, tmp_path_factory):
    """A real ``python -m workloads.serve`` process on a free localhost port; yields its base URL."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        serve_command(tiny_checkpoint, port, MODEL_NAME, "--max-tokens-cap", "64"),
        cwd=repo,
        env=dict(os.environ, PYTHONPATH=str(repo)),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", 90, proc, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
