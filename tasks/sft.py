"""SFT stage: chat data -> fine-tune a registered model with NeMo AutoModel -> check on held-out chat -> register.

    from tasks.sft import ChatDataConfig, run_sft
    summary = run_sft(SftConfig(max_steps=40), ChatDataConfig(source="gs://bucket/chat.jsonl"),
                      base=registry_record, registry_uri=..., executor=executor, image=image)

Steps (each a cached, retried Prefect task; the flow ``sft`` and the end-to-end / CPT flows call
:func:`run_sft`):

1. :func:`prepare_chat_data` reads a JSONL of ``messages`` or ``prompt``/``response`` rows from
   any URI (a path, ``gs://``, ``https://``; the KJV demo set when none is given), normalizes it
   (workloads/chat_data.py) and splits off a held-out share by content hash, into
   ``<work_dir>/sft-data/<hash>/{train,held_out}.jsonl``;
2. :func:`fine_tune` trains with the configured engine (tasks/train_engines/) where the executor says:
   AutoModel's fine-tuning recipe (``python -m workloads.sft``, torchrun when it spans several processes),
   or your command (``engine: command``: the base as NEMOFLOW_INIT_FROM, the chat data as
   NEMOFLOW_CHAT_TRAIN / NEMOFLOW_CHAT_HELD_OUT); a retry resumes from the run's checkpoint;
3. :func:`validate_sft` runs ``python -m workloads.sft --validate`` as a job: held-out loss of the
   fine-tuned model must be below the base model's, and greedy answers must end their turn;
   a failure stops here, naming the checks;
4. :func:`register_sft` records the model in the registry with the base as its parent (promoted only
   when asked: a chat model is not what continued pretraining continues from).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Literal

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import INPUTS
from pydantic import BaseModel, ConfigDict, Field, field_validator

from infra import registry as reg
from infra import secrets, storage
from infra.configs.sft import SftConfig
from infra.executors import Executor
from infra.jobs import ImageRef
from infra.secrets import CredentialFree
from infra.settings import get_settings, redact
from tasks.common import cache_policy, logger, run_job, transient_only
from tasks.refs import ChatDataRef, CheckpointRef
from tasks.train import EngineCode, train_with
from tasks.train_engines import SftEngine, TrainInputs, as_engine, over_default
from tasks.train_engines.automodel import (
    SFT_MODULES,
    AutoModelSft,
    build_sft_job,
    with_inputs,
    write_sft_config,
)
from workloads import chat_data


class ChatDataConfig(BaseModel):
    """Where the chat data comes from and how much of it is held out."""

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)  # inputs may hold credentials

    source: CredentialFree | None = Field(
        None,
        description="JSONL (.jsonl or .jsonl.zst) of messages or prompt/response rows: a path, gs:// or https:// "
        "(a signed URL's credentials by reference: <secret:BLOCK> or <env:NAME>); "
        "None = the KJV demo set (continue the verse / which book)",
    )
    held_out: CredentialFree | None = Field(
        None, description="a separate held-out JSONL (else held_out_fraction of source)"
    )
    held_out_fraction: float = Field(0.1, gt=0, lt=1)
    max_examples: int | None = Field(None, ge=2, description="use at most this many rows of source")
    demo_examples: int = Field(1200, ge=10, description="size of the KJV demo set")
    demo_tasks: list[Literal["continue", "book"]] = Field(
        default_factory=lambda: ["continue", "book"], description="KJV demo tasks: continue the verse, which book"
    )
    seed: int = 1234


class SftReport(BaseModel):
    checkpoint: str
    base: str
    passed: bool
    failed: list[str] = Field(default_factory=list)
    checks: list[dict]
    held_out_loss: float
    base_held_out_loss: float
    answer_rate: float
    exact_match_rate: float
    generations: list[dict] = Field(default_factory=list)
    report_uri: str | None = None


class SftValidationFailed(RuntimeError):
    def __init__(self, report: SftReport):
        self.report = report
        failed = [c for c in report.checks if not c["passed"]]
        super().__init__(
            f"fine-tuned checkpoint {report.checkpoint} failed {len(failed)} check(s): "
            + "; ".join(f"{c['name']} ({c['detail']})" for c in failed)
        )


def demo_sft_config() -> AutoModelSft:
    """Fine-tuning the demo model on the KJV chat set: a couple of minutes on 2 CPU cores."""
    return AutoModelSft(max_steps=40, global_batch_size=8, micro_batch_size=8, lr=5e-4, seq_length=192)


def train_over_demo_defaults(value):
    """A partial ``train`` (e.g. {max_steps: 100} in prefect.yaml) changes the demo run, not replaces it."""
    return over_default(value, demo_sft_config())


class SftStageConfig(BaseModel):
    """Fine-tuning as the last step of end-to-end or a promoting CPT refresh: the model the flow just
    registered is the base; the fine-tuned one is registered with it as its parent."""

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)  # inputs may hold credentials

    data: ChatDataConfig = Field(default_factory=ChatDataConfig, description="the chat data (default: KJV demo set)")
    train: SftEngine = Field(
        default_factory=demo_sft_config, description="the fine-tuning run (engine: automodel, the default, or command)"
    )
    promote: bool = Field(False, description="promote the fine-tuned model once it passed its checks")

    @field_validator("train", mode="before")
    @classmethod
    def _train_over_demo_defaults(cls, value):
        return train_over_demo_defaults(value)


# ------------------------------------------------------------------ 1. data
def _read_source(uri: str) -> bytes:
    """The file's bytes; a ``<secret:...>``/``<env:...>`` reference is resolved for this read only."""
    try:
        return storage.read_bytes(secrets.resolve(uri))
    except FileNotFoundError:
        raise FileNotFoundError(f"chat data {uri} does not exist") from None
    except (OSError, ValueError) as exc:  # fsspec's HTTP errors may quote the resolved URL: redacted
        raise OSError(f"chat data {uri}: cannot be read: {redact(str(exc))}") from None


