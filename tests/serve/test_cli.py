"""``nemoflow serve`` against the real server, and checkpoints that cannot be served."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from infra import services, storage
from nemoflow.cli import main
from tasks.serve import local_checkpoint
from tests.conftest import free_port


@pytest.mark.slow
def test_start_status_list_stop(work_dir, cleanup, tiny_checkpoint, capsys):
    port = free_port()
    args = ["serve", "start", "--checkpoint", str(tiny_checkpoint), "--port", str(port), "--model-name", "Tiny Llama"]
    assert main(args + ["--max-tokens-cap", "8"]) == 0
    out = capsys.readouterr().out
    assert f"serving Tiny Llama at http://127.0.0.1:{port}" in out and "nemoflow serve stop tiny-llama" in out
    answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x", "max_tokens": 9}, timeout=30)
    assert answer.status_code == 400 and "cap of 8" in answer.json()["error"]["message"]

    assert main(["serve", "status", "tiny-llama", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["healthy"] is True and status["model"] == "Tiny Llama" and status["port"] == port
    assert main(["serve", "list", "--json"]) == 0
    assert [e["name"] for e in json.loads(capsys.readouterr().out)] == ["tiny-llama"]
    assert main(["serve", "logs", "tiny-llama", "-n", "200"]) == 0
    assert "loaded " in capsys.readouterr().out  # the server's own "loaded <checkpoint> (...)" line

    # the same port again: refused before anything starts, naming the owner
    assert main(args[:-1] + ["Other"]) == 2
    err = capsys.readouterr().err
    assert f"port {port} is already in use (by pid {status['pid']}, service 'tiny-llama')" in err

    assert main(["serve", "stop", "tiny-llama"]) == 0
    assert main(["serve", "status", "tiny-llama"]) == 1
    assert main(["serve", "stop", "tiny-llama"]) == 1
    assert "not running" in capsys.readouterr().out
    assert not services.pid_alive(status["pid"])


@pytest.mark.slow
def test_unloadable_checkpoint_fails_with_the_reason(work_dir, cleanup, tiny_checkpoint, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, broken)
    (broken / "model.safetensors").write_bytes((tiny_checkpoint / "model.safetensors").read_bytes()[:1000])
    assert main(["serve", "start", "--checkpoint", str(broken), "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert "exited with code 1 before it became ready" in err
    assert f"cannot serve {broken}: SafetensorError" in err  # the server's own last line, from the log tail
    assert services.list_services() == []

    (broken / "tokenizer.model").unlink()
    assert main(["serve", "start", "--checkpoint", str(broken), "--port", str(free_port())]) == 2
    assert "lacks tokenizer.model" in capsys.readouterr().err


def test_an_option_the_engine_does_not_have_is_refused_by_name(work_dir, tiny_checkpoint, capsys):
    """The engine is a value: its options are its model's fields, the built-in engine's load limits are not vLLM's."""
    start = ["serve", "start", "--checkpoint", str(tiny_checkpoint), "--port", str(free_port())]
    assert main([*start, "--engine", "vllm", "--max-concurrency", "4"]) == 2
    assert "--max-concurrency is not an option of the vllm engine" in capsys.readouterr().err
    assert services.list_services() == []


def test_help_explains(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "start", "--help"])
    out = capsys.readouterr().out
    assert "--checkpoint" in out and "/health" in out


def test_gs_checkpoint_is_copied_once_and_refreshed_on_change(work_dir, gcs_bucket, tiny_checkpoint, tmp_path):
    from workloads.checkpoint import write_manifest

    source = tmp_path / "step-1"
    shutil.copytree(tiny_checkpoint, source)
    write_manifest(source)  # the trainer's checkpoints list their files; the copy follows the list
    uri = f"{gcs_bucket}/runs/tiny/step-1"
    for path in source.iterdir():
        storage.put_file(str(path), storage.join(uri, path.name))
    local = local_checkpoint(uri)
    assert str(work_dir) in local
    for name in ("config.json", "model.safetensors", "tokenizer.model"):
        assert storage.file_sha256(f"{local}/{name}") == storage.file_sha256(str(tiny_checkpoint / name))
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    config["use_cache"] = not config.get("use_cache", True)
    storage.write_text(storage.join(uri, "config.json"), json.dumps(config))
    assert local_checkpoint(uri) == local
    assert json.loads(open(f"{local}/config.json").read())["use_cache"] == config["use_cache"]
    with pytest.raises(FileNotFoundError, match="has no tokenizer.model .listed in its MANIFEST.json"):
        storage.remove(storage.join(uri, "tokenizer.model"))
        local_checkpoint(uri)


@pytest.mark.slow
def test_start_with_a_key_and_smoke_it(work_dir, cleanup, tiny_checkpoint, capsys, monkeypatch):
    import secrets

    key = "sk-cli-" + secrets.token_hex(12)
    monkeypatch.setenv("NEMOFLOW_CLI_TEST_KEY", key)
    port = free_port()
    start = ["serve", "start", "--checkpoint", str(tiny_checkpoint), "--port", str(port), "--model-name", "keyed"]
    assert main(start + ["--api-key-env", "NEMOFLOW_CLI_TEST_KEY", "--max-tokens-cap", "16"]) == 0
    capsys.readouterr()
    denied = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
    assert denied.status_code == 401
    # `smoke` finds the key's variable in the server's recorded command and sends the seed's request
    assert main(["serve", "smoke", "keyed", "--retry", "5"]) == 0
    out = capsys.readouterr().out
    assert f"keyed at http://127.0.0.1:{port} answered" in out and "(seed request)" in out
    assert main(["serve", "smoke", "--url", f"http://127.0.0.1:{port}", "--model", "keyed", "--shape", "openai"]) == 2
    assert "HTTP 401" in capsys.readouterr().err  # --url without --api-key-env sends no key
    args = ["serve", "smoke", "--url", f"http://127.0.0.1:{port}", "--model", "keyed", "--shape", "openai"]
    assert main(args + ["--api-key-env", "NEMOFLOW_CLI_TEST_KEY", "--max-tokens", "4"]) == 0
    assert "(openai request)" in capsys.readouterr().out
    # the key is in no registry record and no server log
    entry = services.get_service("keyed")
    assert key not in json.dumps(entry.model_dump(mode="json")) and "NEMOFLOW_CLI_TEST_KEY" in entry.command
    assert key not in open(entry.log_path).read()
    monkeypatch.delenv("NEMOFLOW_CLI_TEST_KEY")
    assert main(["serve", "smoke", "keyed", "--retry", "1"]) == 2
    assert "NEMOFLOW_CLI_TEST_KEY, which is not set here" in capsys.readouterr().err


def test_start_refuses_an_unset_key_variable(work_dir, cleanup, tiny_checkpoint, capsys):
    args = ["serve", "start", "--checkpoint", str(tiny_checkpoint), "--port", str(free_port())]
    assert main(args + ["--api-key-env", "NEMOFLOW_UNSET_VARIABLE_X"]) == 2
    assert "NEMOFLOW_UNSET_VARIABLE_X is not set" in capsys.readouterr().err
    assert services.list_services() == []
