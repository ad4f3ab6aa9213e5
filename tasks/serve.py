"""Stage: deploy the inference server for a checkpoint; stop it.

    endpoint = deploy_inference(checkpoint, port=8000, model_name="nemoflow-model")
    ...
    stop_inference(endpoint)            # or: nemoflow serve stop nemoflow-model

The server (``workloads/serve.py``) is managed by :mod:`infra.services`: it
runs in its own process group and outlives the flow run that deployed it, so a
deployed endpoint keeps serving; teardown is explicit (``stop_inference``).
A deploy that fails or is cancelled before the server is ready kills what it
started. Deploying a name that is already serving something else stops the
old server first (redeploy). Blue/green (the CPT refresh): deploy the new
checkpoint under another name and port, smoke-test it, switch clients, then
``stop_inference`` the old one: start and stop are separate on purpose.

Caching. A server is live state, so a cached result is only valid while the
server it describes still runs. :class:`LiveServiceCache` keys the task on
what is deployed (checkpoint, port, name, host, code of the server); when the
registered server under that name is alive, healthy and was deployed with the
same key, a re-run is a cache hit (``Cached``; the endpoint keeps answering).
Otherwise the stale record is dropped first, so the task runs and deploys again.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import sys
import uuid
from dataclasses import dataclass

from prefect import task
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.cache_policies import CachePolicy

from infra import services, storage
from infra.jobs import ServiceSpec
from tasks.common import code_fingerprint, logger
from tasks.refs import CheckpointRef, EndpointRef, ImageRef

DEFAULT_PORT = 8000
DEFAULT_HOST = "127.0.0.1"
DEFAULT_MODEL_NAME = "nemoflow-model"
SERVER_MODULES = ("workloads.serve", "infra.services", "tasks.serve")
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.model", "generation_config.json")
OPTIONAL_CHECKPOINT_FILES = ("generation_config.json",)


def service_name(model_name: str) -> str:
    """The registry name of a model's server (a DNS-style label, as Slurm/k8s names need)."""
    name = re.sub(r"[^a-z0-9-]+", "-", model_name.lower()).strip("-")[:63].strip("-")
    if not name:
        raise ValueError(f"model name {model_name!r} has no letters or digits to name its server after")
    return name