@task(
    name="prepare-chat-data",
    task_run_name="chat data",
    cache_policy=cache_policy("workloads.chat_data", "tasks.sft"),
    persist_result=True,
)
def prepare_chat_data(config: ChatDataConfig) -> ChatDataRef:
    """Normalized, split chat JSONL under ``<work_dir>/sft-data/<hash>/`` (see the module docstring)."""
    log = logger()
    if config.source:
        data = _read_source(config.source)
        rows = chat_data.parse_jsonl(data, storage.basename(config.source))
        identity = hashlib.sha256(data).hexdigest()
        source = config.source
    else:
        rows = chat_data.kjv_chat_rows(config.demo_examples, config.seed, tuple(config.demo_tasks))
        identity = chat_data.row_key({"demo": [chat_data.row_key(r) for r in rows]})
        source = f"KJV demo set ({len(rows)} examples: continue the verse, which book)"
    if config.max_examples:
        rows = rows[: config.max_examples]
    if config.held_out:
        held_bytes = _read_source(config.held_out)
        train, held = rows, chat_data.parse_jsonl(held_bytes, storage.basename(config.held_out))
        identity += hashlib.sha256(held_bytes).hexdigest()
    else:
        train, held = chat_data.split_rows(rows, config.held_out_fraction, config.seed)
    # content, not location: the same bytes from a path, gs:// or https:// are the same data set
    fingerprint = hashlib.sha256(
        (identity + config.model_dump_json(exclude={"source", "held_out"})).encode()
    ).hexdigest()[:16]
    work_dir = get_settings().work_dir
    if not storage.is_local(work_dir):
        raise ValueError(
            f"work_dir {work_dir} is not a file system the fine-tuning job can read; set NEMOFLOW_WORK_DIR to a shared volume"
        )
    out = storage.join(work_dir, "sft-data", fingerprint)
    train_path, held_path = (
        os.path.join(storage.local_path(out), "train.jsonl"),
        os.path.join(storage.local_path(out), "held_out.jsonl"),
    )
    chat_data.write_jsonl(train_path, train)
    chat_data.write_jsonl(held_path, held)
    log.info("chat data from %s: %d train, %d held-out conversations in %s", source, len(train), len(held), out)
    create_table_artifact(
        key="sft-data-" + fingerprint[:10],
        table=[{"role": m["role"], "content": m["content"][:200]} for row in train[:3] for m in row["messages"]],
        description=f"first training conversations ({len(train)} train, {len(held)} held out) from {source}",
    )
    return ChatDataRef(
        train=train_path,
        held_out=held_path,
        train_examples=len(train),
        held_out_examples=len(held),
        source=source,
        fingerprint=fingerprint,
    )


