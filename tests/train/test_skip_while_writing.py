"""``ckpt_while_writing: skip``: a save due while the previous background save is still being written is skipped
(on record) instead of stalling the loop until that write ends (issue 34: at 1.1B on an H200, with a save every
10 steps, each save waited 10-16 s for the previous one's write: 14.3 % of the no-save rate).

The write is slowed for real, in torch.distributed.checkpoint's background writer process (a failpoint there
waits 6 s before the step-2 save's first file), so the saves of the next steps find it still being written."""

from __future__ import annotations

import pytest

from infra import failpoints
from tests.train.helpers import read_metrics, run_trainer, tiny_config_file
from workloads import checkpoint as ckpt
from workloads.checkpoint_writers import SLOW_WRITE_S

pytestmark = pytest.mark.filterwarnings("ignore:.*Transformer Engine and Apex")


def _training(metrics: list[dict]) -> list[dict]:
    """The optimizer steps' records without wall-clock fields (validation runs at every save, so it differs)."""
    return [{k: v for k, v in m.items() if k != "tokens_per_s"} for m in metrics if "loss" in m]


@pytest.mark.slow
def test_saves_due_while_the_previous_is_written_are_skipped_and_the_loop_does_not_wait(
    tmp_path, train_dataset, reference_run
):
    run_dir = tmp_path / "run"
    config_path = tiny_config_file(
        train_dataset,
        run_dir,
        tmp_path / "config.json",
        ckpt_every_n_steps=2,
        save_top_k=-1,
        ckpt_while_writing="skip",
    )
    proc = run_trainer(config_path, **failpoints.env(train__slow_background_write_at_step=2))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = read_metrics(run_dir)

    skipped = {
        m["step"]: m["checkpoint_skipped_while_writing"] for m in metrics if "checkpoint_skipped_while_writing" in m
    }
    assert skipped, "no save found the step-2 save still being written"
    assert set(skipped.values()) == {2}  # each skipped save names the one being written
    assert all(
        f"checkpoint of step {s} skipped: the save of step 2 is still being written" in proc.stdout for s in skipped
    )
    saved = [c.step for c in ckpt.saved_checkpoints(run_dir)]
    assert saved[0] == 2 and saved[-1] == 12  # the slow one was published; the last step's save is never skipped
    assert not set(skipped) & set(saved)
    assert not any(ckpt.checkpoints_dir(run_dir).joinpath(f"epoch_0_step_{s - 1}").exists() for s in skipped)

    # the loop did not wait for the slow write at any save before the last (the last may: it must be written)
    blocked = {m["step"]: m["checkpoint_save_s"] for m in metrics if "checkpoint_save_s" in m}
    assert all(seconds < SLOW_WRITE_S / 2 for step, seconds in blocked.items() if step != 12), blocked
    # training itself is the uninterrupted run's
    assert _training(metrics) == _training(reference_run["metrics"])

    # benchmarks/bench_train_gpu.py's accounting of the same records: the skipped saves counted, none of them blocked
    from tests.train.helpers import bench_train_gpu

    bench = bench_train_gpu()
    stats = bench.checkpoint_stats(metrics, warmup=1, tokens_per_step=8 * 64)
    assert stats["skipped_saves"] == len(skipped) and stats["checkpoints"] == len(blocked)

    from tasks.train_engines.automodel import loss_curve_markdown

    markdown = loss_curve_markdown(metrics, None, str(run_dir))
    assert f"checkpoints: {len(skipped)} save" in markdown and "skipped while the previous one was" in markdown
