"""Flows for tests/security: small, but through the real stages and a real Prefect server."""

from __future__ import annotations

from prefect import flow

from infra.secrets import CredentialFree
from tasks.image import ImageConfig
from tests.support.tiny import TINY_TRAIN


@flow(name="security-schema-check")
def schema_check(image: ImageConfig) -> str | None:
    """Registered as a deployment only: its parameter schema is what the server enforces."""
    return image.source


# The tests' tiny model, trained as little as the trainer allows: two steps, one checkpoint (AutoModel's
# writer), at the default learning rate.
TINY = {k: v for k, v in TINY_TRAIN.items() if k != "lr"} | dict(
    max_steps=2, val_check_interval=2, ckpt_every_n_steps=2, limit_val_batches=1, log_every_n_steps=1, cpus_per_task=1
)


@flow(name="security-pipeline")
def security_pipeline(sources: list[CredentialFree]) -> dict:
    """prepare-dataset from ``sources`` (credentials by reference), then a two-step pretrain on it."""
    from flows.prepare_dataset import PrepareConfig, prepare_dataset
    from infra.configs.train import TrainConfig
    from tasks.train import pretrain

    dataset = prepare_dataset(PrepareConfig(name="signed", sources=sources, shards_per_file=1, workers=1))
    checkpoint = pretrain(TrainConfig(**TINY), dataset)
    return {"manifest": dataset.manifest_uri, "documents": dataset.documents, "checkpoint": checkpoint.uri}


if __name__ == "__main__":
    # python -m tests.security.flows SOURCES_JSON: the run as its own process (its umask, its environment)
    import json
    import sys

    state = security_pipeline(json.loads(sys.argv[1]), return_state=True)
    result = state.result() if state.is_completed() else None
    print(json.dumps({"flow_run_id": str(state.state_details.flow_run_id), "state": state.name, "result": result}))
