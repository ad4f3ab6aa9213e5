"""`nemoflow render-dpo`: NeMo-RL's DPO config checked against NeMo-RL's own schema, and the Ray launch on Slurm.

NeMo-RL needs Python >= 3.13 and GPUs: these files are rendered and checked here, never run."""

from __future__ import annotations

import copy
import json
import subprocess

import pytest
import yaml

from infra import nemo_rl
from nemoflow.cli import main


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo")
    argv = "render-dpo --model /shared/models/sft-1 --demo-data --container /shared/nemo-rl.sqsh --preset hcc-a3m"
    code = main([*argv.split(), "--nodes", "2", "--max-steps", "40", "--wandb-project", "align", "--out", str(out)])
    assert code == 0
    return out


def test_the_rendered_config_has_exactly_nemo_rls_keys_and_types(rendered):
    config = yaml.safe_load((rendered / "dpo.yaml").read_text())
    nemo_rl.check_config(config)  # raises on any unknown key, missing required key or wrong type
    schema = nemo_rl.load_schema()
    assert schema["source"] == "NVIDIA-NeMo/RL" and len(schema["commit"]) == 40
    assert set(config) == set(schema["classes"]["MasterConfig"]["fields"])
    assert config["cluster"] == {"gpus_per_node": 8, "num_nodes": 2}  # the preset's GPUs
    assert config["dpo"]["max_num_steps"] == 40 and config["logger"]["wandb_enabled"] is True
    assert config["data"]["train"]["dataset_name"] == "BinaryPreferenceDataset"
    assert config["data"]["train"]["data_path"] == str(rendered / "prefs.jsonl")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c["dpo"].update(max_num_step=10), r"dpo\.max_num_step: not a field of NeMo-RL's DPOConfig"),
        (
            lambda c: c["policy"].update(train_global_batch_size="128"),
            r"policy\.train_global_batch_size: '128' is not int",
        ),
        (lambda c: c["policy"].pop("model_name"), r"policy\.model_name: required by NeMo-RL's PolicyConfig, missing"),
        (
            lambda c: c["policy"]["dtensor_cfg"].pop("tensor_parallel_size"),
            r"policy\.dtensor_cfg: .* is not DTensorConfig \| DTensorConfigDisabled",
        ),
        (lambda c: c["cluster"].update(gpus_per_node=8.5), r"cluster\.gpus_per_node: 8\.5 is not int"),
        # JSON Schema's "integer" takes 8.0; NeMo-RL's int does not, and a bool is not an int either
        (lambda c: c["cluster"].update(gpus_per_node=8.0), r"cluster\.gpus_per_node: 8\.0 is not int"),
        (lambda c: c["cluster"].update(num_nodes=True), r"cluster\.num_nodes: True is not int"),
        (lambda c: c.update(logger=5), r"logger: 5 is not LoggerConfig"),
        (lambda c: c["logger"].pop("gpu_monitoring"), r"logger\.gpu_monitoring: required by NeMo-RL's LoggerConfig"),
        (lambda c: c.update(sft={}), r"sft: not a field of NeMo-RL's MasterConfig"),
    ],
)
def test_a_config_nemo_rl_would_reject_is_refused_naming_the_key(rendered, change, message):
    config = copy.deepcopy(yaml.safe_load((rendered / "dpo.yaml").read_text()))
    change(config)
    with pytest.raises(nemo_rl.SchemaMismatch, match=message):
        nemo_rl.check_config(config)


def test_the_shipped_json_schema_is_the_one_built_from_the_extracted_record():
    import jsonschema

    from devtools.nemo_rl_schema import json_schema

    shipped = nemo_rl.load_json_schema()
    jsonschema.Draft202012Validator.check_schema(shipped)
    assert shipped == json_schema(nemo_rl.load_schema())  # re-run: python -m devtools.nemo_rl_schema --from-record
    assert shipped["$defs"]["ClusterConfig"]["additionalProperties"] is False


def test_the_schema_extractor_reads_typeddicts_and_pydantic_models():
    from devtools.nemo_rl_schema import classes_of

    source = (
        "from typing import NotRequired, TypedDict\n"
        "from pydantic import BaseModel\n"
        "Alias = dict[str, list[int]]\n"
        "class A(TypedDict):\n    x: int\n    y: NotRequired[str | None]\n"
        "class B(TypedDict, total=False):\n    z: bool\n"
        "class C(BaseModel, extra='allow'):\n    a: A\n    n: int = 3\n"
        "class NotAConfig:\n    q: int\n"
    )
    classes = classes_of(source)
    assert classes["A"]["fields"] == {
        "x": {"type": "int", "required": True},
        "y": {"type": "str | None", "required": False},
    }
    assert classes["B"]["fields"]["z"]["required"] is False
    assert classes["C"]["fields"] == {"a": {"type": "A", "required": True}, "n": {"type": "int", "required": False}}
    assert classes["C"]["extra_allowed"] and "NotAConfig" not in classes
    assert classes["Alias"] == {"kind": "alias", "type": "dict[str, list[int]]"}


def test_the_launch_is_a_ray_cluster_with_the_seeds_output_layout(rendered):
    script = (rendered / "dpo.sbatch").read_text()
    assert subprocess.run(["bash", "-n", str(rendered / "dpo.sbatch")]).returncode == 0
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=a3mega", "#SBATCH --exclusive"):
        assert line in script
    # the preset's network environment (A3 Mega: FasTrak) and setup
    assert "export NCCL_FASTRAK_IFNAME=" in script and "/var/lib/tcpxo/lib64" in script
    # Ray: the head on the first node, a worker on each other node, all in the container
    assert "ray start --head" in script and 'for node in "${NODES[@]:1}"' in script
    assert 'ray start --address="$HEAD_IP:$RAY_PORT"' in script
    assert "--container-image=/shared/nemo-rl.sqsh" in script
    assert f"{rendered}:{rendered}" in script and "/shared/models/sft-1:/shared/models/sft-1:ro" in script
    # the driver, and the layout <out>/<job_id>/{checkpoints,ray-logs,nemo_rl_output.log}
    assert f'OUT={rendered}/"$SLURM_JOB_ID"' in script
    assert "examples/run_dpo.py" in script and f"--config {rendered / 'dpo.yaml'}" in script
    assert "checkpointing.checkpoint_dir=$OUT/checkpoints" in script
    assert 'tee "$OUT/nemo_rl_output.log"' in script and "$OUT/ray-logs/" in script
    assert "WANDB_API_KEY=" not in script


def test_demo_preference_pairs_are_real_continuations(rendered):
    from workloads.chat_data import CONTINUE_PREFIX, kjv_verses

    rows = [json.loads(line) for line in (rendered / "prefs.jsonl").read_text().splitlines()]
    assert len(rows) == 1000
    verses = {v["text"] for v in kjv_verses()}
    for row in rows[:50]:
        start = row["prompt"].removeprefix(CONTINUE_PREFIX).split(": ", 1)[1]
        assert f"{start} {row['chosen']}" in verses
        assert row["rejected"] != row["chosen"]


def test_an_unknown_preset_is_one_line(tmp_path, capsys):
    code = main(
        [
            "render-dpo",
            "--model",
            "m",
            "--demo-data",
            "--container",
            "c.sqsh",
            "--preset",
            "hcc-z9",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 2
    assert "unknown --preset 'hcc-z9'" in capsys.readouterr().err
