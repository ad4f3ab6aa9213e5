"""The Kubernetes backend against kmock (an in-memory API server) plus tests/k8s/controller.py.

No real cluster is involved: kmock answers the API calls, the stand-in
controller plays Job controller, scheduler and kubelet.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import textwrap

import kmock as km
import pytest

from infra.backends.k8s import KubernetesBackend, KubernetesUnavailable, PreflightError
from infra.jobs import JobSpec, JobState, Resources, ServiceSpec
from infra.k8s.config import api_client_for_url
from tests.k8s.conftest import SECRET_VALUES
from tests.k8s.controller import JobScript, PodScript

IMAGE = "nvcr.io/nvidia/nemo:25.02"


def spec(name="tok", **kwargs) -> JobSpec:
    kwargs.setdefault("command", ["python", "-m", "workloads.tokenize"])
    return JobSpec(name=name, container_image=IMAGE, **kwargs)


async def run(backend: KubernetesBackend, job: JobSpec):
    lines: list[str] = []
    result = await asyncio.to_thread(backend.run, job, lines.append)
    return result, lines


async def test_array_job_completes_and_streams_every_pod_log(ready, make_backend, secret_env):
    ready.scripts["tok"] = JobScript(
        pod=lambda i: PodScript(logs=[f"group {i} start", f"group {i} wrote tokens", f"token {secret_env['HF_TOKEN']}"])
    )
    result, lines = await run(make_backend(ready), spec(array_size=3, secret_env=["HF_TOKEN"]))

    assert result.state is JobState.COMPLETED and result.exit_code == 0, result
    for i in range(3):
        assert f"[{i}] group {i} start" in lines and f"[{i}] group {i} wrote tokens" in lines
    # a secret printed by the workload is redacted before it reaches the Prefect log
    assert not any(secret_env["HF_TOKEN"] in line for line in lines + result.log_tail)
    assert "[0] token ***" in lines
    log_requests = [r for r in ready.kmock if r.method == "GET" and r.url.path.endswith("/log")]
    assert log_requests and all(r.params.get("follow") == "true" for r in log_requests)
    jobs = ready.live("batch/v1/jobs")
    assert len(jobs) == 1, "a finished Job stays for ttlSecondsAfterFinished"
    assert jobs[0]["spec"]["completionMode"] == "Indexed" and jobs[0]["spec"]["completions"] == 3
    assert jobs[0]["spec"]["ttlSecondsAfterFinished"] == 3600


async def test_multinode_job_gets_rendezvous_service_removed_after(ready, make_backend):
    job = spec("train", resources=Resources(nodes=2, gpus_per_node=8))
    result, lines = await run(make_backend(ready), job)
    assert result.state is JobState.COMPLETED
    assert sum("hello from the pod" in line for line in lines) == 2
    created = [r for r in ready.kmock if r.method == "POST" and r.url.path.endswith("/services")]
    assert created and created[0].data["spec"]["clusterIP"] == "None"
    assert ready.live("v1/services") == [], "the headless Service has no TTL: the backend removes it"


@pytest.mark.parametrize(
    "pod, state, expected",
    [
        (
            PodScript(logs=["allocating"], exit_code=137, terminated_reason="OOMKilled"),
            JobState.OUT_OF_MEMORY,
            ["OOMKilled", "exit code 137", "BackoffLimitExceeded"],
        ),
        (PodScript(logs=["bad input"], exit_code=3), JobState.FAILED, ["BackoffLimitExceeded", "exit code 3"]),
        (
            PodScript(waiting=("ImagePullBackOff", 'Back-off pulling image "nvcr.io/nvidia/nemo:99"')),
            JobState.FAILED,
            ["ImagePullBackOff", 'Back-off pulling image "nvcr.io/nvidia/nemo:99"'],
        ),
        (
            PodScript(unschedulable="0/4 nodes are available: 4 Insufficient nvidia.com/gpu."),
            JobState.FAILED,
            ["Unschedulable", "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."],
        ),
    ],
    ids=["oom", "exit-code", "image-pull", "unschedulable"],
)
async def test_failure_reasons(ready, make_backend, pod, state, expected):
    ready.scripts["tok"] = JobScript(pod=lambda i: pod)
    result, lines = await run(make_backend(ready, pending_timeout_s=0.3), spec())
    assert result.state is state, result
    for text in expected:
        assert text in (result.reason or ""), result.reason
    if pod.waiting or pod.unschedulable:
        # the Job would never end by itself: the backend deletes it and its pods
        await ready.settle()  # the Foreground deletion ends when the collector removed the pods
        assert ready.live("batch/v1/jobs") == [] and ready.live("v1/pods") == []
    if pod.unschedulable:
        assert any("0/4 nodes are available" in line for line in lines), "pending reason shown while waiting"


async def test_deadline_exceeded_is_timeout(ready, make_backend):
    ready.scripts["tok"] = JobScript(pod=lambda i: PodScript(hang=True), deadline_after_s=0.3)
    result, _ = await run(make_backend(ready), spec(resources=Resources(time="00:01")))
    assert result.state is JobState.TIMEOUT and "DeadlineExceeded" in result.reason
    assert ready.live("batch/v1/jobs")[0]["spec"]["activeDeadlineSeconds"] == 1


async def test_lost_create_response_and_5xx_are_retried_idempotently(ready, make_backend):
    """The first create is stored but answered 503 (a lost response): the retry's 409 is our own Job."""
    posts: list[int] = []

    def flaky_create(request):
        posts.append(1)
        if len(posts) == 1:
            # raised, not returned: a returned Response would make kmock keep its status for later calls
            raise km.KubernetesError(status=503, reason="ServiceUnavailable", message="etcd leader changed")
        return None  # fall through to the emulator

    lists: list[int] = []

    def flaky_list(request):
        lists.append(1)
        if len(lists) <= 2:
            raise km.KubernetesError(status=500, reason="InternalError", message="internal")
        return None

    ready.kmock["post", km.resource("batch/v1/jobs")] << flaky_create
    ready.kmock[km.action.LIST, km.resource("v1/pods")] << flaky_list
    result, _ = await run(make_backend(ready), spec())
    assert result.state is JobState.COMPLETED, result
    job_posts = [r for r in ready.kmock if r.method == "POST" and r.url.path.endswith("/jobs")]
    assert len(job_posts) == 2, "one retry after the 503; its 409 was taken as our own Job"
    assert len(lists) > 2
    assert len(ready.live("batch/v1/jobs")) == 1


