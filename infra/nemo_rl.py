"""NeMo-RL's DPO on Slurm, rendered (never run here): the config YAML and the sbatch launch of a Ray cluster.

    nemoflow render-dpo --model /shared/models/sft --data /shared/prefs.jsonl --preset hcc-a3m --nodes 2 \\
        --container /shared/nemo-rl.sqsh --out dpo/

NeMo AutoModel 0.7.0 has no preference-optimization recipe, and NVIDIA's library that has one,
NeMo-RL, needs Python >= 3.13 and CUDA: it cannot run next to nemoflow (Python 3.11) nor on CPU.
So nemoflow writes what the seeds' ``sbatch launch.sh --cluster_type ... --job_script
algorithms/dpo.sh`` submits, in our own template (infra/slurm/templates/nemo_rl_ray.sbatch.j2):

* ``dpo.yaml``: NeMo-RL's DPO ``MasterConfig`` (policy, data, dpo, logger, cluster, checkpointing)
  built from :class:`DpoConfig`, a model of the fields nemoflow sets, and checked by
  :func:`check_config` against NeMo-RL's own schema, extracted from its source into
  infra/nemo_rl_dpo_schema.json and written as the JSON Schema infra/nemo_rl_dpo.schema.json
  (devtools/nemo_rl_schema.py), validated with ``jsonschema``: every key must be one NeMo-RL
  defines, every required key present, every value of the declared type;
* ``dpo.sbatch``: one allocation of N nodes x the preset's GPUs; a Ray head on the first node and a
  Ray worker on every other (``srun --overlap`` in the NeMo-RL container, pyxis), the preset's NCCL
  environment, then the driver ``examples/run_dpo.py`` on the head. Output layout, as the seeds':
  ``<out>/<job_id>/checkpoints``, ``<out>/<job_id>/ray-logs/<node>/`` and
  ``<out>/<job_id>/nemo_rl_output.log``.

The preference data is NeMo-RL's ``BinaryPreferenceDataset`` JSONL (``prompt``, ``chosen``,
``rejected``); workloads/chat_data.py makes a demo set from the KJV.
"""

from __future__ import annotations

import json
import shlex
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_FILE = Path(__file__).with_name("nemo_rl_dpo_schema.json")
JSON_SCHEMA_FILE = Path(__file__).with_name("nemo_rl_dpo.schema.json")
NEMO_RL_DIR = "/opt/nemo-rl"  # where the NeMo-RL container holds the repository (its examples/)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DpoSection(_Model):
    max_num_epochs: int = 1
    max_num_steps: int = 150
    val_period: int = 25
    val_batches: int = 8
    val_global_batch_size: int = 8
    val_micro_batch_size: int = 1
    val_at_start: bool = True
    val_at_end: bool = True
    seed: int = 42
    reference_policy_kl_penalty: float = 0.05
    preference_average_log_probs: bool = False
    sft_average_log_probs: bool = False
    preference_loss_weight: float = 1.0
    sft_loss_weight: float = 0.0


class Checkpointing(_Model):
    enabled: bool = True
    checkpoint_dir: str = "results/dpo"  # the launch script overrides it with <out>/<job_id>/checkpoints
    metric_name: str | None = "val:validation-default_loss"
    higher_is_better: bool = False
    keep_top_k: int = 3
    save_period: int = 50


class Tokenizer(_Model):
    name: str


class DTensor(_Model):
    enabled: Literal[True] = True
    tensor_parallel_size: int = 1
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    activation_checkpointing: bool = False
    cpu_offload: bool = False


class Disabled(_Model):
    enabled: Literal[False] = False


class Optimizer(_Model):
    name: str = "torch.optim.AdamW"
    kwargs: dict[str, Any] = Field(
        default_factory=lambda: {
            "lr": 5.0e-6,
            "weight_decay": 0.1,
            "betas": [0.9, 0.98],
            "eps": 1e-5,
            "foreach": False,
            "fused": False,
        }
    )


class Policy(_Model):
    model_name: str
    tokenizer: Tokenizer
    train_global_batch_size: int = 128
    train_micro_batch_size: int = 2
    max_total_sequence_length: int = 1024
    precision: str = "bfloat16"
    dtensor_cfg: DTensor = Field(default_factory=DTensor)
    dynamic_batching: Disabled = Field(default_factory=Disabled)
    sequence_packing: Disabled = Field(default_factory=Disabled)
    make_sequence_length_divisible_by: int = 1
    max_grad_norm: float = 1.0
    optimizer: Optimizer = Field(default_factory=Optimizer)


class PreferenceData(_Model):
    """NeMo-RL's BinaryPreferenceDataset: a JSONL of {prompt, chosen, rejected}."""

    dataset_name: str = "BinaryPreferenceDataset"
    data_path: str
    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"


class Data(_Model):
    max_input_seq_length: int | None = 1024
    shuffle: bool = True
    num_workers: int = 1
    train: PreferenceData
    validation: PreferenceData | None = None


class WandbSection(_Model):
    project: str = "nemoflow-dpo"
    name: str = "dpo"


class GpuMonitoring(_Model):
    collection_interval: int = 10
    flush_interval: int = 10


class Logger(_Model):
    log_dir: str = "logs"
    wandb_enabled: bool = False
    swanlab_enabled: bool = False
    tensorboard_enabled: bool = False
    mlflow_enabled: bool = False
    monitor_gpus: bool = True
    wandb: WandbSection = Field(default_factory=WandbSection)
    gpu_monitoring: GpuMonitoring = Field(default_factory=GpuMonitoring)


