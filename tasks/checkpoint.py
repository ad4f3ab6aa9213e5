"""Checkpoint validation stage: files, checksums, weights, held-out loss; stop the flow on failure.

    from tasks.checkpoint import validate_checkpoint
    report = validate_checkpoint(ckpt, dataset, threshold=7.5, executor="slurm", image=image)

The validator (``python -m workloads.validate_checkpoint``) runs as a job,
since on a cluster it needs a GPU node; it writes a JSON report next to the
run's checkpoints, which this task reads, publishes as a table artifact and
turns into an error naming the failed checks, so nothing is deployed from a
checkpoint that failed.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, Field

from infra import storage
from infra.configs.train import parse_blend
from infra.executors import Executor
from infra.jobs import ImageRef, JobSpec, Resources, workload_job
from tasks.common import cache_policy, logger, transient_only
from tasks.gpu_time import run_timed
from tasks.refs import CheckpointRef, DatasetRef

DEFAULT_RESOURCES = Resources(cpus_per_task=2, time="01:00:00")


class ValidationCheck(BaseModel):
    name: str
    passed: bool
    detail: str


class ValidationReport(BaseModel):
    checkpoint: str
    passed: bool
    checks: list[ValidationCheck]
    failed: list[str] = Field(default_factory=list)
    val_loss: float | None = None
    untrained_loss: float | None = None
    threshold: float
    files: list[str] = Field(default_factory=list)
    sizes: dict[str, int] = Field(default_factory=dict)
    total_bytes: int = 0
    report_uri: str | None = None


class CheckpointValidationFailed(RuntimeError):
    def __init__(self, report: ValidationReport):
        self.report = report
        failed = [c for c in report.checks if not c.passed]
        super().__init__(
            f"checkpoint {report.checkpoint} failed {len(failed)} check(s): "
            + "; ".join(f"{c.name} ({c.detail})" for c in failed)
        )


def report_path(ckpt: CheckpointRef, threshold: float) -> str:
    """``<run_dir>/validation/<checkpoint>-<tag>.json``, a path or a gs:// URI like the run directory."""
    directory = storage.normalize(ckpt.uri)
    run_dir = ckpt.run_dir or storage.parent(storage.parent(directory))
    tag = hashlib.sha256(f"{directory}|{threshold}".encode()).hexdigest()[:8]
    return storage.join(storage.normalize(run_dir), "validation", f"{storage.basename(directory)}-{tag}.json")


def build_validate_job(
    ckpt: CheckpointRef,
    dataset: DatasetRef,
    threshold: float,
    output: str,
    image: ImageRef | None = None,
    num_batches: int = 8,
    resources: Resources | None = None,
) -> JobSpec:
    ckpt_dir = storage.normalize(ckpt.uri)  # a gs:// checkpoint is staged in by the validator itself
    args = [
        ckpt_dir,
        "--threshold",
        repr(float(threshold)),
        "--data-prefix",
        json.dumps(dataset.blend),
        "--num-batches",
        str(num_batches),
        "--output",
        output,
        "--exit-zero",
    ]
    data = [os.path.dirname(storage.local_path(p)) for p in parse_blend(dataset.blend)[0] if storage.is_local(p)]
    if dataset.tokenizer.model:
        args += ["--tokenizer-model", dataset.tokenizer.model]
        if storage.is_local(dataset.tokenizer.model):
            data.append(os.path.dirname(storage.local_path(dataset.tokenizer.model)))
    return workload_job(
        "validate-" + hashlib.sha256(output.encode()).hexdigest()[:10],
        "workloads.validate_checkpoint",
        args,
        image=image,
        resources=resources or DEFAULT_RESOURCES,
        # what the job reads and writes on shared storage (gs:// it reaches itself)
        paths=[os.path.dirname(output)] if storage.is_local(output) else [],
        read_only=sorted({*([ckpt_dir] if storage.is_local(ckpt_dir) else []), *data}),
    )


def report_markdown(report: ValidationReport) -> str:
    verdict = "PASSED" if report.passed else "FAILED: " + ", ".join(report.failed)
    lines = [
        f"# Checkpoint validation: {verdict}",
        "",
        f"checkpoint `{report.checkpoint}`; held-out loss `{report.val_loss}` "
        f"(untrained `{report.untrained_loss}`, threshold `{report.threshold}`); "
        f"{len(report.files)} files, {report.total_bytes / 1e6:.1f} MB",
        "",
        "| check | passed | detail |",
        "|---|---|---|",
    ]
    for check in report.checks:
        detail = check.detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {check.name} | {'yes' if check.passed else '**NO**'} | {detail} |")
    return "\n".join(lines)


@task(
    name="validate-checkpoint",
    task_run_name="validate step {ckpt.step}",
    retries=1,
    retry_delay_seconds=10,
    retry_condition_fn=transient_only(CheckpointValidationFailed),  # not a checkpoint that failed its checks
    cache_policy=cache_policy(
        "workloads.validate_checkpoint", "workloads.checkpoint", "workloads.staging", "tasks.checkpoint"
    ),
    persist_result=True,
)
def validate_checkpoint(
    ckpt: CheckpointRef,
    dataset: DatasetRef,
    threshold: float,
    executor: Executor | Any = None,
    image: ImageRef | None = None,
    num_batches: int = 8,
    resources: Resources | None = None,
) -> ValidationReport:
    """Validate a checkpoint; raises :class:`CheckpointValidationFailed` naming the failed checks."""
    log = logger()
    output = report_path(ckpt, threshold)
    storage.makedirs(storage.parent(output))
    job = build_validate_job(ckpt, dataset, threshold, output, image, num_batches, resources)
    run_timed(job, executor, beside=storage.parent(output))  # timed for the run's gpu-time artifact
    report = ValidationReport.model_validate({**storage.read_json(output), "report_uri": output})
    key = "checkpoint-validation-" + hashlib.sha256(report.checkpoint.encode()).hexdigest()[:10]
    create_markdown_artifact(key=key, markdown=report_markdown(report), description="checkpoint validation checks")
    if not report.passed:
        raise CheckpointValidationFailed(report)
    log.info(
        "checkpoint %s passed: val_loss %.4f < threshold %s and < untrained %.4f",
        report.checkpoint,
        report.val_loss,
        report.threshold,
        report.untrained_loss,
    )
    return report
