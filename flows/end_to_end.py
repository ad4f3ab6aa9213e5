"""Flow ``end-to-end``: the whole NeMo lifecycle in one run.

    stage image -> prepare dataset -> pretrain -> validate checkpoint -> deploy inference -> smoke test

Started by ``prefect deployment run end-to-end/<pool>`` (deployments in
prefect.yaml) or ``nemoflow demo``. Every stage is a cached, retried task: a
re-run with nothing changed is all ``Cached``; a failed run resumes at the
stage that failed. The defaults (the embedded default) run on 2 CPU cores in a
few minutes: the King James Bible, Mixtral's tokenizer, a 20M-parameter Llama.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Literal
from uuid import UUID

from prefect import Task, flow
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from flows.prepare_dataset import PrepareConfig, prepare_dataset
from infra import registry as reg
from infra import storage
from infra.executors import Executor, default_executor
from infra.jobs import Resources
from infra.settings import get_settings
from tasks import gpu_time
from tasks.checkpoint import validate_checkpoint
from tasks.common import result_storage
from tasks.image import ImageConfig, stage_image
from tasks.serve import ServeConfig, deploy_inference, start_inference_early
from tasks.serve import stop_early as stop_standby
from tasks.sft import SftStageConfig, run_sft
from tasks.smoke import DEFAULT_PROMPT, SEED_MAX_TOKENS, smoke_test
from tasks.train import pretrain
from tasks.train_engines import AutoModel, PretrainEngine, TrainEngine, over_default


@dataclass(frozen=True)
class Stage:
    """One stage of the pipeline: its name, the task (or subflow) that runs it, and the job or service it submits
    under that name in ``nemoflow render`` (flows/plan.py builds it with the same task module's builder), if any."""

    name: str
    runs: Any
    submits: str | None = None

    def runner(self, results):
        """What the flow calls: a task persisting its result in ``results``; a subflow as it is."""
        return self.runs.with_options(result_storage=results) if isinstance(self.runs, Task) else self.runs


# The pipeline, declared once: the flow below runs these in this order (and then registers the model, and
# fine-tunes it when the config asks), `nemoflow render` writes the jobs they submit
# (tests/foundation/test_end_to_end_plan.py checks the flow, the list and the plan agree).
STAGES: tuple[Stage, ...] = (
    Stage("stage-image", stage_image),
    Stage("prepare-dataset", prepare_dataset, submits="tokenize"),
    Stage("start-inference-early", start_inference_early),  # only with serve.start_early, beside pretrain
    Stage("pretrain", pretrain, submits="pretrain"),
    Stage("validate", validate_checkpoint, submits="validate"),
    Stage("deploy", deploy_inference, submits="serve"),
    Stage("smoke-test", smoke_test),
)


def demo_train_config() -> AutoModel:
    """A 20M-parameter Llama that learns the demo corpus visibly in about a minute on 2 CPU cores: 40 steps of
    8 x 256 tokens (the loss falls from 10.4 to about 6.3), validated twice, saved once at the end (a
    background writer for three 80 MB saves cost the 2 cores more than it saved)."""
    return AutoModel(
        arch="llama",
        hidden_size=256,
        num_layers=4,
        num_attention_heads=4,
        ffn_hidden_size=688,
        seq_length=256,
        global_batch_size=8,
        micro_batch_size=8,
        max_steps=40,
        lr=1e-3,
        min_lr=1e-4,
        warmup_steps=5,
        val_check_interval=20,
        ckpt_every_n_steps=40,
        limit_val_batches=4,
        save_top_k=2,
        log_every_n_steps=5,
    )


# The GPU demo's token budget: about two passes over the embedded corpus (~1.2M tokens), whatever the GPU count.
GPU_DEMO_TOKENS = 2_500_000


def demo_gpu_train_config(gpus: int) -> AutoModel:
    """The demo on ``gpus`` GPUs of this machine: a 0.25B-parameter Llama (hidden 1024, 16 layers, GQA 16/8,
    SwiGLU 2816, Mixtral's 32000-token vocabulary) trained for two passes over the demo corpus, bf16-mixed,
    each decoder layer compiled, torchrun over the GPUs (``strategy: auto``: DDP for this size on one node).
    Minutes on one H200 (README, "On a GPU machine")."""
    micro, seq = 16, 1024
    steps = GPU_DEMO_TOKENS // (micro * gpus * seq)
    return AutoModel(
        arch="llama",
        hidden_size=1024,
        num_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        ffn_hidden_size=2816,
        seq_length=seq,
        global_batch_size=micro * gpus,
        micro_batch_size=micro,
        max_steps=steps,
        lr=6e-4,
        min_lr=6e-5,
        warmup_steps=min(20, steps // 5),
        val_check_interval=max(1, steps // 3),
        ckpt_every_n_steps=steps,  # one save, at the end: a minutes-long run needs no intermediate ones
        # ...written synchronously: no step follows it for a background write to overlap, and the background
        # writer is a process of its own to start (at d1f5225 its one 3 GB save took 11.8 s, 0.26 GB/s)
        ckpt_async_save=False,
        limit_val_batches=8,
        save_top_k=2,
        log_every_n_steps=5,
        precision="bf16-mixed",
        enable_compile=True,
        gpus_per_node=gpus,
        cpus_per_task=max(2, min(16, (os.cpu_count() or 2) // 2)),
    )


def demo_gpu_config(gpus: int) -> dict:
    """The end-to-end parameters (``config``) of the GPU demo: training on ``gpus`` GPUs, validation and the
    built-in server on one (vLLM when it is installed: the server decides, engine ``auto``)."""
    # `train` is merged over the CPU demo's model (EndToEndConfig), not over the class defaults: every field that
    # differs from the CPU demo's is given, a default value too (val_check_interval 50 was left out as a default,
    # so the GPU demo validated every 20 steps, the CPU demo's interval)
    cpu = demo_train_config().model_dump()
    train = {k: v for k, v in demo_gpu_train_config(gpus).model_dump().items() if v != cpu.get(k)}
    return {
        "train": train,
        # the server starts beside training (vLLM compiles and warms up meanwhile) and loads the validated checkpoint
        "serve": {
            "engine": {"engine": "auto", "resources": {"gpus_per_node": 1, "cpus_per_task": 2}},
            "start_early": True,
        },
    }


class SmokeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str = DEFAULT_PROMPT
    max_tokens: int = Field(SEED_MAX_TOKENS, ge=1, description="the seed sends 2048; the server clamps it")
    shape: Literal["seed", "openai"] = Field(
        "seed", description="seed: NeMo's deploy REST request ({prompt, max-tokens} -> {output}); openai: completions"
    )
    # The seed's request asks for up to 2048 tokens, and the built-in engine on a CPU makes one per forward
    # pass: a 2-core machine busy with other work took over 60 s (the Slurm demo in the suite), so 180 s.
    timeout_s: float = Field(180, gt=0, description="seconds one smoke request may take")


class EndToEndConfig(BaseModel):
    """One typed configuration for the whole pipeline (the flow's single parameter)."""

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)  # inputs may hold credentials

    executor: Executor = Field(
        default_factory=default_executor,
        description="where every stage's jobs run and with what options: local, slurm (sbatch options) or k8s "
        "(cluster options); a name alone takes the options from NEMOFLOW_SLURM_* / NEMOFLOW_K8S_*",
    )
    image: ImageConfig = Field(default_factory=ImageConfig)
    data: PrepareConfig = Field(default_factory=PrepareConfig)
    train: PretrainEngine = Field(
        default_factory=demo_train_config,
        description="the training engine and its options: NeMo AutoModel's NeMo-named fields (the default), "
        "or engine: command with your own command",
    )
    validation_threshold: float = Field(
        8.0, gt=0, description="the checkpoint's validation loss must be below this (and below the untrained model's)"
    )
    serve: ServeConfig = Field(default_factory=ServeConfig)
    smoke: SmokeConfig = Field(default_factory=SmokeConfig)
    sft: SftStageConfig | None = Field(
        None, description="fine-tune the registered model on chat data (NeMo AutoModel), registered as its child"
    )

    @field_validator("train", mode="before")
    @classmethod
    def _train_over_demo_defaults(cls, value):
        """A partial `train` (e.g. {cpus_per_task: 1} in prefect.yaml) changes the demo model, not replaces it."""
        merged = over_default(value, demo_train_config())
        if merged is not value and "max_tokens" in value and "max_steps" not in value:
            merged["max_steps"] = None  # a token budget given instead of the demo's step count
        return merged

    @model_validator(mode="after")
    def _check(self) -> EndToEndConfig:
        # Fail on what the engine cannot run where the executor runs it (AutoModel: impossible parallelism, a
        # layout that does not fit the executor's GPUs) before any stage runs.
        self.train.check(self.executor)
        return self


@flow(name="end-to-end", log_prints=True)
def end_to_end(config: EndToEndConfig | None = None) -> dict:
    config = config or EndToEndConfig()
    executor = config.executor
    results = result_storage()  # every stage persists its (small) result where NEMOFLOW_RESULT_STORAGE says
    stage_image_, prepare_dataset_, start_early_, pretrain_, validate_, deploy_, smoke_ = (
        stage.runner(results) for stage in STAGES
    )

    # 1. the image every later stage runs in (locally: this Python environment, recorded)
    image = stage_image_(config.image.source, config.image.dest, executor, config.image.convert)

    # 2. the dataset: raw shards -> Megatron .bin/.idx + NeMo blend
    dataset = prepare_dataset_(config.data, executor, image)

    # (serve.start_early: the server starts now, beside training, on the model's shape; it serves nothing until
    # step 5 loads the validated checkpoint into it, and stops if training or validation fails)
    early = start_early_.submit(**early_start(config, dataset, image)) if config.serve.start_early else None
    try:
        # 3. pretraining on the blend
        checkpoint = pretrain_(config.train, dataset, image, executor)

        # 4. validation: a failing check stops the flow here, before anything is deployed
        report = validate_(
            checkpoint,
            dataset,
            config.validation_threshold,
            executor,
            image,
            resources=validation_resources(config.train),
        )
    except BaseException:
        stop_early(early)
        raise

    # 5. inference, then 6. the seed's smoke request against it
    endpoint = deploy_(
        checkpoint,
        executor,
        config.serve.port,
        config.serve.model_name,
        config.serve.ready_timeout_s,
        image=image,
        engine=config.serve.engine,
        standby=early,
    )
    answer = smoke_(
        endpoint, config.smoke.prompt, config.smoke.max_tokens, config.smoke.timeout_s, shape=config.smoke.shape
    )

    summary = {
        "flow_run_id": str(flow_run.id) if flow_run.id else None,
        "image": image.model_dump(mode="json"),
        "dataset": dataset.manifest_uri,
        "data_prefix": dataset.blend,
        "tokens": dataset.tokens,
        "checkpoint": checkpoint.uri,
        "val_loss": report.val_loss,
        "untrained_loss": report.untrained_loss,
        "endpoint": endpoint.url,
        "model": endpoint.model,
        "prompt": answer.prompt,
        "answer": answer.output,
        "latency_s": answer.latency_s,
    }
    _publish_summary(summary)

    # 7. the model registry: a CPT refresh (flows/cpt_refresh.py) continues from the promoted model
    summary["registered_model"] = register_checkpoint(config, checkpoint, dataset, report, endpoint, image)

    # 8. optionally, supervised fine-tuning of that model on chat data (tasks/sft.py), registered as its child
    if config.sft is not None:
        registry_uri = storage.join(get_settings().work_dir, "registry")
        base = reg.ModelRegistry(registry_uri).read().models[summary["registered_model"]]
        summary["sft"] = run_sft(
            config.sft.train, config.sft.data, base, registry_uri, executor, image, config.sft.promote
        )
    # where each GPU-second (CPU-second without GPUs) of the stages that ran went, and the run's goodput
    summary["gpu_time"] = gpu_time.publish("end-to-end", serving=config.serve.engine.resources)
    _publish_stage_times()
    return summary


def early_start(config: EndToEndConfig, dataset, image) -> dict:
    """The early server's inputs: the training engine (it says the checkpoint's shape before the run), the dataset
    (its tokenizer), and the deploy stage's own options."""
    return {
        "train": config.train,
        "dataset": dataset,
        "executor": config.executor,
        "port": config.serve.port,
        "model_name": config.serve.model_name,
        "ready_timeout_s": max(config.serve.ready_timeout_s, 300),
        "image": image,
        "engine": config.serve.engine,
    }


def stop_early(early) -> None:
    """Training or validation failed: the early server (once its start ended) is stopped; it served nothing."""
    if early is None:
        return
    try:
        standby = early.result()
    except Exception:  # noqa: BLE001 - a start that failed left nothing to stop
        return
    stop_standby(standby)


def validation_resources(train: TrainEngine) -> Resources:
    """Validation loads the model once: one GPU where training had GPUs, the training job's CPUs."""
    trained = train.resources
    return Resources(gpus_per_node=min(1, trained.gpus_per_node), cpus_per_task=trained.cpus_per_task, time="01:00:00")


def register_checkpoint(config, checkpoint, dataset, report, endpoint, image) -> str:
    """Register the validated checkpoint; promote it (and fix the held-out set) when nothing is promoted yet."""
    registry = reg.ModelRegistry(storage.join(get_settings().work_dir, "registry"))
    state = registry.read()
    existing = next((m.id for m in state.models.values() if m.checkpoint == checkpoint.uri), None)
    if existing:
        return existing  # a cached re-run: already registered
    manifest = storage.read_json(dataset.manifest_uri)
    sources = [
        reg.SourceRecord(name=s["name"], url=s["url"], sha256=s.get("sha256"), size=s.get("size"))
        for s in manifest.get("shards", [])
    ]
    record = reg.ModelRecord(
        id=reg.new_model_id(checkpoint.uri),
        checkpoint=checkpoint.uri,
        data=sources,
        dataset_manifest=dataset.manifest_uri,
        metrics={"val_loss": report.val_loss, "untrained_loss": report.untrained_loss, "tokens": dataset.tokens},
        image=image.model_dump(mode="json") if image else None,
        code_version=reg.code_version(),
        flow_run_id=str(flow_run.id) if flow_run.id else None,
        note="trained by end-to-end",
    )
    first = state.promoted is None
    meta = storage.read_json(storage.join(checkpoint.uri, "meta.json"))
    held_out = reg.HeldOut(
        data_prefix=dataset.blend,
        tokenizer_model=dataset.tokenizer.model,
        # as the checkpoint was trained: its meta.json (every engine's result has one)
        seq_length=meta["seq_length"],
        split=meta.get("split", "98,1,1"),
        seed=meta.get("seed", 1234),
        origin=f"validation split of {dataset.manifest_uri}",
    )
    serving = reg.Serving(
        model=record.id, service=endpoint.handle, port=config.serve.port, model_name=endpoint.model, url=endpoint.url
    )
    # Its sources count as processed only when it becomes the base the refresh continues from.
    registry.register(
        record,
        promote=first,
        sources=sources if first else [],
        held_out=held_out if first else None,
        serving=serving if first else None,
        expected_generation=state.generation,
    )
    return record.id


def stage_times(flow_run_id, settle_s: float = 30) -> list[dict]:
    """Every task run of a flow run and of its subflows (prepare-dataset), oldest first, with its state and the
    seconds it ran (a Cached stage ran none), as the Prefect API records them. A subflow's own stages are
    named with the subflow's flow (``tokenize 4 part(s) (in prepare-dataset)``), and the task run that stands
    for the subflow call itself is left out (its state is the call's, not its stages').

    The API records a task run's last state a moment after the task returns (it travels as an event), so
    the runs are read again, for up to ``settle_s`` seconds, until every one is in a final state (CI saw the
    cached re-run's last stage still ``Pending``)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId

    root = UUID(str(flow_run_id))
    deadline = time.monotonic() + settle_s
    with get_client(sync_client=True) as client:
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[root]))
        )
        names = {root: None, **{child.id: client.read_flow(child.flow_id).name for child in children}}
        while True:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=list(names))))
            if all(r.state and r.state.is_final() for r in runs) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    rows = []
    for run in sorted(runs, key=lambda r: r.expected_start_time or r.created):
        if run.state and run.state.state_details.child_flow_run_id:
            continue  # the subflow call: its stages follow
        subflow = names.get(run.flow_run_id)
        rows.append(
            {
                "stage": f"{run.name} (in {subflow})" if subflow else run.name,
                "state": run.state_name,
                "seconds": round(run.total_run_time.total_seconds(), 1),
            }
        )
    return rows


def _publish_stage_times() -> None:
    if not flow_run.id:
        return
    from prefect.artifacts import create_table_artifact

    rows = stage_times(flow_run.id)
    create_table_artifact(
        key="end-to-end-stage-times", table=rows, description="each stage of this run: state and seconds it ran"
    )


def _publish_summary(summary: dict) -> None:
    if summary["flow_run_id"]:
        storage.write_json(
            storage.join(get_settings().work_dir, "flow-runs", f"{summary['flow_run_id']}.json"), summary
        )
    create_markdown_artifact(
        key="end-to-end-summary",
        description="what this run produced",
        markdown="\n".join(
            [
                "# end-to-end run",
                "",
                "| stage | result |",
                "|---|---|",
                f"| image | `{summary['image']['kind']}` {summary['image']['uri']} |",
                f"| dataset | `{summary['dataset']}` ({summary['tokens']:,} tokens) |",
                f"| checkpoint | `{summary['checkpoint']}` (val loss {summary['val_loss']:.3f}, "
                f"untrained {summary['untrained_loss']:.3f}) |",
                f"| endpoint | [{summary['endpoint']}]({summary['endpoint']}/v1/models) model `{summary['model']}` |",
                f"| smoke test | {summary['prompt']!r} → {summary['answer']!r} ({summary['latency_s']:.2f} s) |",
            ]
        ),
    )
