"""Two gloo processes under torchrun train like one process with the same global batch.

The engine is NeMo AutoModel with FSDP2 or DDP (``strategy``; ``torch.distributed.run
--nproc-per-node 2``, gloo on CPU): each rank reads its own slice of every global batch
(Megatron's sequential sampler), gradients are reduced across the ranks, and only rank 0
writes the run's artifacts, the same consolidated safetensors either way.

Both runs start from the same weights (a checkpoint, as continued pretraining does): a
fresh model's random init is not world-size independent in AutoModel 0.7 (with more than one
rank it initialises on the meta device and then each rank its own FSDP2 shard), so only
identical starting weights make the two curves comparable step for step.
"""

from __future__ import annotations

import json
import re
import signal
from collections import Counter

import pytest

from infra import failpoints
from tests.support import fault_ledger
from tests.train.helpers import (
    deterministic_part,
    read_metrics,
    record_saves,
    run_trainer,
    tensor_layout,
    tiny_config,
    write_config,
)
from workloads import checkpoint as ckpt

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*Transformer Engine and Apex")]

SAMPLES = re.compile(r"^(?:\[rank (\d)\] )?samples step=(\d+) rank=(\d) (\S+)$")


def _samples(stdout: str) -> dict[tuple[int, int], list[str]]:
    """{(step, rank): [sample hash, ...]} from the lines of the trainer's train.log_samples failpoint."""
    found: dict[tuple[int, int], list[str]] = {}
    for line in stdout.splitlines():
        match = SAMPLES.match(line)
        if match:
            prefix, step, rank, rows = match.groups()
            assert prefix is None or prefix == rank, line  # the line came out of the rank it names
            found.setdefault((int(step), int(rank)), []).extend(rows.split(","))
    return found


def _overrides(reference_run) -> dict:
    return dict(
        max_steps=6,
        ckpt_every_n_steps=3,
        val_check_interval=3,
        limit_val_batches=2,
        log_every_n_steps=1,
        init_from=str(ckpt.best_checkpoint(reference_run["run_dir"]).path),
        warmup_steps=0,
        lr=1e-3,
        seed=7,  # other samples than the run the weights come from
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory, train_dataset, reference_run):
    """The 6-step runs, made once each on demand: ``runs("one")``, ``runs("fsdp2")``, ``runs("ddp")``.

    Global batch 8 either way: one process accumulates 2 micro batches of 4; two ranks take 4 each.
    """
    done: dict[str, tuple] = {}

    def get(name: str):
        if name not in done:
            root = tmp_path_factory.mktemp(f"multirank-{name}")
            if name == "one":
                config = tiny_config(train_dataset, root / "run", **_overrides(reference_run))
            else:
                config = tiny_config(
                    train_dataset, root / "run", nproc_per_node=2, strategy=name, **_overrides(reference_run)
                )
            proc = run_trainer(
                write_config(config, root / "config.json"),
                nproc=1 if name == "one" else 2,
                **failpoints.env(train__log_samples=True),
            )
            assert proc.returncode == 0, proc.stdout + proc.stderr
            done[name] = (proc, root / "run", config)
        return done[name]

    return get


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_two_gloo_ranks_match_one_process_with_the_same_global_batch(runs, strategy):
    one, one_dir, _ = runs("one")
    two, two_dir, _ = runs(strategy)
    # The engine asked for is the one that ran: DDP wraps the model, FSDP2 turns it into its FSDP class.
    wrapper = "DistributedDataParallel" if strategy == "ddp" else "FSDPLlamaForCausalLM"
    assert f"strategy={strategy} ({wrapper}) " in two.stdout

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
    assert [c.step for c in ckpt.saved_checkpoints(two_dir)] == [3, 6]
    # Both export the same checkpoints after training (the best and the last: the numbers are the same).
    exported = [c.step for c in ckpt.list_checkpoints(two_dir)]
    assert 6 in exported and exported == [c.step for c in ckpt.list_checkpoints(one_dir)]
    steps_logged = [m["step"] for m in read_metrics(two_dir) if "loss" in m]
    assert steps_logged == [1, 2, 3, 4, 5, 6]  # one metrics line per step, not one per rank
    for info in ckpt.list_checkpoints(two_dir):
        assert ckpt.verify_manifest(info.path) == []
        assert info.meta["world_size"] == 2
    # The same checkpoint as one process writes: the same files, tensor names, shapes and dtypes.
    for mine, theirs in zip(ckpt.list_checkpoints(two_dir), ckpt.list_checkpoints(one_dir), strict=True):
        assert _manifest_files(mine.path) == _manifest_files(theirs.path)
        assert tensor_layout(mine.path) == tensor_layout(theirs.path)


