"""``ckpt_while_writing: replace`` (workloads/train/device_snapshot.py): every save's state is copied within the
device first, a save due while the previous one is being written waits in that copy and is written when the
write ends, and a newer save replaces the waiting one (issue 34, item 5: a save every 10 steps at 1.1B waited
10-16 s for the previous write on an H200).

The write is slowed for real, in torch.distributed.checkpoint's background writer process (a failpoint there
waits 6 s before the step-2 save's first file), so the saves of the next steps find it still being written. On
CPU the "device" is host memory: the same code, the copy a memcpy."""

from __future__ import annotations

import shutil

import pytest

from infra import failpoints
from tests.support import fault_ledger
from tests.train.helpers import checkpoints_now, read_metrics, record_saves, run_trainer, tiny_config_file
from workloads import checkpoint as ckpt
from workloads.checkpoint_writers import SLOW_WRITE_S

pytestmark = pytest.mark.filterwarnings("ignore:.*Transformer Engine and Apex")


def _training(metrics: list[dict], after: int = 0) -> list[dict]:
    """The optimizer steps' records without wall-clock fields (validation runs at every save, so it differs)."""
    return [{k: v for k, v in m.items() if k != "tokens_per_s"} for m in metrics if "loss" in m and m["step"] > after]


@pytest.mark.slow
def test_saves_during_a_write_wait_in_device_memory_the_newest_is_written_and_resumes_exactly(tmp_path, train_dataset):
    run_dir = tmp_path / "run"
    last = 64  # long enough on 2 cores (~15 s of steps) for the slow write (~8 s) to end while training goes on
    config_path = tiny_config_file(
        train_dataset,
        run_dir,
        tmp_path / "config.json",
        max_steps=last,
        val_check_interval=12,
        ckpt_every_n_steps=2,
        save_top_k=-1,
        ckpt_while_writing="replace",
    )
    proc = run_trainer(config_path, **failpoints.env(train__slow_background_write_at_step=2))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = read_metrics(run_dir)

    waiting = {m["step"]: m["checkpoint_waiting_for"] for m in metrics if "checkpoint_waiting_for" in m}
    replaced = {m["step"]: m["checkpoint_replaced_by"] for m in metrics if "checkpoint_replaced_by" in m}
    delayed = {m["step"]: m["checkpoint_write_delayed_s"] for m in metrics if "checkpoint_write_delayed_s" in m}
    assert waiting, "no save found the step-2 save still being written"
    assert 2 in waiting.values()  # saves were taken while the slow one was written
    assert replaced, "no waiting save was replaced by a newer one"
    for step, by in replaced.items():
        assert by > step and step in waiting  # only a waiting save is replaced, by a later one
        assert f"checkpoint of step {step} replaced by the save of step {by} before its write began" in proc.stdout
        assert not ckpt.checkpoints_dir(run_dir).joinpath(ckpt.step_dir_name(step)).exists()
    assert delayed, "no waiting save was written after the slow write"

    saved = [c.step for c in ckpt.saved_checkpoints(run_dir)]
    assert saved[0] == 2 and saved[-1] == last  # the slow one was published; the last step's save is never replaced
    # every save is either written or replaced, never both, never lost without a record
    taken = {m["step"] for m in metrics if "checkpoint_save_s" in m}
    assert set(saved) | set(replaced) == taken and not set(saved) & set(replaced)
    # a save that waited in device memory was then written and published
    written_late = sorted(set(delayed) & set(saved))
    assert written_late and all(delayed[s] > 0 for s in written_late)

    # the loop never waited for the slow write (the last save may: it must be written before the run ends)
    blocked = {m["step"]: m["checkpoint_save_s"] for m in metrics if "checkpoint_save_s" in m}
    assert all(seconds < SLOW_WRITE_S / 2 for step, seconds in blocked.items() if step != last), blocked
    assert not any("checkpoint_wait_s" in m for m in metrics)  # no wait for the copy to host memory either
    # the copy's buffers, and the stager's host buffers for them, were made before the first save, while training
    first = next(m for m in metrics if "checkpoint_snapshot_gib" in m)
    assert first["step"] == 2 and first["checkpoint_snapshot_prepared_gib"] == first["checkpoint_snapshot_gib"] > 0
    prestaged = next(m for m in metrics if "checkpoint_prestage_gib" in m)
    assert prestaged["step"] == 2 and prestaged["checkpoint_prestage_gib"] >= first["checkpoint_snapshot_gib"]

    # The save written after waiting holds the state of its own step (weights, optimizer, data position,
    # schedule), not of the later step it was written at: a run resumed from it trains exactly the steps
    # the uninterrupted run trained after it.
    resume_from = written_late[0]
    for later in ckpt.saved_checkpoints(run_dir):
        if later.step > resume_from:
            shutil.rmtree(later.step_dir)
    for pointer in ("LATEST", "LOWEST_VAL"):
        ckpt.checkpoints_dir(run_dir).joinpath(pointer).unlink(missing_ok=True)
    resumed = run_trainer(config_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"at step {resume_from} " in resumed.stdout
    after = read_metrics(run_dir)  # the resumed run keeps the records up to its step and appends its own
    assert _training(after, resume_from) == _training(metrics, resume_from)
    assert len(_training(after, resume_from)) == last - resume_from

    # benchmarks/bench_train_gpu.py's accounting of the same records, and the run's artifact
    from tests.train.helpers import bench_train_gpu

    bench = bench_train_gpu()
    stats = bench.checkpoint_stats(metrics, warmup=1, tokens_per_step=8 * 64)
    assert stats["replaced_saves"] == len(replaced) and stats["checkpoints"] == len(blocked)

    from tasks.train_engines.automodel import loss_curve_markdown

    markdown = loss_curve_markdown(metrics, None, str(run_dir))
    assert f"{len(replaced)} replaced by a newer save before their write" in markdown


def test_replace_falls_back_to_waiting_without_the_memory_for_the_copy():
    from infra.configs.train import TrainConfig
    from workloads.train.launch import replace_fits

    config = TrainConfig(
        arch="llama",
        hidden_size=2048,
        num_layers=22,
        num_attention_heads=32,
        ffn_hidden_size=5632,
        seq_length=2048,
        global_batch_size=8,
        micro_batch_size=8,
        max_steps=10,
        data_prefix=["1.0", "/data/x"],
        tokenizer_model="/t.model",
        gpus_per_node=1,
        ckpt_while_writing="replace",
    )
    from infra.configs.memory_plan import GIB, check_memory, plan_memory

    # the 1.1B's saved state (fp32 weights, AdamW m and v) beside training: on an H200 it fits
    fits, why = replace_fits(config, 32000, 1, cuda=True, gpu_memory_gib=139.8)
    assert fits and why is None
    # on a GPU where training fits but not the copy too: the trainer saves as with wait, and the layout is not refused
    plan = plan_memory(config, 32000)
    assert plan.snapshot == plan.weights + plan.optimizer and plan.total == plan.training + plan.snapshot
    between = (plan.training + plan.snapshot / 2) / GIB
    fits, why = replace_fits(config, 32000, 1, cuda=True, gpu_memory_gib=between)
    assert not fits
    assert why.startswith(f"warning: ckpt_while_writing: replace needs {plan.snapshot / GIB:.1f} GiB more per GPU")
    assert f"but the GPU has {between:.1f} GiB" in why and why.endswith("saving as with ckpt_while_writing: wait")
    assert check_memory(config, gpu_memory_gib=between, world_size=1).snapshot == plan.snapshot
    # on CPU the copy is in host memory
    fits, why = replace_fits(config, 32000, 1, cuda=False, room=8 * 2**30)
    state = 12 * plan.parameters / 2**30  # fp32 weights and two fp32 moments
    assert not fits and f"needs {state:.2f} GiB of memory" in why and "8.00 GiB is available" in why
    assert replace_fits(config.model_copy(update={"ckpt_while_writing": "wait"}), 32000, 1, cuda=True) == (False, None)


@pytest.mark.slow
@pytest.mark.faults
def test_a_trainer_killed_during_a_write_loses_no_save_its_writer_received(tmp_path, train_dataset, reference_run):
    """SIGKILL of the trainer once DCP's writer process has received the last save (step 12, both parts): the
    writer leaves the trainer's session, finishes the save and marks it written; the next run waits for the
    writer and publishes that save instead of resuming from an earlier one and training those steps again."""
    from workloads.checkpoint_writers import WRITTEN, writer_pidfiles

    run_dir = tmp_path / "run"
    config_path = tiny_config_file(train_dataset, run_dir, tmp_path / "config.json", ckpt_while_writing="replace")
    row = fault_ledger.open_row("training job SIGKILLed while its writer holds the last save (while_writing replace)")
    killed = run_trainer(config_path, **failpoints.env(train__kill_trainer_during_write_at_step=12))
    row.injected += killed.returncode == -9
    assert killed.returncode == -9, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert "SIGKILL of the trainer (failpoint)" in killed.stderr
    step12 = ckpt.checkpoints_dir(run_dir) / ckpt.step_dir_name(12)
    # the trainer never published it; its writer finished it after the trainer's death
    assert (step12 / ckpt.INCOMPLETE).exists()
    assert (step12 / "model" / WRITTEN).exists() and (step12 / "optim" / WRITTEN).exists()
    record_saves(row, run_dir, killed.stdout)  # what the killed run said it saved is intact
    before = [c.step for c in ckpt.saved_checkpoints(run_dir)]
    assert 12 not in before
    assert writer_pidfiles(ckpt.checkpoints_dir(run_dir))  # the writer put its pid on record for the next run

    resumed = run_trainer(config_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"recovered checkpoint {step12} (step 12): its writer finished it after the trainer was killed" in (
        resumed.stdout
    )
    assert "at step 12 (consumed_samples=96)" in resumed.stdout
    assert "step=9 loss" not in resumed.stdout  # nothing trained again
    assert _training(read_metrics(run_dir)) == _training(reference_run["metrics"])
    assert [c.step for c in ckpt.saved_checkpoints(run_dir)] == [*before, 12]
    assert checkpoints_now(run_dir)[12] == "intact"  # every file the recovered save's metadata names, whole
    assert ckpt.latest_checkpoint(run_dir) is not None  # and the export of it was made
    assert not writer_pidfiles(ckpt.checkpoints_dir(run_dir))  # the dead writer's pid file is gone


@pytest.mark.slow
@pytest.mark.faults
def test_without_replace_the_same_kill_resumes_from_the_save_before(tmp_path, train_dataset, reference_run):
    """The same kill with the default saves: the writer marks nothing (and dies with the trainer's session), so
    nothing is recovered and the next run resumes from the save before (the marks decide, not files found)."""
    from tests.train.helpers import deterministic_part

    run_dir = tmp_path / "run"
    config_path = tiny_config_file(train_dataset, run_dir, tmp_path / "config.json")
    row = fault_ledger.open_row("training job SIGKILLed while its writer holds the last save (default saves)")
    killed = run_trainer(config_path, **failpoints.env(train__kill_trainer_during_write_at_step=12))
    row.injected += killed.returncode == -9
    record_saves(row, run_dir, killed.stdout)
    assert killed.returncode == -9, killed.stdout[-3000:] + killed.stderr[-3000:]
    resumed = run_trainer(config_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "recovered checkpoint" not in resumed.stdout and "at step 8 (consumed_samples=64)" in resumed.stdout
    assert deterministic_part(read_metrics(run_dir)) == deterministic_part(reference_run["metrics"])


def test_the_copy_uses_the_buffers_made_ahead_and_holds_the_values_of_its_time():
    import torch

    from workloads.train.device_snapshot import DeviceSnapshot

    weight, moment = torch.randn(4, 3), torch.zeros(4, 3)
    snapshot = DeviceSnapshot()
    made = snapshot.prepare([weight, moment])
    state = {"state": {"w": {"exp_avg": moment, "step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]}
    copied = snapshot.copy("optim", {"model": weight, **state})
    assert copied["model"] is made[0] and copied["state"]["w"]["exp_avg"] is made[1]
    assert snapshot.prepared_used == 2 * weight.numel() * 4  # the step tensor had no buffer made ahead
    # the copy keeps the values of its time: the live state changes after it
    weight_then, moment_then = weight.clone(), moment.clone()
    weight.add_(1.0)
    moment.add_(2.0)
    state["param_groups"][0]["lr"] = 0.05
    assert torch.equal(copied["model"], weight_then) and torch.equal(copied["state"]["w"]["exp_avg"], moment_then)
    assert copied["param_groups"][0]["lr"] == 0.1
    # the next save reuses the same buffers
    again = snapshot.copy("optim", {"model": weight, **state})
    assert again["model"] is made[0] and torch.equal(again["model"], weight)
    # a state of another shape gets buffers of its own
    other = snapshot.copy("optim", {"model": torch.ones(2), **state})
    assert other["model"].shape == (2,) and other["model"] is not made[0]