async def test_expired_watch_410_is_relisted(ready, make_backend):
    watches: list[int] = []

    def gone(request):
        watches.append(1)
        if len(watches) == 1:
            return (
                {
                    "type": "ERROR",
                    "object": {
                        "kind": "Status",
                        "code": 410,
                        "reason": "Expired",
                        "message": "too old resource version",
                    },
                },
            )
        return None

    ready.kmock[km.action.WATCH, km.resource("batch/v1/jobs")] << gone
    result, lines = await run(make_backend(ready), spec())
    assert result.state is JobState.COMPLETED
    assert any("410 Gone" in line for line in lines) and len(watches) >= 2


async def test_foreign_object_with_same_name_is_an_error(ready, make_backend):
    backend = make_backend(ready)
    obj = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "x-1", "namespace": "team", "labels": {"nemoflow.dev/run": "other"}},
    }
    ready.kmock.objects["batch/v1/jobs", "team", "x-1"] = obj
    with pytest.raises(RuntimeError, match="belongs to another run"):
        await asyncio.to_thread(
            backend._create, dict(obj, metadata=dict(obj["metadata"], labels={"nemoflow.dev/run": "mine"})), "mine"
        )


def test_unreachable_api_server_is_a_clear_error(k8s_options):
    backend = KubernetesBackend(
        k8s_options, api_client=api_client_for_url("http://127.0.0.1:9"), retries=1, backoff_s=0.01
    )
    with pytest.raises(KubernetesUnavailable, match=r"http://127.0.0.1:9 unreachable after 2 attempts"):
        backend.run(spec())


