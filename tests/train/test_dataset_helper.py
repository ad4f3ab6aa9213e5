"""AutoModel's dataset helper, compiled by the install, is not compiled again by the first training run.

The helper is cached per user and environment under /tmp; ninja decides whether to rebuild, and ninja
1.11 (Debian's) and 1.13 (the venv's, constraints.txt) hash command lines differently in ``.ninja_log``.
``scripts/setup.sh`` compiled it with whichever ninja its PATH found (the system's: the venv was not on
PATH there) and the demo's training, with the venv on PATH, compiled it again: 35 s or more of the CPU
demo's first run (issue 37). Now the install and the training both use the venv's ninja
(``automodel_shim.pin_ninja``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, VENV_BIN
from tests.support.require import need

# What each process does, as the install and the training job do it; prints where the helper lives.
INSTALL = "from workloads.automodel_shim import build_dataset_helper; build_dataset_helper()"
TRAINING = "from workloads import automodel_shim; automodel_shim.pin_ninja()"
HELPER = (
    "from nemo_automodel.components.datasets.llm.megatron.megatron_utils import compile_helper; "
    "import json, os, shutil; m = compile_helper(); "
    "print(json.dumps({'so': m.__file__, 'ninja': shutil.which('ninja')}))"
)


def _system_ninja() -> str | None:
    """A ninja on the system PATH that is not the venv's (the situation of a shell without the venv)."""
    found = shutil.which("ninja", path="/usr/local/bin:/usr/bin:/bin")
    return found if found and Path(found).resolve() != (VENV_BIN / "ninja").resolve() else None


def _run(code: str, path: str) -> dict:
    env = {**os.environ, "PATH": path, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd="/tmp", env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_pin_ninja_puts_the_environments_ninja_first():
    system_first = f"/usr/bin:/bin:{VENV_BIN}"
    out = _run(TRAINING + "; import json, shutil; print(json.dumps({'ninja': shutil.which('ninja')}))", system_first)
    assert out["ninja"] == str(VENV_BIN / "ninja")


@pytest.mark.slow
def test_the_installs_build_is_the_one_training_finds():
    need(
        _system_ninja(),
        "a system ninja besides the venv's (without one the two build logs cannot disagree)",
        "apt-get install ninja-build (scripts/setup.sh --test)",
    )
    system_first = f"/usr/bin:/bin:{VENV_BIN}"  # scripts/setup.sh's PATH: the venv is not on it
    venv_first = f"{VENV_BIN}:/usr/bin:/bin"  # scripts/demo.sh's and the test command's PATH

    # The install (setup.sh) builds it from a shell whose PATH finds the system's ninja first.
    so = Path(_run(INSTALL + "; " + HELPER, system_first)["so"])
    log_after_install = (so.parent / ".ninja_log").read_text()
    built_ns = so.stat().st_mtime_ns
    # Training jobs in either shell (the venv on PATH first, as the demo and the tests run them, or not).
    found = [_run(TRAINING + "; " + HELPER, path)["ninja"] for path in (venv_first, system_first, venv_first)]
    assert (so.parent / ".ninja_log").read_text() == log_after_install, "the helper was compiled again"
    assert so.stat().st_mtime_ns == built_ns
    assert found == [str(VENV_BIN / "ninja")] * 3
