"""``serve.start_early`` through the real path (prefect.yaml's deployment, a process worker, ``prefect deployment run``):
the server starts beside training on the model's shape, serves nothing until the deploy stage loads the validated
checkpoint into it, a re-run is all Cached, and a run whose validation fails stops it.

The engine is vLLM's stand-in (tests/serve/engine_standins.py: vLLM's command line, ``--load-format dummy`` and the
development routes the load goes through) from an engine environment of its own, as vLLM runs on a GPU node.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port
from tests.e2e.test_end_to_end import _run_deployment, _task_states, deployed_local_pool
from tests.support.tiny import TINY_TRAIN

pytestmark = [pytest.mark.slow, pytest.mark.prefect]
STANDINS = Path(__file__).resolve().parents[1] / "serve" / "engine_standins.py"


@pytest.fixture
def standin_pool(prefect_server, work_dir, tmp_path):
    """The `local` pool's worker with vLLM's stand-in as an engine environment; the stand-ins record to a file."""
    venv = tmp_path / "vllm-venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)
    (venv / "vllm").write_text(f'#!/bin/sh\nexec "{sys.executable}" "{STANDINS}" vllm "$@"\n')
    (venv / "vllm").chmod(0o755)
    record = tmp_path / "standin.json"
    with deployed_local_pool(prefect_server, work_dir, tmp_path, STANDIN_RECORD=str(record)) as env:
        yield env, venv / "python", record


def _calls(record: Path) -> list[dict]:
    path = Path(str(record) + ".calls")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_server_started_early_serves_the_validated_checkpoint_and_a_rerun_is_cached(standin_pool, work_dir):
    env, python, record = standin_pool
    port = free_port()
    engine = {"engine": "vllm", "python": str(python)}
    config = {
        "train": TINY_TRAIN,
        "serve": {"port": port, "model_name": "nemoflow-early", "engine": engine, "start_early": True},
        "validation_threshold": 9.5,
        "smoke": {"max_tokens": 16},
    }
    code, output, run_id = _run_deployment(env, config)
    assert code == 0, output
    summary = json.loads((work_dir / "flow-runs" / f"{run_id}.json").read_text())
    states = _task_states(run_id)
    assert states.get("start nemoflow-early early") == "Completed", states

    # one engine was started, on standby (random weights of the checkpoint's shape), and the validated checkpoint
    # was loaded into it: the deploy stage started no other
    started = json.loads(record.read_text())
    assert started["argv"][started["argv"].index("--load-format") + 1] == "dummy"
    loads = [c for c in _calls(record) if c.get("method") == "reload_weights"]
    checkpoint = summary["checkpoint"]
    assert [c["kwargs"]["weights_path"] for c in loads] == [checkpoint]
    health = httpx.get(f"http://127.0.0.1:{port}/health").json()
    assert health["status"] == "ok" and health["serves"]["checkpoint"] == checkpoint, health
    assert summary["answer"].strip(), summary
    # the config.json it started on is the export's, once transformers fills in its defaults (as vLLM reads both)
    skeleton = json.loads((Path(started["argv"][2]) / "config.json").read_text())  # vLLM's stable path to it
    exported = json.loads(Path(checkpoint, "config.json").read_text())
    from transformers import AutoConfig

    from tasks.serve import CONFIG_PROVENANCE, config_difference

    assert config_difference(skeleton, exported) == []
    full = json.loads(AutoConfig.for_model(**skeleton).to_json_string(use_diff=False))
    assert (
        sorted(k for k in (set(full) | set(exported)) - set(CONFIG_PROVENANCE) if full.get(k) != exported.get(k)) == []
    )

    # nothing changed: every stage Cached, the early start and the deploy included; the server keeps serving
    code, output, second = _run_deployment(env, config)
    assert code == 0, output
    states = _task_states(second)
    assert states and {n: s for n, s in states.items() if s != "Cached"} == {}, states
    assert [c["kwargs"]["weights_path"] for c in _calls(record) if c.get("method") == "reload_weights"] == [checkpoint]
    models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
    assert models["data"][0]["id"] == "nemoflow-early"


def test_a_run_whose_validation_fails_stops_the_server_it_started_early(standin_pool, work_dir):
    env, python, record = standin_pool
    port = free_port()
    config = {
        "train": TINY_TRAIN,
        "serve": {
            "port": port,
            "model_name": "nemoflow-early-fail",
            "engine": {"engine": "vllm", "python": str(python)},
            "start_early": True,
        },
        "validation_threshold": 0.01,
    }
    code, output, run_id = _run_deployment(env, config)
    assert code != 0
    states = _task_states(run_id)
    assert states.get("start nemoflow-early-fail early") == "Completed", states
    assert not any(name.startswith("deploy") for name in states), states
    started = json.loads(record.read_text())
    assert "--load-format" in started["argv"]  # it was started ...
    assert [c for c in _calls(record) if c.get("method") == "reload_weights"] == []  # ... never loaded ...
    with pytest.raises(httpx.ConnectError):  # ... and stopped
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
