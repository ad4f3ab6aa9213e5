"""The command engine for real: a user's script, driven only by the contract's environment variables, trains
with the installed engine (NeMo AutoModel) and writes checkpoints; the pretrain stage finds the newest and
converts a non-Hugging Face one with the configured converter (local executor, a real Prefect server)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tasks.train_engines.command import Command, newest_checkpoint, step_of
from workloads.command_run import child_environment

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory, kjv_chapters, mixtral_tokenizer_model):
    """A DatasetRef over two real Megatron indexed datasets (KJV chapters, Mixtral's tokenizer)."""
    from tests.support.kjv_dataset import small_dataset_ref

    return small_dataset_ref(tmp_path_factory.mktemp("cmd-data"), kjv_chapters, mixtral_tokenizer_model)


def _in_a_flow(fn):
    from prefect import flow

    return flow(name="command-engine-test")(fn)()


@pytest.mark.slow
@pytest.mark.prefect
def test_a_users_script_trains_from_the_contract_and_the_newest_checkpoint_is_found(
    prefect_server, work_dir, small_dataset
):
    from tasks.train import pretrain

    config = Command(command=[sys.executable, str(HERE / "env_trainer.py")], seq_length=64, cpus_per_task=1)
    ref = _in_a_flow(lambda: pretrain(config, small_dataset))

    run_dir = Path(ref.run_dir)
    assert run_dir.parent == work_dir / "runs" and run_dir.name.startswith("cmd-")
    # the script built its config from the contract alone: NeMo's data_prefix string, the tokenizer
    mine = json.loads((run_dir / "my_config.json").read_text())
    assert mine["data_prefix"] == small_dataset.blend
    assert mine["tokenizer_model"] == small_dataset.tokenizer.model and mine["seq_length"] == 64
    # AutoModel wrote checkpoints at steps 3 and 6; the newest is the result, already Hugging Face (consolidated)
    assert ref.step == 5 and Path(ref.uri) == run_dir / "checkpoints" / "epoch_0_step_5" / "model" / "consolidated"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ref.uri)
    assert model.config.hidden_size == 64
    log = (run_dir / "metrics.jsonl").read_text()
    assert '"step": 6' in log


@pytest.mark.prefect
@pytest.mark.slow
def test_a_checkpoint_in_another_layout_is_converted_by_the_converter(prefect_server, work_dir, small_dataset):
    import torch
    from transformers import AutoModelForCausalLM

    from tasks.train import pretrain
    from tasks.train_engines.command import NoCheckpoint

    trainer = [sys.executable, str(HERE / "pt_trainer.py")]
    converter = {"command": [sys.executable, str(HERE / "pt_to_hf.py"), "{checkpoint}", "{output}"]}
    ref = _in_a_flow(lambda: pretrain(Command(command=trainer, converter=converter), small_dataset))
    assert ref.step == 5 and ref.uri.endswith("/hf/iter_0000005")
    model = AutoModelForCausalLM.from_pretrained(ref.uri)
    assert torch.allclose(model.lm_head.weight, torch.full_like(model.lm_head.weight, 0.05))  # step 5's weights
    # what validation, serving and the registry read, added where the converter left it out
    from workloads.checkpoint import verify_manifest

    hf = Path(ref.uri)
    meta = json.loads((hf / "meta.json").read_text())
    assert meta["data_prefix"] == small_dataset.blend and meta["step"] == 5
    assert meta["seq_length"] == model.config.max_position_embeddings  # no seq_length given: the model's
    assert (hf / "tokenizer.model").read_bytes() == Path(small_dataset.tokenizer.model).read_bytes()
    assert verify_manifest(hf) == [] and "model.safetensors" in json.loads((hf / "MANIFEST.json").read_text())["files"]

    # without a converter: one error naming the checkpoint and the option
    with pytest.raises(NoCheckpoint, match=r"iter_0000005 is not in the Hugging Face layout.*set converter"):
        _in_a_flow(lambda: pretrain.with_options(retries=0)(Command(command=trainer, env={"X": "1"}), small_dataset))


