"""Stage: deploy the inference server for a checkpoint; stop it.

    endpoint = deploy_inference(checkpoint, executor, port=8000, model_name="nemoflow-model", image=image)
    ...
    stop_inference(endpoint)            # or: nemoflow serve stop nemoflow-model

The server (``python -m workloads.serve``) is a service of the executor's
backend (:meth:`infra.jobs.Backend.start_service`): a managed local process
group that outlives the flow run, a Slurm job on a compute node, or a
Deployment + Service on Kubernetes. A deployed endpoint keeps serving after the
run; teardown is explicit (``stop_inference``, ``nemoflow serve stop``). A
deploy that fails or is cancelled before the server is ready leaves nothing
running. Deploying a name that serves something else replaces it.

Caching. A server is live state, so a cached result is only valid while the
server it describes still runs. :class:`LiveServiceCache` keys the task on
what is deployed (checkpoint, port, name, executor, image, code of the
server): when the backend reports the service of that name running, healthy
and deployed with the same fingerprint, a re-run is a cache hit (``Cached``;
the endpoint keeps answering). Otherwise the stale record is dropped first, so
the task runs and deploys again. On every backend.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import uuid
from dataclasses import dataclass
from typing import Any

from prefect import task
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.cache_policies import CachePolicy
from pydantic import BaseModel, ConfigDict, Field

from infra import phases, services, storage
from infra.executors import Executor, as_executor, get_backend
from infra.jobs import ImageRef, ServiceInfo, ServiceSpec, workload_service
from infra.settings import SERVE_API_KEY_ENV, get_settings
from tasks import gpu_time
from tasks.common import code_fingerprint, logger, transient_only
from tasks.refs import CheckpointRef, EndpointRef
from workloads.serve_engines import SERVE_ENGINES, Auto, ServeEngine, ServeEngineConfig

DEFAULT_PORT = 8000
DEFAULT_MODEL_NAME = "nemoflow-model"
SERVER_MODULES = (
    "workloads.serve",
    "workloads.serve_http",
    *(cls.__module__ for cls in SERVE_ENGINES),
    "workloads.serve_engines.base",
    "workloads.serve_engines.proxy",
    "infra.services",
    "tasks.serve",
)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class ServeConfig(BaseModel):
    """The inference server of a flow: where users call it and which engine serves (``serve:`` in a config)."""

    model_config = ConfigDict(extra="forbid")

    port: int = Field(DEFAULT_PORT, ge=1, le=65535)
    model_name: str = "nemoflow-demo"
    ready_timeout_s: float = Field(180, gt=0)
    engine: ServeEngineConfig = Field(default_factory=Auto)


def service_name(model_name: str) -> str:
    """The service's name on its backend (a DNS-style label, as Slurm/k8s names need)."""
    name = re.sub(r"[^a-z0-9-]+", "-", model_name.lower()).strip("-")[:63].strip("-")
    if not name:
        raise ValueError(f"model name {model_name!r} has no letters or digits to name its server after")
    return name


