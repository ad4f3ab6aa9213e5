"""Stages of the continued-pretraining refresh that are not training or data stages.

    new = discover_new_sources(spec, chunks, shards, registry_uri)        # inputs not trained on yet
    losses = compare_on_held_out(candidate, promoted_uri, held_out, ...)  # same fixed samples for both
    serving = switch_serving(candidate, model_id, current, executor, ...) # zero-downtime switch
    state = record_model(registry_uri, record, promote=..., ...)          # atomic registry commit

The comparison runs as a job (``python -m workloads.compare``) where the
executor says, like validation: on a cluster it needs a GPU node. The switch is
the backend's (:meth:`infra.jobs.Backend.switch_service`): blue/green on one port
locally, a rolling update on Kubernetes, a new job then the old one cancelled on Slurm.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from typing import Any

from prefect import task
from pydantic import BaseModel

from infra import registry as reg
from infra import storage
from infra.configs.train import parse_blend
from infra.executors import Executor, as_executor, get_backend
from infra.jobs import ImageRef, JobSpec, Resources, ServiceInfo, workload_job
from infra.settings import SERVE_API_KEY_ENV
from infra.sources import expand_sources
from tasks.common import logger, run_job, transient_only
from tasks.refs import CheckpointRef, EndpointRef
from tasks.serve import build_serve_spec, local_checkpoint, service_name
from tasks.smoke import smoke_test
from workloads.serve_engines import ServeEngineConfig

_GLOB = re.compile(r"[*?\[]")
DEFAULT_RESOURCES = Resources(cpus_per_task=2, time="01:00:00")


def source_identity(url: str) -> str:
    """What tells a changed input from a known one: content hash locally, md5/etag on GCS and HTTP."""
    if storage.scheme(url) in ("file", "gs", "gcs"):
        # bare hex for local files: the same form as the dataset manifest's sha256
        return storage.fingerprint(url).removeprefix("sha256:")
    from infra.fetch import probe

    remote = probe(url)
    return remote.sha256 or remote.md5 or remote.etag or f"size:{remote.size}:{remote.last_modified}"


@task(name="discover-new-sources", task_run_name="discover new sources")
def discover_new_sources(
    sources: str | list[str], chunks: str | None, shards: str | None, registry_uri: str
) -> list[reg.SourceRecord]:
    """Sources whose URL was never trained on, or whose content changed since (by checksum)."""
    processed = reg.ModelRegistry(registry_uri).read().processed_sources
    if isinstance(sources, str) and _GLOB.search(sources) and not storage.glob(sources):
        # An empty drop folder is the normal quiet night, not an error (expand_sources refuses it).
        logger().info("no file matches %s", sources)
        return []
    found = expand_sources(sources, chunks=chunks, shards=shards)
    new = []
    for source in found:
        identity = source_identity(source.url)
        known = processed.get(source.url)
        if known is None or known.sha256 != identity:
            new.append(reg.SourceRecord(name=source.name, url=source.url, sha256=identity))
    logger().info("%d source(s) found, %d new since the last successful refresh", len(found), len(new))
    return new


class HeldOutLosses(BaseModel):
    candidate_loss: float
    promoted_loss: float
    held_out: reg.HeldOut


def build_compare_job(
    candidate: str,
    promoted: str,
    held_out: reg.HeldOut,
    output: str,
    image: ImageRef | None = None,
    resources: Resources | None = None,
) -> JobSpec:
    args = ["--candidate", candidate, "--promoted", promoted, "--data-prefix", json.dumps(held_out.data_prefix)]
    data = [os.path.dirname(storage.local_path(p)) for p in parse_blend(held_out.data_prefix)[0]]
    if held_out.tokenizer_model:
        args += ["--tokenizer-model", held_out.tokenizer_model]
        data.append(os.path.dirname(storage.local_path(held_out.tokenizer_model)))
    args += ["--seq-length", str(held_out.seq_length), "--split", held_out.split, "--seed", str(held_out.seed)]
    args += ["--num-batches", str(held_out.num_batches), "--output", output]
    return workload_job(
        "compare-" + hashlib.sha256(output.encode()).hexdigest()[:10],
        "workloads.compare",
        args,
        image=image,
        resources=resources or DEFAULT_RESOURCES,
        paths=[os.path.dirname(output)],
        read_only=sorted({candidate, promoted, *data}),
    )


@task(
    name="compare-on-held-out",
    task_run_name="candidate vs promoted on the held-out set",
    retries=1,
    retry_delay_seconds=5,
    retry_condition_fn=transient_only(),
)
def compare_on_held_out(
    candidate: CheckpointRef,
    promoted_checkpoint: str,
    held_out: reg.HeldOut,
    executor: Executor | Any = None,
    image: ImageRef | None = None,
    resources: Resources | None = None,
) -> HeldOutLosses:
    """Both models' mean loss on exactly the same held-out samples (see workloads.compare)."""
    run_dir = candidate.run_dir or os.path.dirname(os.path.dirname(storage.local_path(candidate.uri)))
    output = os.path.join(storage.local_path(run_dir), "validation", "held-out-comparison.json")
    storage.makedirs(os.path.dirname(output))
    job = build_compare_job(
        storage.local_path(candidate.uri), local_checkpoint(promoted_checkpoint), held_out, output, image, resources
    )
    run_job(job, executor)
    result = storage.read_json(output)
    return HeldOutLosses(
        candidate_loss=result["candidate_loss"], promoted_loss=result["promoted_loss"], held_out=held_out
    )