class Cluster(_Model):
    gpus_per_node: int = 8
    num_nodes: int = 1


class DpoConfig(_Model):
    """NeMo-RL's DPO MasterConfig, the fields nemoflow sets (the rest keep NeMo-RL's defaults)."""

    policy: Policy
    data: Data
    dpo: DpoSection = Field(default_factory=DpoSection)
    logger: Logger = Field(default_factory=Logger)
    cluster: Cluster = Field(default_factory=Cluster)
    checkpointing: Checkpointing = Field(default_factory=Checkpointing)

    def to_nemo_rl(self) -> dict:
        """The YAML mapping run_dpo.py reads (None-valued optional sections left out)."""
        return self.model_dump(mode="json", exclude_none=True)


# ------------------------------------------------------------------ NeMo-RL's schema
class SchemaMismatch(ValueError):
    """The config does not match NeMo-RL's schema; the message lists every problem with its key path."""


@lru_cache(maxsize=1)
def load_schema() -> dict:
    """The extracted record of NeMo-RL's config classes (devtools/nemo_rl_schema.py)."""
    return json.loads(SCHEMA_FILE.read_text())


@lru_cache(maxsize=1)
def load_json_schema() -> dict:
    """The same schema as a JSON Schema (devtools/nemo_rl_schema.py writes both)."""
    return json.loads(JSON_SCHEMA_FILE.read_text())


def _validator(schema: dict):
    import jsonschema

    # NeMo-RL's int is Python's int: 8.0 is not one (JSON Schema's "integer" would accept it).
    strict_int = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _, value: isinstance(value, int) and not isinstance(value, bool)
    )
    cls = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=strict_int)
    return cls(schema)


def _problems(error) -> list[str]:
    """One validation error as lines ``key.path: what is wrong``, naming NeMo-RL's class or annotation."""
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".")
    prefix = f"{path}." if path else ""
    title = error.schema.get("title", "")
    if error.validator == "additionalProperties" and error.schema.get("additionalProperties") is False:
        fields = error.schema.get("properties", {})
        return [
            f"{prefix}{key}: not a field of NeMo-RL's {title} ({', '.join(sorted(fields))})"
            for key in error.instance
            if key not in fields
        ]
    if error.validator == "required":
        return [
            f"{prefix}{key}: required by NeMo-RL's {title}, missing"
            for key in error.validator_value
            if key not in error.instance
        ]
    expected = error.schema.get("x-annotation")
    return [f"{path}: {error.instance!r} is not {expected}" if expected else f"{path}: {error.message}"]


def check_config(config: dict, schema: dict | None = None) -> None:
    """Raise :class:`SchemaMismatch` unless ``config`` matches NeMo-RL's DPO MasterConfig exactly.

    ``schema``: a JSON Schema (default: NeMo-RL's, ``load_json_schema()``), checked with ``jsonschema``.
    """
    schema = schema or load_json_schema()
    errors = sorted(_validator(schema).iter_errors(config), key=lambda e: [str(p) for p in e.absolute_path])
    problems = [line for error in errors for line in _problems(error)]
    if problems:
        raise SchemaMismatch(
            f"the DPO config does not match NeMo-RL's schema ({schema.get('x-source')}@{str(schema.get('x-commit'))[:12]}): "
            + "; ".join(problems)
        )


# ------------------------------------------------------------------ the launch
class RayLaunch(_Model):
    """Where and how the DPO job runs (sbatch names, like infra/slurm/options.py)."""

    job_name: str = "nemoflow-dpo"
    nodes: int = Field(1, ge=1)
    gpus_per_node: int | None = Field(None, ge=1, description="default: the preset's")
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "04:00:00"
    container: str = Field(..., description="the NeMo-RL container (.sqsh or docker reference, pyxis)")
    mounts: list[str] = Field(default_factory=list, description="'src:dst[:ro]'; the output and data dirs are added")
    out_dir: str = Field(..., description="shared directory; each job writes <out_dir>/<job_id>/")
    config_path: str = Field(..., description="where dpo.yaml is, as the nodes see it")
    nemo_rl_dir: str = NEMO_RL_DIR
    ray_port: int = 6379
    ray_ready_timeout_s: int = 600


def render_sbatch(launch: RayLaunch, preset_name: str | None = None) -> str:
    """The sbatch script (pure: no secrets; WANDB_API_KEY / HF_TOKEN reach the job through sbatch's environment)."""
    import jinja2

    from infra.slurm.options import PRESETS
    from infra.slurm.script import TEMPLATES

    preset = PRESETS[preset_name] if preset_name else None
    gpus = launch.gpus_per_node or (preset.gpus_per_node if preset else 8)
    partition = launch.partition or (preset.partition if preset else None)
    mounts = [
        *launch.mounts,
        f"{launch.out_dir}:{launch.out_dir}",
        f"{Path(launch.config_path).parent}:{Path(launch.config_path).parent}:ro",
    ]
    container = [
        f"--container-image={launch.container}",
        "--container-mounts=" + ",".join(dict.fromkeys(mounts)),
        "--no-container-mount-home",
    ]
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined, keep_trailing_newline=True
    )
    env.filters["quote"] = lambda value: shlex.quote(str(value))
    return env.get_template("nemo_rl_ray.sbatch.j2").render(
        launch=launch,
        gpus=gpus,
        partition=partition,
        preset=preset,
        container=" ".join(shlex.quote(c) for c in container),
    )
