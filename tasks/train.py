"""Training stage: pretrain or continue pretraining on a prepared dataset, with any training engine.

    from tasks.train import pretrain
    ckpt = pretrain(TrainConfig(max_steps=300, ...), dataset, image, executor="slurm")     # AutoModel
    ckpt = pretrain(Command(command="python pretrain.py"), dataset, image, executor="slurm")

The engine (tasks/train_engines/) checks its configuration before any compute (AutoModel: the parallelism
arithmetic and the memory plan), gives the job the stage runs where the executor says (AutoModel:
``python -m workloads.train``, under torchrun when it spans several processes) and reads its result. The run
directory is derived from the inputs, so a retry (or a pre-empted job, exit 76) runs on the same directory and
resumes. The stage never asks which engine it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefect import task
from prefect.cache_policies import INPUTS, CachePolicy

from infra import storage
from infra.configs.train import TrainConfig
from infra.executors import Executor
from infra.jobs import ImageRef
from tasks.common import code_fingerprint, logger, transient_only
from tasks.gpu_time import run_timed
from tasks.refs import CheckpointRef, DatasetRef
from tasks.train_engines import PretrainEngine, TrainEngine, TrainInputs, as_engine


@dataclass
class EngineCode(CachePolicy):
    """Cache key part: the source of the code that trains, the engine's own (its ``modules``)."""

    # keyword-only: CachePolicy's first field is key_storage (a positional "pretrain" became a directory)
    stage: str = field(default="pretrain", kw_only=True)

    def compute_key(self, task_ctx, inputs, flow_parameters, **kwargs) -> str:
        engine = as_engine(inputs["config"], self.stage)
        return code_fingerprint(*engine.modules, "tasks.train", "tasks.train_engines.base")


def train_with(engine: TrainEngine, inputs: TrainInputs, executor: Executor | Any = None) -> CheckpointRef:
    """The training stage, whatever the engine: prepare, check, write what the job reads, run it, read the
    result (``pretrain`` and the SFT stage's ``fine_tune`` are this with their inputs)."""
    log = logger()
    engine = engine.prepared(inputs)
    log.info("%s", engine.check(executor))  # what cannot run fails here, before any compute
    for path, text in engine.files().items():
        storage.makedirs(storage.parent(path))
        storage.write_text(path, text)
    # timed: the job's seconds and how it spent them, for the run's gpu-time artifact (tasks/gpu_time.py)
    run_timed(engine.job(inputs), executor, beside=engine.run_dir)
    from tasks.tracking import publish_wandb_run

    publish_wandb_run(engine.run_dir)  # a W&B link (or the offline run's path) in the Prefect UI
    return engine.result(inputs, lambda spec: run_timed(spec, executor, beside=engine.run_dir))


def _run_name() -> str:
    from prefect.runtime import task_run

    return f"pretrain {as_engine(task_run.parameters['config'], 'pretrain').label}"


@task(
    name="pretrain",
    task_run_name=_run_name,
    retries=2,
    retry_delay_seconds=10,
    retry_condition_fn=transient_only(),  # a crash or a lost node resumes; not bad config or OOM
    cache_policy=INPUTS + EngineCode(stage="pretrain"),
    persist_result=True,
)
def pretrain(
    config: PretrainEngine | TrainConfig,
    dataset: DatasetRef,
    image: ImageRef | None = None,
    executor: Executor | Any = None,
    init_from: str | None = None,
) -> CheckpointRef:
    """Train on ``dataset`` with the configured engine (from ``init_from`` for a CPT refresh); the checkpoint
    the engine hands on (AutoModel: the best by validation loss; command: its newest, in the Hugging Face
    layout)."""
    inputs = TrainInputs(dataset=dataset, init_from=init_from, image=image)
    return train_with(as_engine(config, "pretrain"), inputs, executor)