# ------------------------------------------------------------------ 2. fine-tuning
def _fine_tune_name() -> str:
    from prefect.runtime import task_run

    base = task_run.parameters["base"]
    return f"sft of step {base.step} ({as_engine(task_run.parameters['config'], 'sft').label})"


@task(
    name="fine-tune",
    task_run_name=_fine_tune_name,
    retries=2,
    retry_delay_seconds=10,
    retry_condition_fn=transient_only(),  # a retry resumes from the checkpoint; not bad input or OOM
    cache_policy=INPUTS + EngineCode(stage="sft"),
    persist_result=True,
)
def fine_tune(
    config: SftEngine | SftConfig,
    data: ChatDataRef,
    base: CheckpointRef,
    image: ImageRef | None = None,
    executor: Executor | Any = None,
) -> CheckpointRef:
    """Fine-tune ``base`` on ``data`` with the configured engine; the checkpoint it hands on (AutoModel: the
    run's latest; command: its newest, in the Hugging Face layout)."""
    inputs = TrainInputs(chat=data, init_from=base.uri, image=image)
    return train_with(as_engine(config, "sft"), inputs, executor)


def check_options(engine: Any) -> SftConfig:
    """The options of the held-out check (``python -m workloads.sft --validate``) of what ``engine`` fine-tuned:
    the engine's own (:meth:`TrainEngine.sft_check`), over the demo run's for the rest."""
    return as_engine(engine, "sft").sft_check(demo_sft_config())


# ------------------------------------------------------------------ 3. the check
def report_markdown(report: SftReport) -> str:
    verdict = "PASSED" if report.passed else "FAILED: " + ", ".join(report.failed)
    lines = [
        f"# Fine-tuned model check: {verdict}",
        "",
        f"checkpoint `{report.checkpoint}`, base `{report.base}`",
        "",
        "| check | passed | detail |",
        "|---|---|---|",
        *[f"| {c['name']} | {'yes' if c['passed'] else '**NO**'} | {c['detail']} |" for c in report.checks],
        "",
        "| prompt | reference | answer | ended turn |",
        "|---|---|---|---|",
    ]
    for g in report.generations:
        cells = [str(g[k]).replace("|", "\\|").replace("\n", " ")[:120] for k in ("prompt", "reference", "answer")]
        lines.append(f"| {cells[0]} | {cells[1]} | {cells[2]} | {'yes' if g['ended_turn'] else 'no'} |")
    return "\n".join(lines)


@task(
    name="validate-sft",
    task_run_name="check sft step {checkpoint.step}",
    retries=1,
    retry_delay_seconds=10,
    retry_condition_fn=transient_only(SftValidationFailed),
    cache_policy=cache_policy(*SFT_MODULES, "tasks.sft"),
    persist_result=True,
)
def validate_sft(
    config: SftEngine | SftConfig,
    data: ChatDataRef,
    base: CheckpointRef,
    checkpoint: CheckpointRef,
    image: ImageRef | None = None,
    executor: Executor | Any = None,
) -> SftReport:
    """Held-out loss below the base's and non-empty answers that end their turn; raises :class:`SftValidationFailed`."""
    config = with_inputs(check_options(config), base.uri, data)
    output = os.path.join(
        storage.local_path(config.run_dir),
        "validation",
        os.path.basename(os.path.dirname(os.path.dirname(checkpoint.uri))) + ".json",
    )
    storage.makedirs(os.path.dirname(output))
    write_sft_config(config)
    spec = build_sft_job(config, image, validate_to=output)
    spec = spec.model_copy(update={"command": [*spec.command, "--checkpoint", storage.local_path(checkpoint.uri)]})
    run_job(spec, executor)
    report = SftReport.model_validate({**storage.read_json(output), "report_uri": output})
    create_markdown_artifact(
        key="sft-check-" + hashlib.sha256(report.checkpoint.encode()).hexdigest()[:10],
        markdown=report_markdown(report),
        description="fine-tuned model: held-out loss vs base, generations",
    )
    if not report.passed:
        raise SftValidationFailed(report)
    logger().info(
        "fine-tuned %s passed: held-out loss %.4f < base %.4f; %.0f%% of answers were non-empty and ended their turn",
        report.checkpoint,
        report.held_out_loss,
        report.base_held_out_loss,
        report.answer_rate * 100,
    )
    return report


