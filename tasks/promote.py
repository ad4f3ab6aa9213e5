"""Stages of the continued-pretraining refresh that are not training or data stages.

    new = discover_new_sources(spec, chunks, shards, registry_uri)      # inputs not trained on yet
    losses = compare_on_held_out(candidate, promoted_uri, held_out)    # same fixed samples for both
    serving = switch_serving(candidate, current_serving, port, name)   # blue/green on one port
    state = record_model(registry_uri, record, promote=..., ...)       # atomic registry commit

The comparison runs as a job (``python -m tasks.promote compare ...``) on the
chosen backend, like validation: on a cluster it needs a GPU node.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import sys
import time

from prefect import task
from pydantic import BaseModel

from infra import registry as reg
from infra import services, storage
from infra.jobs import JobSpec, Mount, Resources
from infra.sources import expand_sources
from tasks.common import logger, run_job
from tasks.refs import CheckpointRef, ImageRef
from tasks.serve import DEFAULT_HOST, local_checkpoint, serve_command, service_name
from tasks.smoke import smoke_test
from tasks.train import REPO_ROOT

_GLOB = re.compile(r"[*?\[]")


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
    candidate: str, promoted: str, held_out: reg.HeldOut, output: str, image: ImageRef | None = None
) -> JobSpec:
    in_container = image is not None and image.kind in ("sqsh", "registry")
    python = "python" if in_container else (image.uri if image and image.kind == "python-env" else sys.executable)
    return JobSpec(
        name="compare-" + hashlib.sha256(output.encode()).hexdigest()[:10],
        command=[
            python,
            "-m",
            "tasks.promote",
            "compare",
            "--candidate",
            candidate,
            "--promoted",
            promoted,
            "--held-out",
            held_out.model_dump_json(),
            "--output",
            output,
        ],
        env={"PYTHONUNBUFFERED": "1", "PYTHONPATH": REPO_ROOT},
        resources=Resources(gpus_per_node=1 if in_container else 0, cpus_per_task=2, time="01:00:00"),
        container_image=image.uri if in_container else None,
        mounts=[
            Mount(source=REPO_ROOT, target=REPO_ROOT, read_only=True),
            Mount(source=os.path.dirname(output), target=os.path.dirname(output)),
        ]
        if in_container
        else [],
        workdir=REPO_ROOT,
    )


@task(
    name="compare-on-held-out",
    task_run_name="candidate vs promoted on the held-out set",
    retries=1,
    retry_delay_seconds=5,
)
def compare_on_held_out(
    candidate: CheckpointRef,
    promoted_checkpoint: str,
    held_out: reg.HeldOut,
    backend: str = "local",
    image: ImageRef | None = None,
) -> HeldOutLosses:
    """Both models' mean loss on exactly the same held-out samples (see workloads.validate_checkpoint)."""
    run_dir = candidate.run_dir or os.path.dirname(os.path.dirname(storage.local_path(candidate.uri)))
    output = os.path.join(storage.local_path(run_dir), "validation", "held-out-comparison.json")
    storage.makedirs(os.path.dirname(output))
    run_job(
        build_compare_job(
            storage.local_path(candidate.uri), local_checkpoint(promoted_checkpoint), held_out, output, image
        ),
        backend,
    )
    result = storage.read_json(output)
    return HeldOutLosses(
        candidate_loss=result["candidate_loss"], promoted_loss=result["promoted_loss"], held_out=held_out
    )


def _evaluate(checkpoint: str, held_out: reg.HeldOut) -> float:
    from workloads.validate_checkpoint import evaluate_loss

    return evaluate_loss(
        checkpoint,
        held_out.data_prefix,
        tokenizer_model=held_out.tokenizer_model,
        seq_length=held_out.seq_length,
        split=held_out.split,
        seed=held_out.seed,
        num_batches=held_out.num_batches,
    )


# ---------------------------------------------------------------- zero-downtime switch (local backend)


