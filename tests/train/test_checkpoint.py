"""Checkpoint bookkeeping (top-k pruning) and validation of real checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support import fault_ledger
from workloads import checkpoint as ckpt

pytestmark = pytest.mark.filterwarnings("ignore:.*Transformer Engine and Apex")


def _fake_checkpoint(
    run_dir: Path, step: int, val_loss: float | None, published: bool = True, exported: bool = True
) -> Path:
    """An AutoModel step directory with nemoflow's meta.json: unpublished (AutoModel's marker) when not
    ``published``, and with a complete Hugging Face export when ``exported``; returns the export's directory."""
    step_dir = ckpt.checkpoints_dir(run_dir) / ckpt.step_dir_name(step)
    step_dir.mkdir(parents=True)
    (step_dir / ckpt.META).write_text(json.dumps({"step": step, "val_loss": val_loss}))
    if not published:
        (step_dir / ckpt.INCOMPLETE).touch()
    consolidated = ckpt.consolidated_dir(step_dir)
    if exported:
        consolidated.mkdir(parents=True)
        (consolidated / "config.json").write_text("{}")
        ckpt.write_meta(consolidated, {"step": step, "val_loss": val_loss}, None)
        ckpt.write_manifest(consolidated)
    return consolidated


def test_incomplete_marker_is_automodels():
    """A saved checkpoint is one AutoModel published: nemoflow reads its marker without importing AutoModel."""
    from nemo_automodel.components.checkpoint import utils

    assert ckpt.INCOMPLETE == utils._INCOMPLETE_CHECKPOINT_MARKER


def test_prune_keeps_best_k_plus_latest_and_ignores_unfinished(tmp_path):
    losses = {1: 5.0, 2: 3.0, 3: 4.0, 4: 2.0, 5: 6.0}
    for step, loss in losses.items():
        _fake_checkpoint(tmp_path, step, loss, exported=step in (4, 5))
    unfinished = _fake_checkpoint(tmp_path, 6, 1.0, published=False)  # still being written
    assert [c.step for c in ckpt.saved_checkpoints(tmp_path)] == [1, 2, 3, 4, 5]
    assert [c.step for c in ckpt.list_checkpoints(tmp_path)] == [4, 5]  # exported: what later stages see
    assert ckpt.best_checkpoint(tmp_path).step == 4
    # A finished run exports its best (step 4) and its last (step 5); one when they are the same.
    assert [c.step for c in ckpt.to_export(ckpt.saved_checkpoints(tmp_path))] == [4, 5]
    assert [c.step for c in ckpt.to_export(ckpt.saved_checkpoints(tmp_path)[:4])] == [4]

    deleted = ckpt.prune_checkpoints(tmp_path, save_top_k=2)
    # Best two by val_loss are steps 4 (2.0) and 2 (3.0); step 5 stays because it is the latest.
    assert sorted(p.name for p in deleted) == ["epoch_0_step_0", "epoch_0_step_2"]
    assert [c.step for c in ckpt.saved_checkpoints(tmp_path)] == [2, 4, 5]
    assert ckpt.latest_checkpoint(tmp_path).step == 5
    assert unfinished.parent.parent.exists()  # never touched: only saved checkpoints are pruned

    ckpt.prune_checkpoints(tmp_path, save_top_k=0, protect={ckpt.checkpoints_dir(tmp_path) / "epoch_0_step_1"})
    # k=0 keeps the best and the latest, and whatever the caller protects (AutoModel's LATEST target).
    assert [c.step for c in ckpt.saved_checkpoints(tmp_path)] == [2, 4, 5]
    ckpt.prune_checkpoints(tmp_path, save_top_k=0)
    assert [c.step for c in ckpt.saved_checkpoints(tmp_path)] == [4, 5]
    assert ckpt.prune_checkpoints(tmp_path, save_top_k=-1) == []


