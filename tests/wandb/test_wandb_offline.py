"""W&B for real: the pretrain stage (tiny, CPU) with WANDB_API_KEY set and WANDB_MODE=offline writes a W&B run
through NeMo AutoModel with the config and the metrics (read back from the offline run's files), the run's
offline path appears as a Prefect artifact, and the key appears in no log, artifact or file."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.wandb.transaction_log import read_run

SENTINEL_KEY = "wandbTESTkey0123456789abcdef0123456789abcd"  # 40 characters, like a real key


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory, kjv_chapters, mixtral_tokenizer_model):
    from tests.support.kjv_dataset import small_dataset_ref

    return small_dataset_ref(tmp_path_factory.mktemp("wandb-data"), kjv_chapters, mixtral_tokenizer_model)


@pytest.mark.slow
@pytest.mark.prefect
def test_pretrain_writes_an_offline_wandb_run_with_config_and_metrics(
    prefect_server, work_dir, small_dataset, monkeypatch, capfd
):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from infra.configs.train import TrainConfig
    from infra.settings import reload_settings
    from tasks.train import pretrain
    from tests.support.tiny import TINY_TRAIN

    monkeypatch.setenv("WANDB_API_KEY", SENTINEL_KEY)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "nemoflow-test")
    reload_settings()
    config = TrainConfig(
        **{
            **TINY_TRAIN,
            "max_steps": 6,
            "val_check_interval": 3,
            "ckpt_every_n_steps": 6,
            "log_every_n_steps": 2,
            "cpus_per_task": 1,
        }
    )

    @flow(name="wandb-offline-test")
    def run():
        from prefect.runtime import flow_run

        return pretrain(config, small_dataset), str(flow_run.id)

    # every record Prefect's loggers emit in this process (the stage streams the job's output through them);
    # a handler of our own, because where Prefect's console handler writes depends on earlier tests
    records: list[str] = []
    collector = logging.Handler()
    collector.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("prefect").addHandler(collector)
    try:
        checkpoint, run_id = run()
    finally:
        logging.getLogger("prefect").removeHandler(collector)
    run_dir = Path(checkpoint.run_dir)

    record = json.loads((run_dir / "wandb_run.json").read_text())
    assert record["mode"] == "offline" and record["url"] is None and record["project"] == "nemoflow-test"
    run_path = Path(record["path"])
    assert run_path.parent == run_dir / "wandb" and run_path.name.startswith("offline-run-")

    logged = read_run(next(run_path.glob("run-*.wandb")))
    # the config: AutoModel's whole recipe config, as nemoflow mapped it (model, data blend, schedule)
    assert logged["config"]["step_scheduler"]["max_steps"] == 6
    assert logged["config"]["dataset"]["paths"] == small_dataset.blend
    assert logged["config"]["optimizer"]["lr"] == TINY_TRAIN["lr"]
    # the metrics: every train loss metrics.jsonl has (nemoflow's log steps), and the validation losses
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_losses = sorted(m["loss"] for m in metrics if "loss" in m)
    val_losses = sorted(m["val_loss"] for m in metrics if "val_loss" in m)
    assert len(train_losses) == 3 and len(val_losses) == 2
    assert sorted(h["loss"] for h in logged["history"] if "loss" in h) == pytest.approx(train_losses)
    assert sorted(h["val_loss"] for h in logged["history"] if "val_loss" in h) == pytest.approx(val_losses)
    # where the job's seconds went (infra/phases.py): the same record in metrics.jsonl and the W&B summary
    phase_record = next(m for m in metrics if "phase_s" in m)
    assert phase_record["phase_s"]["training steps"] > 0 and 0 < phase_record["goodput"] < 1
    assert logged["summary"]["gpu_time"] == {k: v for k, v in phase_record.items() if k != "step"}

    # the Prefect artifact names the offline run and how to upload it
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
    from prefect.logging.handlers import APILogHandler

    by_run = ArtifactFilterFlowRunId(any_=[run_id])

    APILogHandler().flush()
    logs: list = []
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(  # by key: a session's server holds more than one page of artifacts
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_="wandb-run-%"), flow_run_id=by_run)
        )
        while page := client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), limit=200, offset=len(logs)
        ):
            logs += page
    assert artifacts and str(run_path) in artifacts[-1].data and "wandb sync" in artifacts[-1].data

    # the key is nowhere: job logs, the Prefect run's logs, artifacts, W&B's own files, this process's output
    texts = [m.message for m in logs] + [a.data for a in artifacts]
    out, err = capfd.readouterr()
    assert any("val_loss=" in r for r in records), "the job's output passed through this process's loggers"
    # ... and reached the run's logs in the API (the UI's log view), though streamed from a reader thread
    assert any("val_loss=" in m.message for m in logs), [m.message[:80] for m in logs]
    texts += records
    assert logs and not [t for t in texts + [out, err] if SENTINEL_KEY in t]
    for path in run_dir.rglob("*"):
        if path.is_file() and path.stat().st_size < 50_000_000:
            assert SENTINEL_KEY.encode() not in path.read_bytes(), path
    monkeypatch.delenv("WANDB_API_KEY")
    reload_settings()