@pytest.mark.parametrize(
    "missing, message",
    [
        ("namespace", "namespace 'team' does not exist"),
        ("pvc", "workspace PVC 'workspace' not found in namespace 'team'"),
        ("secret", "Secret 'nemoflow-secrets' (for HF_TOKEN) not found"),
        ("secret-key", "has no key HF_TOKEN"),
        ("gpus", "requests 16 nvidia.com/gpu per pod, more than any node can allocate (gpu-a=8)"),
        ("service-account", "ServiceAccount 'nemoflow' not found in namespace 'team'"),
    ],
)
async def test_preflight_names_what_is_missing(cluster, make_backend, missing, message):
    if missing != "namespace":
        cluster.add_namespace()
    if missing != "pvc":
        cluster.add_pvc("workspace")
    if missing != "service-account":
        cluster.add_service_account("nemoflow")
    if missing == "secret-key":
        cluster.add_secret("nemoflow-secrets", {"OTHER": "x"})
    elif missing != "secret":
        cluster.add_secret("nemoflow-secrets", {"HF_TOKEN": "x", "WANDB_API_KEY": "y"})
    cluster.add_node("gpu-a", 8)
    job = spec(
        "train",
        secret_env=["HF_TOKEN", "WANDB_API_KEY"],
        resources=Resources(gpus_per_node=16 if missing == "gpus" else 8),
    )
    with pytest.raises(PreflightError) as info:
        await asyncio.to_thread(make_backend(cluster).run, job)
    assert message in str(info.value)
    assert cluster.live("batch/v1/jobs") == [], "nothing is submitted when preflight fails"


async def test_inference_service_start_and_stop(ready, make_backend):
    backend = make_backend(ready)
    serve = ServiceSpec(
        name="llm-serve",
        command=["python", "-m", "workloads.serve"],
        port=8000,
        container_image=IMAGE,
        resources=Resources(gpus_per_node=2),
    )
    url = (await asyncio.to_thread(backend.start_service, serve)).url
    assert url == "http://llm-serve.team.svc.cluster.local:8000"
    dep = ready.live("apps/v1/deployments")[0]
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    # starting again applies the spec to the existing objects instead of failing on 409
    assert (await asyncio.to_thread(backend.start_service, serve)).url == url
    await asyncio.to_thread(backend.stop_service, "llm-serve")
    assert ready.live("apps/v1/deployments") == [] and ready.live("v1/services") == []


async def test_switch_to_a_new_name_stops_the_old_service_only_after_the_check(ready, make_backend):
    """A second Deployment + Service beside the serving one: a failed check removes the new one and leaves the
    old one serving; a passed check removes the old one."""
    backend = make_backend(ready)

    def serve(name: str) -> ServiceSpec:
        return ServiceSpec(name=name, command=["python", "-m", "workloads.serve"], port=8000, container_image=IMAGE)

    def deployments() -> list[str]:
        return sorted(d["metadata"]["name"] for d in ready.live("apps/v1/deployments"))

    def refuse(info):
        assert deployments() == ["llm-blue", "llm-green"]  # checked while both run
        raise RuntimeError(f"smoke test of {info.url} failed")

    await asyncio.to_thread(backend.start_service, serve("llm-blue"))
    with pytest.raises(RuntimeError, match="smoke test of http://llm-green"):
        await asyncio.to_thread(backend.switch_service, "llm-blue", serve("llm-green"), refuse)
    assert deployments() == ["llm-blue"]
    checked = []  # (kmock's controller drives a Deployment name once: the second candidate has a name of its own)
    new = await asyncio.to_thread(backend.switch_service, "llm-blue", serve("llm-teal"), checked.append)
    assert [c.url for c in checked] == [new.url] == ["http://llm-teal.team.svc.cluster.local:8000"]
    assert deployments() == ["llm-teal"]


async def test_unschedulable_service_fails_with_scheduler_message(ready, make_backend):
    ready.scripts["llm-serve"] = JobScript(
        pod=lambda i: PodScript(unschedulable="0/2 nodes are available: 2 Insufficient nvidia.com/gpu.")
    )
    backend = make_backend(ready, pending_timeout_s=0.3)
    serve = ServiceSpec(name="llm-serve", command=["x"], port=8000, container_image=IMAGE)
    with pytest.raises(RuntimeError, match="0/2 nodes are available"):
        await asyncio.to_thread(backend.start_service, serve)
    assert ready.live("apps/v1/deployments") == []


