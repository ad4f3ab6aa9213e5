"""pretrain -> validate_checkpoint as Prefect tasks in a flow, against a real Prefect server."""

from __future__ import annotations

import pytest

from tests.train.helpers import tiny_config

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*Transformer Engine")]


def _dataset_ref(train_dataset, tmp_path):
    from tasks.refs import DatasetRef, TokenizerRef

    manifest = tmp_path / "manifest.json"
    manifest.write_text("{}")
    return DatasetRef(
        prefixes=train_dataset["prefixes"],
        blend=train_dataset["blend"],
        manifest_uri=str(manifest),
        tokenizer=TokenizerRef(model=train_dataset["tokenizer_model"]),
        documents=train_dataset["documents"],
        tokens=train_dataset["tokens"],
        bytes=0,
    )


def test_pretrain_then_validate_flow(prefect_server, work_dir, train_dataset, tmp_path):
    from prefect import flow
    from prefect.client.orchestration import get_client

    from infra.configs.train import TrainConfig
    from tasks.checkpoint import CheckpointValidationFailed, validate_checkpoint
    from tasks.train import pretrain

    dataset = _dataset_ref(train_dataset, tmp_path)
    # No run_dir, no data_prefix: the task derives both (from the work dir and the dataset).
    settings = tiny_config(train_dataset, tmp_path, max_steps=4, val_check_interval=4, ckpt_every_n_steps=4)
    settings.update(run_dir=None, data_prefix=None, tokenizer_model=None)
    config = TrainConfig(**settings)
    pretrain_states: list[str] = []

    @flow(name="train-and-validate")
    def train_and_validate(threshold: float):
        state = pretrain(config, dataset, return_state=True)
        pretrain_states.append(state.name)
        checkpoint = state.result()
        return checkpoint, validate_checkpoint(checkpoint, dataset, threshold, num_batches=1)

    checkpoint, report = train_and_validate(10.2)
    assert checkpoint.step == 4 and checkpoint.val_loss is not None
    assert checkpoint.uri.startswith(str(work_dir / "runs"))
    assert checkpoint.uri.endswith("checkpoints/epoch_0_step_3/model/consolidated")
    assert checkpoint.dataset_manifest == dataset.manifest_uri
    assert report.passed and report.val_loss < report.untrained_loss
    assert {c.name for c in report.checks} >= {"checksums", "finite_weights", "val_loss_threshold"}

    # The server is shared by the whole test session: pick this run's artifacts by their keys.
    import hashlib

    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    curve_key = "loss-curve-" + hashlib.sha256(checkpoint.run_dir.encode()).hexdigest()[:10]
    validation_key = "checkpoint-validation-" + hashlib.sha256(report.checkpoint.encode()).hexdigest()[:10]
    with get_client(sync_client=True) as client:
        newest_first = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[curve_key, curve_key + "-table", validation_key])
            ),
            sort=ArtifactSort.CREATED_DESC,
        )
    artifacts: dict = {}
    for artifact in newest_first:
        artifacts.setdefault((artifact.key, artifact.type), artifact)
    artifacts = {f"{key}:{kind}": a for (key, kind), a in artifacts.items()}
    curve = next(a for k, a in artifacts.items() if k.startswith("loss-curve-") and a.type == "markdown")
    assert "| step | loss | val_loss | lr | tokens/s |" in curve.data
    assert any(ch in curve.data for ch in "▁▂▃▄▅▆▇█")
    assert "](data:image/svg+xml;base64," in curve.data  # the inline chart (checked to render in the UI)
    table = next(a for k, a in artifacts.items() if k.startswith("loss-curve-") and a.type == "table")
    assert "val_loss" in str(table.data)
    validation = next(a for k, a in artifacts.items() if k.startswith("checkpoint-validation-"))
    assert "PASSED" in validation.data

    # Same inputs again: training is a cache hit; an impossible threshold stops the flow, naming the check.
    with pytest.raises(CheckpointValidationFailed, match=r"val_loss_threshold \(val_loss [0-9.]+ >= threshold 1.0\)"):
        train_and_validate(1.0)
    assert pretrain_states == ["Completed", "Cached"]


def test_invalid_config_fails_before_any_job(work_dir, train_dataset, tmp_path):
    from infra.configs.train import ParallelismError, TrainConfig
    from tasks.train import pretrain

    dataset = _dataset_ref(train_dataset, tmp_path)
    config = TrainConfig(**tiny_config(train_dataset, tmp_path / "run", global_batch_size=6, micro_batch_size=4))
    with pytest.raises(ParallelismError, match=r"global_batch_size=6 is not divisible by micro_batch_size\(4\)"):
        pretrain.fn(config, dataset)
    assert not (tmp_path / "run").exists()
