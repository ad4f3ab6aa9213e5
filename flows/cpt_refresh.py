"""Flow ``cpt-refresh``: continue pretraining the promoted model on newly arrived data, nightly.

    discover new sources -> (none: no-op) -> prepare them -> continue pretraining from the promoted
    checkpoint -> validate -> candidate vs promoted on the fixed held-out set -> promote or keep
    -> blue/green switch of the server (same URL, no downtime) -> registry commit

Started by the ``cpt-refresh/nightly`` deployment (cron in prefect.yaml), by
``prefect deployment run cpt-refresh/local``, or in Python: ``cpt_refresh(CptRefreshConfig(...))``.
The model registry (``infra.registry``, default ``<work_dir>/registry``) says which checkpoint is
promoted; ``end-to-end`` registers and promotes its checkpoint when nothing is promoted yet, so one
``end-to-end/local`` run gives the first refresh a model to continue from.

What "new" means: a source (file URL) whose checksum is not among the inputs of the promoted
model's lineage (``processed_sources`` in the registry). A rejected candidate does not mark its
sources processed, so they are retried by the next refresh, with whatever arrived since.

The held-out set both models are compared on is recorded in the registry (``held_out``): the
validation split of the dataset the first promoted model was trained on, with its split, seed and
sequence length. It never changes across refreshes, so losses are comparable over the lineage.

Never two at once: the flow takes the global concurrency limit ``cpt-refresh`` (1 slot, whatever
deployment or pool started it) before it reads the registry. A run that cannot take it within
``lock_timeout_s`` (at least ``FREE_SLOT_TIMEOUT_S`` when the slot was free as it started: a slow API's
answer) ends ``Cancelled`` having done nothing, and its state message (what ``--watch``
and the UI show) names the run that holds the slot, its last heartbeat and when the slot frees if that
run is dead; ``nemoflow refresh --wait`` starts a refresh once the slot is free instead. (The check is
the flow's own, not a deployment ``concurrency_limit``: Prefect cancels for that before the flow
starts, with a message of its own that names no holder.) The registry commit also checks the
generation it started from.

A crashed refresh never blocks the next ones: its global slot is a lease of ``LOCK_LEASE_S`` that only
a live holder renews, and a run whose process dies is marked Crashed by the heartbeat automation
``nemoflow deploy`` creates, which frees its deployment slot (devtools/prefect_local.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections.abc import Iterator

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from prefect.states import Cancelled, State
from pydantic import BaseModel, ConfigDict, Field

from flows.prepare_dataset import PrepareConfig, prepare_dataset
from infra import registry as reg
from infra import storage
from infra.executors import Executor, default_executor
from infra.secrets import CredentialFree
from infra.settings import get_settings
from tasks import gpu_time
from tasks.checkpoint import validate_checkpoint
from tasks.common import logger, result_storage
from tasks.image import ImageConfig, stage_image
from tasks.promote import compare_on_held_out, discover_new_sources, record_model, switch_serving
from tasks.refs import CheckpointRef, TokenizerRef
from tasks.serve import ServeConfig
from tasks.sft import SftStageConfig, run_sft
from tasks.train import pretrain
from tasks.train_engines import AutoModelCpt, CptEngine

CONCURRENCY_LIMIT = "cpt-refresh"


class CptServeConfig(ServeConfig):
    """The server a promoted candidate replaces without downtime (its port users call never changes)."""

    smoke_prompt: str = "In the beginning"
    enabled: bool = Field(True, description="switch the server to a promoted candidate without downtime")


class CptRefreshConfig(BaseModel):
    """The refresh's single parameter."""

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)  # inputs may hold credentials

    sources: CredentialFree | list[CredentialFree] | None = Field(
        None,
        description="incoming data: a glob, a list, or a {chunk}/{shard} template; "
        "unset = <work_dir>/incoming/*.jsonl.zst",
    )
    chunks: str | None = None
    shards: str | None = None
    registry: str | None = Field(None, description="model registry URI (default <work_dir>/registry)")
    tolerance: float = Field(0.0, ge=0, description="promote if candidate_loss <= promoted_loss * (1 + tolerance)")
    validation_threshold: float = Field(9.5, gt=0, description="validate_checkpoint's held-out loss threshold")
    train: CptEngine = Field(
        default_factory=AutoModelCpt,
        description="the refresh's training: NeMo AutoModel's budget and schedule (the default; the model's shape "
        "is the promoted checkpoint's), or engine: command with your own command",
    )
    tokenizer: TokenizerRef | None = Field(None, description="default: the held-out set's (the promoted model's)")
    serve: CptServeConfig = Field(default_factory=CptServeConfig)
    sft: SftStageConfig | None = Field(
        None, description="after a promotion, fine-tune the new model on chat data (NeMo AutoModel), as its child"
    )
    executor: Executor = Field(
        default_factory=default_executor, description="where the refresh's jobs run (as in end-to-end)"
    )
    image: ImageConfig = Field(default_factory=ImageConfig, description="what its jobs run in")
    lock_timeout_s: float = Field(5, ge=0, description="how long to wait for a running refresh before giving up")

    def registry_uri(self) -> str:
        return storage.normalize(self.registry) if self.registry else storage.join(get_settings().work_dir, "registry")

    def sources_spec(self) -> str | list[str]:
        return self.sources or storage.join(get_settings().work_dir, "incoming", "*.jsonl.zst")


