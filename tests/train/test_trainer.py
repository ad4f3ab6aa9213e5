"""The trainer as users run it: ``python -m workloads.train --config FILE`` in a subprocess (NeMo AutoModel on CPU)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra import failpoints
from infra.configs.train import EXIT_OUT_OF_MEMORY, EXIT_PREEMPTED
from tests.support import fault_ledger
from tests.train.helpers import (
    REPO,
    deterministic_part,
    read_metrics,
    record_saves,
    run_trainer,
    tiny_config,
    tiny_config_file,
    trainer_env,
    write_config,
)
from workloads import checkpoint as ckpt

pytestmark = pytest.mark.filterwarnings("ignore:.*Transformer Engine and Apex")


def _step_dir(run_dir: Path, step: int) -> Path:
    return ckpt.checkpoints_dir(run_dir) / ckpt.step_dir_name(step)


def test_loss_decreases_on_real_text(reference_run):
    losses = [m["loss"] for m in reference_run["metrics"] if "loss" in m]
    vals = [m["val_loss"] for m in reference_run["metrics"] if "val_loss" in m]
    assert len(losses) == 12
    # Untrained loss is ~ln(32000) = 10.4; a dozen steps on the KJV must clearly beat it.
    assert losses[0] > 10.0
    assert losses[-1] < losses[0] - 1.0
    assert vals[-1] < vals[0]
    line = next(x for x in reference_run["stdout"].splitlines() if x.startswith("step=10 "))
    for field in ("loss=", "lr=", "tokens_per_s=", "grad_norm="):
        assert field in line


def test_checkpoint_layout_and_manifest(reference_run):
    run_dir = reference_run["run_dir"]
    root = ckpt.checkpoints_dir(run_dir)
    # save_top_k=2 with falling val_loss keeps the checkpoints of steps 8 and 12 (AutoModel counts from 0).
    assert sorted(p.name for p in ckpt.step_dirs(run_dir)) == ["epoch_0_step_11", "epoch_0_step_7"]
    assert [c.step for c in ckpt.saved_checkpoints(run_dir)] == [8, 12]
    assert (root / "LATEST").resolve() == _step_dir(run_dir, 12).resolve()
    # Saved during training: AutoModel's sharded resume state with nemoflow's meta.json, no export in the loop.
    eight = ckpt.saved_checkpoints(run_dir)[0]
    assert eight.meta["step"] == 8 and eight.meta["consumed_samples"] == 64 and not eight.exported
    assert not eight.consolidated.exists()
    assert list((eight.step_dir / "model").glob("shard-*.safetensors")) and (eight.step_dir / "optim").is_dir()
    # After training, the best and the last get a Hugging Face export; with a falling val_loss that is step 12.
    assert [c.step for c in ckpt.list_checkpoints(run_dir)] == [12]
    assert "exporting epoch_0_step_11 as Hugging Face safetensors" in reference_run["stdout"]
    latest = ckpt.latest_checkpoint(run_dir)
    assert latest.path == _step_dir(run_dir, 12) / "model" / "consolidated" and latest.step == 12
    names = {p.name for p in latest.path.iterdir()}
    assert {"config.json", "tokenizer.model", "meta.json", "MANIFEST.json", "model.safetensors.index.json"} <= names
    assert any(n.endswith(".safetensors") for n in names)
    manifest = json.loads((latest.path / "MANIFEST.json").read_text())["files"]
    assert set(manifest) == names - {"MANIFEST.json"}
    assert ckpt.verify_manifest(latest.path) == []
    meta = latest.meta
    assert meta["step"] == 12 and meta["consumed_samples"] == 12 * 8 and meta["tokens_seen"] == 12 * 8 * 64
    assert meta["data_prefix"] == reference_run["config"]["data_prefix"] and meta["engine"] == "nemo-automodel"
    logged_val = [m["val_loss"] for m in reference_run["metrics"] if m.get("step") == 12 and "val_loss" in m]
    assert meta["val_loss"] == pytest.approx(logged_val[0])
    # The weights load with plain transformers, and the serving stage accepts the directory as it is.
    from transformers import AutoModelForCausalLM

    from workloads.serve import check_checkpoint

    model = AutoModelForCausalLM.from_pretrained(latest.path)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert json.loads((latest.path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert model.config.vocab_size == 32000 and model.config.num_hidden_layers == 2
    check_checkpoint(latest.path)
    # Pointer-style use keeps working: a CheckpointInfo is a path.
    assert Path(latest) == latest.path and str(latest) == str(latest.path)


def test_validator_passes_the_trained_checkpoint(reference_run):
    from workloads.validate_checkpoint import validate

    best = ckpt.best_checkpoint(reference_run["run_dir"])
    report = validate(best.path, threshold=10.0, num_batches=2, micro_batch_size=4)
    assert report["passed"], report["checks"]
    assert report["val_loss"] < report["untrained_loss"]


def _start(config_path: Path, **env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "workloads.train", "--config", str(config_path)],
        cwd=REPO,
        env=trainer_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for_line(proc: subprocess.Popen, prefix: str | tuple[str, ...], timeout: float = 300) -> list[str]:
    seen = []
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(prefix):
            return seen
        assert time.monotonic() < deadline, "".join(seen)
    raise AssertionError(f"trainer ended before {prefix!r}:\n" + "".join(seen))


@pytest.mark.slow
@pytest.mark.faults
def test_preempted_then_killed_then_resumed_matches_uninterrupted(tmp_path, train_dataset, reference_run):
    """SIGTERM at step 6 (Slurm pre-emption), SIGKILL at step 10, then a clean finish: the same numbers."""
    run_dir = tmp_path / "run"
    config_path = tiny_config_file(train_dataset, run_dir, tmp_path / "config.json")
    row = fault_ledger.open_row("training job SIGTERMed (pre-emption), then SIGKILLed mid-step")

    proc = _start(config_path, **failpoints.env(train__pause_after_step=6))
    try:
        before = "".join(_wait_for_line(proc, "step=6 "))
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        row.injected += 1
        rest = proc.stdout.read()
        proc.wait(timeout=120)
    finally:
        proc.kill()
    record_saves(row, run_dir, before)
    assert proc.returncode == EXIT_PREEMPTED, rest
    assert "received a stop signal: checkpoint saved at step 6" in rest
    assert ckpt.saved_checkpoints(run_dir)[-1].step == 6
    assert ckpt.list_checkpoints(run_dir) == []  # a pre-empted job exports nothing: it resumes

    proc = _start(config_path, **failpoints.env(train__pause_after_step=10))
    try:
        # The save of step 8 is written in the background and published as soon as it is written (between
        # steps, or while paused), not only at the next save: wait for it and for step 10, then kill.
        published = f"saved checkpoint {_step_dir(run_dir, 8)} "
        seen = _wait_for_line(proc, ("step=10 ", published))
        seen += [] if any(x.startswith(published) for x in seen) else _wait_for_line(proc, published)
        seen += [] if any(x.startswith("step=10 ") for x in seen) else _wait_for_line(proc, "step=10 ")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        seen.append(proc.stdout.read())  # what it said before the kill and the test had not read (a prune)
    finally:
        proc.kill()
    row.injected += proc.returncode == -signal.SIGKILL
    record_saves(row, run_dir, before, rest, "".join(seen))
    assert proc.returncode == -signal.SIGKILL
    assert any("at step 6 (consumed_samples=48)" in line for line in seen), seen
    # Killed after step 10: the last saved checkpoint is step 8; steps 9-10 are redone.
    assert ckpt.saved_checkpoints(run_dir)[-1].step == 8

    resumed = run_trainer(config_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "at step 8 (consumed_samples=64)" in resumed.stdout
    # Same data order, optimizer, schedule and RNG: the numbers of the uninterrupted run, bit for bit on CPU.
    # (AutoModel does not validate on a pre-emption checkpoint, so there is no extra val_loss either.)
    assert deterministic_part(read_metrics(run_dir)) == deterministic_part(reference_run["metrics"])


@pytest.mark.slow
@pytest.mark.faults
def test_crash_during_save_leaves_no_complete_checkpoint(tmp_path, train_dataset, reference_run):
    run_dir = tmp_path / "run"
    config_path = tiny_config_file(train_dataset, run_dir, tmp_path / "config.json")
    row = fault_ledger.open_row("training job SIGKILLed mid-checkpoint")
    crashed = run_trainer(config_path, **failpoints.env(train__crash_in_save_at_step=8))
    row.injected += crashed.returncode == -signal.SIGKILL  # it died of the kill inside the save
    record_saves(row, run_dir, crashed.stdout)
    assert crashed.returncode == -signal.SIGKILL, crashed.stdout + crashed.stderr
    half = _step_dir(run_dir, 8)
    # AutoModel's interrupted save: weights written, never published (its marker stays), no manifest.
    assert (half / ".incomplete").exists() and not (half / "model" / "consolidated" / "MANIFEST.json").exists()
    assert [c.step for c in ckpt.saved_checkpoints(run_dir)] == [4] and ckpt.list_checkpoints(run_dir) == []

    resumed = run_trainer(config_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "at step 4 (consumed_samples=32)" in resumed.stdout
    assert not (half / ".incomplete").exists()
    assert deterministic_part(read_metrics(run_dir)) == deterministic_part(reference_run["metrics"])


@pytest.mark.slow
@pytest.mark.faults
def test_out_of_memory_exits_75_and_backend_reports_it(tmp_path, train_dataset):
    row = fault_ledger.open_row("out of memory at step 1 (failpoint)")
    from infra.jobs import ExitCode

    BACKEND_OOM = ExitCode.OUT_OF_MEMORY
    from infra.backends.local import LocalBackend
    from infra.configs.train import TrainConfig
    from infra.jobs import JobState
    from tasks.train_engines.automodel import build_train_job, write_config

    assert EXIT_OUT_OF_MEMORY == BACKEND_OOM
    config = TrainConfig(**tiny_config(train_dataset, tmp_path / "run", micro_batch_size=2))
    write_config(config)
    spec = build_train_job(config)
    spec.env.update(failpoints.env(train__oom_at_step=1))
    lines: list[str] = []
    result = LocalBackend().run(spec, on_log=lines.append)
    row.injected += any("out of memory at step 1" in line for line in lines)  # the failpoint fired
    assert result.exit_code == 75 and result.state is JobState.OUT_OF_MEMORY
    assert any(
        "out of memory at step 1 with micro_batch_size=2, seq_length=64: lower micro_batch_size" in line
        for line in lines
    ), lines


@pytest.mark.slow
def test_bad_inputs_fail_before_training_with_clear_errors(tmp_path, train_dataset):
    missing = tiny_config(
        train_dataset, tmp_path / "run", data_prefix=[0.5, train_dataset["prefixes"][0], 0.5, str(tmp_path / "nope")]
    )
    proc = run_trainer(write_config(missing, tmp_path / "missing.json"))
    assert proc.returncode == 2
    assert f"{tmp_path / 'nope'}.bin" in proc.stderr and f"{tmp_path / 'nope'}.idx" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    unwritable = tiny_config(train_dataset, blocker / "run")
    proc = run_trainer(write_config(unwritable, tmp_path / "unwritable.json"))
    assert proc.returncode == 2
    assert f"checkpoint directory {blocker / 'run' / 'checkpoints'} is not writable" in proc.stderr

    typos = {**tiny_config(train_dataset, tmp_path / "run"), "max_step": 3, "learning_rate": 0.1}
    proc = run_trainer(write_config(typos, tmp_path / "typos.json"))
    assert proc.returncode == 2
    assert "error: unknown TrainConfig keys 'learning_rate', 'max_step' (did you mean 'max_steps' for 'max_step'?)" in (
        proc.stderr
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

    alone = tiny_config(train_dataset, tmp_path / "run", nproc_per_node=2)
    proc = run_trainer(write_config(alone, tmp_path / "alone.json"))
    assert proc.returncode == 2
    assert "asks for 2 training processes" in proc.stderr and "--nproc-per-node 2" in proc.stderr


@pytest.mark.slow
def test_mixtral_run_reports_to_wandb_only_with_key(tmp_path, train_dataset, reference_run, fake_wandb):
    """A tiny Mixtral (MoE) trains through the same engine, with WANDB_API_KEY set; the reference run had none."""
    calls = fake_wandb["calls"]
    assert not calls.exists() or not calls.read_text().strip()

    secret = "wandb-test-secret-0123456789"
    config = tiny_config(
        train_dataset,
        tmp_path / "on",
        arch="mixtral",
        num_moe_experts=4,
        moe_router_topk=2,
        max_steps=2,
        limit_val_batches=0,
        ckpt_every_n_steps=2,
    )
    on = run_trainer(
        write_config(config, tmp_path / "on.json"), WANDB_API_KEY=secret, PYTHONPATH=fake_wandb["pythonpath"]
    )
    assert on.returncode == 0, on.stdout + on.stderr
    assert "NeMo AutoModel mixtral" in on.stdout
    latest = ckpt.latest_checkpoint(tmp_path / "on")
    saved = json.loads((latest.path / "config.json").read_text())
    assert saved["architectures"] == ["MixtralForCausalLM"] and saved["num_local_experts"] == 4
    from transformers import AutoModelForCausalLM

    assert type(AutoModelForCausalLM.from_pretrained(latest.path)).__name__ == "MixtralForCausalLM"

    records = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [r["call"] for r in records if r["call"] != "log"] == ["init", "summary", "finish"]
    assert next(r for r in records if r["call"] == "summary")["keys"] == ["gpu_time"]  # the run's phase seconds
    assert records[0]["project"] == "nemoflow" and records[0]["key"] == secret
    logs = [r for r in records if r["call"] == "log"]
    assert logs and all({"loss", "lr", "grad_norm"} <= set(r["keys"]) for r in logs)
    assert secret not in on.stdout + on.stderr
    assert secret not in (tmp_path / "on" / "train_config.json").read_text()
    assert secret not in (tmp_path / "on" / "metrics.jsonl").read_text()


def test_continued_pretraining_starts_from_checkpoint_weights(tmp_path, train_dataset, reference_run):
    source = ckpt.latest_checkpoint(reference_run["run_dir"])
    config = tiny_config(
        train_dataset,
        tmp_path / "cpt",
        max_steps=2,
        limit_val_batches=1,
        ckpt_every_n_steps=2,
        init_from=str(source.path),
        reset_optimizer=True,
    )
    proc = run_trainer(write_config(config, tmp_path / "cpt.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"initialised weights from {source.path} (reset_optimizer=True)" in proc.stdout
    first = read_metrics(tmp_path / "cpt")[0]
    # A fresh model starts at ~10.4; the loaded one starts near where the reference ended.
    reference_last = [m["loss"] for m in reference_run["metrics"] if "loss" in m][-1]
    assert first["step"] == 1 and first["loss"] < reference_last + 0.5
    meta = ckpt.latest_checkpoint(tmp_path / "cpt").meta
    assert meta["init_from"] == str(source) and meta["step"] == 2

    # reset_optimizer=False continues with the source run's AdamW moments: step 1 (same weights, same
    # batch) gives the same loss, and the first update then differs from a fresh optimizer's.
    keep = {**config, "run_dir": str(tmp_path / "keep"), "reset_optimizer": False}
    proc = run_trainer(write_config(keep, tmp_path / "keep.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(reset_optimizer=False)" in proc.stdout
    fresh = [m["loss"] for m in read_metrics(tmp_path / "cpt") if "loss" in m]
    kept = [m["loss"] for m in read_metrics(tmp_path / "keep") if "loss" in m]
    assert kept[0] == fresh[0] and kept[1] != pytest.approx(fresh[1], abs=1e-6)
