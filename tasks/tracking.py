"""Experiment tracking in the Prefect UI: the W&B run of a training job as an artifact.

    publish_wandb_run(run_dir)     # after the job: a link artifact (online) or the offline run's path

The job writes ``<run_dir>/wandb_run.json`` (workloads/wandb_run.py) when it logged to W&B; without
it (no WANDB_API_KEY) nothing is published.
"""

from __future__ import annotations

import hashlib

from prefect.artifacts import create_link_artifact, create_markdown_artifact

from workloads.wandb_run import read_record


def publish_wandb_run(run_dir: str) -> dict | None:
    """Publish the run's W&B link (or offline path); returns the record, None when the job did not log to W&B."""
    record = read_record(run_dir)
    if record is None:
        return None
    key = "wandb-run-" + hashlib.sha256(str(run_dir).encode()).hexdigest()[:10]
    if record.get("url"):
        create_link_artifact(
            key=key,
            link=record["url"],
            link_text=f"W&B run {record['project']}/{record['name']}",
            description="W&B run",
        )
    else:
        create_markdown_artifact(
            key=key,
            markdown=(
                f"# W&B run `{record['project']}/{record['name']}` (offline)\n\n"
                f"written to `{record['path']}`; upload it with\n\n    wandb sync {record['path']}\n"
            ),
            description="W&B run (offline mode)",
        )
    return record
