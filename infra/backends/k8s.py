"""Run a :class:`~infra.jobs.JobSpec` as Kubernetes objects with the official client.

    backend = KubernetesBackend(K8sOptions(namespace="llm", scheduler_name="runai-scheduler"))
    result = backend.run(spec, on_log=print)          # a Job (or Indexed Job, or PyTorchJob)
    url = backend.start_service(service_spec)         # Deployment + Service, waits for readiness
    backend.stop_service(service_spec.name)

What :meth:`KubernetesBackend.run` does:

1. preflight (:meth:`check`): API reachable, namespace, workspace PVC, the
   Secrets holding ``secret_env`` keys, and a node with enough allocatable GPUs,
   each failing with a message that names what is missing;
2. creates the objects from :func:`infra.k8s.manifests.job_objects`, named
   ``<spec.name>-<run id>`` and labelled with the run id. Calls are retried with
   exponential backoff on 5xx/429 and connection errors; a 409 for an object of
   the same run (a create whose response was lost) is taken as success;
3. watches the Job (a watch that expires with 410 Gone is re-listed and
   re-watched), follows every pod's log into ``on_log`` (with timestamps, so a
   cut connection resumes without losing or repeating lines), and returns when
   the Job completes or fails, with the reason read from the Job and its pods
   (:mod:`infra.k8s.reasons`); a Job whose pod was evicted or preempted (PREEMPTED) is
   submitted again under a new name, up to ``max_resubmits`` times, and resumes from its own
   checkpoint. A job of a flow run that a Prefect Kubernetes worker started (its Job labelled
   ``prefect.io/flow-run-id`` in the same namespace) is owned by that Job (``ownerReferences``):
   deleting the flow-run Job deletes its stage Jobs and their pods. Pods stuck on
   ImagePullBackOff or a bad Secret fail the run at once; pods unschedulable longer than
   ``pending_timeout_s`` too;
4. in ``finally``: unless the Job ended by itself, deletes it with
   ``propagationPolicy: Foreground`` and its pods, so an interrupted or cancelled
   Prefect run leaves nothing running (:func:`cancel_in_flight` does the same for
   runs in worker threads, from a Prefect ``on_cancellation`` hook). Finished Jobs
   are left for ``ttlSecondsAfterFinished`` to clean up (their logs stay readable
   until then).

Multi-node training is an Indexed Job + headless Service by default, a Kubeflow
PyTorchJob with ``K8sOptions(training_kind="pytorchjob")``; inference is a
Deployment + Service, or a Knative Service with ``inference_kind="knative"``.
The API is found in-cluster, through ``KUBECONFIG``, or from a Prefect
``KubernetesCredentials`` block (``credentials_block="name"``).
"""

from __future__ import annotations

import collections
import datetime
import functools
import json
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import urllib3
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from infra.jobs import (
    Backend,
    ImageRef,
    JobResult,
    JobSpec,
    JobState,
    LogSink,
    Resources,
    ServiceInfo,
    ServiceSpec,
)
from infra.k8s import reasons
from infra.k8s.config import api_client as load_api_client
from infra.k8s.manifests import (
    COMPLETION_INDEX_ANNOTATION,
    CONTAINER_NAME,
    GPU_RESOURCE,
    LABEL_JOB,
    LABEL_RUN,
    PYTORCH_CONTAINER_NAME,
    job_objects,
    service_objects,
    to_dict,
)
from infra.k8s.options import K8sOptions
from infra.retry import RetryPolicy
from infra.settings import get_settings, redact

RETRY_STATUSES = {429, 500, 502, 503, 504}
# prefect-kubernetes' worker labels the Job of each flow run it starts with the run's id
FLOW_RUN_JOB_LABEL = "prefect.io/flow-run-id"
# Re-requested log starts this much before the last line seen (clock skew between node and client);
# the overlap is skipped by timestamp.
LOG_RESUME_MARGIN_S = 10
_TIMESTAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)$")
_CUSTOM = {
    "PyTorchJob": ("kubeflow.org", "v1", "pytorchjobs"),
    "Service.serving.knative.dev": ("serving.knative.dev", "v1", "services"),
}


# Runs in progress in this process, for cancel_in_flight(): run id -> (backend, created objects, cancel event)
_IN_FLIGHT: dict[str, tuple[KubernetesBackend, list[dict[str, Any]], threading.Event]] = {}
_IN_FLIGHT_LOCK = threading.Lock()


def cancel_in_flight() -> int:
    """Delete every Job this process has running and make their ``run()`` return CANCELLED.

    ``run()`` deletes its objects itself when an exception reaches it; this is for the
    cases where none does: a run inside a worker thread while the main thread is being
    cancelled. Use it from a Prefect hook::

        @flow(on_cancellation=[lambda *_: cancel_in_flight()], on_crashed=[lambda *_: cancel_in_flight()])

    Returns how many runs were cancelled.
    """
    with _IN_FLIGHT_LOCK:
        runs = list(_IN_FLIGHT.items())
    for run_id, (backend, created, cancel) in runs:
        cancel.set()
        backend._clean_up(list(created), run_id, everything=True, emit=lambda line: None)
    return len(runs)


class _StreamCut(Exception):
    """A followed log stream ended while its container still runs (a proxy or API server cut it)."""


class KubernetesUnavailable(RuntimeError):
    """The API server could not be reached or kept failing (the message names the server)."""


class PreflightError(ValueError):
    """The cluster lacks something the job needs (the message names it and how to fix it)."""