CANCEL_SCRIPT = textwrap.dedent(
    """
    import faulthandler, signal, sys
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for every thread's stack if it hangs
    # What this process inherited for SIGINT, then Ctrl-C as an interactive Python takes it. A hang in full
    # runs (the main thread's stack: still watching the Job 90 s after the SIGINT, no KeyboardInterrupt) would
    # follow from an inherited SIG_IGN (a shell's background job passes it down) or a blocked SIGINT (a
    # thread's signal mask is inherited across fork and exec); neither reproduced alone, so it is printed.
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    print(f"SIGINT inherited: handler {signal.getsignal(signal.SIGINT)!r}, blocked {blocked}", flush=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    from infra.backends.k8s import KubernetesBackend
    from infra.jobs import JobSpec
    from infra.k8s.config import api_client_for_url
    from infra.k8s.options import K8sOptions

    backend = KubernetesBackend(K8sOptions(namespace="team", pvc_name="workspace"),
                                api_client=api_client_for_url(sys.argv[1]), watch_timeout_s=0.5, backoff_s=0.05)
    spec = JobSpec(name="train", command=["python", "-m", "workloads.train"], container_image="nvcr.io/nvidia/nemo:25.02",
                   array_size=2)
    backend.run(spec, on_log=lambda line: print(line, flush=True))
    """
)


async def test_interrupted_run_deletes_job_and_pods(ready):
    """Ctrl-C (or a Prefect cancellation) in the process running the job leaves no Job and no pod behind."""
    ready.scripts["train"] = JobScript(pod=lambda i: PodScript(logs=[f"step 1 of rank {i}"], hang=True))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CANCEL_SCRIPT,
        ready.url,
        cwd=os.getcwd(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    seen = b""
    async with asyncio.timeout(30):
        while b"step 1 of rank" not in seen:
            chunk = await proc.stdout.readline()
            assert chunk, seen.decode()
            seen += chunk
    assert len(ready.live("v1/pods")) == 2
    proc.send_signal(signal.SIGINT)
    # the clean-up is what is asserted, not its speed (30 s ran out in loaded full runs on the 2-core machine)
    # Its output after the SIGINT is kept (the clean-up's lines), to show with the stacks if it hangs.
    try:
        async with asyncio.timeout(90):
            while chunk := await proc.stdout.read(65536):
                seen += chunk
            await proc.wait()
    except TimeoutError:  # it hung: its threads' stacks say where (it passed alone, hung three times in full runs)
        proc.send_signal(signal.SIGUSR1)
        with contextlib.suppress(TimeoutError):  # every thread's stack: all of it (one read returns a part)
            async with asyncio.timeout(5):
                while chunk := await proc.stdout.read(65536):
                    seen += chunk
        proc.kill()
        pytest.fail("the run did not end within 90 s of its SIGINT; its output and stacks:\n" + seen.decode()[-16000:])
    await ready.settle()  # the Foreground deletion ends when the collector removed the pods
    assert ready.live("batch/v1/jobs") == [] and ready.live("v1/pods") == []
    job_deletes = [r for r in ready.kmock if r.method == "DELETE" and "/jobs/" in r.url.path]
    assert job_deletes and job_deletes[0].data["propagationPolicy"] == "Foreground"


async def test_pytorchjob_variant_runs_and_reports_worker_failure(ready, make_backend, k8s_options):
    options = k8s_options.model_copy(update={"training_kind": "pytorchjob"})
    ready.scripts["train"] = JobScript(pod=lambda i: PodScript(logs=[f"rank {i} step 1"]))
    job = spec("train", resources=Resources(nodes=2, gpus_per_node=8))
    result, lines = await run(make_backend(ready, options=options), job)
    assert result.state is JobState.COMPLETED, result
    assert "[master-0] rank 0 step 1" in lines and "[worker-0] rank 1 step 1" in lines
    created = ready.live("kubeflow.org/v1/pytorchjobs")
    assert created and created[0]["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1

    ready.scripts["train"] = JobScript(pod=lambda i: PodScript(logs=["x"], exit_code=1 if i == 1 else 0))
    result, _ = await run(make_backend(ready, options=options), job)
    assert result.state is JobState.FAILED and "PyTorchJobFailed" in result.reason and "exit code 1" in result.reason


async def test_knative_inference_service(ready, make_backend, k8s_options):
    options = k8s_options.model_copy(update={"inference_kind": "knative"})
    backend = make_backend(ready, options=options)
    serve = ServiceSpec(name="llm-serve", command=["python", "-m", "workloads.serve"], port=8000, container_image=IMAGE)
    assert (await asyncio.to_thread(backend.start_service, serve)).url == "http://llm-serve.team.example.com"
    assert len(ready.live("serving.knative.dev/v1/services")) == 1
    await asyncio.to_thread(backend.stop_service, "llm-serve")
    assert ready.live("serving.knative.dev/v1/services") == []


def test_cleanup_failure_is_reported_not_raised(k8s_options):
    """If the API server is gone when a run is interrupted, the run's own error must surface;
    what could not be deleted is named in the log."""
    backend = KubernetesBackend(k8s_options, api_client=api_client_for_url("http://127.0.0.1:9"), retries=0)
    lines: list[str] = []
    created = [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "train-ab12cd"}},
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "train-ab12cd"}},
    ]
    backend._clean_up(created, "ab12cd", everything=True, emit=lines.append)
    assert len(lines) == 1 and "remove by hand in namespace team" in lines[0]
    assert (
        "Job/train-ab12cd" in lines[0] and "Service/train-ab12cd" in lines[0] and "nemoflow.dev/run=ab12cd" in lines[0]
    )


