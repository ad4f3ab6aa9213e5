"""vLLM is served each checkpoint from one of a few stable paths (workloads/serve_engines/vllm.py model_link):
vLLM 0.26 keys its torch.compile cache on the model path as given and config.json, not the weights, so a nightly
refresh served from its new checkpoint directory compiled again every night. What is checked here: the slots and
their locks (real flock, real processes), the links, and the proxy giving the path to a stand-in vLLM
(engine_standins.py). Whether vLLM then loads its compiled graphs is measured on the GPU
(benchmarks/bench_serve_vllm.py's restart on a copy of the checkpoint, in the acceptance report)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port
from tests.serve.conftest import MODEL_NAME
from tests.serve.test_engines import start_proxy, stop
from workloads.serve_engines.vllm import MODEL_LINKS_ENV, model_link


def test_each_server_holds_its_own_path_and_a_freed_one_is_reused(tmp_path):
    root = tmp_path / "links"
    first = model_link(tmp_path / "night-1", root)
    second = model_link(tmp_path / "night-2", root)  # the switch's second server, while the first serves
    try:
        assert (first.path, second.path) == (root / "model-0", root / "model-1")
        assert os.readlink(first.path) == str(tmp_path / "night-1")
        assert os.readlink(second.path) == str(tmp_path / "night-2")
        assert oct(root.stat().st_mode & 0o777) == "0o700"
        first.release()  # the first server stopped after the switch
        third = model_link(tmp_path / "night-3", root)
        assert third.path == root / "model-0" and os.readlink(third.path) == str(tmp_path / "night-3")
        assert os.readlink(second.path) == str(tmp_path / "night-2")  # never re-pointed while held
        third.release()
    finally:
        first.release()
        second.release()


def test_the_engine_holds_its_path_after_the_proxy_let_go(tmp_path):
    """The lock goes to the engine with its fd: an engine left running (its proxy killed) keeps its path."""
    root = tmp_path / "links"
    held = model_link(tmp_path / "a", root)
    engine = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, pass_fds=(held.fd,)
    )
    try:
        held.release()  # the proxy's copy of the lock is gone; the engine's is not
        other = model_link(tmp_path / "b", root)
        assert other.path == root / "model-1" and os.readlink(root / "model-0") == str(tmp_path / "a")
        other.release()
    finally:
        engine.communicate(b"", timeout=30)
    again = model_link(tmp_path / "c", root)
    assert again.path == root / "model-0"
    again.release()


def test_no_slot_or_an_unsafe_directory_serves_from_the_checkpoint_itself(tmp_path, caplog):
    root = tmp_path / "links"
    held = [model_link(tmp_path / f"c{i}", root, slots=2) for i in range(2)]
    try:
        full = model_link(tmp_path / "c2", root, slots=2)
        assert full.path == tmp_path / "c2" and full.fd is None
        assert "all 2 model paths" in caplog.text
    finally:
        for link in held:
            link.release()
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # writable by others: anyone could plant a link there
    fallback = model_link(tmp_path / "c3", shared)
    assert fallback.path == tmp_path / "c3" and fallback.fd is None
    assert "not a directory of this user only" in caplog.text
    assert not any(shared.iterdir())


@pytest.mark.slow
def test_two_servers_at_once_get_two_paths_and_the_next_one_reuses_the_freed_path(tmp_path, tiny_checkpoint, vllm_bin):
    """Three deploys as a CPT refresh makes them (the next server starts beside the serving one): each engine got a
    stable path to its own checkpoint, the third the path the stopped first one freed; each answers."""
    root = tmp_path / "links"
    nights = []
    for n in range(3):
        ckpt = tmp_path / f"night-{n}" / "consolidated"
        shutil.copytree(tiny_checkpoint, ckpt)
        nights.append(ckpt)
    env = {MODEL_LINKS_ENV: str(root)}
    started = []

    def deploy(n: int):
        where = tmp_path / f"server-{n}"
        where.mkdir()
        proc, url, _log, record = start_proxy(
            where, nights[n], "vllm", "--vllm-executable", str(vllm_bin), "--engine-port", str(free_port()), env=env
        )
        started.append(proc)
        model = Path(record["argv"][2])
        assert model.parent == root and os.readlink(model) == str(nights[n])
        # the engine loaded the checkpoint through its path
        answer = httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "In", "max_tokens": 2})
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"]
        return proc, model

    try:
        first, first_path = deploy(0)
        _second, second_path = deploy(1)
        assert first_path != second_path
        assert stop(first) == 0
        _third, third_path = deploy(2)
        assert third_path == first_path and os.readlink(third_path) == str(nights[2])
        assert os.readlink(second_path) == str(nights[1])
        assert json.loads((tmp_path / "server-2" / "vllm-record.json").read_text())["argv"][2] == str(first_path)
    finally:
        for proc in started:
            stop(proc)


# vLLM's own lines from the H200 (the acceptance's serve part at f1327a3, vllm-proxy.log; the engine config line cut
# after its model): a start that compiled.
H200_COMPILED = """\
(EngineCore pid=5447) INFO 12-04 16:59:49 [core.py:116] Initializing a V1 LLM engine (v0.26.0) with config: \
model='/tmp/nemoflow-node/work/runs/llama-a3362992b145/checkpoints/epoch_0_step_151/model/consolidated', \
speculative_config=None, tokenizer='/tmp/nemoflow-tok/dadfd56d766715c6', skip_tokenizer_init=False
(EngineCore pid=5447) INFO 12-04 16:59:57 [backends.py:1094] Using cache directory: \
/root/.cache/vllm/torch_compile_cache/13c37043e9/rank_0_0/backbone for vLLM's torch.compile
(EngineCore pid=5447) INFO 12-04 17:00:06 [backends.py:393] Compiling a graph for compile range (1, 8192) takes 8.90 s
INFO:     127.0.0.1:54466 - "GET /health HTTP/1.1" 503 Service Unavailable
(EngineCore pid=5447) INFO 12-04 17:00:09 [decorators.py:708] saved AOT compiled function to \
/root/.cache/vllm/torch_compile_cache/torch_aot_compile/52d4c09542650474b5a8e321d12d7974e76f4848cbd0a95ffa4791ecde7bec34/rank_0_0/model
(EngineCore pid=5447) INFO 12-04 17:00:09 [monitor.py:53] torch.compile took 15.57 s in total
(EngineCore pid=5447) INFO 12-04 17:00:33 [core.py:340] init engine (profile, create kv cache, warmup model) took \
40.20 s (compilation: 15.57 s)
"""
# A start that loaded them: the same lines' formats in vLLM 0.26's source (decorators.py, backends.py,
# monitor.py, core.py); no such start has run yet.
LOADED = """\
(EngineCore pid=7) INFO [core.py:116] Initializing a V1 LLM engine (v0.26.0) with config: \
model='/tmp/nemoflow-vllm-0/model-0', speculative_config=None
(EngineCore pid=7) INFO [decorators.py:312] Directly load AOT compilation from path \
/root/.cache/vllm/torch_compile_cache/torch_aot_compile/52d4/rank_0_0/model
(EngineCore pid=7) INFO [backends.py:293] Directly load the compiled graph(s) for compile range (1, 8192) from \
the cache, took 0.512 s
(EngineCore pid=7) INFO [monitor.py:53] torch.compile took 1.02 s in total
(EngineCore pid=7) INFO [core.py:348] init engine (profile, create kv cache, warmup model) took 9.50 s
"""


def _bench():
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serve_vllm.py"
    spec = importlib.util.spec_from_file_location("bench_serve_vllm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_reads_from_vllms_log_whether_its_compile_cache_hit():
    bench = _bench()
    cold = bench.compile_cache(H200_COMPILED)
    assert cold == {
        "compile_cache": "miss",
        "graphs_compiled": 1,
        "graphs_loaded": 0,
        "torch_compile_s": 15.57,
        "engine_init_s": 40.2,
        "model_path": "/tmp/nemoflow-node/work/runs/llama-a3362992b145/checkpoints/epoch_0_step_151/model/consolidated",
    }
    warm = bench.compile_cache(LOADED)
    assert (warm["compile_cache"], warm["graphs_compiled"], warm["graphs_loaded"]) == ("hit", 0, 2)
    assert (warm["torch_compile_s"], warm["engine_init_s"], warm["model_path"]) == (
        1.02,
        9.5,
        "/tmp/nemoflow-vllm-0/model-0",
    )
    # a load that failed and compiled again is a miss, whatever else the log says
    failed = LOADED + "(EngineCore pid=7) WARNING Compiling model again due to a load failure from /x, reason: EOF\n"
    assert bench.compile_cache(failed)["compile_cache"] == "miss"
    assert bench.compile_cache("INFO: uvicorn started")["compile_cache"] == "unknown"


@pytest.mark.slow
def test_the_benchmarks_restart_serves_a_copy_from_the_freed_stable_path(tmp_path, tiny_checkpoint, vllm_bin):
    """(d) on the stand-in engine: the copy in a new directory, served through the stable path the first server
    had, the seed's request answered, the copy removed afterwards (its compile cache: the H200's to say)."""
    bench = _bench()
    root = tmp_path / "links"
    first = model_link(tiny_checkpoint, root)  # the benchmark's first server, stopped before the restart
    first.release()
    record = tmp_path / "record.json"
    key = "sk-restart-test"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), STANDIN_RECORD=str(record))
    env.update({bench.KEY_ENV: key, MODEL_LINKS_ENV: str(root)})
    serve = [sys.executable, "-m", "workloads.serve", "--checkpoint", str(tiny_checkpoint)]
    serve += ["--model-name", bench.MODEL_NAME, "--api-key-env", bench.KEY_ENV, "--vllm-executable", str(vllm_bin)]
    report: dict = {}
    saved = []
    args = bench.parser().parse_args(["--out", str(tmp_path / "out")])
    (tmp_path / "out").mkdir()
    bench.run_vllm_restart(args, report, lambda: saved.append(1), serve, env, None, None, tmp_path / "out", key)

    restart = report["vllm_restart"]
    assert restart["checkpoint"] == str(tmp_path / "out" / "next-checkpoint" / tiny_checkpoint.name)
    assert restart["start_to_ready_s"] > 0 and restart["seed_request_s"] > 0 and saved
    assert restart["compile_cache"] == "unknown"  # the stand-in is not vLLM: no compile lines to read
    engine = json.loads(record.read_text())
    assert engine["argv"][2] == str(root / "model-0")  # the path the first server freed
    assert os.readlink(root / "model-0") == restart["checkpoint"]
    assert not (tmp_path / "out" / "next-checkpoint").exists()  # the copy does not outlive the restart


def test_a_restart_that_fails_is_reported_and_the_levels_measured_stand(tmp_path, tiny_checkpoint):
    """The engine exits before it is ready (here: its command fails at once): the benchmark records the error
    under vllm_restart, keeps going (the levels it measured before are saved), and the report says it failed."""
    from devtools import acceptance

    bench = _bench()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), **{bench.KEY_ENV: "k"})
    env[MODEL_LINKS_ENV] = str(tmp_path / "links")
    serve = [sys.executable, "-m", "workloads.serve", "--checkpoint", str(tiny_checkpoint)]
    serve += ["--model-name", bench.MODEL_NAME, "--api-key-env", bench.KEY_ENV, "--vllm-executable", "false"]
    report: dict = {"levels": {"proxy": {"16": {"output_throughput": 5000.0}}}}
    out = tmp_path / "out"
    out.mkdir()
    args = bench.parser().parse_args(["--out", str(out)])
    bench.run_vllm_restart(args, report, lambda: None, serve, env, None, None, out, "k")

    restart = report["vllm_restart"]
    assert "exited 1 before ready" in restart["error"] and "start_to_ready_s" not in restart
    assert report["levels"]["proxy"]["16"]["output_throughput"] == 5000.0
    assert not (out / "next-checkpoint").exists()
    lines = acceptance.serve_lines({"bench_serve_vllm": report})
    failed = [line for line in lines if "(the nightly refresh's) **failed**: " in line]
    assert failed and failed[0].endswith("serve: the vllm engine exited with code 1"), lines  # its last line
