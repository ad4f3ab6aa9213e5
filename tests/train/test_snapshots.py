"""Frequent saves that cost nothing (issue 34, item 5; ``ckpt_snapshots``): snapshots in host memory, persisted by
a writer process at the storage's pace (workloads/train/snapshots.py).

Real tiny training runs on CPU: a writer slowed by a failpoint so that newer snapshots replace the one waiting,
a real SIGKILL of the trainer's process group while the writer persists (the writer finishes, the next run waits
for it and resumes from its newest snapshot with the uninterrupted run's losses), and the fallback line when the
memory is not there.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading

import pytest

from infra import failpoints, processes
from tests.support import fault_ledger
from tests.support.require import need
from tests.train.helpers import (
    REPO,
    checkpoints_now,
    read_metrics,
    record_saves,
    run_trainer,
    tiny_config,
    tiny_config_file,
    trainer_env,
    write_config,
)
from workloads import checkpoint as ckpt
from workloads.train import snapshots
from workloads.train.launch import snapshots_fit, state_bytes_per_rank

pytestmark = pytest.mark.filterwarnings("ignore:.*Transformer Engine and Apex")

VOCAB = 32000  # the Mixtral sentencepiece model the test data is tokenized with
PERSISTED = re.compile(r"snapshot writer: persisted the snapshot of step (\d+) ")


def _training(metrics: list[dict]) -> list[dict]:
    """The optimizer steps' records (loss, lr, grad norm, samples) without wall-clock fields: a run that saves
    (and so validates) at every step trains the same steps as the reference run."""
    return [{k: v for k, v in m.items() if k != "tokens_per_s"} for m in metrics if "loss" in m]


def _incomplete(run_dir) -> list[str]:
    return sorted(p.name for p in ckpt.step_dirs(run_dir) if (p / ckpt.INCOMPLETE).exists())


@pytest.mark.slow
def test_a_slow_writer_has_snapshots_replaced_and_every_persisted_one_is_complete(
    tmp_path, train_dataset, reference_run
):
    """A snapshot at every step; every persist pauses 4 s half-way: the snapshots that arrive meanwhile replace
    one another, the newest waiting is persisted next, and the last (step 12) at the end.
    metrics.jsonl records each snapshot as taken, then persisted or replaced, never both; every persisted one is
    a complete published checkpoint; training is the reference run's."""
    run_dir = tmp_path / "run"
    config = tiny_config_file(
        train_dataset, run_dir, tmp_path / "config.json", ckpt_snapshots=True, ckpt_every_n_steps=1, save_top_k=-1
    )
    proc = run_trainer(config, **failpoints.env(train__slow_checkpoint_write_at_step="1+"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "checkpoint snapshots need" not in proc.stdout  # it did not fall back
    metrics = read_metrics(run_dir)
    taken = [m["step"] for m in metrics if "snapshot_copy_s" in m]
    persisted = {m["step"]: m for m in metrics if "snapshot_persisted_s" in m}
    replaced = {m["step"]: m["snapshot_replaced_by"] for m in metrics if "snapshot_replaced_by" in m}
    assert taken == list(range(1, 13))
    assert not [m for m in metrics if "checkpoint_save_s" in m]  # no ordinary save ran
    assert set(persisted) | set(replaced) == set(taken) and not set(persisted) & set(replaced)
    assert 12 in persisted and len(persisted) < 12
    assert all(m["snapshot_persisted_s"] >= snapshots.SLOW_WRITE_S for m in persisted.values())
    # arrived while another was written, replaced before their own write by the next snapshot
    assert replaced and all(by == step + 1 for step, by in replaced.items()), replaced
    for m in persisted.values():
        assert m["snapshot_lag_s"] >= m["snapshot_persisted_s"] > 0
    # on disk: exactly the persisted snapshots, each published and intact, LATEST at the last
    assert [c.step for c in ckpt.saved_checkpoints(run_dir)] == sorted(persisted)
    assert set(checkpoints_now(run_dir).values()) == {"intact"}
    assert _incomplete(run_dir) == []
    latest = ckpt.checkpoints_dir(run_dir) / "LATEST"
    assert latest.resolve().name == ckpt.step_dir_name(12)
    assert not snapshots.pidfile(run_dir).exists() and not snapshots.shm_root(run_dir).exists()
    assert f"checkpoint snapshots: 12 taken, {len(persisted)} persisted, {len(replaced)} replaced" in proc.stdout
    assert _training(metrics) == _training(reference_run["metrics"])
    from tasks.train_engines.automodel import loss_curve_markdown

    markdown = loss_curve_markdown(metrics, None, str(run_dir))
    assert "checkpoint snapshots: 12 taken (training blocked " in markdown, markdown
    assert f"{len(persisted)} persisted (at most " in markdown
    assert f", {len(replaced)} replaced by a newer snapshot before their write" in markdown


@pytest.mark.slow
@pytest.mark.faults
def test_a_killed_trainer_loses_no_snapshot_the_writer_received(tmp_path, train_dataset, reference_run):
    """SIGKILL of the trainer's whole process group while the writer is half-way through a (slowed) persist: the
    writer, in a session of its own, finishes what it had received and exits; the re-run, started at once, waits
    for it, resumes from its newest snapshot and trains the remaining steps to the uninterrupted run's losses."""
    run_dir = tmp_path / "run"
    config = tiny_config(train_dataset, run_dir, ckpt_snapshots=True, ckpt_every_n_steps=1, save_top_k=-1)
    config_path = write_config(config, tmp_path / "config.json")
    trainer = subprocess.Popen(
        [sys.executable, "-m", "workloads.train", "--config", str(config_path)],
        cwd=REPO,
        env=trainer_env(**failpoints.env(train__slow_checkpoint_write_at_step="4+")),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, killed whole below (not pytest's)
    )
    row = fault_ledger.open_row("training job SIGKILLed (its process group) while the snapshot writer persists")
    lines: list[str] = []
    paused = threading.Event()
    writing: list[int] = []

    def read() -> None:
        for line in trainer.stdout:  # until the writer, which shares the pipe, exits too
            lines.append(line)
            if match := re.search(r"slow write \(failpoint\): pausing \S+ s half-way through step (\d+)", line):
                writing.append(int(match.group(1)))
                paused.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert paused.wait(timeout=240), "".join(lines[-50:])
    writer = snapshots.pidfile(run_dir).read_text().split()[0]
    os.killpg(trainer.pid, signal.SIGKILL)
    assert trainer.wait(timeout=30) == -signal.SIGKILL
    row.injected += 1
    in_flight = writing[0]  # the snapshot the writer was half-way through when the trainer died

    resumed = run_trainer(config_path, timeout=300)  # at once: the writer is still persisting
    reader.join(timeout=60)
    output = "".join(lines)
    record_saves(row, run_dir, output, resumed.stdout)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    persisted = [int(m.group(1)) for m in PERSISTED.finditer(output)]
    newest = max(persisted)
    # the writer outlived the kill: it finished the snapshot it was writing then (and any it had waiting), and exited
    assert in_flight >= 4 and in_flight in persisted and newest >= in_flight, output[-3000:]
    assert not processes.pid_alive(int(writer))
    # what it persisted after the trainer died is on record: it wrote metrics.jsonl itself then
    metrics = read_metrics(run_dir)
    after_kill = [m["step"] for m in metrics if "snapshot_persisted_s" in m and m["step"] <= newest]
    assert in_flight in after_kill, metrics
    assert f"waiting for the snapshot writer (pid {writer}) of {run_dir}" in resumed.stdout, resumed.stdout[-3000:]
    assert f"resuming from {ckpt.checkpoints_dir(run_dir) / ckpt.step_dir_name(newest)} at step {newest} " in (
        resumed.stdout
    )
    assert newest < 12  # the kill came before the end: the re-run trained the rest
    assert _incomplete(run_dir) == []
    assert set(checkpoints_now(run_dir).values()) == {"intact"}
    assert _training(read_metrics(run_dir)) == _training(reference_run["metrics"])


@pytest.mark.slow
@pytest.mark.faults
def test_no_room_for_the_snapshots_falls_back_with_one_line(tmp_path, train_dataset):
    """A private /dev/shm (tmpfs) with room for two copies of the state: the background save's staging copy fits,
    the snapshots' three slots do not. One line says so and why, and the run saves as without ckpt_snapshots
    (today's background save, no writer process, no snapshot records)."""
    need(
        shutil.which("unshare") and os.geteuid() == 0,
        "unshare and root (a private /dev/shm mount)",
        "util-linux, as root",
    )
    from infra.configs.train import TrainConfig

    run_dir = tmp_path / "run"
    config = tiny_config(train_dataset, run_dir, ckpt_snapshots=True, max_steps=2, ckpt_every_n_steps=2)
    config_path = write_config(config, tmp_path / "config.json")
    size = int(2 * state_bytes_per_rank(TrainConfig(**config), VOCAB, 1, False))
    trainer = f"{sys.executable} -m workloads.train --config {config_path}"
    row = fault_ledger.open_row("/dev/shm too small for checkpoint snapshots (a tmpfs of 2 copies of the state)")
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c"]
        + [f"mount -t tmpfs -o size={size} tmpfs /dev/shm && exec {trainer}"],
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if "checkpoint snapshots need" in line]
    row.injected += len(lines) == 1
    record_saves(row, run_dir, proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(lines) == 1, proc.stdout[-3000:]
    assert lines[0].startswith("warning: checkpoint snapshots need ") and "(3 slots of 0.05 GiB" in lines[0]
    assert lines[0].endswith(
        " GiB is available (MemAvailable, the cgroup limit, free /dev/shm): saving as without ckpt_snapshots"
    ), lines[0]
    assert "saving synchronously" not in proc.stdout  # the one line: today's background save fits
    metrics = read_metrics(run_dir)
    assert not [m for m in metrics if any(k.startswith("snapshot_") for k in m)]
    assert [m["step"] for m in metrics if "checkpoint_save_s" in m] == [2]  # today's save
    assert [m["step"] for m in metrics if "checkpoint_write_s" in m] == [2]  # written in the background
    assert [c.step for c in ckpt.saved_checkpoints(run_dir)] == [2]
    assert not snapshots.pidfile(run_dir).exists()


def test_the_snapshot_check_counts_three_slots(tmp_path):
    """snapshots_fit: off unless asked; three copies of the state (12 bytes a parameter on CPU) plus 10 %."""
    from infra.configs.train import TrainConfig, estimate_parameters

    fields = {k: v for k, v in tiny_config({"blend": ["/d"], "tokenizer_model": "/t"}, tmp_path).items()}
    off = TrainConfig(**fields)
    assert snapshots_fit(off, vocab_size=32000, world_size=1, cuda=False, room=1.0) == (False, None)
    on = TrainConfig(**fields, ckpt_snapshots=True)
    needed = 3 * estimate_parameters(on, 32000) * 12 * 1.1
    assert snapshots_fit(on, vocab_size=32000, world_size=1, cuda=False, room=needed * 1.01) == (True, None)
    fits, why = snapshots_fit(on, vocab_size=32000, world_size=1, cuda=False, room=needed * 0.99)
    assert not fits and why.startswith("warning: checkpoint snapshots need ")
    two_nodes = TrainConfig(**{**fields, "num_nodes": 2}, ckpt_snapshots=True)
    assert "need one node" in snapshots_fit(two_nodes, vocab_size=32000, world_size=2, cuda=False, room=1e15)[1]