async def test_log_stream_cut_midway_resumes_without_loss_or_repeats(ready, make_backend):
    lines_written = [f"step {i} loss {10 - i * 0.5:.1f}" for i in range(12)]
    ready.scripts["train"] = JobScript(pod=lambda i: PodScript(logs=lines_written, cut_log_after=4, line_delay_s=0.03))
    result, lines = await run(make_backend(ready), spec("train"))
    assert result.state is JobState.COMPLETED
    assert [line for line in lines if not line.startswith("[k8s]")] == lines_written
    assert any("was interrupted; resuming" in line for line in lines)
    log_requests = [r for r in ready.kmock if r.method == "GET" and r.url.path.endswith("/log")]
    assert len(log_requests) >= 2 and "sinceSeconds" in log_requests[1].params
    assert all(r.params.get("timestamps") == "true" for r in log_requests)


async def test_log_cut_after_the_container_ended_is_read_to_the_end(ready, make_backend):
    """A stream cut just before the container ended looks like the log's end: it is read once more."""
    import time

    pod = "train-ab12cd-0-x7k2p"
    ready.kmock.objects["v1/pods", ready.namespace, pod] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": pod, "namespace": ready.namespace},
        "status": {"phase": "Succeeded", "containerStatuses": [{"name": "main", "state": {"terminated": {}}}]},
    }
    written = [f"step {i}" for i in range(10)]
    ready.logs[pod] = [(time.time() - 5 + i * 0.01, line) for i, line in enumerate(written)]
    ready.cut[pod] = 4  # the first connection drops after 4 lines; the container is not running any more
    lines: list[str] = []
    await asyncio.to_thread(make_backend(ready)._follow, pod, "main", "", lines.append)
    assert [line for line in lines if not line.startswith("[k8s]")] == written, lines
    assert lines[4] == f"[k8s] log stream of pod {pod} was interrupted; resuming", lines


def test_get_backend_takes_executor_fields_and_rejects_unknown_ones(monkeypatch):
    from infra.executors import get_backend

    monkeypatch.setenv("NEMOFLOW_K8S_SCHEDULER_NAME", "runai-scheduler")
    backend = get_backend({"kind": "k8s", "namespace": "llm", "pvc_name": "shared"})
    assert (backend.options.namespace, backend.options.pvc_name, backend.options.scheduler_name) == (
        "llm",
        "shared",
        "runai-scheduler",
    )
    with pytest.raises(ValueError, match="namespaec"):
        get_backend({"kind": "k8s", "namespaec": "llm"})


async def test_service_never_ready_times_out_and_is_removed(ready, make_backend):
    ready.scripts["llm-serve"] = JobScript(pod=lambda i: PodScript(waiting=("ContainerCreating", "")))
    backend = make_backend(ready, service_ready_timeout_s=0.5)
    serve = ServiceSpec(name="llm-serve", command=["x"], port=8000, container_image=IMAGE)
    with pytest.raises(TimeoutError, match="llm-serve not ready after 0.5 s"):
        await asyncio.to_thread(backend.start_service, serve)
    assert ready.live("apps/v1/deployments") == [] and ready.live("v1/services") == []


