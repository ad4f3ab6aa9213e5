"""A server started on standby (``--standby``, what ``serve.start_early`` starts while the model trains): vLLM on
random weights of the model's shape behind the proxy, serving nothing until the deploy stage loads the validated
checkpoint into it through ``POST /nemoflow/load``.

vLLM cannot run here (no GPU): its stand-in (engine_standins.py) takes vLLM's command line, ``--load-format dummy``
and the development routes the load goes through, with vLLM 0.26's order rule (a reload before the loader is set
back to reading files fails). What this proves is the proxy's side: what it refuses before the load, what it never
passes through, the calls it makes and their order, and that afterwards the checkpoint's own weights answer.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx

from tests.conftest import free_port
from tests.serve.conftest import MODEL_NAME, REPO
from tests.serve.test_engines import start_proxy, stop

GREEDY = {"model": MODEL_NAME, "prompt": "In the beginning", "max_tokens": 8, "temperature": 0}


def skeleton_of(checkpoint: Path, dest: Path) -> Path:
    """What the flow writes before training: the checkpoint-to-be's config.json and tokenizer, no weights."""
    dest.mkdir(parents=True)
    for name in ("config.json", "tokenizer.model"):
        shutil.copy(checkpoint / name, dest / name)
    return dest


def calls(record: Path) -> list[dict]:
    path = Path(str(record) + ".calls")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_standby_server_serves_nothing_until_the_checkpoint_is_loaded_into_it(tmp_path, tiny_checkpoint, vllm_bin):
    skeleton = skeleton_of(tiny_checkpoint, tmp_path / "skeleton")
    engine = ("--vllm-executable", str(vllm_bin), "--engine-port", str(free_port()))
    plain = tmp_path / "plain"
    plain.mkdir()
    proc, url, log, record = start_proxy(tmp_path, skeleton, "vllm", "--standby", *engine)
    reference = None
    try:
        # vLLM started on random weights of the skeleton's shape, with its development routes on (loopback only)
        assert (
            "--load-format" in record["argv"] and record["argv"][record["argv"].index("--load-format") + 1] == "dummy"
        )
        assert record["dev_mode"] == "1"
        health = httpx.get(url + "/health").json()
        assert health["status"] == "standby" and "serves" not in health

        # nothing is served from the random weights, on either shape
        refused = httpx.post(url + "/v1/completions", json=GREEDY)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_not_loaded"
        nemo = httpx.post(url + "/v1/chat/completions/", json={"prompt": "In", "model": MODEL_NAME, "max_tokens": 4})
        assert nemo.status_code == 503
        assert httpx.get(url + "/v1/models").status_code == 503
        # and vLLM's development routes are never reachable through the proxy
        for path in ("/collective_rpc", "/reset_prefix_cache", "/sleep"):
            answer = httpx.post(url + path, json={"method": "reload_weights", "kwargs": {"weights_path": "/etc"}})
            assert answer.status_code == 404, path
        assert calls(tmp_path / "vllm-record.json") == []

        bad = httpx.post(url + "/nemoflow/load", json={"fingerprint": "abc"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "checkpoint"

        loaded = httpx.post(
            url + "/nemoflow/load", json={"checkpoint": str(tiny_checkpoint), "fingerprint": "fp-1"}, timeout=120
        )
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["checkpoint"] == str(tiny_checkpoint)
        made = calls(tmp_path / "vllm-record.json")
        assert [(c["route"], c.get("method")) for c in made] == [
            ("/collective_rpc", "update_config"),
            ("/collective_rpc", "reload_weights"),
            ("/reset_prefix_cache", None),
        ]
        assert made[0]["kwargs"] == {"overrides": {"load_config": {"load_format": "auto"}}}
        assert made[1]["kwargs"] == {"weights_path": str(tiny_checkpoint)}
        health = httpx.get(url + "/health").json()
        assert health["status"] == "ok"
        assert health["serves"] == {"checkpoint": str(tiny_checkpoint), "fingerprint": "fp-1"}

        # the checkpoint's own weights answer: the same greedy tokens as a server started on the checkpoint itself
        answer = httpx.post(url + "/v1/completions", json=GREEDY, timeout=60)
        assert answer.status_code == 200
        ref_proc, ref_url, _, _ = start_proxy(
            plain, tiny_checkpoint, "vllm", *engine[:2], "--engine-port", str(free_port())
        )
        reference = ref_proc
        expected = httpx.post(ref_url + "/v1/completions", json=GREEDY, timeout=60).json()["choices"][0]["text"]
        assert answer.json()["choices"][0]["text"] == expected

        # once only; and a server started on its checkpoint loads nothing
        again = httpx.post(url + "/nemoflow/load", json={"checkpoint": str(tiny_checkpoint)})
        assert again.status_code == 409 and again.json()["error"]["code"] == "already_loaded"
        other = httpx.post(ref_url + "/nemoflow/load", json={"checkpoint": str(tiny_checkpoint)})
        assert other.status_code == 409 and other.json()["error"]["code"] == "not_standby"
    finally:
        stop(proc)
        if reference is not None:
            stop(reference)


def test_a_load_that_leaves_the_random_weights_in_place_fails_and_serving_stays_off(
    tmp_path, tiny_checkpoint, vllm_bin
):
    """A "checkpoint" whose weights are the random ones the engine started on: the load answers like a no-op
    reload would (the engine's output unchanged), so the proxy refuses to serve it."""
    skeleton = skeleton_of(tiny_checkpoint, tmp_path / "skeleton")
    same = tmp_path / "same-as-dummy"
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)  # the stand-in's dummy weights
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(skeleton)).save_pretrained(same)
    shutil.copy(skeleton / "tokenizer.model", same / "tokenizer.model")
    proc, url, _log, _record = start_proxy(
        tmp_path, skeleton, "vllm", "--standby", "--vllm-executable", str(vllm_bin), "--engine-port", str(free_port())
    )
    try:
        failed = httpx.post(url + "/nemoflow/load", json={"checkpoint": str(same)}, timeout=120)
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "load_failed"
        assert httpx.get(url + "/health").json()["status"] == "standby"
        assert httpx.post(url + "/v1/completions", json=GREEDY).status_code == 503
    finally:
        stop(proc)


