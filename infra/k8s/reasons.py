"""Why a Job or pod failed, read from their status (plain dicts, as the API returns them).

Pure functions over API objects so they can be tested on real status payloads.
Kubernetes spreads the reason over several places: the Job's ``Failed``
condition (BackoffLimitExceeded, DeadlineExceeded), a container's
``terminated`` state (OOMKilled, exit code), a container stuck ``waiting``
(ImagePullBackOff: the Job itself never fails then), the pod's
``PodScheduled`` condition (Unschedulable, with the scheduler's message), and a pod the
cluster took away (``reason: Evicted`` set by the kubelet under node pressure, or a true
``DisruptionTarget`` condition: preemption, the Eviction API, a node's taint or shutdown):
the job's own code did not fail then, so the verdict is PREEMPTED (resumable).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infra.jobs import JobState

# Waiting reasons that never resolve without a change by the user: fail fast.
FATAL_WAITING = {
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
}


@dataclass(frozen=True)
class Verdict:
    state: JobState
    reason: str | None = None
    exit_code: int | None = None


def _conditions(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return (obj.get("status") or {}).get("conditions") or []


def _true(cond: dict[str, Any]) -> bool:
    return str(cond.get("status")) == "True"


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    status = pod.get("status") or {}
    return (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or [])


def pod_name(pod: dict[str, Any]) -> str:
    return (pod.get("metadata") or {}).get("name", "?")


def fatal_waiting(pod: dict[str, Any]) -> str | None:
    """``ImagePullBackOff: <message>`` when a container waits for something that will not come."""
    for cs in _containers(pod):
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in FATAL_WAITING:
            message = waiting.get("message") or ""
            return f"{waiting['reason']} in pod {pod_name(pod)}" + (f": {message}" if message else "")
    return None


def crash_looping(pod: dict[str, Any]) -> str | None:
    """``CrashLoopBackOff in pod X: <last exit>`` for a server that keeps dying (restartPolicy Always)."""
    for cs in _containers(pod):
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") == "CrashLoopBackOff":
            last = ((cs.get("lastState") or {}).get("terminated")) or {}
            detail = f"last exit {last.get('reason', 'Error')} (exit code {last.get('exitCode')})" if last else ""
            return f"CrashLoopBackOff in pod {pod_name(pod)}" + (f": {detail}" if detail else "")
    return None


def unschedulable(pod: dict[str, Any]) -> str | None:
    """The scheduler's message for a pending pod it could not place, e.g. ``0/4 nodes are available: ...``."""
    for cond in _conditions(pod):
        if cond.get("type") == "PodScheduled" and not _true(cond) and cond.get("reason") == "Unschedulable":
            return f"Unschedulable: pod {pod_name(pod)}: {cond.get('message') or 'no message'}"
    return None


# Pod-level reasons of a pod the cluster terminated (the kubelet's node-pressure eviction, node shutdown).
DISRUPTED_REASONS = {"Evicted", "Preempting", "Terminated", "Shutdown", "NodeShutdown"}


def disrupted(pod: dict[str, Any]) -> str | None:
    """``Evicted in pod X: <the kubelet's message>`` for a failed pod the cluster took away, not its code."""
    status = pod.get("status") or {}
    if status.get("phase") != "Failed":
        return None
    target = next((c for c in _conditions(pod) if c.get("type") == "DisruptionTarget" and _true(c)), None)
    if status.get("reason") in DISRUPTED_REASONS:
        reason, message = status["reason"], status.get("message") or (target or {}).get("message") or ""
    elif target is not None:
        reason, message = target.get("reason") or "DisruptionTarget", target.get("message") or ""
    else:
        return None
    return f"{reason} in pod {pod_name(pod)}" + (f": {message}" if message else "")


