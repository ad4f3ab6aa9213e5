"""What every stage shares: cache policy, result storage, running a job under Prefect.

Caching: a task's cache key is the hash of its inputs (which, by convention,
carry content fingerprints: a source's etag/size/checksum, a tokenizer file's
hash, the flags) plus a hash of the source files of the code that produces its
output (:class:`CodeVersion`), not only the task function's own source.
Results are small pydantic models persisted to the configured result storage.

Retries: every task that has retries retries only transient failures
(:func:`transient_only`, its ``retry_condition_fn``). A failure caused by the
configuration or the input (a missing key, an invalid value, a refused path, a job
that exits ``ExitCode.BAD_CONFIG``, a server that exits while starting) fails at once
with its cause, instead of being run again to the same end.
"""

from __future__ import annotations

import contextvars
import hashlib
import importlib
import importlib.util
import inspect
import linecache
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect.cache_policies import INPUTS, CachePolicy

from infra import storage
from infra.executors import get_backend
from infra.jobs import ExitCode, JobFailed, JobResult, JobSpec, JobState
from infra.settings import get_settings


@dataclass
class CodeVersion(CachePolicy):
    """Cache key part: the source of the modules that produce a task's output."""

    modules: tuple[str, ...] = field(default_factory=tuple)

    def compute_key(self, task_ctx, inputs, flow_parameters, **kwargs) -> str:
        return code_fingerprint(*self.modules)


def code_fingerprint(*modules: str) -> str:
    """A hash of the source of ``modules``; a package counts with every module under it, so code moved from a
    package's ``__init__`` into one of its modules is still part of the key. The files are read, not imported:
    a cache key must not import the job's code (workloads.train imports torch: 3-18 s of the flow-run process
    before its training stage)."""
    digest = hashlib.sha256()
    for name in sorted(modules):
        spec = importlib.util.find_spec(name)  # imports the parent packages only
        digest.update(name.encode())
        digest.update(_source(name, spec).encode())
        if spec is not None and spec.submodule_search_locations is not None and spec.origin:
            init = Path(spec.origin)  # a package: its __init__ (above) and every module under it
            for path in sorted(init.parent.rglob("*.py")):
                if path != init:
                    digest.update(str(path.relative_to(init.parent)).encode())
                    digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _source(name: str, spec) -> str:
    """The module's source text, as ``inspect.getsource(module)`` gives it (so cache keys stay the same)."""
    if spec is None or not spec.has_location or not (spec.origin or "").endswith(".py"):
        return inspect.getsource(importlib.import_module(name))  # no .py file to read: ask the module
    return "".join(linecache.getlines(spec.origin))


def cache_policy(*modules: str) -> CachePolicy:
    return INPUTS + CodeVersion(modules=tuple(modules))


_result_storage_cache: dict[str, Any] = {}


def result_storage():
    """The Prefect file system for persisted results (local directory or gs://).

    Prefect requires result storage to be a saved block (so that another
    process, a worker or a cluster job, can read the results back): we save one
    per location, named after a hash of its URI, and reuse it.
    """
    uri = get_settings().result_storage_uri
    if uri in _result_storage_cache:
        return _result_storage_cache[uri]
    from prefect.filesystems import LocalFileSystem, RemoteFileSystem

    if storage.is_local(uri):
        storage.makedirs(uri)
        block = LocalFileSystem(basepath=storage.local_path(uri))
    else:
        options = {}
        settings = get_settings()
        if settings.gcs_endpoint:
            options = {"endpoint_url": settings.gcs_endpoint, "token": "anon"}
        block = RemoteFileSystem(basepath=uri, settings=options)
    name = "nemoflow-results-" + hashlib.sha256(uri.encode()).hexdigest()[:12]
    block.save(name, overwrite=True)
    _result_storage_cache[uri] = block
    return block


def logger():
    """The Prefect run logger inside a run, a plain logger outside."""
    import logging

    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("nemoflow")


