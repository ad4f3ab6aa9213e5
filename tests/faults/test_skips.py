"""Under CI=true no test skips for something the test command installs (tests/support/require.py fails it).

A static check: every ``pytest.skip``, ``pytest.importorskip`` and ``skipif`` in the tests is listed here with
why it may stay a skip under CI (hardware the CI machine lacks, software the test command does not install, a
state of the machine the test cannot change). Anything else must go through ``require.need`` / ``missing``,
which skip outside CI and fail under CI=true. A new skip fails this test until it is either converted or
listed with its reason.
"""

from __future__ import annotations

import re

import pytest

from tests.conftest import REPO
from tests.support import require

ALLOWED = {
    ("tests/faults/test_slurm_faults.py", "other jobs kept running"): "the shared node is busy with other tests' "
    "jobs: taking it down would break them (a scheduling state, not a missing tool)",
    ("tests/serve/test_device.py", "this machine has a GPU"): "the no-GPU error path cannot run on a GPU machine",
    ("tests/serve/test_engines.py", "NEMOFLOW_VLLM_PYTHON"): "vLLM is not installed by the test command (GPU node)",
    ("tests/serve/test_blue_green.py", "needs an NVIDIA GPU"): "no GPU on the CI machine (the GPU acceptance runs it)",
    ("tests/serve/test_blue_green.py", "NEMOFLOW_VLLM_PYTHON"): "vLLM is not installed by the test command (GPU node)",
    ("tests/serve/test_engines.py", "NEMOFLOW_NEMO_DEPLOY_SCRIPT"): "NeMo's Triton deploy script is not installed "
    "by the test command",
    ("tests/image/test_convert.py", "enroot is installed"): "the enroot-missing path cannot run where it is installed",
    ("tests/install/test_torch_build.py", "has a GPU"): "the no-GPU path cannot run on a GPU machine",
    ("tests/install/test_torch_build.py", "torch is a CUDA build"): "the CPU-build path needs the CPU torch",
    ("tests/train/test_gpu_resume.py", "needs an NVIDIA GPU"): "no GPU on the CI machine (the lead runs it on H200)",
    ("tests/train/test_moe_sync.py", "needs an NVIDIA GPU"): "no GPU on the CI machine (the GPU acceptance runs it)",
    ("tests/train/test_moe_plan.py", "NVIDIA GPU(s)"): "fewer GPUs than the case measures (1 or 2 H200s)",
}
SKIP = re.compile(r"pytest\.skip\(|importorskip\(|mark\.skipif\(|mark\.skip\(")


def test_every_skip_is_one_the_test_command_cannot_provide():
    found = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        if rel in ("tests/support/require.py", "tests/faults/test_skips.py", "tests/faults/test_fault_ledger.py"):
            continue  # the mechanism itself, this check, and the ledger's inner session (source in a string)
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if not SKIP.search(line):
                continue
            context = "\n".join(lines[i : i + 4])  # a skipif's reason is on the lines after it
            if not any(rel == f and key in context for f, key in ALLOWED):
                found.append(f"{rel}:{i + 1}: {line.strip()}")
    assert not found, "skips that CI=true would let through (use tests.support.require.need):\n" + "\n".join(found)


def test_need_fails_under_ci_and_skips_outside(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true and this test needs squeue: apt-get install"):
        require.need(None, "squeue", "apt-get install slurm-client")
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception, match="needs squeue: apt-get install"):
        require.need(None, "squeue", "apt-get install slurm-client")
    require.need(True, "squeue", "apt-get install slurm-client")  # present: goes on
