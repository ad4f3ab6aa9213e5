"""vLLM from its own environment (scripts/setup.sh --engine-venv): found through ``engine.python`` or
``$NEMOFLOW_VLLM_PYTHON``, chosen by ``auto`` on a GPU node where it is there.

The environment here is a STAND-IN: a ``bin/python`` that runs this interpreter with a ``vllm`` package whose
``vllm.entrypoints.cli.main`` is tests/serve/engine_standins.py (vLLM's wheels need CUDA). What is proven is
our side: which command starts, with which environment, through the proxy; not vLLM itself."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port, wait_http
from tests.serve.conftest import MODEL_NAME
from tests.serve.test_engines import KEY_ENV, kill_leftover, stop
from workloads.serve_engines import auto
from workloads.serve_engines.vllm import PYTHON_ENV, Vllm, vllm_command, vllm_installed

REPO = Path(__file__).resolve().parents[2]


def executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def stand_in_env(root: Path, with_vllm: bool = True, with_script: bool = False) -> Path:
    """``root/bin/python``: this interpreter seeing only ``root/lib`` added (where the stand-in vllm lives)."""
    lib = root / "lib"
    if with_vllm:
        cli = lib / "vllm" / "entrypoints" / "cli"
        cli.mkdir(parents=True)
        for d in (lib / "vllm", lib / "vllm" / "entrypoints", cli):
            (d / "__init__.py").write_text("")
        (cli / "main.py").write_text(
            "import os, sys\n"
            f"sys.path.insert(0, {str(REPO)!r})\n"
            "from tests.serve.engine_standins import vllm\n"
            "if __name__ == '__main__':\n"
            "    os.environ['STANDIN_VIA'] = 'python -m vllm.entrypoints.cli.main'\n"
            "    os.environ['STANDIN_PYTHONPATH'] = os.environ.get('NEMOFLOW_SEEN_PYTHONPATH', '')\n"
            "    sys.exit(vllm(sys.argv[1:]))\n"
        )
    python = executable(
        root / "bin" / "python",
        f'#!/bin/sh\nNEMOFLOW_SEEN_PYTHONPATH="$PYTHONPATH" PYTHONPATH="{lib}" exec "{sys.executable}" "$@"\n',
    )
    if with_script:
        executable(root / "bin" / "vllm", f'#!/bin/sh\nexec "{python}" -m vllm.entrypoints.cli.main "$@"\n')
    return python


def test_the_command_comes_from_the_engine_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    assert vllm_command() == ["vllm"]  # nothing said: vllm on PATH, as before
    py = stand_in_env(tmp_path / "a")
    assert vllm_command(str(py)) == [str(py), "-m", "vllm.entrypoints.cli.main"]
    with_script = stand_in_env(tmp_path / "b", with_script=True)
    assert vllm_command(str(with_script)) == [str(with_script.parent / "vllm")]  # its console script
    monkeypatch.setenv(PYTHON_ENV, str(py))
    assert vllm_command() == [str(py), "-m", "vllm.entrypoints.cli.main"]
    assert vllm_command(str(with_script)) == [str(with_script.parent / "vllm")]  # the option wins
    monkeypatch.setenv(PYTHON_ENV, str(tmp_path / "missing" / "python"))
    with pytest.raises(FileNotFoundError) as err:
        vllm_command()
    assert str(err.value) == (
        f"${PYTHON_ENV}={tmp_path}/missing/python: no such file (vLLM's environment: scripts/setup.sh --engine-venv)"
    )


def test_the_option_is_a_server_flag():
    assert Vllm(python="/opt/vllm/bin/python").server_args() == ["--engine", "vllm", "--python", "/opt/vllm/bin/python"]


def test_auto_on_a_gpu_takes_vllm_from_its_environment(tmp_path, monkeypatch):
    monkeypatch.setattr(auto, "_gpu_visible", lambda: True)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no vllm on PATH
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    assert auto.resolve_engine("auto", vllm_executable="vllm-not-here") == "builtin"
    without = stand_in_env(tmp_path / "without", with_vllm=False)
    assert not vllm_installed(str(without)) and auto.resolve_engine("auto", "vllm-not-here", str(without)) == "builtin"
    monkeypatch.setenv(PYTHON_ENV, str(stand_in_env(tmp_path / "with")))
    assert vllm_installed() and auto.resolve_engine("auto", vllm_executable="vllm-not-here") == "vllm"
    monkeypatch.setattr(auto, "_gpu_visible", lambda: False)
    assert auto.resolve_engine("auto", vllm_executable="vllm-not-here") == "builtin"  # no GPU: the CPU engine


@pytest.mark.slow
def test_auto_serves_through_the_proxy_with_vllm_from_its_environment(tmp_path, tiny_checkpoint, monkeypatch):
    """``--engine auto`` on a (pretended) GPU node with $NEMOFLOW_VLLM_PYTHON: the proxy starts that
    environment's vLLM, without nemoflow's PYTHONPATH, with the key in its environment only."""
    import secrets

    python = stand_in_env(tmp_path / "vllm-env")
    key = "sk-env-" + secrets.token_hex(8)
    # the server decides auto itself: a sitecustomize that makes this (CPU) node report a GPU to auto only
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import workloads.serve_engines.auto as a\na._gpu_visible = lambda: True\n")
    port = free_port()
    record_file = tmp_path / "record.json"
    log = tmp_path / "proxy.log"
    command = [sys.executable, "-m", "workloads.serve", "--engine", "auto", "--checkpoint", str(tiny_checkpoint)]
    command += ["--port", str(port), "--model-name", MODEL_NAME, "--api-key-env", KEY_ENV]
    env = dict(os.environ, STANDIN_RECORD=str(record_file), **{KEY_ENV: key, PYTHON_ENV: str(python)})
    env["PYTHONPATH"] = f"{shim}{os.pathsep}{REPO}"
    proc = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    record = {"pid": -1}
    try:
        wait_http(url + "/health", 120, proc, log)
        record = json.loads(record_file.read_text())
        assert record["kind"] == "vllm" and record["vllm_api_key_set"] is False and key not in json.dumps(record)
        assert record.get("via") == "python -m vllm.entrypoints.cli.main"
        assert record.get("pythonpath") == ""  # nemoflow's checkout does not shadow vLLM's packages
        argv = record["argv"]
        assert argv[argv.index("--tokenizer") + 1].endswith(tuple("0123456789abcdef"))
        auth = {"Authorization": f"Bearer {key}"}
        done = httpx.post(
            url + "/v1/completions",
            json={"model": MODEL_NAME, "prompt": "In the beginning", "max_tokens": 3, "temperature": 0},
            headers=auth,
            timeout=60,
        )
        assert done.status_code == 200, done.text
        assert httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=30).status_code == 401
    finally:
        stop(proc)
        if record["pid"] > 0:
            kill_leftover(record["pid"])