def _wait_for_log(path: str, text: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(path, errors="replace") as fh:
                if text in fh.read():
                    return True
        except FileNotFoundError:
            pass
        time.sleep(0.1)
    return False


def _signal(handle: services.ServiceHandle, sig: int) -> None:
    if services.pid_alive(handle.pid, handle.proc_start):
        os.kill(handle.pid, sig)


def free_port(host: str = DEFAULT_HOST) -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@task(name="switch-serving", task_run_name="switch {model_name} on port {port} to {model_id}")
def switch_serving(
    checkpoint: CheckpointRef,
    model_id: str,
    current: reg.Serving | None,
    port: int,
    model_name: str,
    smoke_prompt: str = "In the beginning",
    ready_timeout_s: float = 180,
    host: str = DEFAULT_HOST,
) -> reg.Serving:
    """Blue/green on one port: start the new server on a private port, smoke-test it there, make it
    listen on ``port`` too (SO_REUSEPORT, see workloads.serve), then drain and stop the old one.

    The URL users call (``http://host:port``) never changes and some server accepts on it at every
    moment. A failure before the switch stops only the new server: the old one keeps serving.
    """
    log = logger()
    name = f"{service_name(model_name)}-{model_id.rsplit('-', 1)[-1]}-{int(time.time()) % 100000}"
    old = services.get_service(current.service) if current else None
    if old is None:
        # Something may still answer on the port (a server deploy_inference started): find it by port.
        owner = services.port_owner(port)
        old = next((s for s in services.list_services() if s.pid == owner), None) if owner else None
    if old is None:
        try:
            services.check_port_free(port, host)
        except services.PortInUseError as exc:
            raise services.ServiceError(
                f"port {port} is served by a process nemoflow does not manage; it cannot be switched without "
                f"downtime ({exc})"
            ) from exc
    private = free_port(host)
    command = serve_command(local_checkpoint(checkpoint.uri), private, model_name, host) + ["--join-port", str(port)]
    spec_log_dir = services.registry_path().parent / "logs"
    from infra.jobs import ServiceSpec

    handle = services.start_service(
        ServiceSpec(name=name, command=command, port=private),
        spec_log_dir,
        host=host,
        ready_timeout_s=ready_timeout_s,
        checkpoint=checkpoint.uri,
        model=model_name,
        on_log=lambda line: log.info("[%s] %s", name, line),
    )
    public_url = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"
    try:
        from tasks.refs import EndpointRef

        smoke_test.fn(
            EndpointRef(url=handle.url, model=model_name, handle=name, checkpoint=checkpoint.uri), smoke_prompt, 8, 60
        )
        _signal(handle, signal.SIGUSR1)
        if not _wait_for_log(handle.log_path, f"joined port {port}", 20):
            raise services.ServiceError(
                f"new server {name} did not join port {port} (see {handle.log_path}); was the old server "
                "started before SO_REUSEPORT support? Restart it once, then refresh again"
            )
    except BaseException:
        services.stop_service(handle)
        raise
    # Traffic now reaches both; take the old one out: leave the port (a relay), then stop after draining.
    if old is not None:
        if "--join-port" in old.command:
            # A relay (an earlier switch): close it first, so no new connection lands on a server
            # that is about to stop; without --join-port, SIGUSR2 would kill the server outright.
            _signal(old, signal.SIGUSR2)
            _wait_for_log(old.log_path, f"left port {port}", 5)
        # SIGTERM: uvicorn closes its listener, then finishes the requests in flight (graceful).
        services.stop_service(old)
        log.info("stopped the old server %s (pid %d)", old.name, old.pid)
    log.info("%s now serves %s at %s", name, model_id, public_url)
    return reg.Serving(model=model_id, service=name, port=port, model_name=model_name, url=public_url)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tasks.promote",
        description="Job entry of the CPT refresh: compare a candidate with the promoted model on one held-out set.",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    compare = sub.add_parser("compare", help="write {candidate_loss, promoted_loss} as JSON to --output")
    compare.add_argument("--candidate", required=True)
    compare.add_argument("--promoted", required=True)
    compare.add_argument("--held-out", required=True, help="HeldOut as JSON (infra.registry)")
    compare.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    held_out = reg.HeldOut.model_validate_json(args.held_out)
    result = {
        "candidate_loss": _evaluate(args.candidate, held_out),
        "promoted_loss": _evaluate(args.promoted, held_out),
    }
    storage.write_json(args.output, result)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