def run_job(spec: JobSpec, executor: Any = None) -> JobResult:
    """Run a job where ``executor`` says, streaming its output into the Prefect log; raise on failure.

    The job is labelled with the (root) flow run that submitted it, so it can be found (and
    cancelled) from the run: Slurm's ``--comment nemoflow:flow-run=ID``, a Kubernetes label.
    """
    log = logger()
    backend = get_backend(executor)
    run_id = _flow_run_id()
    if run_id and "flow-run" not in spec.labels:
        spec = spec.model_copy(update={"labels": {**spec.labels, "flow-run": run_id}})
    log.info("submitting job %s to the %s backend", spec.name, backend.name)
    # Backends call on_log from their reader threads, which do not inherit this task's context
    # variables: Prefect's settings context among them (the API the log lines go to, when the run
    # was started under temporary settings). Each line is logged in a copy of this context.
    context = contextvars.copy_context()
    result = backend.run(spec, on_log=lambda line: context.copy().run(log.info, "%s", line))
    if result.state is not JobState.COMPLETED:
        raise JobFailed(spec.name, result)
    return result


def _flow_run_id() -> str | None:
    """The run a person started (the root of subflows): cancelling it must reach every job below it."""
    from prefect.runtime import flow_run

    run_id = flow_run.root_flow_run_id or flow_run.id
    return str(run_id) if run_id else None


# ---------------------------------------------------------------- retries

# Errors of the input or the configuration: the same call fails the same way again. (ValueError
# covers pydantic's ValidationError and nemoflow's own configuration errors: SettingsError,
# K8sOptionsError, SlurmPreflightError, SourceError, CredentialInParameter, ParallelismError, ...)
DETERMINISTIC_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    TypeError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)


def is_deterministic(exc: BaseException, also: tuple[type[BaseException], ...] = ()) -> bool:
    """True when running the same stage again cannot succeed: its configuration or input is wrong.

    In order: an error that says itself whether it is ``transient`` (transfers, images, a server that
    exited while starting) is believed; a job that failed is deterministic when it exited
    ``ExitCode.BAD_CONFIG`` or ran out of memory (the same job needs the same memory again), and transient
    otherwise (a crash, a lost node, a time limit: a retry resumes from its checkpoint); the
    :data:`DETERMINISTIC_ERRORS` and the task's own ``also`` (a checkpoint that failed its checks) are
    deterministic. Anything else, a connection reset, an API outage, a time-out, is transient.
    """
    if isinstance(exc, also):
        return True
    transient = getattr(exc, "transient", None)
    if isinstance(transient, bool):
        return not transient
    if isinstance(exc, JobFailed):
        out_of_memory = exc.result.state is JobState.OUT_OF_MEMORY or exc.result.exit_code == ExitCode.OUT_OF_MEMORY
        return exc.result.exit_code == ExitCode.BAD_CONFIG or out_of_memory
    return isinstance(exc, DETERMINISTIC_ERRORS)


def first_line(exc: BaseException) -> str:
    """``Type: the first line of the message`` (the one-line cause)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def transient_only(*also: type[BaseException]) -> Callable[[Any, Any, Any], bool]:
    """The ``retry_condition_fn`` of every task that has retries: retry transient failures only.

        @task(retries=2, retry_delay_seconds=10, retry_condition_fn=transient_only())
        @task(retries=1, retry_condition_fn=transient_only(CheckpointValidationFailed))

    ``also`` names the task's own deterministic outcomes (exceptions that mean "checked, and the
    answer is no"). A failure that is not retried is logged with its one-line cause.
    """

    def retry_if_transient(task, task_run, state) -> bool:
        try:
            state.result()
        except Exception as exc:  # noqa: BLE001 - classified, not swallowed: Prefect raises it after
            if is_deterministic(exc, also):
                logger().error(
                    "not retried (a configuration or input error: retrying cannot help): %s", first_line(exc)
                )
                return False
            return True
        return True

    retry_if_transient.transient_only = also  # marks the shared condition (a test checks every task uses it)
    return retry_if_transient