class RefreshFailed(RuntimeError):
    pass


class RefreshRefused(RefreshFailed):
    """Another refresh holds the slot: this one did nothing (the flow ends Cancelled with this message)."""


# The start of a refused run's state message (``nemoflow refresh --wait`` recognises it).
REFUSED = "another cpt-refresh holds the 'cpt-refresh' concurrency limit"


def _ensure_limit(name: str) -> bool:
    """The global concurrency limit must exist: an unknown name would silently not limit anything. True when
    it has a free slot now."""
    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            limit = client.read_global_concurrency_limit_by_name(name)
            return limit.active_slots < limit.limit
        except ObjectNotFound:
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
            except ObjectAlreadyExists:
                return False  # created meanwhile by another refresh, which may hold it: wait as for a holder
            return True


# The global slot's lease, seconds (Prefect's minimum is 60): the holder renews it every 45 s while it
# runs; when the holder dies (SIGKILL, a lost host) nobody renews it and the server's repossessor frees
# the slot within about a minute, so a crashed refresh cannot block the nightly ones (issue #12).
LOCK_LEASE_S = 60

# How long taking a slot that was free may take. ``timeout_s`` is the wait for another refresh; taking a free slot is
# one request, and a loaded server can answer it later than a short ``timeout_s`` (2 s). A request the client gave
# up on is still granted by the server: the slot then belongs to a lease nobody renews, and the run refused itself,
# "held by a dead run" (the suite at 7e887fc). Short enough that a refresh which lost a race for the free slot to
# one started at the same moment still gives up long before that one's refresh is done.
FREE_SLOT_TIMEOUT_S = 20


@contextlib.contextmanager
def refresh_lock(timeout_s: float) -> Iterator[None]:
    """Hold the global ``cpt-refresh`` concurrency slot; :class:`RefreshFailed` after ``timeout_s`` of waiting for
    another refresh (a slot that is free is waited for up to :data:`FREE_SLOT_TIMEOUT_S`: the API's answer)."""
    from prefect.concurrency.sync import concurrency

    if _ensure_limit(CONCURRENCY_LIMIT):
        timeout_s = max(timeout_s, FREE_SLOT_TIMEOUT_S)
    with contextlib.ExitStack() as held:
        try:
            # strict: a missing limit must fail, not run unlimited. A lost lease renewal (an API blip in a
            # long refresh) must not kill the run: the registry's generation check still stops a second writer.
            held.enter_context(
                concurrency(
                    CONCURRENCY_LIMIT,
                    occupy=1,
                    timeout_seconds=timeout_s,
                    lease_duration=LOCK_LEASE_S,
                    strict=True,
                    raise_on_lease_renewal_failure=False,
                )
            )
        except TimeoutError as exc:
            message = f"{REFUSED}: {_holder()}; this run did nothing (waited {timeout_s:g} s). {WAIT_HINT}"
            _failure_artifact(message, outcome="REFUSED (another refresh runs)")
            raise RefreshRefused(message) from exc
        _record_holder(held)
        yield


WAIT_HINT = "To start one that waits for the slot: nemoflow refresh --wait"