async def test_cancel_in_flight_stops_a_run_in_another_thread(ready, make_backend):
    """What a Prefect on_cancellation hook calls: the run in a worker thread ends CANCELLED, nothing is left."""
    from infra.backends.k8s import cancel_in_flight

    ready.scripts["train"] = JobScript(pod=lambda i: PodScript(logs=["step 1"], hang=True))
    running = asyncio.create_task(run(make_backend(ready), spec("train", array_size=2)))
    async with asyncio.timeout(20):
        while len([p for p in ready.live("v1/pods") if p["status"].get("phase") == "Running"]) < 2:
            await asyncio.sleep(0.05)
    assert await asyncio.to_thread(cancel_in_flight) == 1
    async with asyncio.timeout(20):
        result, _ = await running
    assert result.state is JobState.CANCELLED
    await ready.settle()  # the Foreground deletion ends when the collector removed the pods
    assert ready.live("batch/v1/jobs") == [] and ready.live("v1/pods") == []
    assert await asyncio.to_thread(cancel_in_flight) == 0


async def test_invalid_image_is_refused_before_anything_is_created(ready, make_backend):
    from infra.k8s.images import InvalidImageReference

    bad = JobSpec(name="tok", command=["x"], container_image="nvcr.io/nvidia/nemo:25.02@sha256:123")
    with pytest.raises(InvalidImageReference, match="64 lowercase hex"):
        await asyncio.to_thread(make_backend(ready).run, bad)
    assert not [r for r in ready.kmock if r.method == "POST"]


async def test_optional_secret_may_be_absent(cluster, make_backend):
    """WANDB_API_KEY is optional by default: a run without it passes preflight (W&B stays off)."""
    cluster.add_namespace()
    cluster.add_pvc("workspace")
    cluster.add_service_account("nemoflow")
    cluster.add_secret("nemoflow-secrets", {"HF_TOKEN": "x"})
    result, _ = await run(make_backend(cluster), spec(secret_env=["HF_TOKEN", "WANDB_API_KEY"]))
    assert result.state is JobState.COMPLETED
    env = {e["name"]: e for e in cluster.live("batch/v1/jobs")[0]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["WANDB_API_KEY"]["valueFrom"]["secretKeyRef"]["optional"] is True
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is False


async def test_api_outage_while_waiting_is_tolerated(ready, make_backend):
    """An API server that answers 503 for a while (an upgrade) must not make nemoflow abandon a running job."""
    reads: list[int] = []

    def outage(request):
        reads.append(1)
        if len(reads) <= 6:  # two whole retry rounds of 3 attempts each
            raise km.KubernetesError(status=503, reason="ServiceUnavailable", message="apiserver is shutting down")
        return None

    ready.scripts["train"] = JobScript(pod=lambda i: PodScript(logs=[f"step {n}" for n in range(5)], line_delay_s=0.1))
    ready.kmock[km.action.FETCH, km.resource("batch/v1/jobs")] << outage
    result, lines = await run(make_backend(ready, retries=2, api_outage_tolerance_s=60), spec("train"))
    assert result.state is JobState.COMPLETED, result
    assert sum("still waiting" in line for line in lines) == 2
    assert [line for line in lines if line.startswith("step")] == [f"step {n}" for n in range(5)]


def test_api_outage_longer_than_tolerated_raises(k8s_options):
    backend = KubernetesBackend(
        k8s_options,
        api_client=api_client_for_url("http://127.0.0.1:9"),
        retries=0,
        backoff_s=0.01,
        api_outage_tolerance_s=0.2,
    )
    cancel = __import__("threading").Event()
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "train-ab12cd"}}
    lines: list[str] = []
    with pytest.raises(KubernetesUnavailable, match="unreachable"):
        backend._wait(job, "ab12cd", lines.append, {}, cancel)
    assert lines and all("still waiting" in line for line in lines)


