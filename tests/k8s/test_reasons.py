"""Failure reasons read from Job and pod status, on payloads shaped like a v1.30 API server's."""

from __future__ import annotations

from infra.jobs import JobState
from infra.k8s import reasons


def pod(name="train-0-abcde", *, state=None, last_state=None, conditions=None, phase="Running", **status):
    cs = {
        "name": "main",
        "ready": False,
        "restartCount": 0,
        "image": "nvcr.io/nvidia/nemo:25.02",
        "imageID": "",
        "state": state or {},
        "lastState": last_state or {},
    }
    return {
        "metadata": {"name": name},
        "status": {"phase": phase, "conditions": conditions or [], "containerStatuses": [cs], **status},
    }


def job(*conditions):
    return {"metadata": {"name": "train"}, "status": {"conditions": list(conditions)}}


FAILED_BACKOFF = {
    "type": "Failed",
    "status": "True",
    "reason": "BackoffLimitExceeded",
    "message": "Job has reached the specified backoff limit",
}
OOM = {"terminated": {"exitCode": 137, "reason": "OOMKilled", "containerID": "containerd://1f"}}


def test_running_job_has_no_verdict():
    assert reasons.job_verdict(job({"type": "SuccessCriteriaMet", "status": "True"}), [pod()]) is None
    assert reasons.job_verdict(job({"type": "Failed", "status": "False"}), [pod()]) is None


def test_complete():
    verdict = reasons.job_verdict(job({"type": "Complete", "status": "True"}), [])
    assert verdict.state is JobState.COMPLETED and verdict.exit_code == 0
    # 1.31+: SuccessCriteriaMet comes first, then Complete
    both = job({"type": "SuccessCriteriaMet", "status": "True"}, {"type": "Complete", "status": "True"})
    assert reasons.job_verdict(both, []).state is JobState.COMPLETED


def test_oom_killed_pod_makes_out_of_memory():
    verdict = reasons.job_verdict(job(FAILED_BACKOFF), [pod(state=OOM, phase="Failed")])
    assert verdict.state is JobState.OUT_OF_MEMORY and verdict.exit_code == 137
    assert verdict.reason.startswith("OOMKilled in pod train-0-abcde") and "BackoffLimitExceeded" in verdict.reason


def test_oom_in_a_restarted_container_is_found_in_last_state():
    restarted = pod(state={"running": {}}, last_state=OOM)
    assert reasons.job_verdict(job(FAILED_BACKOFF), [restarted]).state is JobState.OUT_OF_MEMORY


def test_sigkill_without_oom_reason_is_a_plain_failure():
    killed = pod(state={"terminated": {"exitCode": 137, "reason": "Error"}}, phase="Failed")
    verdict = reasons.job_verdict(job(FAILED_BACKOFF), [killed])
    assert verdict.state is JobState.FAILED and "exit code 137" in verdict.reason


def test_deadline_is_timeout():
    deadline = {
        "type": "Failed",
        "status": "True",
        "reason": "DeadlineExceeded",
        "message": "Job was active longer than specified deadline",
    }
    verdict = reasons.job_verdict(job(deadline), [])
    assert verdict.state is JobState.TIMEOUT
    assert verdict.reason == "DeadlineExceeded: Job was active longer than specified deadline"


def test_failure_target_counts_as_failed():
    target = dict(FAILED_BACKOFF, type="FailureTarget")
    assert reasons.job_verdict(job(target), []).state is JobState.FAILED


def test_evicted_pod_reason():
    evicted = pod(phase="Failed", reason="Evicted", message="The node was low on resource: memory.")
    evicted["status"]["containerStatuses"] = []
    verdict = reasons.job_verdict(job(FAILED_BACKOFF), [evicted])
    assert "Evicted in pod train-0-abcde: The node was low on resource: memory." in verdict.reason


KUBELET_EVICTION = "The node was low on resource: memory. Threshold quantity: 100Mi, available: 42Mi."


def test_an_evicted_pod_is_preempted_not_failed_even_with_the_kill_exit_code():
    """As a kubelet reports a node-pressure eviction (1.31+): phase Failed, reason Evicted, a DisruptionTarget
    condition, and the container killed with 137; the job's code did not fail, so the verdict is resumable."""
    killed = {"terminated": {"exitCode": 137, "reason": "Error", "finishedAt": "2026-11-29T20:01:00Z"}}
    target = {
        "type": "DisruptionTarget",
        "status": "True",
        "reason": "TerminationByKubelet",
        "message": KUBELET_EVICTION,
    }
    evicted = pod(phase="Failed", state=killed, conditions=[target], reason="Evicted", message=KUBELET_EVICTION)
    verdict = reasons.job_verdict(job(FAILED_BACKOFF), [evicted])
    assert verdict.state is JobState.PREEMPTED and verdict.state.is_resumable
    assert (
        verdict.reason
        == f"BackoffLimitExceeded: Job has reached the specified backoff limit; Evicted in pod train-0-abcde: {KUBELET_EVICTION}"
    )


