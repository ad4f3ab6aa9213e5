"""The jobs one pipeline run submits, as specs, without running anything.

``nemoflow render`` turns these into manifests for review. PROVISIONAL: the
specs are built here from a config dict; the stage modules (tasks/) will build
them from their real inputs and this function will call into them. Keep the
signature: ``planned_specs(config=None) -> list[JobSpec | ServiceSpec]``.

Config keys (all optional): ``image``, ``workspace`` (the shared directory,
``/nemo-workspace``), ``run_name``, ``file_groups`` (array size of the
tokenize step), ``nodes``, ``gpus_per_node``, ``tensor_parallel``,
``train_time`` (sbatch syntax), ``mem``, ``port``.
"""

from __future__ import annotations

from typing import Any

from infra.jobs import JobSpec, Resources, ServiceSpec

DEFAULTS: dict[str, Any] = {
    "image": "nvcr.io/nvidia/nemo:25.02",
    "workspace": "/nemo-workspace",
    "run_name": "nemoflow",
    "file_groups": 4,
    "nodes": 1,
    "gpus_per_node": 0,
    "tensor_parallel": 1,
    "train_time": "04:00:00",
    "mem": None,
    "port": 8000,
}


def planned_specs(config: dict[str, Any] | None = None) -> list[JobSpec | ServiceSpec]:
    """The tokenize array job, the training job and the inference service of one run."""
    unknown = set(config or {}) - set(DEFAULTS) - {"k8s"}
    if unknown:
        raise ValueError(f"unknown plan config keys: {', '.join(sorted(unknown))}; known: {', '.join(DEFAULTS)}")
    c = {**DEFAULTS, **{k: v for k, v in (config or {}).items() if k != "k8s"}}
    run_dir = f"{c['workspace'].rstrip('/')}/runs/{c['run_name']}"
    tokenize = JobSpec(
        name=f"{c['run_name']}-tokenize",
        command=[
            "python",
            "-m",
            "workloads.tokenize",
            "--input-list",
            f"{run_dir}/data/file-groups.json",
            "--output-dir",
            f"{run_dir}/data/tokenized",
        ],
        secret_env=["HF_TOKEN"],
        resources=Resources(cpus_per_task=4, mem=c["mem"]),
        container_image=c["image"],
        array_size=int(c["file_groups"]),
    )
    train = JobSpec(
        name=f"{c['run_name']}-train",
        command=["python", "-m", "workloads.train", "--config", f"{run_dir}/train/train.json"],
        secret_env=["HF_TOKEN", "WANDB_API_KEY"],
        resources=Resources(
            nodes=int(c["nodes"]),
            gpus_per_node=int(c["gpus_per_node"]),
            ntasks_per_node=max(1, int(c["gpus_per_node"])),
            cpus_per_task=8,
            mem=c["mem"],
            time=c["train_time"],
        ),
        container_image=c["image"],
    )
    serve = ServiceSpec(
        name=f"{c['run_name']}-serve",
        command=[
            "python",
            "-m",
            "workloads.serve",
            "--checkpoint",
            f"{run_dir}/train/checkpoints/latest",
            "--port",
            str(c["port"]),
        ],
        port=int(c["port"]),
        secret_env=["HF_TOKEN"],
        resources=Resources(gpus_per_node=int(c["tensor_parallel"]) if int(c["gpus_per_node"]) else 0, cpus_per_task=4),
        container_image=c["image"],
    )
    return [tokenize, train, serve]