# The Prefect variable naming the flow run that holds the slot (the API cannot list a limit's holders).
HOLDER_VARIABLE = "cpt_refresh_slot_holder"


def _record_holder(held: contextlib.ExitStack) -> None:
    """Name this run as the slot's holder in :data:`HOLDER_VARIABLE`, until it lets the slot go."""
    from prefect import get_client
    from prefect.client.schemas.actions import VariableCreate, VariableUpdate

    me = str(flow_run.id) if flow_run.id else None
    if me is None:
        return
    try:
        with get_client(sync_client=True) as client:
            if client.read_variable_by_name(HOLDER_VARIABLE) is not None:  # a dead holder's: the slot is ours now
                client.update_variable(VariableUpdate(name=HOLDER_VARIABLE, value=me))
            else:
                client.create_variable(VariableCreate(name=HOLDER_VARIABLE, value=me))
    except Exception as exc:  # noqa: BLE001 - only a refused run's message needs it; the refresh goes on
        logger().warning("could not record this run as the slot's holder: %s", exc)
        return

    def release() -> None:
        with contextlib.suppress(Exception), get_client(sync_client=True) as client:  # a dead API: it is stale then
            current = client.read_variable_by_name(HOLDER_VARIABLE)
            if current is not None and current.value == me:
                client.delete_variable_by_name(HOLDER_VARIABLE)

    held.callback(release)


def _holder() -> str:
    """Who holds the slot, from the API: the run the holder variable names (and any other live
    cpt-refresh run), with its last heartbeat and when its slot frees if it is dead."""
    from prefect import get_client

    from infra.run_slots import slot_holders

    try:
        with get_client(sync_client=True) as client:
            named = client.read_variable_by_name(HOLDER_VARIABLE)
        ids = [str(named.value)] if named is not None and named.value else []
        holders = slot_holders("cpt-refresh", run_ids=ids, exclude=str(flow_run.id) if flow_run.id else None)
    except Exception as exc:  # noqa: BLE001 - the refusal matters more than its details
        return f"(the holder could not be read from the API: {type(exc).__name__}: {exc})"
    if not holders:
        # Killed runs already marked Crashed: only their leases hold the slot, until nobody renews them.
        return (
            "no cpt-refresh run is alive; the slot is a dead run's and frees when its lease lapses "
            f"(within ~{LOCK_LEASE_S + 15} s of the run's death)"
        )
    return "held by " + "; and ".join(h.describe() for h in holders)


@flow(name="cpt-refresh", log_prints=True)
def cpt_refresh(config: CptRefreshConfig | None = None) -> dict | State:
    config = config or CptRefreshConfig()
    try:
        with refresh_lock(config.lock_timeout_s):
            return _refresh(config)
    except RefreshRefused as exc:  # raised only by the lock: the refresh itself never started
        logger().warning("%s", exc)
        _refused_event(str(exc))
        return Cancelled(message=str(exc))  # the run's final state: the UI shows it on the run's page


def _refused_event(message: str) -> None:
    """An event about this run whose resource name is the refusal: `prefect deployment run --watch`
    prints the run's events (not its logs, unless the server streams them), so it shows why."""
    from prefect.events import emit_event

    if flow_run.id:
        emit_event(
            event="nemoflow.cpt-refresh.refused",
            resource={
                "prefect.resource.id": f"nemoflow.concurrency-limit.{CONCURRENCY_LIMIT}",
                "prefect.resource.name": message,
            },
            related=[{"prefect.resource.id": f"prefect.flow-run.{flow_run.id}", "prefect.resource.role": "flow-run"}],
            payload={"message": message},
        )
        # Send it before the run turns Cancelled: events leave through a background worker, and
        # `--watch` stops at the final state (CI once saw the state overtake the event under load).
        from prefect.events.worker import EventsWorker

        sender = threading.Thread(target=EventsWorker.instance().wait_until_empty, daemon=True)
        sender.start()
        sender.join(timeout=15)


