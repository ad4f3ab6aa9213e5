"""The trainer with its dataset, tokenizer, configuration and run directory in GCS (the emulator):
pre-empted on one node, resumed on another from the checkpoint it uploaded, with the numbers of an
uninterrupted local run; the validator reads the gs:// checkpoint."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from infra import failpoints
from infra.configs.train import EXIT_PREEMPTED
from tests.support import fault_ledger
from tests.train.helpers import REPO, deterministic_part, tiny_config, trainer_env
from workloads import checkpoint as ckpt

pytestmark = pytest.mark.filterwarnings("ignore:.*Transformer Engine and Apex")


def _upload_dataset(bucket: str, dataset: dict) -> dict:
    from infra import storage

    prefixes = []
    for prefix in dataset["prefixes"]:
        remote = f"{bucket}/data/{storage.basename(prefix)}"
        for ext in (".bin", ".idx"):
            storage.put_file(prefix + ext, remote + ext)
        prefixes.append(remote)
    tokenizer = f"{bucket}/data/tokenizer.model"
    storage.put_file(dataset["tokenizer_model"], tokenizer)
    weights = dataset["blend"][0::2]
    return {"blend": [x for w, p in zip(weights, prefixes) for x in (w, p)], "tokenizer_model": tokenizer}


def _trainer(config_uri: str, home, **env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "workloads.train", "--config", config_uri],
        cwd=REPO,
        env=trainer_env(NEMOFLOW_HOME=str(home), **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
@pytest.mark.gcs
@pytest.mark.faults
def test_gs_run_dir_preempted_on_one_node_resumes_on_another(gcs_bucket, tmp_path, train_dataset, reference_run):
    row = fault_ledger.open_row("training job pre-empted (SIGTERM) with a gs:// run dir, resumed on another node")
    from infra import storage

    remote = _upload_dataset(gcs_bucket, train_dataset)
    run_dir = f"{gcs_bucket}/runs/tiny"
    config = tiny_config(remote, run_dir)
    config_uri = f"{run_dir}/train_config.request.json"
    storage.write_text(config_uri, json.dumps(config))

    # node A: pre-empted after step 6 (SIGTERM): it saves, uploads and exits 76
    node_a = _trainer(config_uri, tmp_path / "node-a", **failpoints.env(train__pause_after_step=6))
    seen = []
    try:
        deadline = time.monotonic() + 300
        for line in node_a.stdout:
            seen.append(line)
            if line.startswith("step=6 "):
                node_a.send_signal(signal.SIGTERM)
                row.injected += 1
            assert time.monotonic() < deadline, "".join(seen)
        node_a.wait(timeout=120)
    finally:
        node_a.kill()
    assert node_a.returncode == EXIT_PREEMPTED, "".join(seen)
    from workloads.staging import RunMirror

    uploaded = RunMirror(run_dir).saved()  # the saved (resumable) checkpoints in the bucket
    assert [c.step for c in uploaded] == [4, 6], uploaded
    assert all(c.step_dir.startswith(run_dir + "/checkpoints/") for c in uploaded)
    assert ckpt.stored_checkpoints(run_dir) == []  # a pre-empted job exports nothing

    # node B: an empty disk; it pulls the newest uploaded checkpoint and finishes the run
    node_b = _trainer(config_uri, tmp_path / "node-b")
    out, _ = node_b.communicate(timeout=600)
    assert node_b.returncode == 0, out
    assert f"resuming from {run_dir}/checkpoints/epoch_0_step_5" in out, out
    assert "at step 6 (consumed_samples=48)" in out, out
    metrics = [json.loads(line) for line in storage.read_text(f"{run_dir}/metrics.jsonl").splitlines()]
    # the same data order, optimizer, schedule and RNG across nodes: the uninterrupted run's numbers
    assert deterministic_part(metrics) == deterministic_part(reference_run["metrics"])
    # save_top_k applies to the bucket: the checkpoints the uninterrupted run kept, each complete
    kept = [storage.basename(c.step_dir) for c in RunMirror(run_dir).saved()]
    assert kept == [p.name for p in ckpt.step_dirs(reference_run["run_dir"])], kept
    # and the exports (best and last) are uploaded as the local run makes them
    exported = [storage.basename(c.step_dir) for c in ckpt.stored_checkpoints(run_dir)]
    assert exported == [c.step_dir.name for c in ckpt.list_checkpoints(reference_run["run_dir"])], exported
    assert not storage.exists(f"{run_dir}/checkpoints/{ckpt.step_dir_name(6)}"), "the pruned one is gone remotely"
    assert json.loads(storage.read_text(f"{run_dir}/train_config.json"))["run_dir"] == run_dir
    best = ckpt.best_of(ckpt.stored_checkpoints(run_dir))
    assert best.meta["data_prefix"] == remote["blend"], "meta.json records the gs:// blend"
    # the dataset was staged once per node, next to nothing else
    staged = sorted(p.name for p in (tmp_path / "node-b" / "cache" / "stage").rglob("*.bin"))
    assert staged == sorted(storage.basename(p) + ".bin" for p in remote["blend"][1::2]), staged

    # the validator reads the gs:// checkpoint (a copy by its manifest) and writes its report to the bucket
    report_uri = f"{run_dir}/validation/best.json"
    validated = subprocess.run(
        [sys.executable, "-m", "workloads.validate_checkpoint", best.uri, "--threshold", "20", "--output", report_uri],
        cwd=REPO,
        env=trainer_env(NEMOFLOW_HOME=str(tmp_path / "node-c")),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert validated.returncode == 0, validated.stdout + validated.stderr
    report = storage.read_json(report_uri)
    assert report["passed"] and report["checkpoint"] == best.uri, report
    assert report["data_prefix"] == remote["blend"], "the report names the held-out data as given"


def test_gs_run_dir_needs_one_node(tmp_path):
    from infra.configs.train import TrainConfig
    from workloads.train.launch import run_mirror

    data = {"blend": [1.0, "gs://b/data/x_text_document"], "tokenizer_model": "gs://b/data/tokenizer.model"}
    one = TrainConfig(**tiny_config(data, "gs://b/runs/one"))
    assert run_mirror(one).uri == "gs://b/runs/one"
    assert run_mirror(TrainConfig(**tiny_config(data, tmp_path / "run"))) is None
    with pytest.raises(ValueError, match=r"gs://b/runs/two is in object storage, which needs the run on one node"):
        run_mirror(TrainConfig(**tiny_config(data, "gs://b/runs/two", num_nodes=2)))
