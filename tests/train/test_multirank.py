"""Two gloo processes under torchrun train like one process with the same global batch.

The engine is NeMo AutoModel with FSDP2 (``torch.distributed.run --nproc-per-node 2``, gloo on
CPU): each rank reads its own slice of every global batch (Megatron's sequential sampler),
gradients are reduced across the ranks, and only rank 0 writes the run's artifacts.

Both runs start from the same weights (a checkpoint, as continued pretraining does): a
fresh model's random init is not world-size independent in AutoModel 0.7 (with more than one
rank it initialises on the meta device and then each rank its own FSDP2 shard), so only
identical starting weights make the two curves comparable step for step.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

from tests.train.helpers import read_metrics, run_trainer, tiny_config, write_config
from workloads import checkpoint as ckpt

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*Transformer Engine and Apex")]

SAMPLES = re.compile(r"^(?:\[rank (\d)\] )?samples step=(\d+) rank=(\d) (\S+)$")


def _samples(stdout: str) -> dict[tuple[int, int], list[str]]:
    """{(step, rank): [sample hash, ...]} from the trainer's NEMOFLOW_TRAIN_TEST_LOG_SAMPLES lines."""
    found: dict[tuple[int, int], list[str]] = {}
    for line in stdout.splitlines():
        match = SAMPLES.match(line)
        if match:
            prefix, step, rank, rows = match.groups()
            assert prefix is None or prefix == rank, line  # the line came out of the rank it names
            found.setdefault((int(step), int(rank)), []).extend(rows.split(","))
    return found


def test_two_gloo_ranks_match_one_process_with_the_same_global_batch(tmp_path, train_dataset, reference_run):
    start = ckpt.best_checkpoint(reference_run["run_dir"]).path
    overrides = dict(
        max_steps=6,
        ckpt_every_n_steps=3,
        val_check_interval=3,
        limit_val_batches=2,
        log_every_n_steps=1,
        init_from=str(start),
        warmup_steps=0,
        lr=1e-3,
        seed=7,  # other samples than the run the weights come from
    )
    one_dir, two_dir = tmp_path / "one", tmp_path / "two"
    # Global batch 8 either way: one process accumulates 2 micro batches of 4; two ranks take 4 each.
    one = run_trainer(
        write_config(tiny_config(train_dataset, one_dir, **overrides), tmp_path / "one.json"),
        NEMOFLOW_TRAIN_TEST_LOG_SAMPLES="1",
    )
    assert one.returncode == 0, one.stdout + one.stderr
    two = run_trainer(
        write_config(tiny_config(train_dataset, two_dir, nproc_per_node=2, **overrides), tmp_path / "two.json"),
        nproc=2,
        NEMOFLOW_TRAIN_TEST_LOG_SAMPLES="1",
    )
    assert two.returncode == 0, two.stdout + two.stderr

    # The same loss curve (training and validation), within floating-point reduction-order tolerance.
    curve = {(m["step"], k): m[k] for m in read_metrics(one_dir) for k in ("loss", "val_loss", "grad_norm") if k in m}
    curve2 = {(m["step"], k): m[k] for m in read_metrics(two_dir) for k in ("loss", "val_loss", "grad_norm") if k in m}
    assert curve.keys() == curve2.keys() and len([k for k in curve if k[1] == "loss"]) == 6
    for key, value in curve.items():
        assert curve2[key] == pytest.approx(value, rel=2e-4, abs=1e-5), key
    losses = [m["loss"] for m in read_metrics(one_dir) if "loss" in m]
    assert losses[0] != losses[1]  # it trains: the comparison is of six different points

    # Each rank read different samples, and together exactly the samples one process read at that step.
    single, split = _samples(one.stdout), _samples(two.stdout)
    for step in range(1, 7):
        rank0, rank1 = split[(step, 0)], split[(step, 1)]
        assert len(rank0) == len(rank1) == 4
        assert not set(rank0) & set(rank1)
        assert Counter(rank0 + rank1) == Counter(single[(step, 0)])

    # Every rank's output reaches the log prefixed with its rank; artifacts come from rank 0 only, once.
    assert any(line.startswith("[rank 1] ") for line in two.stdout.splitlines())
    saved = [line for line in two.stdout.splitlines() if "saved checkpoint" in line]
    assert [line.split("] ", 1)[0] for line in saved] == ["[rank 0", "[rank 0"]
    assert [c.step for c in ckpt.list_checkpoints(two_dir)] == [3, 6]
    steps_logged = [m["step"] for m in read_metrics(two_dir) if "loss" in m]
    assert steps_logged == [1, 2, 3, 4, 5, 6]  # one metrics line per step, not one per rank
    for info in ckpt.list_checkpoints(two_dir):
        assert ckpt.verify_manifest(info.path) == []
        assert info.meta["world_size"] == 2