def _refresh(config: CptRefreshConfig) -> dict:
    log = logger()
    registry = reg.ModelRegistry(config.registry_uri())
    state = registry.read()
    base_generation = state.generation
    promoted = state.promoted_model()
    run_id = str(flow_run.id) if flow_run.id else None
    if promoted is None or state.held_out is None:
        message = (
            f"the model registry {registry.uri} has no promoted model to continue from; run "
            "`prefect deployment run end-to-end/local` once (it registers and promotes its checkpoint) "
            "or `nemoflow models promote ID`"
        )
        _failure_artifact(message)
        raise RefreshFailed(message)

    # 1-2. what arrived since the last successful refresh
    new = discover_new_sources(config.sources_spec(), config.chunks, config.shards, registry.uri)
    if not new:
        message = f"no new data under {config.sources_spec()}: nothing to do; {promoted.id} stays promoted"
        log.info(message)
        create_markdown_artifact(
            key="cpt-refresh-report",
            markdown=f"# CPT refresh: no-op\n\n{message}\n",
            description="nothing new to train on",
        )
        return {"decision": "no-op", "promoted": promoted.id, "new_sources": []}

    try:
        return _train_and_decide(config, registry, state, base_generation, promoted, new, run_id)
    except Exception as exc:
        _failure_artifact(f"{type(exc).__name__}: {exc}", new)
        raise


def _train_and_decide(config, registry, state, base_generation, promoted, new, run_id) -> dict:
    log = logger()
    held_out = state.held_out
    # 3. prepare only the new sources, in a dataset of their own (a retry of this refresh hits the cache)
    identity = json.dumps(sorted((s.url, s.sha256) for s in new))
    name = "cpt-" + hashlib.sha256(identity.encode()).hexdigest()[:12]
    tokenizer = config.tokenizer or TokenizerRef(model=held_out.tokenizer_model)
    results = result_storage()  # where every stage persists its result (NEMOFLOW_RESULT_STORAGE)
    image = stage_image.with_options(result_storage=results)(
        config.image.source, config.image.dest, config.executor, config.image.convert
    )
    dataset = prepare_dataset(
        PrepareConfig(name=name, sources=[s.url for s in new], tokenizer=tokenizer), config.executor, image
    )
    manifest = storage.read_json(dataset.manifest_uri)
    sizes = {shard["url"]: shard.get("size") for shard in manifest.get("shards", [])}

    # 4. continue pretraining from the promoted checkpoint
    train = config.train.continued(promoted.checkpoint, dataset.tokens)
    steps = train.planned_steps()
    log.info(
        "continuing %s on %d new tokens with the %s engine (%s steps)",
        promoted.id,
        dataset.tokens,
        train.engine,
        steps if steps is not None else "its own",
    )
    candidate: CheckpointRef = pretrain.with_options(result_storage=results)(
        train, dataset, image, config.executor, init_from=storage.local_path(promoted.checkpoint)
    )

    # 5. the candidate's own checks (files, weights, loss threshold, better than untrained)
    report = validate_checkpoint.with_options(result_storage=results)(
        candidate, dataset, config.validation_threshold, config.executor, image
    )

    # 6. candidate vs promoted on the same fixed held-out set
    losses = compare_on_held_out(candidate, promoted.checkpoint, held_out, config.executor, image)
    limit = losses.promoted_loss * (1 + config.tolerance)
    accept = losses.candidate_loss <= limit
    why = (
        f"candidate held-out loss {losses.candidate_loss:.4f} {'<=' if accept else '>'} promoted "
        f"{losses.promoted_loss:.4f} x (1 + tolerance {config.tolerance:g}) = {limit:.4f}"
    )
    model_id = reg.new_model_id(candidate.uri)
    record = reg.ModelRecord(
        id=model_id,
        checkpoint=candidate.uri,
        parent=promoted.id,
        data=[s.model_copy(update={"size": sizes.get(s.url)}) for s in new],
        dataset_manifest=dataset.manifest_uri,
        metrics={
            "val_loss": report.val_loss,
            "untrained_loss": report.untrained_loss,
            "held_out_loss": losses.candidate_loss,
            "parent_held_out_loss": losses.promoted_loss,
            "tokens": dataset.tokens,
            "steps": steps if steps is not None else candidate.step,
        },
        image=image.model_dump(mode="json"),
        code_version=reg.code_version(),
        flow_run_id=run_id,
        note=("promoted: " if accept else "rejected: ") + why,
    )

    serving = state.serving
    if accept and config.serve.enabled:
        if registry.read().generation != base_generation:
            raise reg.ConcurrentUpdate(f"registry {registry.uri} changed during this refresh; not switching")
        # 7. zero-downtime switch; only then the registry says the candidate is promoted
        serving = switch_serving(
            candidate,
            model_id,
            state.serving,
            config.serve.port,
            config.serve.model_name,
            config.executor,
            image,
            config.serve.engine,
            config.serve.smoke_prompt,
            config.serve.ready_timeout_s,
        )
    # A rejected candidate is kept for the record, but its sources stay pending (see module docstring).
    new_state = record_model(
        registry.uri, record, accept, record.data if accept else [], base_generation, serving if accept else None
    )
    summary = {
        "decision": "promoted" if accept else "rejected",
        "reason": why,
        "candidate": model_id,
        "promoted": new_state.promoted,
        "new_sources": [s.url for s in new],
        "tokens": dataset.tokens,
        "candidate_loss": losses.candidate_loss,
        "promoted_loss": losses.promoted_loss,
        "endpoint": serving.url if serving else None,
    }
    _report_artifacts(summary, record, promoted, new_state, held_out)
    if accept and config.sft is not None:
        # 8. supervised fine-tuning of the model just promoted (tasks/sft.py), registered as its child
        summary["sft"] = run_sft(
            config.sft.train,
            config.sft.data,
            new_state.models[model_id],
            registry.uri,
            config.executor,
            image,
            config.sft.promote,
        )
    log.info("%s %s: %s", "promoted" if accept else "kept", new_state.promoted, why)
    summary["gpu_time"] = gpu_time.publish("cpt-refresh")  # where the training and validation GPU-seconds went
    return summary