def test_prune_announces_each_checkpoint_before_deleting_it(tmp_path):
    """The trainer reports a pruned checkpoint before it is gone: a job killed mid-prune never leaves a
    checkpoint its output still calls saved missing (the fault table counted one as data lost)."""
    for step, loss in {1: 5.0, 2: 3.0, 3: 4.0}.items():
        _fake_checkpoint(tmp_path, step, loss)
    seen = []
    deleted = ckpt.prune_checkpoints(tmp_path, save_top_k=1, before_delete=lambda d: seen.append((d.name, d.exists())))
    assert seen == [(p.name, True) for p in deleted] == [("epoch_0_step_0", True)]
    assert [c.step for c in ckpt.saved_checkpoints(tmp_path)] == [2, 3]


def test_checkpoint_info_is_the_consolidated_directory(tmp_path):
    consolidated = _fake_checkpoint(tmp_path, 7, None)
    info = ckpt.latest_checkpoint(tmp_path)
    assert info.path == consolidated and info.step == 7 and info.val_loss is None
    assert info.step_dir == ckpt.checkpoints_dir(tmp_path) / "epoch_0_step_6"
    assert Path(info) == consolidated  # os.PathLike: usable wherever a path was
    assert ckpt.best_checkpoint(tmp_path) == info  # no val_loss anywhere: the latest
    assert ckpt.latest_checkpoint(tmp_path / "nowhere") is None


@pytest.fixture(scope="module")
def trained(reference_run):
    return ckpt.latest_checkpoint(reference_run["run_dir"]).path


WEIGHTS = "model-00001-of-00001.safetensors"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _by_name(report: dict) -> dict:
    return {c["name"]: c for c in report["checks"]}


def test_trained_checkpoint_passes_and_loss_matches_trainer(trained):
    from workloads.validate_checkpoint import evaluate_loss, validate

    report = validate(trained, threshold=9.5, num_batches=4, micro_batch_size=4)
    assert report["passed"], report
    assert report["failed"] == []
    assert report["val_loss"] < report["untrained_loss"]
    assert report["untrained_loss"] > 10.0  # ~ln(32000): a random model knows nothing
    assert WEIGHTS in report["files"]
    assert report["sizes"][WEIGHTS] == (trained / WEIGHTS).stat().st_size
    # The validator reads the validation split with megatron-core, the trainer with AutoModel's copy of it:
    # the same 16 held-out samples (2 global batches of 8) give the trainer's number.
    meta = json.loads((trained / "meta.json").read_text())
    assert evaluate_loss(trained, num_batches=4, micro_batch_size=4) == pytest.approx(meta["val_loss"], abs=1e-4)
    assert report["val_loss"] == pytest.approx(meta["val_loss"], abs=1e-4)


@pytest.mark.faults
def test_corrupted_file_fails_checksum(trained, tmp_path):
    from workloads.validate_checkpoint import validate

    row = fault_ledger.open_row("corrupted checkpoint file (one flipped byte)")
    original = fault_ledger.checksums(trained)
    bad = _copy(trained, tmp_path / "consolidated")
    data = bytearray((bad / WEIGHTS).read_bytes())
    data[-100] ^= 0xFF  # a flipped bit deep in the weights: same size, different content
    (bad / WEIGHTS).write_bytes(bytes(data))
    row.injected += fault_ledger.checksums(bad)[WEIGHTS] != original[WEIGHTS]
    report = validate(bad, threshold=9.5, num_batches=1)
    row.compare(original, fault_ledger.checksums(trained))  # validating the copy left the original as it was
    checks = _by_name(report)
    assert not report["passed"]
    assert checks["files_complete"]["passed"]
    assert not checks["checksums"]["passed"]
    assert f"{WEIGHTS}: sha256" in checks["checksums"]["detail"]


def test_missing_file_fails_completeness(trained, tmp_path):
    from workloads.validate_checkpoint import validate

    bad = _copy(trained, tmp_path / "consolidated")
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

    bad = _copy(trained, tmp_path / "consolidated")
    tensors = load_file(bad / WEIGHTS)
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, bad / WEIGHTS, metadata={"format": "pt"})
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