async def test_stage_helper_run_job_drives_the_k8s_backend(ready, caplog, monkeypatch):
    """The path every stage takes: tasks.common.run_job(spec, executor) raises JobFailed on failure."""
    import logging

    from infra.executors import K8sExecutor
    from infra.jobs import JobFailed
    from tasks.common import run_job

    executor = {"kind": "k8s", "namespace": "team", "pvc_name": "workspace"}
    client = api_client_for_url(ready.url)
    # The executor says where; the API client (kmock here, KUBECONFIG or in-cluster for real) is the backend's.
    monkeypatch.setattr(
        K8sExecutor,
        "backend",
        lambda self: KubernetesBackend(self, api_client=client, watch_timeout_s=0.5, backoff_s=0.05),
    )
    ready.scripts["tok"] = JobScript(pod=lambda i: PodScript(logs=[f"shard {i} done"]))
    with caplog.at_level(logging.INFO, logger="nemoflow"):
        result = await asyncio.to_thread(run_job, spec(array_size=2), executor)
    assert result.state is JobState.COMPLETED and "[1] shard 1 done" in caplog.text
    ready.scripts["tok"] = JobScript(
        pod=lambda i: PodScript(logs=["killed"], exit_code=137, terminated_reason="OOMKilled")
    )
    with pytest.raises(JobFailed, match="ended out_of_memory with exit code 137: OOMKilled"):
        await asyncio.to_thread(run_job, spec(), executor)


async def test_deploy_inference_stage_on_kubernetes(prefect_server, ready, make_backend, monkeypatch):
    """The end-to-end flow's deploy stage on the k8s backend: a Deployment + Service serving the checkpoint."""
    from prefect.logging import disable_run_logger

    from infra.executors import K8sExecutor
    from tasks.refs import CheckpointRef, ImageRef
    from tasks.serve import deploy_inference, stop_inference
    from workloads.serve_engines import Auto

    backend = make_backend(ready)
    monkeypatch.setattr(K8sExecutor, "backend", lambda self: backend)
    checkpoint = CheckpointRef(uri="/nemo-workspace/runs/llama/checkpoints/step-000060", step=60)
    image = ImageRef(kind="registry", uri=IMAGE)
    executor = {"kind": "k8s", "namespace": "team"}

    def deploy(**kwargs):
        with disable_run_logger():
            return deploy_inference.fn(checkpoint, executor, 8000, "nemoflow-demo", 60, image, **kwargs)

    # On a cluster the endpoint needs an API key by default: the Secret must hold it.
    with pytest.raises(PreflightError, match="has no key NEMOFLOW_SERVE_API_KEY"):
        await asyncio.to_thread(deploy)
    assert ready.live("apps/v1/deployments") == []
    ready.add_secret("nemoflow-secrets", {**SECRET_VALUES, "NEMOFLOW_SERVE_API_KEY": "sk-serve-SENTINEL"})
    endpoint = await asyncio.to_thread(deploy)
    assert endpoint.url == "http://nemoflow-demo.team.svc.cluster.local:8000" and endpoint.backend == "k8s"
    assert endpoint.api_key_env == "NEMOFLOW_SERVE_API_KEY"
    deployment = ready.live("apps/v1/deployments")[0]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == IMAGE
    command = container.get("command", []) + container.get("args", [])
    assert "workloads.serve" in command and checkpoint.uri in command and "0.0.0.0" in command
    assert command[command.index("--api-key-env") + 1] == "NEMOFLOW_SERVE_API_KEY"
    key_env = next(e for e in container["env"] if e["name"] == "NEMOFLOW_SERVE_API_KEY")
    ref = key_env["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"], ref.get("optional")) == ("nemoflow-secrets", "NEMOFLOW_SERVE_API_KEY", False)
    assert "sk-serve-SENTINEL" not in json.dumps(deployment)
    assert deployment["metadata"]["annotations"]["nemoflow.io/fingerprint"]  # what a re-run compares
    # The explicit opt-out: no key, and the server is told so (it logs the warning).
    open_endpoint = await asyncio.to_thread(deploy, engine=Auto(allow_unauthenticated=True))
    container = ready.live("apps/v1/deployments")[0]["spec"]["template"]["spec"]["containers"][0]
    assert "--allow-unauthenticated" in container["command"] and open_endpoint.api_key_env is None
    with disable_run_logger():
        await asyncio.to_thread(stop_inference.fn, endpoint)
    assert ready.live("apps/v1/deployments") == []