def terminated_failure(pod: dict[str, Any]) -> tuple[str, int | None] | None:
    """(reason, exit code) of the first container that ended badly."""
    for cs in _containers(pod):
        for state in ((cs.get("state") or {}).get("terminated"), (cs.get("lastState") or {}).get("terminated")):
            if state and (state.get("exitCode") not in (0, None) or state.get("reason") == "OOMKilled"):
                reason = state.get("reason") or "Error"
                code = state.get("exitCode")
                text = f"{reason} in pod {pod_name(pod)} (container {cs.get('name')}, exit code {code})"
                if state.get("message"):
                    text += f": {state['message']}"
                return text, code
    status = pod.get("status") or {}
    if status.get("phase") == "Failed" and status.get("reason"):
        # Evicted, DeadlineExceeded at pod level, node shutdown
        return f"{status['reason']} in pod {pod_name(pod)}: {status.get('message', '')}".rstrip(": "), None
    return None


def _finished_at(pod: dict[str, Any]) -> str:
    """When the pod's failed container ended (RFC 3339 UTC sorts as text); unknown sorts last."""
    times = [
        (state or {}).get("finishedAt")
        for cs in _containers(pod)
        for state in ((cs.get("state") or {}).get("terminated"), (cs.get("lastState") or {}).get("terminated"))
    ]
    return min((t for t in times if t), default="~")


def job_verdict(job: dict[str, Any], pods: list[dict[str, Any]]) -> Verdict | None:
    """The final state of a batch/v1 Job, or None while it still runs."""
    true_conditions = [c for c in _conditions(job) if _true(c)]
    # FailureTarget (1.31+) precedes Failed while pods terminate; either decides the outcome.
    failed = next((c for c in true_conditions if c.get("type") in ("Failed", "FailureTarget")), None)
    if failed is not None:
        return failure_verdict(failed.get("reason"), failed.get("message"), pods)
    # SuccessCriteriaMet (1.31+) precedes Complete; only Complete means every pod is done.
    if any(c.get("type") == "Complete" for c in true_conditions):
        return Verdict(JobState.COMPLETED, exit_code=0)
    return None


def failure_verdict(job_reason: str | None, job_message: str | None, pods: list[dict[str, Any]]) -> Verdict:
    """Combine the Job's reason with what its pods say; OOM and deadlines get their own states."""
    # The first container to fail is the cause; the ranks that died after it (SIGTERM'd by
    # the Job controller, or timed out in a collective) are consequences.
    pod_failures = [
        f
        for _, f in sorted(
            ((_finished_at(p), f) for p in pods for f in [terminated_failure(p)] if f), key=lambda item: item[0]
        )
    ]
    oom = next((f for f in pod_failures if f[0].startswith("OOMKilled")), None)
    taken = [r for r in map(disrupted, pods) if r]
    stuck = [r for r in (unschedulable(p) or fatal_waiting(p) for p in pods) if r]
    head = job_reason or "Failed"
    if job_message:
        head += f": {job_message}"
    if oom:
        return Verdict(JobState.OUT_OF_MEMORY, f"{oom[0]}; job {head}", oom[1])
    if taken:
        # an evicted or preempted pod: the cluster's doing, not the code's (its exit code is the kill's)
        return Verdict(JobState.PREEMPTED, f"{head}; {taken[0]}")
    detail = pod_failures[0] if pod_failures else (stuck[0], None) if stuck else None
    state = JobState.TIMEOUT if job_reason == "DeadlineExceeded" else JobState.FAILED
    if detail:
        return Verdict(state, f"{head}; {detail[0]}", detail[1])
    return Verdict(state, head)


def pytorchjob_verdict(job: dict[str, Any], pods: list[dict[str, Any]]) -> Verdict | None:
    """The final state of a Kubeflow PyTorchJob (conditions Succeeded / Failed), or None while it runs."""
    for cond in _conditions(job):
        if not _true(cond):
            continue
        if cond.get("type") == "Succeeded":
            return Verdict(JobState.COMPLETED, exit_code=0)
        if cond.get("type") == "Failed":
            return failure_verdict(cond.get("reason"), cond.get("message"), pods)
    return None