def test_a_disruption_target_without_a_pod_reason_is_preempted():
    target = {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler", "message": "preempted"}
    preempted = pod(phase="Failed", conditions=[target], state={"terminated": {"exitCode": 143, "reason": "Error"}})
    verdict = reasons.job_verdict(job(FAILED_BACKOFF), [preempted])
    assert verdict.state is JobState.PREEMPTED
    assert "PreemptionByScheduler in pod train-0-abcde: preempted" in verdict.reason


def test_a_pod_that_exited_1_is_failed_not_preempted():
    crashed = pod(phase="Failed", state={"terminated": {"exitCode": 1, "reason": "Error"}})
    assert reasons.job_verdict(job(FAILED_BACKOFF), [crashed]).state is JobState.FAILED
    assert reasons.disrupted(crashed) is None


def test_image_pull_and_config_errors_are_fatal_while_waiting():
    pulling = pod(
        state={"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "nvcr.io/x:1"'}},
        phase="Pending",
    )
    assert (
        reasons.fatal_waiting(pulling) == 'ImagePullBackOff in pod train-0-abcde: Back-off pulling image "nvcr.io/x:1"'
    )
    secret = pod(
        state={"waiting": {"reason": "CreateContainerConfigError", "message": 'secret "nemoflow-secrets" not found'}},
        phase="Pending",
    )
    assert 'secret "nemoflow-secrets" not found' in reasons.fatal_waiting(secret)
    creating = pod(state={"waiting": {"reason": "ContainerCreating"}}, phase="Pending")
    assert reasons.fatal_waiting(creating) is None


def test_unschedulable_carries_the_scheduler_message():
    message = (
        "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available: "
        "3 No preemption victims found for incoming pod."
    )
    pending = pod(
        phase="Pending",
        conditions=[
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": message,
                "lastProbeTime": None,
            }
        ],
    )
    assert reasons.unschedulable(pending) == f"Unschedulable: pod train-0-abcde: {message}"
    scheduled = pod(conditions=[{"type": "PodScheduled", "status": "True"}])
    assert reasons.unschedulable(scheduled) is None


def test_pytorchjob_conditions():
    ok = {"status": {"conditions": [{"type": "Created", "status": "True"}, {"type": "Succeeded", "status": "True"}]}}
    assert reasons.pytorchjob_verdict(ok, []).state is JobState.COMPLETED
    running = {"status": {"conditions": [{"type": "Running", "status": "True"}]}}
    assert reasons.pytorchjob_verdict(running, []) is None


def test_log_cursor_skips_exactly_what_was_emitted():
    from infra.backends.k8s import _LogCursor

    cursor = _LogCursor()
    first = ["2026-11-29T20:00:00.1Z a", "2026-11-29T20:00:00.12Z b", "2026-11-29T20:00:00.12Z c"]
    assert [cursor.accept(line) for line in first] == ["a", "b", "c"]
    cursor.resume()
    # the re-requested log overlaps: same lines again (one written in another offset), then new ones
    again = [
        "2026-11-29T20:00:00.1Z a",
        "2026-11-29T21:00:00.12+01:00 b",
        "2026-11-29T20:00:00.12Z c",
        "2026-11-29T20:00:00.12Z d",
        "2026-11-29T20:00:01Z e",
    ]
    assert [cursor.accept(line) for line in again] == [None, None, None, "d", "e"]
    assert cursor.accept("no timestamp here") == "no timestamp here"


def test_crash_loop_names_the_last_exit():
    looping = pod(
        state={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 5m0s restarting failed container"}},
        last_state={"terminated": {"exitCode": 1, "reason": "Error"}},
    )
    assert reasons.crash_looping(looping) == "CrashLoopBackOff in pod train-0-abcde: last exit Error (exit code 1)"
    assert reasons.crash_looping(pod(state={"running": {}})) is None


def test_the_first_rank_to_fail_is_the_reason():
    victim = pod(
        "train-0-aaaaa",
        phase="Failed",
        state={"terminated": {"exitCode": 143, "reason": "Error", "finishedAt": "2026-11-29T20:00:09Z"}},
    )
    culprit = pod(
        "train-1-bbbbb",
        phase="Failed",
        state={"terminated": {"exitCode": 1, "reason": "Error", "finishedAt": "2026-11-29T20:00:02Z"}},
    )
    verdict = reasons.job_verdict(job(FAILED_BACKOFF), [victim, culprit])
    assert verdict.exit_code == 1 and "pod train-1-bbbbb" in verdict.reason