def _custom_key(obj: dict[str, Any]) -> str | None:
    if obj["kind"] == "PyTorchJob":
        return "PyTorchJob"
    if obj["kind"] == "Service" and obj["apiVersion"].startswith("serving.knative.dev/"):
        return "Service.serving.knative.dev"
    return None


class KubernetesBackend(Backend):
    name = "k8s"

    def __init__(
        self,
        options: K8sOptions | None = None,
        *,
        api_client: client.ApiClient | None = None,
        credentials_block: str | None = None,
        kubeconfig: str | None = None,
        context: str | None = None,
        preflight: bool = True,
        retries: int = 5,
        backoff_s: float = 0.5,
        watch_timeout_s: float = 5.0,
        pending_timeout_s: float | None = 900.0,
        service_ready_timeout_s: float = 1800.0,
        log_join_timeout_s: float = 10.0,
        log_reconnects: int = 20,
        api_outage_tolerance_s: float = 600.0,
        **option_fields: Any,
    ):
        # K8sOptions fields may be passed directly: get_backend("k8s", namespace="llm")
        if option_fields:
            base = options.model_dump() if options is not None else {}
            options = (type(options) if options is not None else K8sOptions)(**{**base, **option_fields})
        self.options = options or K8sOptions()
        self._api_client = api_client
        self._config_source = dict(credentials_block=credentials_block, kubeconfig=kubeconfig, context=context)
        self.preflight = preflight
        self.retries = retries
        self.backoff_s = backoff_s
        self.watch_timeout_s = watch_timeout_s
        self.pending_timeout_s = pending_timeout_s
        self.service_ready_timeout_s = service_ready_timeout_s
        self.log_join_timeout_s = log_join_timeout_s
        self.log_reconnects = log_reconnects
        self.api_outage_tolerance_s = api_outage_tolerance_s

    # --- API access ---------------------------------------------------------------

    @property
    def api(self) -> client.ApiClient:
        if self._api_client is None:
            self._api_client = load_api_client(**self._config_source)
        return self._api_client

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    @property
    def batch(self) -> client.BatchV1Api:
        return client.BatchV1Api(self.api)

    @property
    def apps(self) -> client.AppsV1Api:
        return client.AppsV1Api(self.api)

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api)

    @property
    def ns(self) -> str:
        return self.options.namespace

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call the API, retrying what a busy or restarting API server answers (the shared policy of
        :mod:`infra.retry`: 429/5xx with Retry-After, dropped connections); other errors pass through."""
        policy = RetryPolicy(attempts=self.retries + 1, initial=self.backoff_s, maximum=30.0, budget=None)
        try:
            return policy.call(fn, *args, **kwargs)
        except ApiException as exc:
            if exc.status not in RETRY_STATUSES:
                raise
            last: Exception | None = exc
        except (urllib3.exceptions.HTTPError, ConnectionError) as exc:
            last = exc
        host = self.api.configuration.host
        if isinstance(last, ApiException):
            raise KubernetesUnavailable(
                f"Kubernetes API server {host} kept failing ({last.status} {last.reason}) "
                f"after {self.retries + 1} attempts"
            ) from last
        raise KubernetesUnavailable(
            f"Kubernetes API server {host} unreachable after {self.retries + 1} attempts: {_short(last)}"
        ) from last

    def _dict(self, obj: Any) -> dict[str, Any]:
        return obj if isinstance(obj, dict) else self.api.sanitize_for_serialization(obj)

    def _raw(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        """An API read as the server's JSON, not the client's models.

        The models of kubernetes 37 validate strictly: one object they reject (a quantity sent as a
        number, which an API server may hand back as it was stored; a field newer than the client)
        would fail every list of the namespace. The backend reads only a few fields of what it
        lists, so it reads them from the JSON.
        """
        resp = self._call(fn, *args, _preload_content=False, **kwargs)
        try:
            return json.loads(resp.data)
        finally:
            resp.release_conn()

    # --- preflight -------------------------------------------------------------------

    def check(self, spec: JobSpec | ServiceSpec) -> None:
        """Fail before submitting when the cluster cannot run ``spec``."""
        ns = self.ns
        try:
            self._call(self.core.read_namespace, ns)
        except ApiException as exc:
            if exc.status == 404:
                raise PreflightError(f"namespace {ns!r} does not exist (kubectl create namespace {ns})") from None
            if exc.status != 403:  # a namespaced service account may not read namespaces
                raise
        if self.options.pvc_name:
            try:
                self._call(self.core.read_namespaced_persistent_volume_claim, self.options.pvc_name, ns)
            except ApiException as exc:
                if exc.status == 404:
                    raise PreflightError(
                        f"workspace PVC {self.options.pvc_name!r} not found in namespace {ns!r}; create it once "
                        "(nemoflow render writes persistentvolumeclaim-<name>.yaml) or set NEMOFLOW_K8S_PVC_NAME"
                    ) from None
                raise
        for kind, reader, name in [
            ("ServiceAccount", self.core.read_namespaced_service_account, self.options.service_account),
            *[("image pull Secret", self.core.read_namespaced_secret, n) for n in self.options.image_pull_secrets],
        ]:
            if not name:
                continue
            try:
                self._call(reader, name, ns)
            except ApiException as exc:
                if exc.status == 404:
                    raise PreflightError(f"{kind} {name!r} not found in namespace {ns!r}") from None
                if exc.status != 403:
                    raise
        by_secret: dict[str, list[str]] = collections.defaultdict(list)
        for env_name in spec.secret_env:
            if env_name not in self.options.optional_secrets:
                by_secret[self.options.secret_for(env_name)].append(env_name)
        for secret_name, keys in by_secret.items():
            try:
                secret = self._call(self.core.read_namespaced_secret, secret_name, ns)
            except ApiException as exc:
                if exc.status == 404:
                    raise PreflightError(
                        f"Secret {secret_name!r} (for {', '.join(keys)}) not found in namespace {ns!r}; create it "
                        f"with: kubectl -n {ns} create secret generic {secret_name} "
                        + " ".join(f"--from-literal={k}=..." for k in keys)
                    ) from None
                raise
            present = set((secret.data or {}).keys()) | set((secret.string_data or {}).keys())
            missing = [k for k in keys if k not in present]
            if missing:
                raise PreflightError(f"Secret {secret_name!r} in namespace {ns!r} has no key {', '.join(missing)}")
        gpus = spec.resources.gpus_per_node
        if gpus:
            try:
                nodes = self._call(self.core.list_node).items
            except ApiException as exc:
                if exc.status == 403:
                    return  # cannot list nodes: the scheduler will say it
                raise
            allocatable = {
                n.metadata.name: int((n.status.allocatable or {}).get(GPU_RESOURCE, "0") if n.status else 0)
                for n in nodes
            }
            if not any(v >= gpus for v in allocatable.values()):
                listing = ", ".join(f"{k}={v}" for k, v in sorted(allocatable.items())) or "no nodes"
                raise PreflightError(
                    f"{spec.name} requests {gpus} {GPU_RESOURCE} per pod, more than any node can allocate ({listing})"
                )

    # --- create / delete ------------------------------------------------------------

    def _create(self, obj: dict[str, Any], run_id: str | None) -> None:
        kind, name = obj["kind"], obj["metadata"]["name"]
        custom = _custom_key(obj)
        if custom:
            group, version, plural = _CUSTOM[custom]
            create = functools.partial(
                self.custom.create_namespaced_custom_object, group, version, self.ns, plural, obj
            )
            read = functools.partial(self.custom.get_namespaced_custom_object, group, version, self.ns, plural, name)
            patch = functools.partial(
                self.custom.patch_namespaced_custom_object, group, version, self.ns, plural, name, obj
            )
        else:
            api, suffix = {
                "Job": (self.batch, "job"),
                "Service": (self.core, "service"),
                "Deployment": (self.apps, "deployment"),
            }[kind]
            create = functools.partial(getattr(api, f"create_namespaced_{suffix}"), self.ns, obj)
            read = functools.partial(getattr(api, f"read_namespaced_{suffix}"), name, self.ns)
            patch = functools.partial(getattr(api, f"patch_namespaced_{suffix}"), name, self.ns, obj)
        try:
            self._call(create)
            return
        except ApiException as exc:
            if exc.status != 409:
                raise _api_error(f"creating {kind} {name} in namespace {self.ns}", exc) from None
        existing = self._raw(read) if not custom else self._dict(self._call(read))
        labels = (existing.get("metadata") or {}).get("labels") or {}
        if run_id is not None:
            if labels.get(LABEL_RUN) == run_id:
                return  # our own earlier create whose response was lost: nothing to do
            raise RuntimeError(
                f"{kind} {name} already exists in namespace {self.ns} and belongs to another run "
                f"({LABEL_RUN}={labels.get(LABEL_RUN)}); delete it or pick another name"
            )
        # services (no run id) are applied: an existing one is brought to the new spec
        self._call(patch)

    def _delete(self, kind: str, name: str, api_version: str = "") -> None:
        body = client.V1DeleteOptions(propagation_policy="Foreground")
        try:
            if kind == "PyTorchJob" or api_version.startswith("serving.knative.dev/"):
                group, version, plural = _CUSTOM[
                    "PyTorchJob" if kind == "PyTorchJob" else "Service.serving.knative.dev"
                ]
                self._call(
                    self.custom.delete_namespaced_custom_object, group, version, self.ns, plural, name, body=body
                )
            elif kind == "Job":
                self._call(self.batch.delete_namespaced_job, name, self.ns, body=body)
            elif kind == "Deployment":
                self._call(self.apps.delete_namespaced_deployment, name, self.ns, body=body)
            elif kind == "Service":
                self._call(self.core.delete_namespaced_service, name, self.ns, body=body)
            elif kind == "Pod":
                self._call(self.core.delete_namespaced_pod, name, self.ns, body=body)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def _pods(self, label: str, value: str) -> list[dict[str, Any]]:
        listed = self._raw(self.core.list_namespaced_pod, self.ns, label_selector=f"{label}={value}")
        pods = listed.get("items") or []
        # Filter again: the selector is the server's job, but an old or partial API must not mix runs.
        return [p for p in pods if ((p.get("metadata") or {}).get("labels") or {}).get(label) == value]

    # --- run ------------------------------------------------------------------------------

    def submitted_spec(self, spec: JobSpec) -> JobSpec:
        """``spec`` as its pods run it: a distributed job's command started by torchrun."""
        if not spec.nproc_per_node or (spec.resources.nodes == 1 and spec.nproc_per_node == 1):
            return spec
        python, rest = spec.command[0], spec.command[1:]
        if not rest or rest[0] != "-m":
            raise ValueError(f"a distributed job runs `python -m MODULE ...`, not {spec.command[:3]}")
        launcher = [python, "-m", "torch.distributed.run", f"--nproc-per-node={spec.nproc_per_node}"]
        if spec.resources.nodes == 1:
            launcher.append("--standalone")
        elif self.options.training_kind != "pytorchjob":
            # The Indexed Job's rendezvous variables (manifests.rendezvous_env), expanded by the kubelet;
            # a PyTorchJob's operator sets torchrun's PET_* variables itself.
            launcher += [
                "--nnodes=$(NNODES)",
                "--node-rank=$(NODE_RANK)",
                "--master-addr=$(MASTER_ADDR)",
                "--master-port=$(MASTER_PORT)",
            ]
        return spec.model_copy(update={"command": [*launcher, *rest]})

    def _job_objects(self, spec: JobSpec, name: str | None = None, run_id: str | None = None) -> list[dict]:
        objects = [to_dict(o) for o in job_objects(self.submitted_spec(spec), self.options, name=name, run_id=run_id)]
        for obj in objects:
            _add_labels(obj, spec.labels)
        return objects

    def _service_objects(self, spec: ServiceSpec) -> list[dict]:
        objects = [to_dict(o) for o in service_objects(spec, self.options)]
        for obj in objects:
            _add_labels(obj, spec.labels)
            annotations = obj["metadata"].setdefault("annotations", {})
            annotations.update({f"nemoflow.io/{k}": v for k, v in spec.annotations.items()})
            if spec.fingerprint:
                annotations[FINGERPRINT_ANNOTATION] = spec.fingerprint
        return objects

    def _flow_run_job(self, spec: JobSpec) -> dict[str, Any] | None:
        """An ownerReference to the Job that runs this job's flow run, when a Prefect Kubernetes worker started
        it in this namespace (its Job carries ``prefect.io/flow-run-id``): deleting that Job (the worker's
        ``kill_infrastructure``, ``kubectl delete``, its TTL) then deletes this job's objects and pods through
        the garbage collector. No ``blockOwnerDeletion`` (it would need update on ``jobs/finalizers``), no
        ``controller``. None when the run has no such Job or it cannot be listed."""
        flow_run = spec.labels.get("flow-run")
        if not flow_run:
            return None
        try:
            listed = self._raw(
                self.batch.list_namespaced_job, self.ns, label_selector=f"{FLOW_RUN_JOB_LABEL}={flow_run}"
            )
        except (ApiException, KubernetesUnavailable):
            return None  # e.g. 403: the job runs without an owner, as before
        jobs = [
            j
            for j in listed.get("items") or []
            if ((j.get("metadata") or {}).get("labels") or {}).get(FLOW_RUN_JOB_LABEL) == flow_run
            and not j["metadata"].get("deletionTimestamp")
            and j["metadata"].get("uid")
        ]
        if len(jobs) != 1:
            return None
        meta = jobs[0]["metadata"]
        return {"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"], "uid": meta["uid"]}

    def cancel(self, job_id: str) -> None:
        """Delete a job this process runs (``run()`` then returns CANCELLED); ``job_id`` is ``ns/name``."""
        with _IN_FLIGHT_LOCK:
            runs = [(r, v) for r, v in _IN_FLIGHT.items() if any(job_id.endswith(o["metadata"]["name"]) for o in v[1])]
        for run_id, (backend, created, cancel) in runs:
            cancel.set()
            backend._clean_up(list(created), run_id, everything=True, emit=lambda line: None)

    def run(self, spec: JobSpec, on_log: LogSink | None = None) -> JobResult:
        """Run the job to its end; a job whose pod the cluster took away (evicted, preempted: PREEMPTED or
        NODE_FAIL) is submitted again as a new Job, up to ``options.max_resubmits`` times, and resumes from its
        own latest checkpoint, as Slurm's backend resubmits. A deadline (TIMEOUT) is the stage's own time
        limit and is not resubmitted here; a failure of the job's code never is."""
        attempt = 1
        while True:
            result = self._run_once(spec, on_log, check=attempt == 1).model_copy(update={"attempts": attempt})
            resubmit = result.state in (JobState.PREEMPTED, JobState.NODE_FAIL)
            if not resubmit or attempt > self.options.max_resubmits:
                return result
            if on_log is not None:
                on_log(
                    f"[k8s] job {result.job_id} ended {result.state.value} ({result.reason}); resubmitting "
                    f"({attempt}/{self.options.max_resubmits}) to resume from the latest checkpoint"
                )
            attempt += 1

    def _run_once(self, spec: JobSpec, on_log: LogSink | None, *, check: bool) -> JobResult:
        run_id = uuid.uuid4().hex[:6]
        # room for "-<run id>" and the pod hostname suffix "-<index>" within 63 characters
        name = f"{spec.name[:48].rstrip('-')}-{run_id}"
        objects = self._job_objects(spec, name=name, run_id=run_id)
        owner = self._flow_run_job(spec)
        for obj in objects:
            if owner is not None:
                obj["metadata"]["ownerReferences"] = [owner]
        job_obj = objects[-1]
        if self.preflight and check:
            self.check(spec)
        tail: collections.deque[str] = collections.deque(maxlen=50)
        secrets = get_settings().secret_values()
        lock = threading.Lock()

        def emit(line: str) -> None:
            line = redact(line, secrets)
            with lock:
                tail.append(line)
            if on_log is not None:
                on_log(line)

        followers: dict[str, threading.Thread] = {}
        created: list[dict[str, Any]] = []
        ended_by_itself = False
        cancel = threading.Event()
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT[run_id] = (self, created, cancel)
        try:
            for obj in objects:
                self._create(obj, run_id)
                created.append(obj)
            verdict, ended_by_itself = self._wait(job_obj, run_id, emit, followers, cancel)
            for thread in followers.values():
                thread.join(timeout=self.log_join_timeout_s)
            with lock:
                log_tail = list(tail)
            return JobResult(
                job_id=f"{self.ns}/{name}",
                backend=self.name,
                state=verdict.state,
                exit_code=verdict.exit_code,
                reason=redact(verdict.reason, secrets) if verdict.reason else None,
                log_tail=log_tail,
            )
        finally:
            with _IN_FLIGHT_LOCK:
                _IN_FLIGHT.pop(run_id, None)
            self._clean_up(created, run_id, everything=not ended_by_itself, emit=emit)

    def _clean_up(self, created: list[dict[str, Any]], run_id: str, *, everything: bool, emit: LogSink) -> None:
        """Delete what a run created: all of it when the run did not end by itself, else the
        rendezvous Service only (it has no TTL; the Job has one and keeps its logs until then).
        Never raises: a failure here must not hide the run's own error; it names what is left."""
        doomed = list(reversed(created)) if everything else created[:-1]
        left: list[str] = []
        for obj in doomed:
            try:
                self._delete(obj["kind"], obj["metadata"]["name"], obj["apiVersion"])
            except Exception as exc:  # noqa: BLE001 - reported below, with the objects' names
                left.append(f"{obj['kind']}/{obj['metadata']['name']} ({_short(exc)})")
        if everything and created:
            # Foreground deletion removes the pods on a real cluster; deleting them here
            # as well means none keeps running if the garbage collector lags.
            try:
                for pod in self._pods(LABEL_RUN, run_id):
                    self._delete("Pod", pod["metadata"]["name"])
            except Exception as exc:  # noqa: BLE001 - reported below, with the label selector
                left.append(f"pods with label {LABEL_RUN}={run_id} ({_short(exc)})")
        if left:
            emit(f"[k8s] could not delete, remove by hand in namespace {self.ns}: " + "; ".join(left))

    def _read(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        name = obj["metadata"]["name"]
        try:
            if obj["kind"] == "PyTorchJob":
                return self._call(
                    self.custom.get_namespaced_custom_object,
                    *_CUSTOM["PyTorchJob"][:2],
                    self.ns,
                    _CUSTOM["PyTorchJob"][2],
                    name,
                )
            return self._raw(self.batch.read_namespaced_job, name, self.ns)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _wait(
        self,
        job_obj: dict[str, Any],
        run_id: str,
        emit: LogSink,
        followers: dict[str, threading.Thread],
        cancel: threading.Event,
    ) -> tuple[reasons.Verdict, bool]:
        """The job's verdict, and whether the job ended by itself (else the caller deletes it)."""
        name = job_obj["metadata"]["name"]
        pending_since: float | None = None
        announced: set[str] = set()
        cancelled = reasons.Verdict(JobState.CANCELLED, "cancelled by nemoflow (cancel_in_flight)"), False

        def observe() -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
            job = self._read(job_obj)
            return job, self._pods(LABEL_RUN, run_id) if job is not None else []

        # The Job runs on without us (a control-plane upgrade, a network blip): keep waiting, up to the
        # tolerated outage, rather than abandon, and so delete, a healthy multi-day training job (unless cancelled).
        outage = RetryPolicy(
            attempts=sys.maxsize,
            initial=self.backoff_s,
            maximum=self.backoff_s,
            budget=self.api_outage_tolerance_s,
            brief_attempts=sys.maxsize,  # an API server whose name stops resolving is an outage too
            transient=lambda exc: isinstance(exc, KubernetesUnavailable) and not cancel.is_set(),
        )

        def still_waiting(exc: BaseException, attempt: int, sleep_s: float) -> None:
            emit(f"[k8s] {exc}; the job keeps running, still waiting")

        while True:
            if cancel.is_set():
                return cancelled
            try:
                job, pods = outage.retrying(on_retry=still_waiting)(observe)
            except KubernetesUnavailable:
                if cancel.is_set():
                    return cancelled
                raise
            if job is None:
                return reasons.Verdict(
                    JobState.CANCELLED, f"{job_obj['kind']} {name} was deleted outside nemoflow"
                ), True
            self._follow_logs(pods, followers, emit)
            verdict = (
                reasons.pytorchjob_verdict(job, pods)
                if job_obj["kind"] == "PyTorchJob"
                else reasons.job_verdict(job, pods)
            )
            if verdict is not None:
                return verdict, True
            for pod in pods:
                stuck = reasons.fatal_waiting(pod)
                if stuck:
                    return reasons.Verdict(JobState.FAILED, stuck), False
            waiting = next((r for r in map(reasons.unschedulable, pods) if r), None)
            if waiting:
                if waiting not in announced:
                    announced.add(waiting)
                    emit(f"[k8s] {waiting}")
                pending_since = pending_since or time.monotonic()
                if self.pending_timeout_s is not None and time.monotonic() - pending_since > self.pending_timeout_s:
                    return reasons.Verdict(
                        JobState.FAILED, f"{waiting} (pending over {self.pending_timeout_s:g} s)"
                    ), False
            else:
                pending_since = None
            self._watch_change(job_obj, job, emit)

    def _watch_change(self, job_obj: dict[str, Any], seen: dict[str, Any], emit: LogSink) -> None:
        """Block until the job's status changes, or watch_timeout_s passes (pods are re-read then)."""
        name = job_obj["metadata"]["name"]
        seen_status = json.dumps(seen.get("status") or {}, sort_keys=True)
        if job_obj["kind"] == "PyTorchJob":
            group, version, plural = _CUSTOM["PyTorchJob"]
            fn, args = self.custom.list_namespaced_custom_object, (group, version, self.ns, plural)
        else:
            fn, args = self.batch.list_namespaced_job, (self.ns,)
        kwargs: dict[str, Any] = dict(
            field_selector=f"metadata.name={name}",
            timeout_seconds=max(1, int(self.watch_timeout_s)),
            # the client-side read timeout also bounds servers that ignore timeoutSeconds
            _request_timeout=(10, self.watch_timeout_s + 1),
        )
        rv = (seen.get("metadata") or {}).get("resourceVersion")
        if rv:
            kwargs["resource_version"] = rv
        w = _RawWatch()
        try:
            for event in w.stream(fn, *args, **kwargs):
                obj = event.get("raw_object") or {}
                if (obj.get("metadata") or {}).get("name") != name:
                    continue
                if event.get("type") == "DELETED":
                    return
                if json.dumps(obj.get("status") or {}, sort_keys=True) != seen_status:
                    return
        except ApiException as exc:
            if exc.status == 410:
                emit(f"[k8s] watch of {name} expired (410 Gone); re-listing")
                return  # the caller re-reads the job, which gives a fresh resourceVersion
            if exc.status in RETRY_STATUSES:
                time.sleep(self.backoff_s)
                return
            raise
        except (urllib3.exceptions.HTTPError, ConnectionError):
            # read timeout on a server that keeps the watch open, or a dropped connection: re-read
            return
        finally:
            w.stop()

    def _follow_logs(self, pods: list[dict[str, Any]], followers: dict[str, threading.Thread], emit: LogSink) -> None:
        for pod in pods:
            pod_name = pod["metadata"]["name"]
            if pod_name in followers or not _started(pod):
                continue
            annotations = pod["metadata"].get("annotations") or {}
            labels = pod["metadata"].get("labels") or {}
            index = annotations.get(COMPLETION_INDEX_ANNOTATION) or labels.get(COMPLETION_INDEX_ANNOTATION)
            replica = labels.get("training.kubeflow.org/replica-type")
            if replica:  # a PyTorchJob's pods: master-0, worker-0, ...
                index = f"{replica}-{labels.get('training.kubeflow.org/replica-index', '0')}"
            prefix = f"[{index}] " if index is not None else ""
            names = [c.get("name") for c in (pod.get("spec") or {}).get("containers") or []]
            container = PYTORCH_CONTAINER_NAME if PYTORCH_CONTAINER_NAME in names else CONTAINER_NAME
            thread = threading.Thread(
                target=self._follow, args=(pod_name, container, prefix, emit), daemon=True, name=f"log-{pod_name}"
            )
            followers[pod_name] = thread
            thread.start()

    def _follow(self, pod_name: str, container: str, prefix: str, emit: LogSink) -> None:
        """Stream one container's log into ``emit`` until the container ends.

        A followed log is a single long HTTP response; API server restarts and idle
        proxies cut it. Lines are requested with timestamps, so after a cut the log is
        re-requested from shortly before the last line seen and lines already emitted
        are skipped: nothing is lost or repeated. When the container has ended, the log
        is read once more the same way (a cut and the container's end look alike).
        """
        cursor = _LogCursor()

        def read(final: bool) -> bool | None:
            """One request of the log from the cursor: True when it was read to its end, False when it was
            cut, None when the log cannot be read at all."""
            kwargs: dict[str, Any] = dict(container=container, follow=True, timestamps=True, _preload_content=False)
            if cursor.last_time is not None:
                age = (datetime.datetime.now(datetime.UTC) - cursor.last_time).total_seconds()
                kwargs["since_seconds"] = max(1, int(age) + LOG_RESUME_MARGIN_S)
            try:
                resp = self._call(self.core.read_namespaced_pod_log, pod_name, self.ns, **kwargs)
            except (ApiException, KubernetesUnavailable) as exc:
                if not (isinstance(exc, ApiException) and exc.status == 404):
                    emit(f"[k8s] cannot read the log of pod {pod_name}: {_short(exc)}")
                return None
            cursor.resume()
            complete = False
            pending = b""
            # after the container ended: lines found now were cut off before; say so before the first one
            note = [f"[k8s] log stream of pod {pod_name} was interrupted; resuming"] if final else []

            def out(text: str | None, note: list[str] = note) -> None:
                if text is not None:
                    while note:
                        emit(note.pop())
                    emit(prefix + text)

            try:
                for chunk in resp.stream(8192):
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        out(cursor.accept(line.decode("utf-8", "replace").rstrip("\r")))
                complete = True
            except (urllib3.exceptions.HTTPError, ConnectionError):
                pass
            finally:
                resp.release_conn()
            if pending:
                out(cursor.accept(pending.decode("utf-8", "replace")))
            return complete

        def follow() -> None:
            complete = read(final=False)
            if complete is None:
                return
            if complete and not self._container_running(pod_name, container):
                # The stream ended and so did the container; but a stream cut just before the container
                # ended looks the same and left lines unread: read once more from the cursor (the lines
                # already emitted are skipped, so a log read to its end repeats nothing).
                read(final=True)
                return
            emit(f"[k8s] log stream of pod {pod_name} was interrupted; resuming")
            raise _StreamCut(pod_name)

        # a cut stream is re-requested under the shared retry policy (jittered backoff up to 10 s)
        policy = RetryPolicy(
            attempts=self.log_reconnects + 1,
            initial=self.backoff_s,
            maximum=10.0,
            budget=None,
            transient=lambda exc: isinstance(exc, _StreamCut),
        )
        try:
            policy.call(follow)
        except _StreamCut:
            emit(f"[k8s] stopped following the log of pod {pod_name} after {self.log_reconnects} reconnects")

    def _container_running(self, pod_name: str, container: str) -> bool:
        try:
            pod = self._raw(self.core.read_namespaced_pod, pod_name, self.ns)
        except (ApiException, KubernetesUnavailable):
            return False
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            if cs.get("name") == container and (cs.get("state") or {}).get("running") is not None:
                return True
        return False

    # --- services ---------------------------------------------------------------------

    def start_service(
        self, spec: ServiceSpec, *, ready_timeout_s: float | None = None, on_log: LogSink | None = None
    ) -> ServiceInfo:
        """Create (or update: a rolling update) the inference Deployment + Service; wait until it is ready.

        If it cannot become ready (image pull, crash loop, unschedulable, timeout) or the
        caller is interrupted, its objects are deleted before the error propagates.
        """
        objects = self._service_objects(spec)
        if self.preflight:
            self.check(spec)
        try:
            for obj in objects:
                self._create(obj, None)
            url = self._wait_service(spec, knative=_custom_key(objects[0]) is not None, timeout_s=ready_timeout_s)
        except BaseException:
            try:
                self.stop_service(spec.name)
            except Exception:  # noqa: BLE001 - the original error matters more
                pass
            raise
        return ServiceInfo(
            name=spec.name,
            url=url,
            backend=self.name,
            job_id=f"{self.ns}/{spec.name}",
            healthy=True,
            fingerprint=spec.fingerprint,
            log=f"kubectl -n {self.ns} logs deployment/{spec.name}",
        )

    def service(self, name: str) -> ServiceInfo | None:
        """The Deployment (or Knative Service) of that name, if it exists; healthy = all replicas ready."""
        try:
            if self.options.inference_kind == "knative":
                group, version, plural = _CUSTOM["Service.serving.knative.dev"]
                obj = self._call(self.custom.get_namespaced_custom_object, group, version, self.ns, plural, name)
                status = obj.get("status") or {}
                ready = any(
                    c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
                )
                url = status.get("url") or ""
            else:
                obj = self._raw(self.apps.read_namespaced_deployment, name, self.ns)
                ready = _deployment_ready(obj)
                ports = [
                    p.get("containerPort")
                    for c in (((obj.get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers") or []
                    for p in c.get("ports") or []
                ]
                url = f"http://{name}.{self.ns}.svc.cluster.local:{ports[0]}" if ports else ""
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        annotations = (obj.get("metadata") or {}).get("annotations") or {}
        return ServiceInfo(
            name=name,
            url=url,
            backend=self.name,
            job_id=f"{self.ns}/{name}",
            healthy=ready,
            fingerprint=annotations.get(FINGERPRINT_ANNOTATION),
        )

    def service_log_tail(self, name: str, lines: int = 20) -> list[str]:
        """The last lines of the service's first pod (the API's tailLines)."""
        try:
            pods = self._pods(LABEL_JOB, name)
            if not pods:
                return []
            text = self._call(self.core.read_namespaced_pod_log, pods[0]["metadata"]["name"], self.ns, tail_lines=lines)
        except (ApiException, KubernetesUnavailable):
            return []
        return [redact(line) for line in str(text).splitlines()[-lines:]]

    def switch_service(
        self,
        current: str | None,
        spec: ServiceSpec,
        check: Callable[[ServiceInfo], None],
        *,
        ready_timeout_s: float | None = None,
        on_log: LogSink | None = None,
    ) -> ServiceInfo:
        """Under the current name: a rolling update of the Deployment, gated by its readiness probe (old pods
        serve until new ones are ready), then ``check``. Under a new name: a second Deployment + Service,
        checked, then the old one deleted (clients move to the new Service name)."""
        return self._start_checked_then_stop(current, spec, check, ready_timeout_s=ready_timeout_s, on_log=on_log)

    def stage_image(
        self,
        source: str | None,
        dest: str,
        *,
        convert: bool = False,
        force: bool = False,
        log: LogSink | None = None,
        progress: Callable[[int, int | None], None] | None = None,
        resources: Resources | None = None,
    ) -> tuple[ImageRef, dict[str, Any]]:
        """Nodes pull registry images: the reference is validated and recorded, nothing is copied.

        Without a SOURCE the executor's ``image`` is used (the nemoflow image the work pool names).
        """
        from infra import images

        log = log or (lambda line: None)
        if convert:
            raise ValueError("--convert makes an enroot .sqsh for Slurm; Kubernetes nodes pull registry images")
        source = images.resolve_region(source or self.options.image)
        parsed = images.parse_docker_ref(source)
        log(f"Kubernetes pulls {parsed.canonical}" + ("" if parsed.digest else " (no digest: the tag may move)"))
        ref = ImageRef(kind="registry", uri=parsed.canonical, digest=parsed.digest, source=source)
        return ref, {"cached": False, "bytes_copied": 0, "seconds": 0.0}

    def planned_image(self, source: str | None, dest: str, convert: bool = False) -> ImageRef:
        return self.stage_image(source, dest, convert=convert)[0]  # validation only: nothing is copied

    def image_identity(self, source: str | None, dest: str, convert: bool = False) -> tuple[str, bool] | None:
        return "registry:" + (source or self.options.image), True

    def render(self, spec: JobSpec | ServiceSpec) -> dict[str, str]:
        """One YAML document per object, named ``<kind>-<name>.yaml`` (what ``run``/``start_service`` create)."""
        import yaml

        objects = self._service_objects(spec) if isinstance(spec, ServiceSpec) else self._job_objects(spec)
        return {
            f"{o['kind'].lower()}-{o['metadata']['name']}.yaml": yaml.safe_dump(o, sort_keys=False) for o in objects
        }

    def _wait_service(self, spec: ServiceSpec, *, knative: bool, timeout_s: float | None = None) -> str:
        deadline = time.monotonic() + (timeout_s or self.service_ready_timeout_s)
        pending_since: float | None = None
        while True:
            if knative:
                group, version, plural = _CUSTOM["Service.serving.knative.dev"]
                ksvc = self._call(self.custom.get_namespaced_custom_object, group, version, self.ns, plural, spec.name)
                status = ksvc.get("status") or {}
                ready = any(
                    c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
                )
                if ready and status.get("url"):
                    return status["url"]
            else:
                dep = self._raw(self.apps.read_namespaced_deployment, spec.name, self.ns)
                if _deployment_ready(dep):
                    return f"http://{spec.name}.{self.ns}.svc.cluster.local:{spec.port}"
            pods = self._pods(LABEL_JOB, spec.name)
            fatal = next((r for r in map(reasons.fatal_waiting, pods) if r), None) or next(
                (r for r in map(reasons.crash_looping, pods) if r), None
            )
            if fatal:
                raise RuntimeError(f"service {spec.name} did not start: {fatal}")
            waiting = next((r for r in map(reasons.unschedulable, pods) if r), None)
            if waiting:
                pending_since = pending_since or time.monotonic()
                if self.pending_timeout_s is not None and time.monotonic() - pending_since > self.pending_timeout_s:
                    raise RuntimeError(f"service {spec.name} did not start: {waiting}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"service {spec.name} not ready after {self.service_ready_timeout_s:g} s"
                    + (f": {waiting}" if waiting else "")
                )
            time.sleep(min(2.0, self.watch_timeout_s))

    def stop_service(self, name: str) -> bool:
        """Delete the service's objects (absent ones are fine); False when there was none."""
        existed = self.service(name) is not None
        if self.options.inference_kind == "knative":
            self._delete("Service", name, "serving.knative.dev/v1")
            return existed
        self._delete("Deployment", name)
        self._delete("Service", name)
        return existed


FINGERPRINT_ANNOTATION = "nemoflow.io/fingerprint"


class _RawWatch(watch.Watch):
    """A watch whose events carry the server's JSON only (see :meth:`KubernetesBackend._raw`).

    ``stream(..., deserialize=False)`` would do the same, but the client (37.0.1) then fails on ERROR
    events (410 Gone) with a KeyError; this keeps its event shape (``raw_object``) and its 410 handling.
    """

    def unmarshal_event(self, data, return_type):
        return super().unmarshal_event(data, None)


_LABEL_VALUE = re.compile(r"[^A-Za-z0-9._-]+")


def _add_labels(obj: dict[str, Any], labels: dict[str, str]) -> None:
    """``labels`` on an object (values made label-safe: 63 characters of [A-Za-z0-9._-])."""
    if not labels:
        return
    safe = {f"nemoflow.io/{k}": _LABEL_VALUE.sub("-", v)[:63].strip("-._") for k, v in labels.items()}
    obj["metadata"].setdefault("labels", {}).update(safe)


class _LogCursor:
    """Position in a timestamped log (``timestamps=true``), to resume after a cut without repeats."""

    def __init__(self) -> None:
        self.last_key: tuple[str, str] | None = None
        self.last_time: datetime.datetime | None = None
        self.at_last = 0  # lines emitted carrying last_key
        self.skip_equal = 0

    def resume(self) -> None:
        self.skip_equal = self.at_last

    def accept(self, line: str) -> str | None:
        """The line without its timestamp, or None if it was already emitted."""
        stamp, _, text = line.partition(" ")
        match = _TIMESTAMP.match(stamp)
        if not match:
            return line  # a server that ignores timestamps=true: nothing to resume by
        base, fraction, offset = match.groups()
        when = datetime.datetime.fromisoformat(base + ("+00:00" if offset == "Z" else offset))
        when = when.astimezone(datetime.UTC)
        key = (when.strftime("%Y-%m-%dT%H:%M:%S"), (fraction or "").ljust(9, "0"))
        if self.last_key is not None and key <= self.last_key:
            if key < self.last_key:
                return None
            if self.skip_equal > 0:
                self.skip_equal -= 1
                return None
            self.at_last += 1
        else:
            self.last_key, self.at_last, self.skip_equal = key, 1, 0
        self.last_time = when
        return text


def _deployment_ready(dep: dict[str, Any]) -> bool:
    """Every replica of the CURRENT spec is ready (after a re-apply, old ready pods do not count)."""
    want = (dep.get("spec") or {}).get("replicas", 1)
    status = dep.get("status") or {}
    generation = (dep.get("metadata") or {}).get("generation")
    if generation is not None and (status.get("observedGeneration") or 0) < generation:
        return False
    if "updatedReplicas" in status and (status.get("updatedReplicas") or 0) < want:
        return False
    return (status.get("readyReplicas") or 0) >= want


def _started(pod: dict[str, Any]) -> bool:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        state = cs.get("state") or {}
        if state.get("running") or state.get("terminated"):
            return True
    return False


def _short(exc: BaseException | None) -> str:
    text = str(exc) if exc is not None else "unknown error"
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _api_error(what: str, exc: ApiException) -> RuntimeError:
    message = exc.reason
    try:
        message = json.loads(exc.body or "{}").get("message") or message
    except (TypeError, ValueError):
        pass
    return RuntimeError(f"{what} failed: {exc.status} {message}")
