"""What every training engine is: one pydantic model of its options (the flow config's ``train:``) with the
same small interface, which the training stages call without asking which engine they hold
(torchtitan's ``TrainSpec`` is the model: what differs per engine travels with it).

    engine = engine.prepared(TrainInputs(dataset=dataset, image=image))   # inputs in, run directory fixed
    log.info(engine.check(executor))       # what cannot run fails here, before any compute
    write(engine.files())                  # what the job reads
    run_job(engine.job(inputs), executor)  # the training job, on any backend
    checkpoint = engine.result(inputs, run=lambda spec: run_job(spec, executor))  # -> CheckpointRef

That is :func:`tasks.train.train_with`, which ``pretrain`` (end-to-end, CPT) and ``fine_tune`` (SFT) run.
A new engine is one module in this package and its line in the lists of ``__init__.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from infra.configs.sft import SftConfig
from infra.jobs import ImageRef, JobSpec, Resources
from tasks.refs import ChatDataRef, CheckpointRef, DatasetRef

RunJob = Callable[[JobSpec], Any]


class TrainInputs(BaseModel):
    """What a training stage hands its engine (each engine reads what its stage gives)."""

    dataset: DatasetRef | None = Field(None, description="pretraining and CPT: the Megatron blend and tokenizer")
    chat: ChatDataRef | None = Field(None, description="SFT: the normalized chat JSONL (train and held out)")
    init_from: str | None = Field(
        None, description="a checkpoint to start from (CPT: the promoted model; SFT: the base)"
    )
    image: ImageRef | None = Field(None, description="what the jobs run in")


class TrainEngine(BaseModel):
    """One training engine's options (subclasses set ``engine`` and add their own, ``run_dir`` among them:
    where the run writes, fixed by :meth:`prepared`) and its interface."""

    model_config = ConfigDict(extra="forbid")

    engine: str
    # The code whose change makes a cached training result stale (the stage's cache key includes its source).
    modules: ClassVar[tuple[str, ...]] = ()

    @property
    def resources(self) -> Resources:
        """The training job's resources (one value, from the engine's NeMo-named fields)."""
        raise NotImplementedError

    @property
    def label(self) -> str:
        """A short name for task runs and logs (``llama``, ``command``)."""
        return self.engine

    def sft_check(self, defaults: SftConfig) -> SftConfig:
        """SFT engines: the options of the held-out check of what this engine fine-tuned (``python -m
        workloads.sft --validate``: loss against the base, greedy answers), from ``defaults`` (the demo run's)
        and what this engine decides (its run directory, sequence length, resources)."""
        raise NotImplementedError(f"the {self.engine} engine has no held-out check of a fine-tuned model")

    def prepared(self, inputs: TrainInputs) -> TrainEngine:
        """The options with the stage's inputs filled in and the run directory fixed (stable across retries)."""
        raise NotImplementedError

    def check(self, executor: Any = None) -> str:
        """What cannot run fails here, before any compute (one error naming each problem); the plan, for the log."""
        return f"training with the {self.engine} engine in {self.run_dir}"

    def files(self) -> dict[str, str]:
        """Files the job reads, written before it starts (path or URI -> text)."""
        return {}

    def job(self, inputs: TrainInputs) -> JobSpec:
        """The training job (what the stage runs and ``nemoflow render`` shows)."""
        raise NotImplementedError

    def result(self, inputs: TrainInputs, run: RunJob) -> CheckpointRef:
        """The run's checkpoint for the next stages (Hugging Face layout), its artifacts published; follow-up
        jobs (a conversion) go through ``run``."""
        raise NotImplementedError

    def expected_result(self, inputs: TrainInputs) -> CheckpointRef:
        """The checkpoint :meth:`result` will hand on, before the run (``nemoflow render``): the run's when it
        exists, else where it will be."""
        raise NotImplementedError

    def served_config(self, inputs: TrainInputs) -> dict | None:
        """The ``config.json`` of the checkpoint this run will hand on, known before the run (a server can then be
        started on its shape while the model trains: ``serve.start_early``); None when the engine cannot know it."""
        return None

    def planned_steps(self) -> int | None:
        """The optimizer steps the run takes, when the engine knows them."""
        return None

    def memory_plan(self, executor: Any = None) -> str | None:
        """The layout's memory per GPU, for the reviewer of a render; None when the engine has no plan."""
        return None

    def continued(self, promoted_checkpoint: str, new_tokens: int) -> TrainEngine:
        """The run of one CPT refresh from ``promoted_checkpoint`` on ``new_tokens`` new tokens (the engine's
        options for a refresh; the stage passes the checkpoint as ``init_from``)."""
        return self


def over_default(value: Any, default: BaseModel, tag: str = "engine") -> Any:
    """A partial config of the default's own engine (e.g. ``train: {cpus_per_task: 1}`` in prefect.yaml)
    changes the default run, not replaces it; a config of another engine stands as it is."""
    if not isinstance(value, dict) or value.get(tag, getattr(default, tag)) != getattr(default, tag):
        return value
    return {**default.model_dump(exclude_unset=True), **value}


def launcher_resources(config: Any) -> Resources:
    """A training job's resources from an engine's flat NeMo-named fields (``num_nodes``, ``gpus_per_node``,
    ``cpus_per_task``, ``mem``, ``time``): one launcher per node (torchrun or the command starts the processes)."""
    return Resources(
        nodes=config.num_nodes,
        ntasks_per_node=1,
        gpus_per_node=config.gpus_per_node,
        cpus_per_task=config.cpus_per_task,
        mem=config.mem,
        time=config.time,
    )
