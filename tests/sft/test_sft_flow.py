"""The sft flow for real: NeMo AutoModel fine-tunes a registered model on KJV chats, the check runs, the registry
records the result with its parent (local executor, a real Prefect server)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# "which book" questions: short answers, so a 4M-parameter model learns to answer and end its turn
DATA = {"demo_examples": 400, "demo_tasks": ["book"]}
# 4M-parameter base, 128-token conversations: 120 steps (about a minute of compute on 2 CPU cores); fewer
# leave it answering with an empty piece before </s>, which the generation check rightly fails
TINY_SFT = {
    "max_steps": 120,
    "global_batch_size": 8,
    "micro_batch_size": 8,
    "lr": 0.005,
    "min_lr": 0.0005,
    "warmup_steps": 2,
    "val_check_interval": 60,
    "log_every_n_steps": 20,
    "seq_length": 128,
    "eval_examples": 16,
    "generation_examples": 6,
    "max_new_tokens": 8,
    "cpus_per_task": 1,
}


@pytest.mark.slow
@pytest.mark.prefect
def test_sft_fine_tunes_checks_and_registers_with_the_parent(prefect_server, registry_with_base, base_model):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.sft import SftFlowConfig, sft
    from infra import registry as reg

    registry_uri, base_id = registry_with_base
    summary = sft(SftFlowConfig(train=TINY_SFT, data=DATA, registry=registry_uri))

    # the registry: a new model whose parent is the base; the base stays promoted (promote: false)
    state = reg.ModelRegistry(registry_uri).read()
    record = state.model(summary["model"])
    assert record.parent == base_id and state.promoted == base_id
    assert [m.id for m in state.lineage(record.id)] == [record.id, base_id]
    assert record.metrics["kind"] == "sft"
    assert record.metrics["held_out_chat_loss"] < record.metrics["parent_held_out_chat_loss"]

    # the checkpoint is a complete Hugging Face directory with nemoflow's manifest, and differs from the base
    checkpoint = Path(record.checkpoint)
    assert checkpoint.parts[-2:] == ("model", "consolidated")
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert meta["kind"] == "sft" and meta["init_from"] == str(base_model) and meta["step"] == TINY_SFT["max_steps"]
    manifest = json.loads((checkpoint / "MANIFEST.json").read_text())
    assert "tokenizer.model" in manifest["files"]

    # the report the check wrote: answers generated from held-out prompts
    run_dir = checkpoint.parents[3]
    report = json.loads(next((run_dir / "validation").glob("*.json")).read_text())
    assert report["passed"] and report["answer_rate"] >= 0.5
    assert len(report["generations"]) == TINY_SFT["generation_examples"]
    assert all(g["reference"] and g["prompt"] for g in report["generations"])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == TINY_SFT["max_steps"] // TINY_SFT["log_every_n_steps"] and losses[-1] < losses[0]

    # artifacts in the Prefect UI: the check and the summary
    with get_client(sync_client=True) as client:
        # by key: a session's server holds more than one page of artifacts, some without a key
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["sft-summary"]))
        ) + client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_="sft-check-%")))
        keys = {a.key for a in found}
    assert "sft-summary" in keys and any(k.startswith("sft-check-") for k in keys)

    # a second run with nothing changed is all cached and registers nothing new
    again = sft(SftFlowConfig(train=TINY_SFT, data=DATA, registry=registry_uri))
    assert again["model"] == summary["model"]
    assert len(reg.ModelRegistry(registry_uri).read().models) == 2


@pytest.mark.slow
def test_the_check_fails_when_the_model_did_not_learn(tmp_path, base_model):
    """The base model itself, presented as the fine-tuned one: its loss is not below the base's."""
    from workloads import chat_data

    rows = chat_data.kjv_chat_rows(40, seed=5)
    chat_data.write_jsonl(tmp_path / "held.jsonl", rows)
    config = {
        "init_from": str(base_model),
        "train_data": str(tmp_path / "held.jsonl"),
        "valid_data": str(tmp_path / "held.jsonl"),
        "run_dir": str(tmp_path / "run"),
        "eval_examples": 4,
        "generation_examples": 2,
        "max_new_tokens": 4,
    }
    (tmp_path / "sft.json").write_text(json.dumps(config))
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "workloads.sft",
            "--config",
            str(tmp_path / "sft.json"),
            "--validate",
            str(out),
            "--checkpoint",
            str(base_model),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert not report["passed"]
    assert "held_out_loss_below_base" in report["failed"]
    # an untuned model does not end its turn: the generation check fails too
    assert "generation_answers" in report["failed"] and report["answer_rate"] == 0
    assert report["held_out_loss"] == pytest.approx(report["base_held_out_loss"])


def test_bad_configuration_is_one_line_naming_the_key(tmp_path):
    (tmp_path / "sft.json").write_text(json.dumps({"max_step": 3}))
    proc = subprocess.run(
        [sys.executable, "-m", "workloads.sft", "--config", str(tmp_path / "sft.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "error: unknown SftConfig key 'max_step'"
