"""Checkpoint bookkeeping (top-k pruning) and validation of real checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from workloads import checkpoint as ckpt

pytestmark = pytest.mark.filterwarnings("ignore:.*Transformer Engine and Apex")


def _fake_checkpoint(run_dir: Path, step: int, val_loss: float | None) -> Path:
    directory = ckpt.checkpoints_dir(run_dir) / ckpt.step_name(step)
    directory.mkdir(parents=True)
    (directory / "meta.json").write_text(json.dumps({"step": step, "val_loss": val_loss}))
    ckpt.write_manifest(directory)
    return directory


def test_prune_keeps_best_k_plus_latest_and_ignores_partial(tmp_path):
    losses = {1: 5.0, 2: 3.0, 3: 4.0, 4: 2.0, 5: 6.0}
    for step, loss in losses.items():
        _fake_checkpoint(tmp_path, step, loss)
    (ckpt.checkpoints_dir(tmp_path) / "latest").write_text("step-000005\n")
    partial = ckpt.checkpoints_dir(tmp_path) / ".tmp-step-000006-deadbeef"
    partial.mkdir()
    no_manifest = ckpt.checkpoints_dir(tmp_path) / "step-000007"
    no_manifest.mkdir()
    assert [c.step for c in ckpt.list_checkpoints(tmp_path)] == [1, 2, 3, 4, 5]

    deleted = ckpt.prune_checkpoints(tmp_path, save_top_k=2)
    # Best two by val_loss are steps 4 (2.0) and 2 (3.0); step 5 stays because it is the latest.
    assert sorted(p.name for p in deleted) == ["step-000001", "step-000003"]
    assert [c.step for c in ckpt.list_checkpoints(tmp_path)] == [2, 4, 5]
    assert (ckpt.checkpoints_dir(tmp_path) / "best").read_text().strip() == "step-000004"
    assert ckpt.latest_checkpoint(tmp_path).name == "step-000005"
    assert not partial.exists()

    ckpt.prune_checkpoints(tmp_path, save_top_k=0)
    # Even k=0 keeps the latest and the best.
    assert [c.step for c in ckpt.list_checkpoints(tmp_path)] == [4, 5]


def test_latest_falls_back_when_pointer_names_incomplete(tmp_path):
    _fake_checkpoint(tmp_path, 3, None)
    (ckpt.checkpoints_dir(tmp_path) / "step-000009").mkdir()
    (ckpt.checkpoints_dir(tmp_path) / "latest").write_text("step-000009\n")
    assert ckpt.latest_checkpoint(tmp_path).name == "step-000003"


@pytest.fixture(scope="module")
def trained(reference_run):
    return ckpt.latest_checkpoint(reference_run["run_dir"])


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _by_name(report: dict) -> dict:
    return {c["name"]: c for c in report["checks"]}


def test_trained_checkpoint_passes_and_loss_matches_trainer(trained):
    from workloads.validate_checkpoint import evaluate_loss, validate

    report = validate(trained, threshold=9.5, num_batches=2, micro_batch_size=4)
    assert report["passed"], report
    assert report["failed"] == []
    assert report["val_loss"] < report["untrained_loss"]
    assert report["untrained_loss"] > 10.0  # ~ln(32000): a random model knows nothing
    assert "model.safetensors" in report["files"]
    assert report["sizes"]["model.safetensors"] == (trained / "model.safetensors").stat().st_size
    # The same held-out batches the trainer validated on give the trainer's number.
    meta = json.loads((trained / "meta.json").read_text())
    assert evaluate_loss(trained, num_batches=2, micro_batch_size=4) == pytest.approx(meta["val_loss"], abs=1e-5)
    assert report["val_loss"] == pytest.approx(meta["val_loss"], abs=1e-5)


def test_corrupted_file_fails_checksum(trained, tmp_path):
    from workloads.validate_checkpoint import validate

    bad = _copy(trained, tmp_path / "step-000012")
    data = bytearray((bad / "model.safetensors").read_bytes())
    data[-100] ^= 0xFF  # a flipped bit deep in the weights: same size, different content
    (bad / "model.safetensors").write_bytes(bytes(data))
    report = validate(bad, threshold=9.5, num_batches=1)
    checks = _by_name(report)
    assert not report["passed"]
    assert checks["files_complete"]["passed"]
    assert not checks["checksums"]["passed"]
    assert "model.safetensors: sha256" in checks["checksums"]["detail"]


def test_missing_file_fails_completeness(trained, tmp_path):
    from workloads.validate_checkpoint import validate

    bad = _copy(trained, tmp_path / "step-000012")
    (bad / "tokenizer.model").unlink()
    report = validate(bad, threshold=9.5, num_batches=1)
    checks = _by_name(report)
    assert report["failed"][:2] == ["files_complete", "checksums"]
    assert "tokenizer.model: missing" in checks["files_complete"]["detail"]
    assert "tokenizer.model does not exist" in checks["val_loss_threshold"]["detail"]
    assert not report["passed"]


def test_nan_poisoned_weight_fails(trained, tmp_path):
    from safetensors.torch import load_file, save_file

    from workloads.validate_checkpoint import validate

    bad = _copy(trained, tmp_path / "step-000012")
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    ckpt.write_manifest(bad)  # the manifest agrees: only the NaN check can catch it
    report = validate(bad, threshold=9.5, num_batches=1)
    checks = _by_name(report)
    assert checks["checksums"]["passed"] and checks["weights_load"]["passed"]
    assert not checks["finite_weights"]["passed"]
    assert "model.layers.1.mlp.down_proj.weight (1 non-finite)" in checks["finite_weights"]["detail"]
    assert "finite_weights" in report["failed"]


def test_threshold_too_strict_fails_with_both_losses(trained, tmp_path):
    from workloads.validate_checkpoint import main

    output = tmp_path / "report.json"
    code = main([str(trained), "--threshold", "2.0", "--num-batches", "1", "--output", str(output)])
    assert code == 1
    report = json.loads(output.read_text())
    assert report["failed"] == ["val_loss_threshold"]
    detail = _by_name(report)["val_loss_threshold"]["detail"]
    assert f"val_loss {report['val_loss']:.4f} >= threshold 2.0" == detail
    assert _by_name(report)["better_than_untrained"]["passed"]