def _failure_artifact(message: str, new: list | None = None, outcome: str = "FAILED") -> None:
    lines = [
        f"# CPT refresh {outcome}",
        "",
        message,
        "",
        "The promoted model keeps serving; the registry is unchanged.",
    ]
    if new:
        lines += ["", "New sources (still pending):", ""] + [f"- `{s.url}`" for s in new]
    create_markdown_artifact(
        key="cpt-refresh-report", markdown="\n".join(lines), description=f"refresh {outcome.split()[0].lower()}"
    )


def _report_artifacts(
    summary: dict, record: reg.ModelRecord, parent: reg.ModelRecord, state: reg.RegistryState, held_out: reg.HeldOut
) -> None:
    lines = [
        f"# CPT refresh: {summary['decision'].upper()}",
        "",
        summary["reason"],
        "",
        "| | candidate | promoted before |",
        "|---|---|---|",
        f"| model | `{record.id}` | `{parent.id}` |",
        f"| held-out loss | {summary['candidate_loss']:.4f} | {summary['promoted_loss']:.4f} |",
        f"| checkpoint | `{record.checkpoint}` | `{parent.checkpoint}` |",
        "",
        f"New data: {len(record.data)} source(s), {summary['tokens']:,} tokens",
        "",
        *[f"- `{s.url}` ({s.sha256})" for s in record.data],
        "",
        f"Held-out set (fixed, from the registry): validation split {held_out.split} (seed {held_out.seed}, "
        f"{held_out.num_batches} batches of {held_out.seq_length} tokens) of `{held_out.data_prefix}`",
        "",
        f"Serving: {summary['endpoint'] or 'unchanged'}; now promoted: `{state.promoted}`",
    ]
    create_markdown_artifact(key="cpt-refresh-report", markdown="\n".join(lines), description="CPT refresh decision")
    create_markdown_artifact(
        key="model-lineage",
        markdown=model_lineage_markdown(state, state.promoted),
        description="the promoted model and its parents",
    )


def model_lineage_markdown(state: reg.RegistryState, model_id: str | None) -> str:
    lines = [
        f"# Lineage of `{model_id}`",
        "",
        "| model | parent | held-out loss | val loss | data | created |",
        "|---|---|---:|---:|---|---|",
    ]
    for record in state.lineage(model_id) if model_id else []:
        data = ", ".join(f"`{s.name}`" for s in record.data[:5]) + (" ..." if len(record.data) > 5 else "")
        held = record.metrics.get("held_out_loss")
        val = record.metrics.get("val_loss")
        lines.append(
            f"| `{record.id}` | `{record.parent or '-'}` | {'' if held is None else f'{held:.4f}'} | "
            f"{'' if val is None else f'{val:.4f}'} | {data} | {record.created_at} |"
        )
    return "\n".join(lines)
