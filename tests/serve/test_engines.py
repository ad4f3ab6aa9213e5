"""``--engine vllm|triton``: the engines' command lines (pure), checked by the engines' own parsers
where they are available, and the proxy + supervisor against stand-in engines (engine_standins.py:
the real engines need GPUs and do not install here)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port, wait_http
from tests.serve.conftest import MODEL_NAME
from tests.support import fault_ledger
from workloads.serve_engines.base import visible_gpus
from workloads.serve_engines.hf_tokenizer import tokenizer_dir
from workloads.serve_engines.triton import triton_argv, triton_cwd
from workloads.serve_engines.vllm import SWITCH_MEMORY_SHARE, vllm_argv, vllm_env, vllm_target

REPO = Path(__file__).resolve().parents[2]
STANDINS = Path(__file__).with_name("engine_standins.py")
PROBE = Path(__file__).with_name("engine_parser_probe.py")
KEY_ENV = "NEMOFLOW_TEST_ENGINE_KEY"


# ---------------------------------------------------------------- command lines


def test_vllm_command_line():
    argv = vllm_argv(
        "/ckpt/step-60",
        model_name="mixtral",
        port=9000,
        tensor_parallel_size=4,
        max_model_len=4096,
        extra=["--gpu-memory-utilization=0.85"],
    )
    assert argv == [
        "vllm",
        "serve",
        "/ckpt/step-60",
        "--host",
        "127.0.0.1",
        "--port",
        "9000",
        "--served-model-name",
        "mixtral",
        "--tensor-parallel-size",
        "4",
        "--max-model-len",
        "4096",
        "--gpu-memory-utilization=0.85",
    ]
    assert "--max-model-len" not in vllm_argv("/c", model_name="m", port=1, tensor_parallel_size=1)


def test_vllm_leaves_room_on_its_gpus_for_the_next_server_of_a_switch():
    """vLLM's own default takes 0.9 of each GPU and refuses to start where less is free, so the second server
    of a blue/green switch on the same GPUs could never start: nemoflow's default is a share two servers fit
    in, and a user's own --gpu-memory-utilization (either spelling) replaces it."""
    from workloads.serve import parse_args

    def engine_argv(*extra: str) -> list[str]:
        args = parse_args(["--checkpoint", "/c", "--engine", "vllm", "--engine-arg=--tokenizer=/t", *extra])
        return vllm_target(args, Path("/c"), "m").argv

    default = engine_argv()
    at = default.index("--gpu-memory-utilization")
    assert 2 * float(default[at + 1]) < 0.95  # two servers fit, with vLLM's own margin
    assert default.count("--gpu-memory-utilization") == 1
    argv = engine_argv("--engine-arg=--gpu-memory-utilization=0.85")
    assert [a for a in argv if a.startswith("--gpu-memory-utilization")] == ["--gpu-memory-utilization=0.85"]
    argv = engine_argv("--engine-arg=--gpu-memory-utilization", "--engine-arg=0.85")
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.85" and argv.count("--gpu-memory-utilization") == 1


def test_vllm_gets_no_key_in_its_environment():
    """vLLM 0.26 hashes its VLLM_* variables into its compile cache key and writes them, values included, to
    cache_key_factors.json: a key there was a secret on disk (and a new cache key every deploy). The proxy
    checks the key; vLLM listens on loopback behind it."""
    off = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}  # the engine environment carries no flashinfer
    triton = {"TRITON_CACHE_DIR": "/home/u/.cache/vllm/triton"}  # a stable one: see the next test
    # a VLLM_API_KEY inherited from the caller's environment is dropped too
    assert vllm_env({"HOME": "/home/u", "VLLM_API_KEY": "stale"}) == {"HOME": "/home/u", **off, **triton}
    # a user's own choice stays; vLLM's own environment does not see nemoflow's PYTHONPATH
    mine = {"VLLM_USE_FLASHINFER_SAMPLER": "1", "TRITON_CACHE_DIR": "/t"}
    assert vllm_env({**mine, "PYTHONPATH": "/repo"}, own_environment=True) == mine