def deployment_fingerprint(
    checkpoint: CheckpointRef,
    port: int,
    model_name: str,
    executor: Any = None,
    image: ImageRef | None = None,
    engine: ServeEngine | None = None,
) -> str:
    """What a running server must match for a re-run to reuse it (the key's presence, never its value)."""
    payload = {
        "checkpoint": checkpoint.model_dump(mode="json"),
        "port": port,
        "model_name": model_name,
        "executor": as_executor(executor).kind,
        "image": image.model_dump(mode="json") if image else None,
        "engine": (engine or Auto()).model_dump(mode="json"),
        "keyed": get_settings().serve_api_key is not None,
        "code": code_fingerprint(*SERVER_MODULES),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def serve_args(checkpoint_dir: str, port: int, model_name: str, host: str) -> list[str]:
    """The arguments of ``python -m workloads.serve``."""
    return ["--checkpoint", checkpoint_dir, "--port", str(port), "--host", host, "--model-name", model_name]


def build_serve_spec(
    checkpoint: CheckpointRef,
    port: int,
    model_name: str,
    host: str,
    image: ImageRef | None = None,
    fingerprint: str | None = None,
    engine: ServeEngine | None = None,
) -> ServiceSpec:
    """The inference server as a service of any backend (what deploy_inference and nemoflow render use).

    The API key travels by name: the server reads NEMOFLOW_SERVE_API_KEY, which the backend injects
    from the settings (locally, sbatch's environment) or a Kubernetes Secret key. A server bound to
    every interface (a cluster node) requires it unless ``engine.allow_unauthenticated``. The engine gives
    its flags and the job's resources; nothing here depends on which engine it is.
    """
    engine = engine or Auto()
    checkpoint_dir = checkpoint.uri if not storage.is_local(checkpoint.uri) else storage.local_path(checkpoint.uri)
    public = host not in LOOPBACK
    keyed = get_settings().serve_api_key is not None or (public and not engine.allow_unauthenticated)
    auth = ["--api-key-env", SERVE_API_KEY_ENV] if keyed else ["--allow-unauthenticated"] if public else []
    return workload_service(
        service_name(model_name),
        "workloads.serve",
        serve_args(checkpoint_dir, port, model_name, host) + engine.server_args() + auth,
        port=port,
        image=image,
        resources=engine.resources,
        read_only=[checkpoint_dir],
        secret_env=[SERVE_API_KEY_ENV] if keyed else [],
        fingerprint=fingerprint,
        annotations={"checkpoint": checkpoint.uri, "model": model_name},
    )


def local_checkpoint(uri: str) -> str:
    """A local directory holding the checkpoint: the path itself, or a verified copy of a remote one.

    Remote (gs://) checkpoints are copied once into ``<work_dir>/cache/checkpoints/``: every file
    its ``MANIFEST.json`` lists (sharded safetensors, tokenizer files, ...), the manifest last (without
    a manifest: every file of the directory); a copy is reused only while every file's fingerprint
    (md5/crc32c on GCS) is unchanged.
    """
    if storage.is_local(uri):
        return storage.local_path(uri)
    digest = hashlib.sha256(storage.normalize(uri).encode()).hexdigest()[:16]
    dest = services.local_state_dir() / "cache" / "checkpoints" / digest
    manifest_path = dest / ".nemoflow-source.json"
    try:
        seen = json.loads(manifest_path.read_text())
    except (FileNotFoundError, ValueError):
        seen = {}
    listing = storage.join(uri, "MANIFEST.json")
    if storage.exists(listing):
        names = sorted(storage.read_json(listing).get("files", {})) + ["MANIFEST.json"]
    else:  # a checkpoint nemoflow did not write: every file of the directory
        names = sorted(storage.basename(p) for p in storage.listdir(uri))
    if "config.json" not in names:
        raise FileNotFoundError(f"checkpoint {uri} has no config.json (not a Hugging Face checkpoint directory)")
    for name in names:
        source = storage.join(uri, name)
        if not storage.exists(source):
            raise FileNotFoundError(f"checkpoint {uri} has no {name} (listed in its MANIFEST.json)")
        fingerprint = storage.fingerprint(source)
        if seen.get(name) == fingerprint and (dest / name).exists():
            continue
        storage.get_file(source, str(dest / name))  # atomic: never a half file under its name
        seen[name] = fingerprint
        storage.write_json(str(manifest_path), seen)
    return str(dest)


def _drop_record(task_ctx, key: str) -> bool:
    """Delete the persisted result under ``key``; True when it is gone (or never existed)."""
    store = getattr(task_ctx, "result_store", None)
    blocks = [b for b in (getattr(store, "result_storage", None), getattr(store, "metadata_storage", None)) if b]
    if not blocks:
        return False
    for block in blocks:
        basepath = getattr(block, "basepath", None)
        if not basepath:
            return False
        try:
            storage.remove(storage.join(str(basepath), key))
        except Exception:  # noqa: BLE001 - a record that cannot be removed is reported as not dropped
            return False
    return True


@dataclass
class LiveServiceCache(CachePolicy):
    """Cache hit only while the server recorded for these inputs is alive and healthy (see module doc)."""

    def compute_key(self, task_ctx, inputs, flow_parameters, **kwargs) -> str | None:
        model_name = inputs.get("model_name", DEFAULT_MODEL_NAME)
        executor = inputs.get("executor")
        fingerprint = deployment_fingerprint(
            inputs["checkpoint"],
            inputs.get("port", DEFAULT_PORT),
            model_name,
            executor,
            inputs.get("image"),
            inputs.get("engine"),
        )
        key = f"deploy-inference-{fingerprint}"
        try:
            running = get_backend(executor).service(service_name(model_name))
        except Exception:  # noqa: BLE001 - a backend that cannot be asked: deploy again
            running = None
        if not (running and running.fingerprint == fingerprint and running.healthy):
            # The server a stored result describes is gone: drop that result so this run deploys
            # again and stores the new one under the same key. If it cannot be dropped (a result
            # storage without a path), a one-off key still forces the deploy.
            if not _drop_record(task_ctx, key):
                return f"{key}-{uuid.uuid4().hex}"
        return key


def _publish(endpoint: EndpointRef, info: ServiceInfo) -> None:
    key = service_name(endpoint.model)
    create_link_artifact(
        key=f"endpoint-{key}",
        link=endpoint.url + "/v1/models",
        link_text=f"{endpoint.model} at {endpoint.url}",
        description=f"OpenAI-compatible endpoint serving {endpoint.checkpoint}",
    )
    seed = {"prompt": "In the beginning", "model": endpoint.model, "max-tokens": 64, "top_p": 0, "top_k": 0.9}
    seed = json.dumps({**seed, "temperature": 1.0})
    body = json.dumps({"prompt": "In the beginning", "model": endpoint.model, "max_tokens": 20, "temperature": 0})
    chat = json.dumps({"model": endpoint.model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 20})
    auth = f' -H "Authorization: Bearer ${endpoint.api_key_env}"' if endpoint.api_key_env else ""
    client_key = f"os.environ['{endpoint.api_key_env}']" if endpoint.api_key_env else '"unused"'
    create_markdown_artifact(
        key=f"endpoint-{key}-usage",
        description=f"How to call {endpoint.model}",
        markdown=f"""# Endpoint `{endpoint.model}`

| | |
|---|---|
| URL | {endpoint.url} |
| checkpoint | `{endpoint.checkpoint}` |
| backend | {info.backend} ({info.job_id}) |
| log | `{info.log}` |

```bash
# the NeMo deploy service's request (the seed's smoke test); it answers {{"output": ...}}
curl -s -X POST {endpoint.url}/v1/chat/completions/ -H 'Content-Type: application/json'{auth} \\
  -d {shlex.quote(seed)}
# OpenAI's completions and chat
curl -s {endpoint.url}/v1/completions -H 'Content-Type: application/json'{auth} \\
  -d {shlex.quote(body)}
curl -s {endpoint.url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\
  -d {shlex.quote(chat)}
```

OpenAI clients: `OpenAI(base_url="{endpoint.url}/v1", api_key={client_key})`.

Stop it: `nemoflow serve stop {key}`
""",
    )


@task(
    name="deploy-inference",
    task_run_name="deploy {model_name} on port {port}",
    cache_policy=LiveServiceCache(),
    persist_result=True,
    retries=2,
    retry_delay_seconds=[5, 30],
    retry_condition_fn=transient_only(),  # an unreachable API or a slow start; not a server that exited
)
def deploy_inference(
    checkpoint: CheckpointRef,
    executor: Executor | Any = None,
    port: int = DEFAULT_PORT,
    model_name: str = DEFAULT_MODEL_NAME,
    ready_timeout_s: float = 120,
    image: ImageRef | None = None,
    engine: ServeEngineConfig | None = None,
) -> EndpointRef:
    """Serve ``checkpoint`` (OpenAI API and the seed's NeMo route) where ``executor`` says; return once
    ``/health`` answers. A start that failed for a transient reason is retried (the task's retries)."""
    log = logger()
    executor = as_executor(executor)
    backend = get_backend(executor)
    engine = engine or Auto()
    fingerprint = deployment_fingerprint(checkpoint, port, model_name, executor, image, engine)
    spec = build_serve_spec(checkpoint, port, model_name, backend.bind_host, image, fingerprint, engine)
    if "--allow-unauthenticated" in spec.command:
        log.warning("%s serves on %s without an API key (allow_unauthenticated)", spec.name, backend.bind_host)
    log.info("starting %s on the %s backend: %s", spec.name, backend.name, shlex.join(spec.command))
    # timed for the run's gpu-time artifact: the server's start, itemised by its own /health report
    with gpu_time.clocked(spec.resources, tail=phases.WAIT) as clock:
        info = backend.start_service(
            spec, ready_timeout_s=ready_timeout_s, on_log=lambda line: log.info("[%s] %s", spec.name, line)
        )
        clock.stop()
        clock.job = gpu_time.service_phases(info.url)
    endpoint = EndpointRef(
        url=info.url,
        model=model_name,
        executor=executor,
        handle=spec.name,
        checkpoint=checkpoint.uri,
        api_key_env=SERVE_API_KEY_ENV if SERVE_API_KEY_ENV in spec.secret_env else None,
    )
    log.info("%s is ready at %s (%s %s)", spec.name, info.url, backend.name, info.job_id)
    _publish(endpoint, info)
    return endpoint


@task(name="stop-inference", task_run_name="stop {endpoint.model}")
def stop_inference(endpoint: EndpointRef) -> bool:
    """Stop the server behind ``endpoint``; False if it was not running (already stopped)."""
    stopped = get_backend(endpoint.executor).stop_service(endpoint.handle or service_name(endpoint.model))
    logger().info("%s: %s", endpoint.model, "stopped" if stopped else "was not running")
    return stopped
