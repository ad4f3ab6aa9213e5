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
from pathlib import Path
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
from tasks.refs import CheckpointRef, DatasetRef, EndpointRef
from workloads.serve_engines import ENGINES, SERVE_ENGINES, Auto, ServeEngine, ServeEngineConfig

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
    start_early: bool = Field(
        False,
        description="start the server while the model trains, on random weights of its shape, and load the "
        "validated checkpoint into it in place (engines that can: vllm; the GPU needs room for both); the server "
        "serves nothing before that load, and is stopped when training or validation fails",
    )


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
    return _served_hash({"checkpoint": checkpoint.model_dump(mode="json")}, port, model_name, executor, image, engine)


def _served_hash(what: dict, port: int, model_name: str, executor, image, engine) -> str:
    """The hash of what a server serves (``what``) and how: its port, name, backend, image, engine, whether keyed,
    the server's code."""
    payload = {
        **what,
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
    standby: bool = False,
    readable: list[str] | None = None,
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
        serve_args(checkpoint_dir, port, model_name, host)
        + engine.server_args()
        + auth
        + (["--standby"] if standby else []),
        port=port,
        image=image,
        resources=engine.resources,
        read_only=[checkpoint_dir, *(readable or [])],
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
        if not (running and running.healthy and fingerprint in (running.fingerprint, loaded_fingerprint(running))):
            # The server a stored result describes is gone: drop that result so this run deploys
            # again and stores the new one under the same key. If it cannot be dropped (a result
            # storage without a path), a one-off key still forces the deploy.
            if not _drop_record(task_ctx, key):
                return f"{key}-{uuid.uuid4().hex}"
        return key


# ---------------------------------------------------------------- started early (serve.start_early)

STANDBY_PREFIX = "standby-"


class Standby(BaseModel):
    """A server started on standby while the model trains (``start_inference_early``), for the deploy stage."""

    endpoint: EndpointRef
    fingerprint: str = Field(..., description="its service's fingerprint (STANDBY_PREFIX...)")
    skeleton: str = Field(..., description="the directory it was started on: config.json and the tokenizer")


def standby_fingerprint(served_config: dict, port: int, model_name: str, executor, image, engine) -> str:
    return STANDBY_PREFIX + _served_hash({"served_config": served_config}, port, model_name, executor, image, engine)


def loaded_fingerprint(running: ServiceInfo) -> str | None:
    """The deployment a standby server loaded (its ``/health`` says); None for any other server."""
    if not (running.fingerprint or "").startswith(STANDBY_PREFIX):
        return None
    import httpx

    try:
        return ((httpx.get(running.url.rstrip("/") + "/health", timeout=5).json() or {}).get("serves") or {}).get(
            "fingerprint"
        )
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


# config.json fields that name where and with what a config was written, not the model
CONFIG_PROVENANCE = ("_name_or_path", "transformers_version")


def config_difference(expected: dict, actual: dict) -> list[str]:
    """The config.json fields in which a checkpoint differs from the shape a standby server was started on (the
    fields it was started on: the rest are transformers' defaults, which vLLM filled in alike)."""
    keys = set(expected) - set(CONFIG_PROVENANCE)
    return sorted(k for k in keys if expected.get(k) != actual.get(k))


def served_config(train, dataset: DatasetRef, image: ImageRef | None) -> dict | None:
    """The config.json ``train`` (a training engine) will give its checkpoint, before it trains (None: unknown)."""
    from tasks.train_engines.base import TrainInputs

    return train.served_config(TrainInputs(dataset=dataset, image=image))


class StandbyCache(CachePolicy):
    """Cached on the same inputs while a server of that name runs (the standby, or what it became); when none
    runs, the record is dropped and the task starts one again (a run that failed before deploying stopped it)."""

    def compute_key(self, task_ctx, inputs, flow_parameters, **kwargs) -> str | None:
        model_name = inputs.get("model_name", DEFAULT_MODEL_NAME)
        shape = served_config(inputs["train"], inputs["dataset"], inputs.get("image"))
        key = "start-inference-early-" + standby_fingerprint(
            shape,
            inputs.get("port", DEFAULT_PORT),
            model_name,
            inputs.get("executor"),
            inputs.get("image"),
            inputs.get("engine"),
        )
        try:
            running = get_backend(inputs.get("executor")).service(service_name(model_name))
        except Exception:  # noqa: BLE001 - a backend that cannot be asked: start again
            running = None
        if running is None and not _drop_record(task_ctx, key):
            return f"{key}-{uuid.uuid4().hex}"
        return key


@task(
    name="start-inference-early",
    task_run_name="start {model_name} early",
    cache_policy=StandbyCache(),
    persist_result=True,
)
def start_inference_early(
    train: Any,
    dataset: DatasetRef,
    executor: Executor | Any = None,
    port: int = DEFAULT_PORT,
    model_name: str = DEFAULT_MODEL_NAME,
    ready_timeout_s: float = 300,
    image: ImageRef | None = None,
    engine: ServeEngineConfig | None = None,
) -> Standby | None:
    """Start the server on standby while the model trains: on the config.json of the checkpoint ``train`` (a
    training engine) will make from ``dataset`` and the dataset's tokenizer, random weights, serving nothing until
    :func:`deploy_inference` loads the validated checkpoint into it. Never fails the run: where it cannot start (an engine that cannot load in place,
    a server of that name already running, no room on the GPU) it says why in one line and returns None, and the
    deploy stage starts the server as usual."""
    log = logger()
    executor = as_executor(executor)
    backend = get_backend(executor)
    engine = engine or Auto()
    name = service_name(model_name)
    shape = served_config(train, dataset, image)
    tokenizer_model = dataset.tokenizer.model
    why = None
    if not ENGINES[engine.served_name()].can_standby:
        why = f"the {engine.served_name()} engine cannot load weights into a running server"
    elif shape is None or not tokenizer_model or not storage.is_local(tokenizer_model):
        why = "the training engine cannot say the checkpoint's shape before it trains (or its tokenizer is remote)"
    elif not storage.is_local(get_settings().work_dir):
        why = f"the work dir {get_settings().work_dir} is not a file system the server can load a checkpoint from"
    elif (running := backend.service(name)) is not None:
        why = f"{name} runs already ({running.url}); the deploy stage replaces it once the checkpoint is validated"
    if why:
        log.warning("not starting %s early: %s", name, why)
        return None
    fingerprint = standby_fingerprint(shape, port, model_name, executor, image, engine)
    # on the work dir, which the server's node (or pod) sees as the flow does; the checkpoint it loads will be there
    work_dir = Path(storage.local_path(get_settings().work_dir))
    skeleton = work_dir / "standby" / fingerprint
    skeleton.mkdir(parents=True, exist_ok=True)
    storage.write_json(str(skeleton / "config.json"), shape)
    storage.get_file(tokenizer_model, str(skeleton / "tokenizer.model"))
    spec = build_serve_spec(
        CheckpointRef(uri=str(skeleton), step=0),
        port,
        model_name,
        backend.bind_host,
        image,
        fingerprint,
        engine,
        standby=True,
        readable=[str(work_dir / "runs")],
    )
    log.info("starting %s early (standby) on the %s backend: %s", spec.name, backend.name, shlex.join(spec.command))
    try:
        with gpu_time.clocked(spec.resources, tail=phases.WAIT) as clock:
            info = backend.start_service(
                spec, ready_timeout_s=ready_timeout_s, on_log=lambda line: log.info("[%s] %s", spec.name, line)
            )
            clock.stop()
            clock.job = gpu_time.service_phases(info.url)
    except Exception as exc:  # noqa: BLE001 - see the docstring: the deploy stage starts it as usual
        log.warning(
            "could not start %s early (%s: %s); the deploy stage starts it as usual", name, type(exc).__name__, exc
        )
        backend.stop_service(name)
        return None
    log.info("%s is up on standby at %s: it serves once the validated checkpoint is loaded", name, info.url)
    endpoint = EndpointRef(
        url=info.url,
        model=model_name,
        executor=executor,
        handle=spec.name,
        checkpoint=None,
        api_key_env=SERVE_API_KEY_ENV if SERVE_API_KEY_ENV in spec.secret_env else None,
    )
    return Standby(endpoint=endpoint, fingerprint=fingerprint, skeleton=str(skeleton))


def stop_early(standby: Standby | None) -> None:
    """Stop a standby server that will not be loaded (training or validation failed); it served nothing."""
    if standby is not None and get_backend(standby.endpoint.executor).stop_service(standby.endpoint.handle):
        logger().info("stopped %s, started early: nothing was deployed", standby.endpoint.handle)


def load_into_standby(standby: Standby, checkpoint: CheckpointRef, fingerprint: str, clock) -> ServiceInfo | None:
    """Load ``checkpoint`` into the standby server; its service once it serves it, else None (the reason logged in
    one line, the standby stopped: the caller starts the server as usual)."""
    import httpx

    log = logger()
    backend = get_backend(standby.endpoint.executor)
    name = standby.endpoint.handle
    running = backend.service(name)
    why = None
    if running is None or running.fingerprint != standby.fingerprint or not running.healthy:
        why = "it is not running (or something else runs under its name)"
        running = None
    elif not storage.is_local(checkpoint.uri):
        why = f"the checkpoint {checkpoint.uri} is not on this file system"
    else:
        checkpoint_dir = storage.local_path(checkpoint.uri)
        try:
            expected = json.loads((Path(standby.skeleton) / "config.json").read_text())
            differ = config_difference(expected, storage.read_json(storage.join(checkpoint_dir, "config.json")))
        except (OSError, ValueError) as exc:
            differ, why = [], f"its config.json could not be compared ({type(exc).__name__}: {exc})"
        if differ:
            why = f"the checkpoint's config.json differs from the shape it started on in {', '.join(differ)}"
    if why is None:
        key = get_settings().serve_api_key
        headers = {"Authorization": f"Bearer {key.get_secret_value()}"} if key is not None else {}
        try:
            with clock.part(phases.SERVER_START):
                answer = httpx.post(
                    running.url.rstrip("/") + "/nemoflow/load",
                    json={"checkpoint": checkpoint_dir, "fingerprint": fingerprint},
                    headers=headers,
                    timeout=httpx.Timeout(600, connect=10),
                )
            if answer.status_code == 200:
                done = answer.json()
                log.info("loaded %s into %s (started early) in %.1f s", checkpoint.uri, name, done.get("seconds", 0))
                return running
            why = f"its load answered HTTP {answer.status_code}: {answer.text[:300]}"
        except httpx.HTTPError as exc:
            why = f"its load failed: {type(exc).__name__}: {exc}"
    log.warning("not serving from %s, started early: %s; starting the server as usual", name, why)
    if running is not None:
        backend.stop_service(name)
    return None


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
    standby: Standby | None = None,
) -> EndpointRef:
    """Serve ``checkpoint`` (OpenAI API and the seed's NeMo route) where ``executor`` says; return once
    ``/health`` answers. A start that failed for a transient reason is retried (the task's retries). With
    ``standby`` (a server :func:`start_inference_early` started while the model trained), the checkpoint is loaded
    into it in place; where that cannot be done, the server starts as usual."""
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
        info = load_into_standby(standby, checkpoint, fingerprint, clock) if standby is not None else None
        if info is None:
            clock.parts.clear()
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