def deployment_fingerprint(checkpoint: CheckpointRef, port: int, model_name: str, host: str) -> str:
    """What a running server must match for a re-run to reuse it."""
    payload = {
        "checkpoint": checkpoint.model_dump(mode="json"),
        "port": port,
        "model_name": model_name,
        "host": host,
        "code": code_fingerprint(*SERVER_MODULES),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def serve_command(checkpoint_dir: str, port: int, model_name: str, host: str = DEFAULT_HOST) -> list[str]:
    return [
        sys.executable,
        "-m",
        "workloads.serve",
        "--checkpoint",
        checkpoint_dir,
        "--port",
        str(port),
        "--host",
        host,
        "--model-name",
        model_name,
    ]


def local_checkpoint(uri: str) -> str:
    """A local directory holding the checkpoint: the path itself, or a verified copy of a remote one.

    Remote (gs://) checkpoints are copied once into ``<work_dir>/cache/checkpoints/``;
    a copy is reused only while every file's fingerprint (md5/crc32c on GCS) is unchanged.
    """
    if storage.is_local(uri):
        return storage.local_path(uri)
    digest = hashlib.sha256(storage.normalize(uri).encode()).hexdigest()[:16]
    dest = services.local_state_dir() / "cache" / "checkpoints" / digest
    manifest_path = dest / ".nemoflow-source.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (FileNotFoundError, ValueError):
        manifest = {}
    for name in CHECKPOINT_FILES:
        source = storage.join(uri, name)
        if not storage.exists(source):
            if name in OPTIONAL_CHECKPOINT_FILES:
                continue
            raise FileNotFoundError(f"checkpoint {uri} has no {name}")
        fingerprint = storage.fingerprint(source)
        if manifest.get(name) == fingerprint and (dest / name).exists():
            continue
        storage.get_file(source, str(dest / name))  # atomic: never a half file under its name
        manifest[name] = fingerprint
        storage.write_json(str(manifest_path), manifest)
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
        if inputs.get("backend", "local") != "local":
            return None
        model_name = inputs.get("model_name", DEFAULT_MODEL_NAME)
        fingerprint = deployment_fingerprint(
            inputs["checkpoint"], inputs.get("port", DEFAULT_PORT), model_name, inputs.get("host", DEFAULT_HOST)
        )
        key = f"deploy-inference-{fingerprint}"
        entry = services.get_service(service_name(model_name))
        if not (entry and entry.spec_hash == fingerprint and services.is_healthy(entry)):
            # The server a stored result describes is gone: drop that result so this run deploys
            # again and stores the new one under the same key. If it cannot be dropped (a result
            # storage without a path), a one-off key still forces the deploy.
            if not _drop_record(task_ctx, key):
                return f"{key}-{uuid.uuid4().hex}"
        return key


def _publish(endpoint: EndpointRef, handle: services.ServiceHandle) -> None:
    key = service_name(endpoint.model)
    create_link_artifact(
        key=f"endpoint-{key}",
        link=endpoint.url + "/v1/models",
        link_text=f"{endpoint.model} at {endpoint.url}",
        description=f"OpenAI-compatible endpoint serving {endpoint.checkpoint}",
    )
    body = json.dumps({"prompt": "In the beginning", "model": endpoint.model, "max_tokens": 20, "temperature": 0})
    chat = json.dumps({"model": endpoint.model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 20})
    create_markdown_artifact(
        key=f"endpoint-{key}-usage",
        description=f"How to call {endpoint.model}",
        markdown=f"""# Endpoint `{endpoint.model}`

| | |
|---|---|
| URL | {endpoint.url} |
| checkpoint | `{endpoint.checkpoint}` |
| pid | {handle.pid} |
| log | `{handle.log_path}` |

```bash
curl -s {endpoint.url}/v1/completions -H 'Content-Type: application/json' \\
  -d {shlex.quote(body)}
curl -s {endpoint.url}/v1/chat/completions -H 'Content-Type: application/json' \\
  -d {shlex.quote(chat)}
```

OpenAI clients: `OpenAI(base_url="{endpoint.url}/v1", api_key="unused")`.

Stop it: `nemoflow serve stop {key}`
""",
    )


@task(
    name="deploy-inference",
    task_run_name="deploy {model_name} on port {port}",
    cache_policy=LiveServiceCache(),
    persist_result=True,
)
def deploy_inference(
    checkpoint: CheckpointRef,
    port: int = DEFAULT_PORT,
    model_name: str = DEFAULT_MODEL_NAME,
    backend: str = "local",
    ready_timeout_s: float = 120,
    host: str = DEFAULT_HOST,
    image: ImageRef | None = None,
) -> EndpointRef:
    """Serve ``checkpoint`` over the OpenAI API; return once ``/health`` answers 200."""
    if backend in ("slurm", "k8s"):
        return _deploy_on_cluster(backend, checkpoint, port, model_name, ready_timeout_s, image)
    if backend != "local":
        raise ValueError(f"deploy_inference: unknown backend {backend!r}; local, slurm and k8s can serve")
    log = logger()
    name = service_name(model_name)
    fingerprint = deployment_fingerprint(checkpoint, port, model_name, host)
    endpoint = EndpointRef(
        url=f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}",
        model=model_name,
        backend=backend,
        handle=name,
        checkpoint=checkpoint.uri,
    )
    current = services.get_service(name)
    if current and current.spec_hash == fingerprint and services.is_healthy(current):
        log.info("%s already serves %s at %s (pid %d): keeping it", name, checkpoint.uri, current.url, current.pid)
        _publish(endpoint, current)
        return endpoint
    if current is not None:
        log.info("stopping the previous %s server (pid %d, %s)", name, current.pid, current.checkpoint)
        services.stop_service(current)
    local_dir = local_checkpoint(checkpoint.uri)
    spec = ServiceSpec(name=name, command=serve_command(local_dir, port, model_name, host), port=port)
    log_dir = services.registry_path().parent / "logs"
    log.info("starting %s: %s", name, " ".join(spec.command))
    handle = services.start_service(
        spec,
        log_dir,
        host=host,
        ready_timeout_s=ready_timeout_s,
        checkpoint=checkpoint.uri,
        model=model_name,
        spec_hash=fingerprint,
        on_log=lambda line: log.info("[%s] %s", name, line),
    )
    log.info("%s is ready at %s (pid %d, log %s)", name, handle.url, handle.pid, handle.log_path)
    _publish(endpoint, handle)
    return endpoint


