"""Where the server runs its model: ``--engine auto`` is decided on the node, ``--device`` for the built-in engine.

The GPU path itself ran on an H200 (devtools/gpu_node.sh; README, "On a GPU machine"); here the choices and
their errors are checked on the CPU.
"""

from __future__ import annotations

import os
import stat
import subprocess

import pytest

from tests.conftest import free_port
from tests.serve.conftest import serve_command
from workloads.serve_engines import auto


def test_auto_is_builtin_without_a_gpu(monkeypatch, tmp_path):
    fake_vllm = tmp_path / "vllm"
    fake_vllm.write_text("#!/bin/sh\nexit 0\n")
    fake_vllm.chmod(fake_vllm.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(auto, "_gpu_visible", lambda: False)
    assert auto.resolve_engine("auto") == "builtin"  # vLLM installed, but no GPU: the CPU engine


def test_auto_on_a_gpu_takes_vllm_only_where_it_is_installed(monkeypatch, tmp_path):
    monkeypatch.setattr(auto, "_gpu_visible", lambda: True)
    monkeypatch.setenv("PATH", str(tmp_path))  # no vllm anywhere
    assert auto.resolve_engine("auto", vllm_executable="vllm-not-here") == "builtin"
    fake_vllm = tmp_path / "vllm"
    fake_vllm.write_text("#!/bin/sh\nexit 0\n")
    fake_vllm.chmod(fake_vllm.stat().st_mode | stat.S_IEXEC)
    assert auto.resolve_engine("auto") == "vllm"
    assert auto.resolve_engine("builtin") == "builtin" and auto.resolve_engine("triton") == "triton"


def test_cuda_visible_devices_empty_means_no_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert auto._gpu_visible() is False


def test_device_cuda_without_a_gpu_fails_with_one_line(tiny_checkpoint, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the error path is for machines without one")
    proc = subprocess.run(
        serve_command(tiny_checkpoint, free_port()) + ["--engine", "builtin", "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("serve: cannot serve ") and "--device cuda but torch sees no GPU" in last, last