def test_an_engine_that_cannot_load_in_place_refuses_standby_in_one_line(tmp_path, tiny_checkpoint):
    skeleton = skeleton_of(tiny_checkpoint, tmp_path / "skeleton")
    command = [
        sys.executable,
        "-m",
        "workloads.serve",
        "--engine",
        "builtin",
        "--standby",
        "--checkpoint",
        str(skeleton),
    ]
    done = subprocess.run(
        command + ["--port", str(free_port())],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "serve: --standby: the builtin engine cannot load weights into a running server (engines that can: vllm)"
    )


def test_a_standby_vllm_gets_a_fixed_kv_cache_from_the_gpus_memory():
    """vLLM sizes its KV cache by profiling, which a training job beside it on the GPU upsets; a standby server is
    given a size instead: a quarter of the smallest visible GPU's memory (nvidia-smi's MiB), none without a GPU."""
    from workloads.serve_engines.vllm import standby_kv_cache_bytes

    assert standby_kv_cache_bytes("143771\n") == 143771 * 2**20 // 4  # an H200
    assert standby_kv_cache_bytes("81559\n143771\n") == 81559 * 2**20 // 4
    assert standby_kv_cache_bytes("") is None
    assert standby_kv_cache_bytes("No devices were found\n") is None


def test_the_deploy_stage_loads_only_a_checkpoint_of_the_shape_the_server_started_on(
    tmp_path, tiny_checkpoint, work_dir, monkeypatch
):
    """tasks/serve.py's side on the local backend: a checkpoint whose config.json differs from the standby's shape
    is not loaded (the standby is stopped and the deploy stage starts the server as usual); one of that shape is."""
    from infra.backends.local import LocalBackend
    from tasks import gpu_time
    from tasks.refs import CheckpointRef, EndpointRef
    from tasks.serve import Standby, build_serve_spec, load_into_standby
    from workloads.serve_engines.vllm import Vllm

    venv = tmp_path / "vllm-venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)
    standins = Path(__file__).with_name("engine_standins.py")
    (venv / "vllm").write_text(f'#!/bin/sh\nexec "{sys.executable}" "{standins}" vllm "$@"\n')
    (venv / "vllm").chmod(0o755)
    skeleton = skeleton_of(tiny_checkpoint, tmp_path / "skeleton")
    wider = tmp_path / "wider"
    shutil.copytree(tiny_checkpoint, wider)
    config = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] + 1}))
    backend = LocalBackend()

    def standby() -> Standby:
        port = free_port()
        spec = build_serve_spec(
            CheckpointRef(uri=str(skeleton), step=0),
            port,
            MODEL_NAME,
            "127.0.0.1",
            None,
            "standby-test",
            Vllm(python=str(venv / "python")),
            standby=True,
        )
        info = backend.start_service(spec, ready_timeout_s=120)
        endpoint = EndpointRef(url=info.url, model=MODEL_NAME, handle=spec.name)
        return Standby(endpoint=endpoint, fingerprint="standby-test", skeleton=str(skeleton))

    first = standby()
    with gpu_time.clocked(None) as clock:
        assert load_into_standby(first, CheckpointRef(uri=str(wider), step=1), "fp-wider", clock) is None
    assert backend.service(first.endpoint.handle) is None  # stopped: the deploy stage starts its own

    second = standby()
    with gpu_time.clocked(None) as clock:
        info = load_into_standby(second, CheckpointRef(uri=str(tiny_checkpoint), step=1), "fp-ok", clock)
    try:
        assert info is not None and info.fingerprint == "standby-test"
        assert httpx.get(info.url + "/health").json()["serves"] == {
            "checkpoint": str(tiny_checkpoint),
            "fingerprint": "fp-ok",
        }
        assert clock.parts["server start"] > 0  # the load, timed for the run's gpu-time artifact
    finally:
        backend.stop_service(second.endpoint.handle)