def test_vllm_keeps_its_triton_kernels_in_one_place_outside_the_compile_key():
    """Inductor points an unset TRITON_CACHE_DIR into the compile cache's hash-keyed directory, so vLLM's warm-up
    kernels were compiled again whenever that key changed: the engine gets vLLM's cache root's triton/."""
    assert vllm_env({"HOME": "/h"})["TRITON_CACHE_DIR"] == "/h/.cache/vllm/triton"
    assert vllm_env({"HOME": "/h", "XDG_CACHE_HOME": "/x"})["TRITON_CACHE_DIR"] == "/x/vllm/triton"
    assert vllm_env({"HOME": "/h", "VLLM_CACHE_ROOT": "~/vc"})["TRITON_CACHE_DIR"] == "/h/vc/triton"
    assert not [k for k in vllm_env({"HOME": "/h"}) if k.startswith("VLLM_") and k != "VLLM_USE_FLASHINFER_SAMPLER"]


# The ports and limits both Triton tests give triton_argv.
TRITON_LIMITS = dict(
    triton_port=9001, service_port=9002, tensor_parallel_size=4, max_input_len=2048, max_output_len=512
)


def test_triton_command_line():
    argv = triton_argv(
        "/ckpt/step-60",
        model_name="mixtral",
        model_type="MixtralForCausalLM",
        model_repository="/scratch/trt",
        **TRITON_LIMITS,
    )
    assert argv == [
        "python",
        "/opt/NeMo/scripts/deploy/nlp/deploy_triton.py",
        "--hf_model_id_path",
        "/ckpt/step-60",
        "--model_type",
        "MixtralForCausalLM",
        "--triton_model_name",
        "mixtral",
        "--triton_port",
        "9001",
        "--triton_http_address",
        "127.0.0.1",
        "--tensor_parallelism_size",
        "4",
        "--max_input_len",
        "2048",
        "--max_output_len",
        "512",
        "--start_rest_service",
        "True",
        "--service_http_address",
        "127.0.0.1",
        "--service_port",
        "9002",
        "--triton_model_repository",
        "/scratch/trt",
    ]
    assert triton_cwd("/opt/NeMo/scripts/deploy/nlp/deploy_triton.py") == "/opt/NeMo"


@pytest.mark.parametrize(
    ("devices", "count"),
    [(None, 0), ("", 0), ("0", 1), ("0,1,2,3", 4), ("GPU-aa,GPU-bb", 2), ("-1", 0), ("NoDevFiles", 0)],
)
def test_tensor_parallel_defaults_to_the_gpus_given(devices, count):
    assert visible_gpus({} if devices is None else {"CUDA_VISIBLE_DEVICES": devices}) == count


def _vllm_parses(argv: list[str]) -> subprocess.CompletedProcess:
    """vLLM's own argument parser (in NEMOFLOW_VLLM_PYTHON, on CPU) given ``argv``."""
    return subprocess.run(
        [os.environ["NEMOFLOW_VLLM_PYTHON"], str(PROBE), "vllm", json.dumps(argv)],
        capture_output=True,
        text=True,
        env=dict(os.environ, VLLM_TARGET_DEVICE="cpu"),
        timeout=300,
    )


@pytest.mark.skipif(
    not os.environ.get("NEMOFLOW_VLLM_PYTHON"),
    reason="set NEMOFLOW_VLLM_PYTHON to a Python where vllm imports (README: Serving on GPU clusters)",
)
def test_vllm_parser_accepts_the_command_line():
    argv = vllm_argv(
        "/ckpt", model_name="m", port=9000, tensor_parallel_size=4, max_model_len=4096, extra=["--max-num-seqs=8"]
    )

    out = _vllm_parses(argv)
    assert out.returncode == 0, out.stderr[-2000:]
    parsed = json.loads(out.stdout.splitlines()[-1])
    assert (parsed["model"], parsed["host"], parsed["port"]) == ("/ckpt", "127.0.0.1", 9000)
    assert parsed["served_model_name"] == ["m"] and parsed["tensor_parallel_size"] == 4
    assert parsed["max_model_len"] == 4096 and parsed["max_num_seqs"] == 8 and parsed["api_key"] is None
    typo = _vllm_parses(argv + ["--tensor-paralel", "2"])
    assert typo.returncode != 0  # the parser is strict: the check above means something