@task(name="switch-serving", task_run_name="switch {model_name} on port {port} to {model_id}")
def switch_serving(
    checkpoint: CheckpointRef,
    model_id: str,
    current: reg.Serving | None,
    port: int,
    model_name: str,
    executor: Executor | Any = None,
    image: ImageRef | None = None,
    engine: ServeEngineConfig | None = None,
    smoke_prompt: str = "In the beginning",
    ready_timeout_s: float = 180,
) -> reg.Serving:
    """Serve ``checkpoint`` instead of the current server without downtime, smoke-tested before it takes
    traffic (:meth:`infra.jobs.Backend.switch_service`). A failure leaves the current server serving."""
    log = logger()
    executor = as_executor(executor)
    backend = get_backend(executor)
    spec = build_serve_spec(checkpoint, port, model_name, backend.bind_host, image, engine=engine)
    api_key_env = SERVE_API_KEY_ENV if SERVE_API_KEY_ENV in spec.secret_env else None
    # A name of its own: the old and the new server run side by side until the switch.
    spec = spec.model_copy(
        update={"name": f"{service_name(model_name)[:40]}-{model_id.rsplit('-', 1)[-1]}-{int(time.time()) % 100000}"}
    )

    def check(new: ServiceInfo) -> None:
        endpoint = EndpointRef(
            url=new.url,
            model=model_name,
            executor=executor,
            handle=new.name,
            checkpoint=checkpoint.uri,
            api_key_env=api_key_env,
        )
        smoke_test.fn(endpoint, smoke_prompt, 8, 60)

    info = backend.switch_service(
        current.service if current else None,
        spec,
        check,
        ready_timeout_s=ready_timeout_s,
        on_log=lambda line: log.info("[%s] %s", spec.name, line),
    )
    log.info("%s now serves %s at %s", info.name, model_id, info.url)
    return reg.Serving(
        model=model_id,
        service=info.name,
        port=port,
        model_name=model_name,
        url=info.url,
        executor=executor.model_dump(mode="json"),
    )


@task(name="record-model", task_run_name="registry: {record.id}")
def record_model(
    registry_uri: str,
    record: reg.ModelRecord,
    promote: bool,
    sources: list[reg.SourceRecord],
    expected_generation: int,
    serving: reg.Serving | None = None,
    held_out: reg.HeldOut | None = None,
) -> reg.RegistryState:
    return reg.ModelRegistry(registry_uri).register(
        record,
        promote=promote,
        sources=sources,
        serving=serving,
        held_out=held_out,
        expected_generation=expected_generation,
    )