def _deploy_on_cluster(
    backend_name: str,
    checkpoint: CheckpointRef,
    port: int,
    model_name: str,
    ready_timeout_s: float,
    image: ImageRef | None,
) -> EndpointRef:
    """The server as a Slurm job on a compute node, or a Deployment + Service on Kubernetes.

    The checkpoint must be on storage the server sees (the cluster file system, the workspace
    PVC). On Slurm a job of the same name is replaced first (the backend would otherwise reuse a
    running job even when it serves another checkpoint); on Kubernetes the Deployment is applied
    over the old one (a rolling update). Not cached: a cluster server's liveness is not recorded
    here, so a re-run redeploys.
    """
    from infra.backends import get_backend
    from infra.jobs import Resources
    from tasks.image import container_image

    log = logger()
    name = service_name(model_name)
    backend = get_backend(backend_name)
    if backend_name == "slurm" and backend.stop_service(name):
        log.info("stopped the previous %s server job", name)
    in_container = container_image(image) is not None
    checkpoint_dir = checkpoint.uri if in_container or backend_name == "k8s" else local_checkpoint(checkpoint.uri)
    command = serve_command(checkpoint_dir, port, model_name, "0.0.0.0")
    if in_container or backend_name == "k8s":
        command[0] = "python"  # the image's interpreter, not this machine's
    spec = ServiceSpec(
        name=name,
        command=command,
        port=port,
        resources=Resources(cpus_per_task=1, gpus_per_node=1 if in_container else 0),
        container_image=container_image(image),
    )
    log.info("starting %s on %s: %s", name, backend_name, " ".join(command))
    if backend_name == "k8s":
        # Applied over an existing Deployment of that name: a rolling update, no downtime.
        url = backend.start_service(spec)
    else:
        url = backend.start_service(spec, ready_timeout_s=ready_timeout_s)
    endpoint = EndpointRef(url=url, model=model_name, backend=backend_name, handle=name, checkpoint=checkpoint.uri)
    log.info("%s is ready at %s", name, url)
    create_link_artifact(key=f"endpoint-{name}", link=url + "/v1/models", link_text=f"{model_name} on {backend_name}")
    return endpoint


@task(name="stop-inference", task_run_name="stop {endpoint.model}")
def stop_inference(endpoint: EndpointRef) -> bool:
    """Stop the server behind ``endpoint``; False if it was not running (already stopped)."""
    if endpoint.backend in ("slurm", "k8s"):
        from infra.backends import get_backend

        return get_backend(endpoint.backend).stop_service(endpoint.handle or service_name(endpoint.model))
    if endpoint.backend != "local":
        raise ValueError(f"stop_inference: unknown backend {endpoint.backend!r}")
    stopped = services.stop_service(endpoint.handle or service_name(endpoint.model))
    logger().info("%s: %s", endpoint.model, "stopped" if stopped else "was not running")
    return stopped