def test_newest_checkpoint_by_step_across_layouts(tmp_path):
    for name in ("iter_0000090", "iter_0000100", "model--step=99-consumed_samples=800.0", "checkpoint-7"):
        (tmp_path / name / "weights").mkdir(parents=True)
    (tmp_path / "iter_0000100" / "iter_0000999-not-a-checkpoint").mkdir()  # nested: ignored
    (tmp_path / ".tmp-iter_0000200").mkdir()  # being written: ignored
    path, step = newest_checkpoint(tmp_path)
    assert (path.name, step) == ("iter_0000100", 100)
    assert step_of("epoch_1_step_41") == 41
    with pytest.raises(Exception, match="no checkpoint under"):
        newest_checkpoint(tmp_path / "iter_0000090")


def test_rank_layout_for_one_node_and_under_a_multinode_launch():
    one = child_environment({"NEMOFLOW_NNODES": "1", "NEMOFLOW_NPROC_PER_NODE": "2", "PATH": "/bin"})
    assert one["NNODES"] == "1" and one["NPROC_PER_NODE"] == "2" and one["NODE_RANK"] == "0"
    assert one["MASTER_ADDR"] == "127.0.0.1" and int(one["MASTER_PORT"]) > 0
    # node 2 of 4 under the Slurm backend's torchrun (one launcher per node): torchrun's own variables are gone
    under = child_environment(
        {
            "NEMOFLOW_NNODES": "4",
            "NEMOFLOW_NPROC_PER_NODE": "8",
            "GROUP_RANK": "2",
            "RANK": "2",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "0",
            "TORCHELASTIC_RUN_ID": "123",
            "MASTER_ADDR": "gpu-001",
            "MASTER_PORT": "29500",
        }
    )
    assert {k: under[k] for k in ("NNODES", "NPROC_PER_NODE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")} == {
        "NNODES": "4",
        "NPROC_PER_NODE": "8",
        "NODE_RANK": "2",
        "MASTER_ADDR": "gpu-001",
        "MASTER_PORT": "29501",
    }
    assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"} & set(under)
    # a Kubernetes Indexed Job pod: the backend's NODE_RANK / MASTER_* as they are
    pod = child_environment(
        {"NNODES": "2", "NPROC_PER_NODE": "8", "NODE_RANK": "1", "MASTER_ADDR": "j-0.j", "MASTER_PORT": "29500"}
    )
    assert (pod["NODE_RANK"], pod["MASTER_ADDR"], pod["MASTER_PORT"]) == ("1", "j-0.j", "29500")


def test_the_contract_in_a_rendered_slurm_job(small_dataset, tmp_path):
    """Two nodes on Slurm: one launcher per node, the contract's variables exported, secrets by name only."""
    from infra.executors import SlurmExecutor, get_backend
    from tasks.train_engines.command import build_command_job

    config = Command(command="python run.py -e slurm -n $NNODES", num_nodes=2, gpus_per_node=8, env={"EXTRA": "1"})
    spec = build_command_job(config, small_dataset, str(tmp_path / "run"))
    script = next(iter(get_backend(SlurmExecutor(partition="gpu")).render(spec).values()))
    assert "--nproc-per-node=1" in script and "--nodes=2" in script
    assert f"export NEMOFLOW_DATA_PREFIX='0.6 {small_dataset.prefixes[0]} 0.4 {small_dataset.prefixes[1]}'" in script
    assert "export NEMOFLOW_NPROC_PER_NODE=8" in script
    assert f"export NEMOFLOW_CHECKPOINT_DIR={tmp_path / 'run' / 'checkpoints'}" in script
    assert "-m workloads.command_run --shell -- 'python run.py -e slurm -n $NNODES'" in script
    assert "WANDB_API_KEY=" not in script
    assert os.environ.get("WANDB_API_KEY", "unset-key-value") not in script