def _manifest_files(path) -> list[str]:
    return sorted(json.loads((path / ckpt.MANIFEST).read_text())["files"])


@pytest.mark.faults
def test_two_ddp_ranks_killed_in_a_save_resume_with_the_same_numbers(tmp_path, runs):
    """A DDP run killed inside its step-6 save resumes from step 3 and ends as the uninterrupted run."""
    _, whole_dir, config = runs("ddp")
    run_dir = tmp_path / "run"
    config_path = write_config({**config, "run_dir": str(run_dir)}, tmp_path / "config.json")
    row = fault_ledger.open_row("2-rank DDP training job SIGKILLed mid-checkpoint")
    crashed = run_trainer(config_path, nproc=2, **failpoints.env(train__crash_in_save_at_step=6))
    row.injected += f"exitcode  : -{int(signal.SIGKILL)}" in crashed.stdout + crashed.stderr  # torchrun saw it
    record_saves(row, run_dir, crashed.stdout)
    assert crashed.returncode != 0, crashed.stdout + crashed.stderr
    assert f"exitcode  : -{int(signal.SIGKILL)}" in crashed.stdout + crashed.stderr  # torchrun saw the kill
    assert [c.step for c in ckpt.saved_checkpoints(run_dir)] == [3] and ckpt.list_checkpoints(run_dir) == []

    resumed = run_trainer(config_path, nproc=2)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "at step 3 (consumed_samples=24)" in resumed.stdout
    assert "strategy=ddp " in resumed.stdout
    assert deterministic_part(read_metrics(run_dir)) == deterministic_part(read_metrics(whole_dir))
    assert [c.step for c in ckpt.saved_checkpoints(run_dir)] == [3, 6]
    assert [c.step for c in ckpt.list_checkpoints(run_dir)] == [c.step for c in ckpt.list_checkpoints(whole_dir)]
    for info in ckpt.list_checkpoints(run_dir):
        assert ckpt.verify_manifest(info.path) == []


def test_two_fsdp2_ranks_replace_saves_while_writing_and_train_as_before(tmp_path, runs):
    """``ckpt_while_writing: replace`` on two FSDP2 ranks (the state dicts hold DTensors: each rank copies its
    shards): a save every step, the first one's write slowed in the writer processes, so later saves wait in the
    copy and are replaced; every rank takes the same decisions (the ranks' training is the run without it)."""
    _, whole_dir, config = runs("fsdp2")
    run_dir = tmp_path / "run"
    replacing = {**config, "run_dir": str(run_dir), "ckpt_every_n_steps": 1, "ckpt_while_writing": "replace"}
    proc = run_trainer(
        write_config(replacing, tmp_path / "config.json"),
        nproc=2,
        **failpoints.env(train__slow_background_write_at_step=1),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = read_metrics(run_dir)
    replaced = [m["step"] for m in metrics if "checkpoint_replaced_by" in m]
    assert replaced and all(s not in (1, 6) for s in replaced)
    assert deterministic_part([m for m in metrics if "loss" in m]) == deterministic_part(
        [m for m in read_metrics(whole_dir) if "loss" in m]
    )
    saved = [c.step for c in ckpt.saved_checkpoints(run_dir)]
    assert saved[0] == 1 and saved[-1] == 6 and not set(saved) & set(replaced)
    for info in ckpt.list_checkpoints(run_dir):  # the export of the last save: every rank's shards were written
        assert ckpt.verify_manifest(info.path) == []