# ------------------------------------------------------------------ 4. registry
def register_sft(
    registry_uri: str,
    checkpoint: CheckpointRef,
    report: SftReport,
    parent: str,
    data: ChatDataRef,
    image: ImageRef | None = None,
    promote: bool = False,
) -> str:
    """Record the fine-tuned model with ``parent`` (a registry id); returns its id (idempotent per checkpoint)."""
    from prefect.runtime import flow_run

    registry = reg.ModelRegistry(registry_uri)
    state = registry.read()
    existing = next((m.id for m in state.models.values() if m.checkpoint == checkpoint.uri), None)
    if existing:
        return existing
    record = reg.ModelRecord(
        id=reg.new_model_id(checkpoint.uri),
        checkpoint=checkpoint.uri,
        parent=parent,
        data=[
            reg.SourceRecord(
                name=storage.basename(data.source) if "://" in data.source else "chat",
                url=data.source,
                sha256=data.fingerprint,
            )
        ],
        metrics={
            "kind": "sft",
            "held_out_chat_loss": report.held_out_loss,
            "parent_held_out_chat_loss": report.base_held_out_loss,
            "answer_rate": report.answer_rate,
            "exact_match_rate": report.exact_match_rate,
            "train_examples": data.train_examples,
            "steps": checkpoint.step,
        },
        image=image.model_dump(mode="json") if image else None,
        code_version=reg.code_version(),
        flow_run_id=str(flow_run.id) if flow_run.id else None,
        note=f"sft of {parent}: held-out chat loss {report.held_out_loss:.4f} (base {report.base_held_out_loss:.4f})",
    )
    registry.register(record, promote=promote, expected_generation=state.generation)
    return record.id


def run_sft(
    config: SftEngine,
    data: ChatDataConfig,
    base: reg.ModelRecord,
    registry_uri: str,
    executor: Executor | Any = None,
    image: ImageRef | None = None,
    promote: bool = False,
) -> dict:
    """The whole stage (steps 1-4) from a registered base model; what the sft, end-to-end and CPT flows call."""
    from tasks.common import result_storage

    results = result_storage()
    prepare, tune, check = (
        t.with_options(result_storage=results) for t in (prepare_chat_data, fine_tune, validate_sft)
    )
    base_ref = CheckpointRef(uri=base.checkpoint, step=int(base.metrics.get("steps", 0) or 0), image=image)
    chats = prepare(data)
    tuned = tune(config, chats, base_ref, image, executor)
    report = check(config, chats, base_ref, tuned, image, executor)
    model_id = register_sft(registry_uri, tuned, report, base.id, chats, image, promote)
    summary = {
        "model": model_id,
        "parent": base.id,
        "checkpoint": tuned.uri,
        "held_out_loss": report.held_out_loss,
        "base_held_out_loss": report.base_held_out_loss,
        "answer_rate": report.answer_rate,
        "exact_match_rate": report.exact_match_rate,
        "train_examples": chats.train_examples,
        "promoted": promote,
    }
    create_markdown_artifact(
        key="sft-summary",
        markdown="# SFT\n\n" + "\n".join(f"- {k}: `{v}`" for k, v in summary.items()),
        description="fine-tuned model registered with its parent",
    )
    logger().info("registered %s (parent %s): %s", model_id, base.id, json.dumps(summary))
    return summary