@pytest.mark.skipif(
    not os.environ.get("NEMOFLOW_NEMO_DEPLOY_SCRIPT"),
    reason="set NEMOFLOW_NEMO_DEPLOY_SCRIPT to NeMo's scripts/deploy/nlp/deploy_triton.py",
)
def test_nemo_parser_accepts_the_command_line():
    script = os.environ["NEMOFLOW_NEMO_DEPLOY_SCRIPT"]
    argv = triton_argv("/ckpt", model_name="m", model_type="LlamaForCausalLM", script=script, **TRITON_LIMITS)
    out = subprocess.run(
        [sys.executable, str(PROBE), "nemo", script, json.dumps(argv)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    parsed = json.loads(out.stdout)
    assert parsed["hf_model_id_path"] == "/ckpt" and parsed["model_type"] == "LlamaForCausalLM"
    assert parsed["tensor_parallelism_size"] == 4 and parsed["start_rest_service"] is True
    assert (parsed["max_input_len"], parsed["max_output_len"]) == (2048, 512)
    assert (parsed["triton_port"], parsed["service_port"], parsed["service_http_address"]) == (9001, 9002, "127.0.0.1")


# ---------------------------------------------------------------- proxy + supervisor, against stand-ins


def start_proxy(tmp_path: Path, checkpoint: Path, engine: str, *extra: str, env: dict[str, str] | None = None):
    port = free_port()
    log = tmp_path / f"{engine}-proxy.log"
    record = tmp_path / f"{engine}-record.json"
    command = [sys.executable, "-m", "workloads.serve", "--engine", engine, "--checkpoint", str(checkpoint)]
    command += ["--port", str(port), "--model-name", MODEL_NAME, *extra]
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO), STANDIN_RECORD=str(record), **(env or {})),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 120, proc, log)
    return proc, url, log, json.loads(record.read_text())


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.terminate()
    try:
        return proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def kill_leftover(pid: int) -> None:
    """A failing test must not leave its stand-in engine running."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def pid_gone(pid: int, timeout: float = 40) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        status = Path(f"/proc/{pid}/stat")
        if status.exists() and status.read_text().split()[2] == "Z":
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_vllm_engine_behind_the_proxy(tmp_path, tiny_checkpoint, vllm_bin):
    import openai

    key = "sk-engine-" + secrets.token_hex(12)
    proc, url, log, record = start_proxy(
        tmp_path,
        tiny_checkpoint,
        "vllm",
        "--vllm-executable",
        str(vllm_bin),
        "--api-key-env",
        KEY_ENV,
        "--tensor-parallel-size",
        "2",
        "--engine-arg=--max-num-seqs=8",
        "--join-port",
        str(shared_port := free_port()),
        env={KEY_ENV: key},
    )
    try:
        # the engine got the command line vllm_argv renders, and no key: the proxy checks it; the model is the
        # checkpoint through a stable path (test_vllm_model_paths.py)
        engine_port = int(record["argv"][record["argv"].index("--port") + 1])
        model = record["argv"][2]
        assert Path(model).resolve() == tiny_checkpoint.resolve() and model != str(tiny_checkpoint)
        assert (
            record["argv"][1:]
            == vllm_argv(
                model,
                model_name=MODEL_NAME,
                port=engine_port,
                tensor_parallel_size=2,
                tokenizer=str(tokenizer_dir(tiny_checkpoint)),  # ids = sentencepiece's (test_hf_tokenizer.py)
                extra=["--gpu-memory-utilization", str(SWITCH_MEMORY_SHARE), "--max-num-seqs=8"],
                executable=str(vllm_bin),
            )[1:]
        )
        assert record["vllm_api_key_set"] is False and key not in json.dumps(record)
        auth = {"Authorization": f"Bearer {key}"}

        # ready only once warm: the proxy's /health said ok after one generation had gone through the engine
        text = log.read_text()
        warm = text.find("the vllm engine is warm (")
        assert warm > 0, text[-3000:]
        assert '"POST /v1/completions HTTP/1.1" 200' in text[:warm], text[:warm][-3000:]
        # and /health says where the start went, for the deploy stage's gpu-time rows (vLLM's start "not itemised"
        # before): the proxy's start and imports, the engine's start until its health answered, the warm-up
        start = httpx.get(url + "/health", timeout=10).json()["phases"]["seconds"]
        assert list(start) == ["process start and imports", "server start", "generation"], start

        # the seed's request, answered by the proxy from vLLM's /tokenize + /v1/completions
        seed = {"prompt": "In the beginning", "model": MODEL_NAME, "max-tokens": 2048, "top_p": 0, "top_k": 0.9}
        answer = httpx.post(url + "/v1/chat/completions/", json={**seed, "temperature": 1.0}, headers=auth, timeout=60)
        assert answer.status_code == 200, answer.text
        count = httpx.post(
            f"http://127.0.0.1:{engine_port}/tokenize", json={"prompt": "In the beginning"}, headers=auth
        )
        room = count.json()["max_model_len"] - count.json()["count"]
        greedy = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60).completions.create(
            model=MODEL_NAME, prompt="In the beginning", max_tokens=room, temperature=0
        )
        assert answer.json() == {"output": greedy.choices[0].text}

        # OpenAI API straight through to the engine: chat, streaming, its errors
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
        chat = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
        )
        assert chat.object == "chat.completion"
        chunks = list(
            client.completions.create(model=MODEL_NAME, prompt="Amen", max_tokens=6, temperature=0, stream=True)
        )
        plain = client.completions.create(model=MODEL_NAME, prompt="Amen", max_tokens=6, temperature=0)
        assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-4o", prompt="x", max_tokens=1)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        health = httpx.get(url + "/health").json()
        assert {k: health[k] for k in ("status", "model", "engine")} == {
            "status": "ok",
            "model": MODEL_NAME,
            "engine": "vllm",
        }
        assert health["phases"] == httpx.get(url + "/health").json()["phases"]  # frozen once warm
        messages = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        slash_chat = httpx.post(url + "/v1/chat/completions/", json=messages, headers=auth, timeout=60)
        assert slash_chat.status_code == 200 and slash_chat.json()["object"] == "chat.completion"

        # blue/green as with the built-in engine: SIGUSR1 joins the shared port, SIGUSR2 leaves it
        os.kill(proc.pid, signal.SIGUSR1)
        shared = f"http://127.0.0.1:{shared_port}"
        wait_http(shared + "/health", 20, proc, log)
        assert httpx.get(shared + "/v1/models", headers=auth).json()["data"][0]["id"] == MODEL_NAME
        os.kill(proc.pid, signal.SIGUSR2)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "left port" not in log.read_text():
            time.sleep(0.2)
        with pytest.raises(httpx.ConnectError):
            httpx.get(shared + "/health", timeout=5)

        # the key never reached a command line or the log
        assert key not in Path(f"/proc/{proc.pid}/cmdline").read_text()
        assert key not in Path(f"/proc/{record['pid']}/cmdline").read_text()
    finally:
        code = stop(proc)
        gone = pid_gone(record["pid"])
        kill_leftover(record["pid"])
    assert code == 0
    assert gone  # stopping the proxy stopped the engine
    assert key not in log.read_text()


@pytest.mark.slow
@pytest.mark.faults
def test_proxy_exits_when_the_engine_dies(tmp_path, tiny_checkpoint, vllm_bin):
    row = fault_ledger.open_row("vLLM engine SIGKILLed under the serve proxy")
    proc, url, log, record = start_proxy(
        tmp_path, tiny_checkpoint, "vllm", "--vllm-executable", str(vllm_bin), "--tensor-parallel-size", "1"
    )
    try:
        os.kill(record["pid"], signal.SIGKILL)
        row.injected += 1  # the engine was alive (os.kill raises otherwise)
        code = proc.wait(timeout=30)
    finally:
        stop(proc)
    assert code != 0
    assert log.read_text().rstrip().endswith("serve: the vllm engine exited with code -9")


@pytest.mark.slow
def test_triton_engine_behind_the_proxy(tmp_path, tiny_checkpoint):
    nemo = tmp_path / "NeMo"
    script = nemo / "scripts" / "deploy" / "nlp" / "deploy_triton.py"
    script.parent.mkdir(parents=True)
    (nemo / "nemo" / "deploy" / "service").mkdir(parents=True)
    script.write_text(
        f"import runpy, sys\nsys.argv = [{str(STANDINS)!r}, 'triton', *sys.argv[1:]]\n"
        f"runpy.run_path({str(STANDINS)!r}, run_name='__main__')\n"
    )
    key = "sk-triton-" + secrets.token_hex(12)
    proc, url, log, record = start_proxy(
        tmp_path,
        tiny_checkpoint,
        "triton",
        "--triton-script",
        str(script),
        "--tensor-parallel-size",
        "4",
        "--max-input-len",
        "128",
        "--max-output-len",
        "24",
        "--api-key-env",
        KEY_ENV,
        env={KEY_ENV: key},
    )
    try:
        argv = record["argv"]
        triton_port = int(argv[argv.index("--triton_port") + 1])
        service_port = int(argv[argv.index("--service_port") + 1])
        expected = triton_argv(
            str(tiny_checkpoint),
            model_name=MODEL_NAME,
            model_type="LlamaForCausalLM",
            triton_port=triton_port,
            service_port=service_port,
            tensor_parallel_size=4,
            max_input_len=128,
            max_output_len=24,
            script=str(script),
            python=sys.executable,
        )
        assert [str(STANDINS), *argv[1:]] == [str(STANDINS), *expected[2:]]
        assert record["cwd"] == str(nemo)  # NeMo's script writes nemo/deploy/service/config.json from there
        assert json.loads((nemo / "nemo/deploy/service/config.json").read_text())["triton_service_port"] == triton_port
        assert record["vllm_api_key_set"] is False

        auth = {"Authorization": f"Bearer {key}"}
        seed = {"prompt": "In the beginning", "model": MODEL_NAME, "max-tokens": 2048, "top_p": 0, "top_k": 0.9}
        answer = httpx.post(url + "/v1/chat/completions/", json={**seed, "temperature": 1.0}, headers=auth, timeout=60)
        assert answer.status_code == 200, answer.text
        direct = httpx.post(
            f"http://127.0.0.1:{service_port}/v1/completions",
            json={"prompt": "In the beginning", "max_tokens": 24, "temperature": 0},
            timeout=60,
        )
        assert answer.json() == {"output": direct.json()["choices"][0]["text"]}  # greedy, --max-output-len 24
        assert httpx.post(url + "/v1/chat/completions/", json=seed, timeout=60).status_code == 401
        unsupported = httpx.post(url + "/v1/completions", json={"prompt": "x"}, headers=auth, timeout=30)
        assert unsupported.status_code == 404 and "NeMo's REST shape only" in unsupported.json()["error"]["message"]
        models = httpx.get(url + "/v1/models", headers=auth).json()
        assert [m["id"] for m in models["data"]] == [MODEL_NAME]
        assert httpx.get(url + "/health").json()["engine"] == "triton"
    finally:
        code = stop(proc)
        gone = pid_gone(record["pid"])
        kill_leftover(record["pid"])
    assert code == 0 and gone
    assert key not in log.read_text()
